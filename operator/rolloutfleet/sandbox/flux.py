"""Flux's source-controller and kustomize-controller, built from their Go modules and run against a cluster.

Called by ``rolloutfleet sandbox up --flux`` / ``sandbox demo --flux`` (:mod:`rolloutfleet.sandbox.commands`)
and by the Git-driven integration tier (``tests/integration/gitops``). It owns:

- the build recipe and its pinned versions; binaries are cached like the control plane's
  (:mod:`rolloutfleet.sandbox.binaries`: ``<cache>/bin/<controller>-<version>/<controller>``, one flock per
  controller, build logs in ``<cache>/logs/``), with each module's CRDs copied next to its binary
  (``crds/``), so installing them needs neither the module cache nor the network;
- installing the Flux CRDs into a cluster (server-side apply with the cached kubectl);
- running both controllers as child processes (:class:`Flux`): own sessions, logs to files, every
  address on 127.0.0.1, stopped with SIGTERM then SIGKILL (:mod:`rolloutfleet.sandbox.processes`);
- :func:`start_for_cluster`: the controllers plus a loopback Git server (:mod:`rolloutfleet.sandbox.git_server`)
  and a seeded repository beside a sandbox cluster, adopted by the cluster so ``sandbox down`` stops them.

Why copies of the modules: every Flux controller's go.mod has ``replace <module>/api => ./api`` (a
directory that is a separate module, published on the proxy as ``<module>/api``), so ``go install
MODULE@VERSION`` refuses it. The recipe downloads the module, copies it to a temporary directory, drops
replace directives that point at local paths (:func:`rewrite_gomod`; the ``require`` of ``<module>/api``
at the same tag then resolves from the proxy), adds the pins below, and builds the copy.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from rolloutfleet.sandbox import binaries, cluster, git_server, processes, waiting

SOURCE_CONTROLLER_VERSION = "v1.9.6"
KUSTOMIZE_CONTROLLER_VERSION = "v1.9.6"
# source-controller v1.9.6 (and v1.9.5) require github.com/fluxcd/pkg/artifact v0.18.3, whose zip the module
# proxy refuses (403 "This module version is not available"; v0.18.2 too). v0.18.1 is served, builds, and
# behaved the same in every Git-driven test (tests/integration/gitops): clone, artifact served over HTTP,
# garbage collection. v1.9.6 is the newest that builds here: the v1.10 controllers require Go >= 1.27 (the
# project requires 1.26; with GOTOOLCHAIN=local Go refuses them rather than fetch a newer toolchain).
ARTIFACT_PIN = ("github.com/fluxcd/pkg/artifact", "v0.18.1")
# What a Kustomization waits for on our objects (docs/gitops/flux/fleet-sync.yaml has the same rules; a
# unit test keeps them equal). Without them kstatus waits forever on a Superseded revision (Ready=False).
HEALTH_CHECK_EXPRS: list[dict[str, str]] = [
    {
        "apiVersion": "rolloutfleet.io/v1alpha1",
        "kind": "RolloutFleet",
        "current": (
            "has(status.observedGeneration) && status.observedGeneration == metadata.generation && "
            "status.conditions.exists(c, c.type == 'Available' && c.status == 'True') && "
            "!status.conditions.exists(c, c.type in ['Progressing', 'Degraded'] && c.status == 'True')"
        ),
        "failed": "status.conditions.exists(c, c.type == 'Degraded' && c.status == 'True')",
    },
    {
        "apiVersion": "rolloutfleet.io/v1alpha1",
        "kind": "WeightRevision",
        "current": "has(status.phase) && status.phase in ['Succeeded', 'Superseded']",
        "failed": "has(status.phase) && status.phase in ['Failed', 'RolledBack']",
    },
]
# Asking Flux to sync now instead of waiting for an interval (what `flux reconcile` writes).
REQUESTED_AT = "reconcile.fluxcd.io/requestedAt"
EMPTY_KUSTOMIZATION = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: []\n"
NAMESPACE = "flux-system"
FIELD_MANAGER = "rolloutfleet-sandbox"
# Sets the controllers' environment and then execs them (Flux._spawn says why).
_ENV = shutil.which("env") or "/usr/bin/env"
# Health checks go to loopback directly, whatever proxy the caller's environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclasses.dataclass(frozen=True)
class Controller:
    """One Flux controller: its Go module, the version built, the pins added to its go.mod."""

    name: str
    module: str
    version: str
    # (module, version) pairs written as `replace M => M V`: versions the proxy serves instead of refused ones.
    pins: tuple[tuple[str, str], ...] = ()
    # A cold build on 2 quiet cores (the issue's measurement), shown while a first build runs; a build here
    # records its own time (binaries' build-times.json), shown instead the next time.
    reference_seconds: float = 0.0


SOURCE_CONTROLLER = Controller(
    "source-controller",
    "github.com/fluxcd/source-controller",
    SOURCE_CONTROLLER_VERSION,
    pins=(ARTIFACT_PIN,),
    reference_seconds=190.0,
)
KUSTOMIZE_CONTROLLER = Controller(
    "kustomize-controller",
    "github.com/fluxcd/kustomize-controller",
    KUSTOMIZE_CONTROLLER_VERSION,
    reference_seconds=115.0,
)
CONTROLLERS = (SOURCE_CONTROLLER, KUSTOMIZE_CONTROLLER)


class FluxError(RuntimeError):
    """A controller did not start (the message carries its log tail) or the CRDs did not install."""


# -- the build ---------------------------------------------------------------------------------------


def binary_path(controller: Controller) -> pathlib.Path:
    """The cached binary (it may not exist yet)."""
    return binaries.cache_root() / "bin" / f"{controller.name}-{controller.version}" / controller.name


def crd_dir(controller: Controller) -> pathlib.Path:
    """The module's ``config/crd/bases`` as copied next to the binary."""
    return binary_path(controller).parent / "crds"


