"""What the built images ship, checked inside them with podman (tests/images).

Run by ``scripts/images.sh test`` (and so by ``make images`` and CI) right after it built both images; there
``ROLLOUTFLEET_IMAGES_REQUIRED=1`` turns every skip below into a failure, so a broken build cannot pass as
skipped. Elsewhere (`pytest -m images` without podman or without the images; `make test` deselects the marker)
the tests skip and say why. Images: ``ROLLOUTFLEET_OPERATOR_IMAGE`` / ``ROLLOUTFLEET_WORKER_IMAGE``, else the
script's tags.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from rolloutfleet.sandbox import operator_process

REQUIRED = os.environ.get("ROLLOUTFLEET_IMAGES_REQUIRED") == "1"
OPERATOR_IMAGE = os.environ.get("ROLLOUTFLEET_OPERATOR_IMAGE") or "localhost/rolloutfleet-operator:dev"
WORKER_IMAGE = os.environ.get("ROLLOUTFLEET_WORKER_IMAGE") or "localhost/rolloutfleet-worker:dev"
# What the chart gives the operator (and what these tests give both images): a read-only root filesystem
# with a writable /tmp and nothing else writable (podman's --read-only alone also mounts /var/tmp and /run).
READ_ONLY = ["--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp"]

_serial = itertools.count()
Runner = Callable[..., subprocess.CompletedProcess[str]]
Probe = Callable[..., dict[str, Any]]
PROBE = (pathlib.Path(__file__).parent / "probe.py").read_text()


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (ROLLOUTFLEET_IMAGES_REQUIRED=1: scripts/images.sh should have provided it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def podman() -> tuple[str, dict[str, str]]:
    """The podman binary and its environment (the private config of scripts/images.sh when none is set)."""
    binary = shutil.which("podman")
    if binary is None:
        _unavailable("podman is not installed (scripts/images.sh tools)")
    assert binary is not None
    env = operator_process.podman_environment()
    if "CONTAINERS_CONF" not in env:
        _unavailable("no podman configuration (scripts/images.sh tools writes the private one)")
    return binary, env


def _image(podman: tuple[str, dict[str, str]], image: str) -> str:
    binary, env = podman
    if subprocess.run([binary, "image", "exists", image], env=env, check=False).returncode != 0:
        _unavailable(f"image {image} is not built (scripts/images.sh build)")
    return image


@pytest.fixture(scope="session")
def operator_image(podman: tuple[str, dict[str, str]]) -> str:
    return _image(podman, OPERATOR_IMAGE)


@pytest.fixture(scope="session")
def worker_image(podman: tuple[str, dict[str, str]]) -> str:
    return _image(podman, WORKER_IMAGE)


@pytest.fixture(scope="session")
def run(podman: tuple[str, dict[str, str]]) -> Runner:
    """``run(image, *args, entrypoint=None, options=())``: one ``podman run --rm``, read-only, no network."""
    binary, env = podman

    def _run(
        image: str, *args: str, entrypoint: str | None = None, options: tuple[str, ...] = (), timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        # A name of its own, so that a run past its timeout is removed (killing podman leaves it running).
        name = f"rolloutfleet-images-test-{os.getpid()}-{next(_serial)}"
        command = [binary, "run", "--rm", "--name", name, "--network=none", *READ_ONLY, *options]
        if entrypoint is not None:
            command += ["--entrypoint", entrypoint]
        try:
            return subprocess.run(
                [*command, image, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            operator_process.remove(name, env)
            raise

    return _run


@pytest.fixture(scope="session")
def inspect(podman: tuple[str, dict[str, str]]) -> Callable[[str], dict[str, Any]]:
    binary, env = podman

    def _inspect(image: str) -> dict[str, Any]:
        out = subprocess.run(
            [binary, "image", "inspect", image], env=env, capture_output=True, text=True, check=True
        ).stdout
        found: dict[str, Any] = json.loads(out)[0]
        return found

    return _inspect


@pytest.fixture(scope="session")
def probe(run: Runner) -> Probe:
    """``probe(image, modules, entrypoint=..., options=())``: probe.py run inside ``image`` (what each module's
    import gives, the files of site-packages and of the whole root filesystem, the uid, the writable paths)."""

    def _probe(image: str, modules: list[str], *, entrypoint: str, options: tuple[str, ...] = ()) -> dict[str, Any]:
        done = run(image, "-c", PROBE, json.dumps(modules), entrypoint=entrypoint, options=options)
        assert done.returncode == 0, done.stderr
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    return _probe
