"""Build and cache the binaries of the local control plane from their Go modules.

Called by ``rolloutfleet sandbox build`` / ``sandbox up``, by ``.ci/run`` and by the test fixtures.
It owns the per-version cache ``$ROLLOUTFLEET_CACHE/bin/<tool>-<version>/<binary>`` (default
``~/.cache/rolloutfleet``), which lives outside the repository so that a fresh clone reuses it.

Why wrapper modules: ``go install k8s.io/kubernetes/cmd/...@vX`` is refused because k8s.io/kubernetes's
go.mod replaces its staging modules (``k8s.io/api => ./staging/src/k8s.io/api``) and requires them at
``v0.0.0``. A throwaway module that requires k8s.io/kubernetes and replaces every such ``v0.0.0``
requirement with the published ``v0.<minor>.<patch>`` tag resolves the same code from the module proxy.
The replace list is generated from k8s.io/kubernetes's own go.mod, never hard-coded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v4.3.1"
# Argo CD's Lua interpreter (its go.mod requires gopher-lua v1.1.1): the Argo CD health checks of
# docs/gitops run under it in tests/unit/gitops, besides a C Lua 5.1.
GOPHER_LUA_VERSION = "v1.1.1"


@dataclasses.dataclass(frozen=True)
class Tool:
    """One binary: the Go module that holds it, its package path and how to stamp its version."""

    name: str
    module: str
    version: str
    package: str
    kubernetes_staging: bool = False
    ldflags: tuple[str, ...] = ()
    # Files copied from the module's source next to the binary: (output name, module-relative paths to
    # concatenate). kwok needs its stage definitions, which kwokctl embeds but the bare binary does not.
    assets: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _kubernetes_ldflags(version: str) -> tuple[str, ...]:
    # Unstamped binaries report v0.0.0, which breaks helm's kubeVersion checks and kubectl's skew warnings.
    major, minor, _ = version.lstrip("v").split(".")
    stamp = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.{key}={value}" for key, value in stamp.items()]
    return tuple(flags)


def _kubernetes_tool(name: str) -> Tool:
    return Tool(
        name=name,
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        package=f"k8s.io/kubernetes/cmd/{name}",
        kubernetes_staging=True,
        ldflags=_kubernetes_ldflags(KUBERNETES_VERSION),
    )


TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        _kubernetes_tool("kube-apiserver"),
        _kubernetes_tool("kube-controller-manager"),
        _kubernetes_tool("kube-scheduler"),
        _kubernetes_tool("kubectl"),
        Tool("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION, "go.etcd.io/etcd/server/v3"),
        Tool(
            "kwok",
            "sigs.k8s.io/kwok",
            KWOK_VERSION,
            "sigs.k8s.io/kwok/cmd/kwok",
            ldflags=(f"-X sigs.k8s.io/kwok/pkg/consts.Version={KWOK_VERSION}",),
            # The stages kwokctl uses by default (pkg/kwokctl/runtime/cluster.go: getDefaultNodeStages
            # with a lease, getDefaultPodStages). Without stages the bare kwok binary exits.
            assets=(
                (
                    "stages.yaml",
                    (
                        "kustomize/stage/node/fast/node-initialize.yaml",
                        "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                        "kustomize/stage/pod/fast/pod-ready.yaml",
                        "kustomize/stage/pod/fast/pod-complete.yaml",
                        "kustomize/stage/pod/fast/pod-delete.yaml",
                    ),
                ),
            ),
        ),
        Tool("glua", "github.com/yuin/gopher-lua", GOPHER_LUA_VERSION, "github.com/yuin/gopher-lua/cmd/glua"),
        Tool(
            "helm",
            "helm.sh/helm/v4",
            HELM_VERSION,
            "helm.sh/helm/v4/cmd/helm",
            ldflags=(
                f"-X helm.sh/helm/v4/internal/version.version={HELM_VERSION}",
                "-X helm.sh/helm/v4/internal/version.gitTreeState=clean",
                # No stamp exists for the kube version helm assumes without a cluster: v4 derives it from
                # its client-go module (pkg/chart/common/capabilities.go), v1.37 for v4.3.1. Chart
                # tests that need another pass `helm template --kube-version`.
            ),
        ),
    )
}

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl")


class BuildError(RuntimeError):
    """A tool could not be built; the message names the tool, the command and Go's own output."""


def cache_root() -> pathlib.Path:
    """Where binaries and build logs are cached (outside the repository)."""
    explicit = os.environ.get("ROLLOUTFLEET_CACHE")
    if explicit:
        return pathlib.Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path("~/.cache").expanduser()) / "rolloutfleet"