def _complete(controller: Controller) -> bool:
    return binary_path(controller).exists() and any(crd_dir(controller).glob("*.yaml"))


_REPLACE_LINE = re.compile(r"^\s*(?:replace\s+)?(\S+)(?:\s+\S+)?\s+=>\s+(\S+)(?:\s+(\S+))?\s*(?://.*)?$")


@dataclasses.dataclass(frozen=True)
class GoModRewrite:
    """The rewritten go.mod and the modules whose local-path replace it dropped."""

    text: str
    dropped: tuple[str, ...]


def rewrite_gomod(text: str, pins: tuple[tuple[str, str], ...] = ()) -> GoModRewrite:
    """Drop every ``replace`` that points at a local path and append ``replace M => M V`` for each pin.

    A dropped module must be required at a version (the published module then stands in for the local
    directory); a pin must not collide with an existing replace (Go refuses two replacements of a path).

    >>> rewrite_gomod("require x/api v1.0.0\\nreplace x/api => ./api\\n").text
    'require x/api v1.0.0\\n'
    """
    lines = text.splitlines()
    out: list[str] = []
    dropped: list[str] = []
    replaced: set[str] = set()
    in_block = False
    for line in lines:
        stripped = line.strip()
        if re.match(r"^replace\s*\($", stripped):
            in_block = True
            out.append(line)
            continue
        if in_block and stripped == ")":
            in_block = False
            out.append(line)
            continue
        if in_block or stripped.startswith("replace "):
            match = _REPLACE_LINE.match(stripped)
            if match is None:
                if stripped and not stripped.startswith("//"):
                    raise ValueError(f"unparsed replace directive: {line!r}")
                out.append(line)
                continue
            module, target, target_version = match.group(1), match.group(2), match.group(3)
            if target_version is None and target.startswith(("./", "../", "/")):
                dropped.append(module)
                continue
            replaced.add(module)
        out.append(line)
    if not dropped:
        raise ValueError("no replace directive points at a local path: the recipe's assumption no longer holds")
    required = set(re.findall(r"^\s*(?:require\s+)?(\S+)\s+v\S+(?:\s|$)", text, flags=re.MULTILINE))
    unrequired = [m for m in dropped if m not in required]
    if unrequired:
        raise ValueError(f"dropped local replaces of modules required at no version: {unrequired}")
    for module, version in pins:
        if module in replaced:
            raise ValueError(f"{module} is already replaced in go.mod; a pin would collide with it")
        out.append(f"replace {module} => {module} {version}")
    # Empty `replace ( )` blocks left by the drop are valid go.mod syntax; nothing to tidy.
    return GoModRewrite("\n".join(out) + "\n", tuple(dropped))


