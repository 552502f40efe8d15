"""Start ``rolloutfleet run`` against a local cluster (sandbox demo, tests, benches): a process or its image.

Called by ``sandbox.demo``, the integration fixtures and ``bench/``. The operator watches every namespace
(or those given), runs standalone (no peering), logs to a file, and lives in its own session so it can be
killed as a group.

By default it is a child process of this Python. With ``image`` (or ``ROLLOUTFLEET_OPERATOR_IMAGE`` in the
environment) it is the operator *container*, run by podman the way the chart runs it: read-only root
filesystem, a tmpfs on /tmp and nothing else writable, uid 65532, the kubeconfig mounted read-only. The host
network, because the sandbox's API server and its pods' IPs are on loopback. ``scripts/images.sh`` builds
the image and writes the private podman configuration used here when the environment names none.
Stopping: SIGTERM to podman (``terminate``, ``sandbox down``) reaches the operator and the container goes;
``kill`` removes the container. A SIGKILL sent to podman's group from elsewhere leaves the container running
until the next start for the same kubeconfig replaces it (the callers that do that run the process, not
the image, unless the variable is set for them too).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

from rolloutfleet.sandbox import binaries

IMAGE_ENV = "ROLLOUTFLEET_OPERATOR_IMAGE"
# The Dockerfile's USER, repeated so that an image built without it still never runs the operator as root.
CONTAINER_USER = "65532:65532"
# scripts/images.sh writes these under <cache>/containers/; podman reads them through these variables.
_PODMAN_CONFIG = {
    "CONTAINERS_CONF": "containers.conf",
    "CONTAINERS_STORAGE_CONF": "storage.conf",
    "CONTAINERS_REGISTRIES_CONF": "registries.conf",
}


class ContainerProcess(subprocess.Popen[bytes]):
    """``podman run`` in the foreground: SIGTERM reaches the operator (podman proxies signals to it), and
    ``kill`` removes the container too, which a SIGKILL of podman alone would leave running."""

    container: str
    image: str
    podman_env: dict[str, str]

    def kill(self) -> None:
        remove(self.container, self.podman_env)
        super().kill()


def start(
    kubeconfig: pathlib.Path,
    log_path: pathlib.Path,
    *,
    env: dict[str, str] | None = None,
    metrics_port: int = 0,
    image: str | None = None,
    namespaces: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """The operator as a subprocess (or, with an image, as its container); fast resync settings unless
    ``env`` overrides them. It watches every namespace, or only ``namespaces``."""
    settings = {"ROLLOUTFLEET_RESYNC_SECONDS": "2", "ROLLOUTFLEET_IDLE_SECONDS": "1", "PYTHONUNBUFFERED": "1"}
    settings.update(env or {})
    scope = ["--all-namespaces"] if namespaces is None else [a for n in namespaces for a in ("--namespace", n)]
    arguments = [*scope, "--standalone", "--metrics-port", str(metrics_port), "--liveness", ""]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    image = image if image is not None else os.environ.get(IMAGE_ENV) or None
    if image:
        return _start_container(image, kubeconfig, log_path, settings, arguments)
    child_env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    child_env.update(settings)
    command = [sys.executable, "-m", "rolloutfleet.cli", "run", *arguments]
    with log_path.open("ab") as sink:  # the child keeps its own descriptor
        return subprocess.Popen(
            command,
            env=child_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def executable(proc: subprocess.Popen[bytes]) -> str:
    """The program ``start`` ran (Python, or podman): what ``sandbox down`` checks a recorded pid against."""
    args = proc.args
    if isinstance(args, str | bytes | os.PathLike):
        return os.fsdecode(args)
    return os.fsdecode(args[0])


def describe(proc: subprocess.Popen[bytes]) -> str:
    """One phrase for progress lines: the pid, and the image when it is the container."""
    if isinstance(proc, ContainerProcess):
        return f"container {proc.container} of image {proc.image}, podman pid {proc.pid}"
    return f"pid {proc.pid}"


def podman_environment() -> dict[str, str]:
    """The environment for podman: the caller's, plus the private configuration of ``scripts/images.sh``
    when the caller names none (never the machine's global one by accident)."""
    env = dict(os.environ)
    directory = binaries.cache_root() / "containers"
    if not any(name in env for name in _PODMAN_CONFIG) and (directory / "containers.conf").is_file():
        env.update({name: str(directory / file) for name, file in _PODMAN_CONFIG.items()})
    return env


def remove(container: str, env: dict[str, str]) -> None:
    """Remove a container whatever its state (a no-op for one already gone)."""
    podman = shutil.which("podman")
    if podman:
        subprocess.run(
            [podman, "rm", "--force", "--time", "0", "--ignore", container],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )


def _start_container(
    image: str,
    kubeconfig: pathlib.Path,
    log_path: pathlib.Path,
    settings: dict[str, str],
    arguments: list[str],
) -> ContainerProcess:
    podman = shutil.which("podman")
    if podman is None:
        raise RuntimeError(f"{IMAGE_ENV}={image} needs podman on PATH (scripts/images.sh tools installs it)")
    # One name per cluster: --replace then removes a container that a killed run left behind.
    container = "rolloutfleet-operator-" + hashlib.sha256(str(kubeconfig.resolve()).encode()).hexdigest()[:12]
    mounted = _readable_copy(kubeconfig, container)
    command = [
        podman,
        "run",
        "--rm",
        "--replace",
        "--name",
        container,
        "--network",
        "host",
        "--read-only",
        # podman's --read-only adds writable tmpfs on /tmp, /var/tmp and /run by default; only /tmp here.
        "--read-only-tmpfs=false",
        "--tmpfs",
        "/tmp",  # noqa: S108 -- the container's own /tmp, not this host's
        "--user",
        CONTAINER_USER,
        "--volume",
        f"{mounted}:/kubeconfig:ro",
        "--env",
        "KUBECONFIG=/kubeconfig",
    ]
    for name, value in settings.items():
        if name != "KUBECONFIG":
            command += ["--env", f"{name}={value}"]
    command += [image, *arguments]  # the image's entrypoint is `rolloutfleet run`
    env = podman_environment()
    with log_path.open("ab") as sink:
        proc = ContainerProcess(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.container, proc.image, proc.podman_env = container, image, env
    return proc


def _readable_copy(kubeconfig: pathlib.Path, container: str) -> pathlib.Path:
    """A copy of the kubeconfig that uid 65532 can read: the sandbox writes it 0600 for its own user.

    The copy is world-readable but sits in a directory only this user can enter: on the host only the
    owner reaches it; in the container only the file itself is mounted.
    """
    directory = kubeconfig.parent / f".{container}"
    directory.mkdir(mode=0o700, exist_ok=True)
    directory.chmod(0o700)
    copy = directory / "kubeconfig"
    with contextlib.suppress(FileNotFoundError):
        copy.chmod(0o600)
    shutil.copyfile(kubeconfig, copy)
    copy.chmod(0o444)
    return copy