def binary_path(name: str) -> pathlib.Path:
    """The cached binary of a tool (it may not exist yet)."""
    tool = TOOLS[name]
    return cache_root() / "bin" / f"{tool.name}-{tool.version}" / tool.name


def asset_path(name: str, asset: str) -> pathlib.Path:
    """A file copied from a tool's module next to its binary (e.g. kwok's ``stages.yaml``)."""
    return binary_path(name).parent / asset


def _complete(tool: Tool) -> bool:
    return binary_path(tool.name).exists() and all(asset_path(tool.name, a).exists() for a, _ in tool.assets)


@contextlib.contextmanager
def locked(tool: Tool) -> Iterator[None]:
    # Two builders of one tool (a test run and `sandbox build`) would fight for the cores and race on the
    # rename; an exclusive flock makes the second wait and then find the binary cached.
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{tool.name}-{tool.version}.lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"{tool.name}: another process is building it; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def progress(message: str) -> None:
    print(f"[sandbox build] {message}", file=sys.stderr, flush=True)


# Seconds of a cold build of each tool on 2 cores with empty Go caches, in the demo's order (kwok, then
# the Kubernetes binaries, the first of which compiles the packages they share, then etcd;
# bench/results/first_run.md): the estimate shown while a tool builds on a machine that never built it.
# A build here records its own time, which is shown instead the next time.
REFERENCE_SECONDS: dict[str, float] = {
    "kwok": 92.0,
    "kube-scheduler": 140.0,
    "kube-controller-manager": 112.0,
    "kube-apiserver": 10.0,
    "etcd": 27.0,
}


def _timings_file() -> pathlib.Path:
    return cache_root() / "build-times.json"


def recorded_seconds() -> dict[str, float]:
    """The build times recorded here (an absent or damaged file: none)."""
    try:
        recorded = json.loads(_timings_file().read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _expected_seconds(tool: Tool) -> tuple[float, str] | None:
    """(seconds, where the number comes from) of the last build of ``tool`` here, else the reference."""
    seconds = recorded_seconds().get(f"{tool.name}-{tool.version}")
    if isinstance(seconds, int | float):
        return float(seconds), "its last build here"
    if tool.name in REFERENCE_SECONDS:
        return REFERENCE_SECONDS[tool.name], "a cold build on 2 cores"
    return None


def record_seconds(tool: Tool, seconds: float) -> None:
    recorded = recorded_seconds()
    recorded[f"{tool.name}-{tool.version}"] = round(seconds, 1)
    tmp = _timings_file().with_suffix(".partial")
    tmp.write_text(json.dumps(recorded, indent=1, sort_keys=True))
    tmp.rename(_timings_file())


def run_go(args: list[str], cwd: pathlib.Path, log: pathlib.Path, *, expected: float | None = None) -> str:
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod", GOWORK="off")
    started = time.monotonic()
    with log.open("a") as sink, tempfile.TemporaryFile("w+") as out:
        sink.write(f"$ go {' '.join(args)}\n")
        sink.flush()
        proc = subprocess.Popen(["go", *args], cwd=cwd, env=env, stdout=out, stderr=sink, text=True)
        # Go prints nothing while it compiles; a heartbeat tells a waiting user (or CI log) it is alive.
        while True:
            try:
                proc.wait(timeout=60)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                hint = f" of about {expected:.0f}s" if expected and expected > elapsed else ""
                progress(f"  ... go {args[0]} still running ({elapsed:.0f}s{hint})")
        out.seek(0)
        stdout = out.read()
        sink.write(stdout)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-25:]
        command = " ".join(args[:2])
        raise BuildError(f"go {command} failed (exit {proc.returncode}); log {log}:\n" + "\n".join(tail))
    return stdout


def staging_replaces(kubernetes_gomod: str, version: str) -> list[tuple[str, str]]:
    """Every requirement pinned at v0.0.0 in k8s.io/kubernetes's go.mod, mapped to its published tag.

    >>> staging_replaces("require (\\n\\tk8s.io/api v0.0.0\\n\\tk8s.io/klog/v2 v2.1.0\\n)", "v1.36.3")
    [('k8s.io/api', 'v0.36.3')]
    """
    staging_version = "v0." + version.lstrip("v").split(".", 1)[1]
    found = re.findall(r"^\s*(?:require\s+)?(\S+)\s+v0\.0\.0(?:\s|$)", kubernetes_gomod, flags=re.MULTILINE)
    return [(module, staging_version) for module in sorted(set(found))]