def _expected_seconds(controller: Controller) -> float:
    recorded = binaries.recorded_seconds().get(f"{controller.name}-{controller.version}")
    return float(recorded) if isinstance(recorded, int | float) else controller.reference_seconds


def _make_writable(root: pathlib.Path) -> None:
    # The module cache is read-only; go.mod must be rewritten and go.sum extended, and the temporary
    # directory must be deletable afterwards.
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)


def build(controller: Controller, force: bool = False) -> pathlib.Path:
    """Build one controller into the cache unless it is there (a second builder waits, then reuses it)."""
    target = binary_path(controller)
    if _complete(controller) and not force:
        return target
    if shutil.which("go") is None:
        raise binaries.BuildError("the go command is not on PATH; Go >= 1.26 is needed to build Flux")
    with binaries.locked(tool_key(controller)):
        if _complete(controller) and not force:  # built by whoever held the lock before us
            return target
        logs = binaries.cache_root() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        _compile(controller, target, logs / f"build-{controller.name}-{controller.version}.log")
    return target


def _compile(controller: Controller, target: pathlib.Path, log: pathlib.Path) -> None:
    log.write_text("")
    started = time.monotonic()
    expected = _expected_seconds(controller)
    binaries.progress(f"building {controller.name} {controller.version} (about {expected:.0f}s; log: {log})")
    with tempfile.TemporaryDirectory(prefix=f"rf-build-{controller.name}-") as tmp:
        workdir = pathlib.Path(tmp)
        download = ["mod", "download", "-json", f"{controller.module}@{controller.version}"]
        info = json.loads(binaries.run_go(download, workdir, log))
        source = workdir / "src"
        shutil.copytree(info["Dir"], source, symlinks=True)
        _make_writable(source)
        rewrite = rewrite_gomod((source / "go.mod").read_text(), controller.pins)
        (source / "go.mod").write_text(rewrite.text)
        with log.open("a") as sink:
            sink.write(f"# go.mod: dropped local replaces of {list(rewrite.dropped)}; pins {list(controller.pins)}\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(target.name + ".partial")
        left = expected - (time.monotonic() - started)
        binaries.run_go(
            ["build", "-trimpath", "-ldflags", "-s -w", "-o", str(staging), "."], source, log, expected=left
        )
        crds = crd_dir(controller)
        partial = crds.with_name("crds.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for crd in sorted((source / "config" / "crd" / "bases").glob("*.yaml")):
            (partial / crd.name).write_text(crd.read_text())
        shutil.rmtree(crds, ignore_errors=True)
        partial.rename(crds)
        staging.rename(target)
    seconds = time.monotonic() - started
    binaries.record_seconds(tool_key(controller), seconds)
    binaries.progress(f"built {controller.name} in {seconds:.0f}s -> {target}")


def tool_key(controller: Controller) -> binaries.Tool:
    """The :class:`binaries.Tool` whose name and version key the build lock and the recorded build time."""
    return binaries.Tool(controller.name, controller.module, controller.version, controller.module)


def ensure(force: bool = False) -> dict[str, pathlib.Path]:
    """Build (or reuse) both controllers; progress goes to stderr, nothing is printed when warm."""
    return {c.name: build(c, force=force) for c in CONTROLLERS}


# -- CRDs ---------------------------------------------------------------------------------------------


def crd_files() -> list[pathlib.Path]:
    return sorted(p for c in CONTROLLERS for p in crd_dir(c).glob("*.yaml"))


def install_crds(kubeconfig: pathlib.Path, *, timeout: float = 60.0) -> list[str]:
    """Server-side apply Flux's CRDs (they are too large for client-side apply's annotation) and wait
    until they are Established; returns their names."""
    files = crd_files()
    if not files:
        raise FluxError("no Flux CRDs in the cache; build the controllers first (flux.ensure())")
    try:
        return cluster.apply_crds(kubeconfig, files, field_manager=FIELD_MANAGER, timeout=timeout)
    except cluster.ClusterError as err:
        raise FluxError(f"the Flux CRDs: {err}") from err


# -- running the controllers ----------------------------------------------------------------------------


def _stderr(message: str) -> None:
    print(f"[flux] {message}", file=sys.stderr, flush=True)


class Flux:
    """source-controller and kustomize-controller as child processes, watching every namespace of the
    cluster behind ``kubeconfig``. ``directory`` holds their logs (``logs/``) and the artifact storage.

    ``tie_to_parent=True`` (tests, a demo without ``--keep``) makes them die with the calling thread's
    process; ``False`` leaves them running for ``sandbox down`` (the caller adopts :attr:`records`).
    """

    def __init__(
        self,
        kubeconfig: pathlib.Path,
        directory: pathlib.Path,
        *,
        tie_to_parent: bool,
        progress: Callable[[str], None] = _stderr,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.directory = directory
        self.tie_to_parent = tie_to_parent
        self.progress = progress
        self.ports: dict[str, int] = {}
        self.records: list[processes.Record] = []
        self._popens: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def logs(self) -> pathlib.Path:
        return self.directory / "logs"

    def log(self, name: str) -> pathlib.Path:
        return self.logs / f"{name}.log"

    @property
    def storage_address(self) -> str:
        """Where source-controller serves artifacts (kustomize-controller downloads them from here)."""
        return f"127.0.0.1:{self.ports['storage']}"

    def start(self, timeout: float = 60.0) -> None:
        """Build or reuse the binaries, install the CRDs, start both controllers, wait until they answer."""
        started = time.monotonic()
        paths = ensure()
        install_crds(self.kubeconfig)
        names = ("storage", "source_metrics", "source_health", "kustomize_metrics", "kustomize_health")
        self.ports = dict(zip(names, cluster.free_ports(len(names)), strict=True))
        storage = self.directory / "storage"
        storage.mkdir(parents=True, exist_ok=True)
        common = ["--enable-leader-election=false", "--watch-all-namespaces=true", "--log-level=info"]
        source_args = [
            str(paths[SOURCE_CONTROLLER.name]),
            f"--storage-path={storage}",
            f"--storage-addr={self.storage_address}",
            # The URL written into each artifact: loopback, never the hostname the default would derive.
            f"--storage-adv-addr={self.storage_address}",
            f"--metrics-addr=127.0.0.1:{self.ports['source_metrics']}",
            f"--health-addr=127.0.0.1:{self.ports['source_health']}",
            *common,
        ]
        kustomize_args = [
            str(paths[KUSTOMIZE_CONTROLLER.name]),
            f"--metrics-addr=127.0.0.1:{self.ports['kustomize_metrics']}",
            f"--health-addr=127.0.0.1:{self.ports['kustomize_health']}",
            # Only what the Git source holds is built: no kustomize base is ever fetched from elsewhere.
            "--no-remote-bases=true",
            # A Kustomization waiting on dependsOn retries every 5 s, not every 30 s.
            "--requeue-dependency=5s",
            *common,
        ]
        try:
            self._spawn(SOURCE_CONTROLLER.name, source_args)
            self._spawn(KUSTOMIZE_CONTROLLER.name, kustomize_args)
            deadline = time.monotonic() + timeout
            for name, port in (
                (SOURCE_CONTROLLER.name, "source_health"),
                (KUSTOMIZE_CONTROLLER.name, "kustomize_health"),
            ):
                self._await(name, f"http://127.0.0.1:{self.ports[port]}/readyz", deadline)
        except BaseException:
            self.stop()
            raise
        self.progress(f"source-controller and kustomize-controller ready in {time.monotonic() - started:.1f}s")

    def _spawn(self, name: str, argv: list[str]) -> None:
        # processes.spawn passes this process's environment on; the controllers need a KUBECONFIG of their
        # own, and changing os.environ of the caller (pytest, the CLI, with threads running) would leak.
        # `env` sets it and then execs the controller, so the pid and its command line are the controller's.
        settings = [f"KUBECONFIG={self.kubeconfig}", f"RUNTIME_NAMESPACE={NAMESPACE}"]
        # Go never proxies loopback; a proxy variable must not matter here at all, whatever the Go version.
        settings += [f"{key}=127.0.0.1,localhost" for key in ("NO_PROXY", "no_proxy")]
        proc, record = processes.spawn(name, [_ENV, *settings, *argv], self.log(name), tie_to_parent=self.tie_to_parent)
        self._popens[name] = proc
        self.records.append(dataclasses.replace(record, binary=argv[0]))

    def _await(self, name: str, url: str, deadline: float) -> None:
        def ready() -> bool:
            proc = self._popens[name]
            if proc.poll() is not None:
                tail = "\n".join(self.log(name).read_text(errors="replace").splitlines()[-30:])
                raise FluxError(f"{name} exited with {proc.returncode}; last log lines:\n{tail}")
            with _DIRECT.open(url, timeout=2) as resp:
                return bool(resp.status == 200)

        remaining = max(1.0, deadline - time.monotonic())
        errors = (OSError, urllib.error.URLError)
        waiting.wait_for(ready, timeout=remaining, interval=0.1, what=f"{name} ready", ignore=errors)

    def stop(self) -> None:
        """kustomize-controller first (it downloads from source-controller), SIGTERM then SIGKILL."""
        processes.terminate(self.records[::-1], self._popens)
        self._popens.clear()

    def __enter__(self) -> Flux:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- objects --------------------------------------------------------------------------------------------


def git_repository(
    name: str, namespace: str, url: str, *, branch: str = "main", interval: str = "1m"
) -> dict[str, Any]:
    """A ``GitRepository`` of a loopback repository (no credentials: the Git server allows anonymous reads)."""
    return {
        "apiVersion": "source.toolkit.fluxcd.io/v1",
        "kind": "GitRepository",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"interval": interval, "url": url, "ref": {"branch": branch}, "timeout": "20s"},
    }


def kustomization(
    name: str,
    namespace: str,
    source: str,
    path: str,
    *,
    interval: str = "1m",
    timeout: str = "2m",
    target_namespace: str | None = None,
    health_check_exprs: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A pruning, waiting ``Kustomization`` of ``path`` with our health rules (:data:`HEALTH_CHECK_EXPRS`)."""
    spec: dict[str, Any] = {
        "interval": interval,
        "path": path,
        "prune": True,
        "sourceRef": {"kind": "GitRepository", "name": source},
        "wait": True,
        "timeout": timeout,
        "force": False,  # an edited revision must be refused, never deleted and re-created
        "healthCheckExprs": health_check_exprs if health_check_exprs is not None else HEALTH_CHECK_EXPRS,
    }
    if target_namespace:
        spec["targetNamespace"] = target_namespace
    return {
        "apiVersion": "kustomize.toolkit.fluxcd.io/v1",
        "kind": "Kustomization",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


# -- beside a sandbox cluster ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SandboxFlux:
    """What :func:`start_for_cluster` started: where to push and what Flux follows."""

    flux: Flux
    git: git_server.GitServerProcess
    repo_url: str
    sync_file: pathlib.Path

    def stop(self) -> None:
        self.flux.stop()
        self.git.stop()


def start_for_cluster(local: cluster.Cluster, *, tie_to_parent: bool) -> SandboxFlux:
    """Flux and a loopback Git server beside a running sandbox cluster, adopted by it (``sandbox down``
    stops them): a repository ``fleet.git`` seeded with an empty ``fleet/`` kustomization, a GitRepository
    ``flux-system/sandbox`` following it, and ``<dir>/flux/sandbox-sync.yaml``, a Kustomization of
    ``./fleet`` with our health rules, written for the user to apply."""
    root = local.directory / "flux"
    flux = Flux(local.kubeconfig, root, tie_to_parent=tie_to_parent)
    flux.start()
    git = git_server.GitServerProcess(root / "git", root / "logs" / "git-server.log", tie_to_parent=tie_to_parent)
    try:
        git.start()
        repo = git_server.create_repository(root / "git", "fleet")
        git_server.seed(
            repo,
            {"fleet/kustomization.yaml": EMPTY_KUSTOMIZATION},
            message="an empty fleet",
        )
        url = f"{git.url}/fleet.git"
        objects = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            git_repository("sandbox", NAMESPACE, url),
        ]
        apply = ["apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", "-"]
        applied = cluster.kubectl(local.kubeconfig, *apply, stdin=yaml.safe_dump_all(objects), timeout=60)
        if applied.returncode != 0:
            raise FluxError(f"applying the sandbox GitRepository failed: {applied.stderr.strip()}")
        sync = root / "sandbox-sync.yaml"
        sync.write_text(yaml.safe_dump(kustomization("sandbox", NAMESPACE, "sandbox", "./fleet"), sort_keys=False))
    except BaseException:
        git.stop()
        flux.stop()
        raise
    for record in [*flux.records, git.record]:
        local.adopt(record.name, record.pid, record.binary, record.log)
    return SandboxFlux(flux, git, url, sync)


ADOPTED_NAMES = (SOURCE_CONTROLLER.name, KUSTOMIZE_CONTROLLER.name, "git-server")


def running_beside(local: cluster.Cluster) -> list[str]:
    """Which of Flux's processes adopted by ``local`` still run (a second ``up --flux`` starts none)."""
    return [r.name for r in local.adopted() if r.name in ADOPTED_NAMES and processes.alive(r)]


class BesideCluster(threading.Thread):
    """Starts Flux beside a cluster that another part of this process starts (``sandbox demo --flux``):
    waits until that cluster answers, then calls ``start(cluster, tie_to_parent=not keep)``.

    The thread lives until :meth:`finish`: children started with PR_SET_PDEATHSIG (a demo without
    ``--keep``) die when the *thread* that spawned them ends, so it must outlive the demo. With ``keep``
    they are detached and adopted by the cluster, and ``sandbox down`` stops them.
    """

    def __init__(self, target: cluster.Cluster, *, keep: bool, start: Callable[..., SandboxFlux | None]) -> None:
        super().__init__(name="flux-beside-cluster", daemon=True)
        self.target, self.keep, self._start = target, keep, start
        self.since = time.time()
        self.done = threading.Event()
        self.started: SandboxFlux | None = None

    def _cluster_up(self) -> bool:
        # A cluster left running is stopped and restarted by the demo: only one started after us counts.
        try:
            state = json.loads(self.target.state_file.read_text())
            fresh = float(state.get("started_at", 0)) >= self.since
            return fresh and self.target.running() and self.target.request("GET", "/readyz") == "ok"
        except (OSError, ValueError, urllib.error.URLError, cluster.ClusterError):
            return False

    def run(self) -> None:
        while not self.done.is_set() and not self._cluster_up():
            time.sleep(0.5)
        if self.done.is_set():
            return
        try:
            self.started = self._start(self.target, tie_to_parent=not self.keep)
        except (FluxError, binaries.BuildError, RuntimeError, OSError) as err:
            _stderr(f"did not start: {err}")
            return
        self.done.wait()
        if self.started is not None and not self.keep:
            self.started.stop()

    def finish(self) -> None:
        """The demo is over: stop what was started (unless kept) and end the thread."""
        self.done.set()
        self.join(timeout=60)


def main(argv: list[str] | None = None) -> int:
    """``python -m rolloutfleet.sandbox.flux``: build (or reuse) both controllers; ``make binaries`` runs it
    so that a cold build shows up front, with its progress, instead of inside the Git-driven test tier."""
    force = "--force" in (argv if argv is not None else sys.argv[1:])
    try:
        paths = ensure(force=force)
    except binaries.BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