def _wrapper_gomod(tool: Tool, workdir: pathlib.Path, log: pathlib.Path) -> str:
    lines = ["module rolloutfleet.local/build/" + tool.name, "", "go 1.26", ""]
    if tool.kubernetes_staging:
        info = json.loads(run_go(["mod", "download", "-json", f"{tool.module}@{tool.version}"], workdir, log))
        replaces = staging_replaces(pathlib.Path(info["GoMod"]).read_text(), tool.version)
        if not replaces:
            raise BuildError(f"{tool.module}@{tool.version}: found no v0.0.0 staging requirements to replace")
        lines += [f"replace {module} => {module} {ver}" for module, ver in replaces]
    return "\n".join(lines) + "\n"


def build(name: str, force: bool = False) -> pathlib.Path:
    """Build one tool into the cache unless it is already there; return the binary's path."""
    tool = TOOLS[name]
    target = binary_path(name)
    if _complete(tool) and not force:
        return target
    with locked(tool):
        if _complete(tool) and not force:  # built by whoever held the lock before us
            return target
        logs = cache_root() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"build-{tool.name}-{tool.version}.log"
        if force or not target.exists():
            _compile(tool, target, log)
        _write_assets(tool, log)
    return target


def _compile(tool: Tool, target: pathlib.Path, log: pathlib.Path) -> None:
    log.write_text("")
    started = time.monotonic()
    estimate = _expected_seconds(tool)
    how_long = f"about {estimate[0]:.0f}s, as {estimate[1]}" if estimate else "cold builds take minutes"
    progress(f"building {tool.name} {tool.version} from {tool.module} ({how_long}; log: {log})")
    with tempfile.TemporaryDirectory(prefix=f"rf-build-{tool.name}-") as tmp:
        workdir = pathlib.Path(tmp)
        (workdir / "go.mod").write_text(_wrapper_gomod(tool, workdir, log))
        # `go get -tool` records the package as a tool of the wrapper and resolves the whole graph.
        run_go(["get", "-tool", f"{tool.package}@{tool.version}"], workdir, log)
        staging = target.with_suffix(".partial")
        target.parent.mkdir(parents=True, exist_ok=True)
        args = ["build", "-trimpath", "-o", str(staging)]
        if tool.ldflags:
            args += ["-ldflags", " ".join(("-s", "-w", *tool.ldflags))]
        else:
            args += ["-ldflags", "-s -w"]
        left = estimate[0] - (time.monotonic() - started) if estimate else None  # the download is done
        run_go([*args, tool.package], workdir, log, expected=left)
        staging.rename(target)
    seconds = time.monotonic() - started
    record_seconds(tool, seconds)
    progress(f"built {tool.name} in {seconds:.0f}s -> {target}")


def _write_assets(tool: Tool, log: pathlib.Path) -> None:
    if not tool.assets:
        return
    with tempfile.TemporaryDirectory(prefix=f"rf-assets-{tool.name}-") as tmp:
        download = ["mod", "download", "-json", f"{tool.module}@{tool.version}"]
        info = json.loads(run_go(download, pathlib.Path(tmp), log))
    source = pathlib.Path(info["Dir"])
    for asset, parts in tool.assets:
        documents = [(source / part).read_text().strip() + "\n" for part in parts]
        target = asset_path(tool.name, asset)
        target.with_suffix(".partial").write_text("---\n".join(documents))
        target.with_suffix(".partial").rename(target)


def ensure(names: tuple[str, ...] | list[str] = CONTROL_PLANE, force: bool = False) -> dict[str, pathlib.Path]:
    """Build (or reuse) several tools in order and return their paths; progress goes to stderr."""
    # Go only where something must be built: a machine given a complete cache (the device bench,
    # scripts/bench/device-bench.sh) has none.
    missing = [name for name in names if force or not _complete(TOOLS[name])]
    if missing and shutil.which("go") is None:
        raise BuildError(
            f"the go command is not on PATH; Go >= 1.26 is needed to build {', '.join(missing)} for the local "
            "control plane"
        )
    paths = {}
    for index, name in enumerate(names, start=1):
        # Quiet when warm: a test session or `sandbox up` should not print a line per cached binary.
        if force or not _complete(TOOLS[name]):
            progress(f"[{index}/{len(names)}] {name}: building")
        paths[name] = build(name, force=force)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tools", nargs="*", default=[*CONTROL_PLANE, "helm", "glua"])
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    started = datetime.datetime.now()
    try:
        paths = ensure(args.tools, force=args.force)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    progress(f"done in {(datetime.datetime.now() - started).total_seconds():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
