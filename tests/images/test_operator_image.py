"""The operator image ships the operator and nothing of the test rig or the worker; it runs as the chart runs it.

The build (Dockerfile) deletes ``rolloutfleet.sim`` and ``rolloutfleet.sandbox`` before installing, and installs
neither the worker distribution nor torch; these tests fail if any of it leaks back into the built image, by an
import attempt inside the container and by a listing of its files.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.images

# The ``run`` and ``probe`` fixtures of conftest.py: one ``podman run --rm`` of an image (read-only, without
# network), and probe.py's report from inside it.
Runner = Callable[..., subprocess.CompletedProcess[str]]
Probe = Callable[..., dict[str, Any]]

SHIPPED = ["rolloutfleet", "rolloutfleet.cli", "rolloutfleet.reconcile", "rolloutfleet_digest", "kopf", "kubernetes"]
NOT_SHIPPED = ["rolloutfleet.sim", "rolloutfleet.sandbox", "rolloutfleet_worker", "torch", "vllm"]
# The image's user: numeric, so the kubelet can verify runAsNonRoot (the chart sets runAsUser to the same).
OPERATOR_UID = 65532


@pytest.fixture(scope="module")
def probed(probe: Probe, operator_image: str) -> dict[str, Any]:
    return probe(operator_image, SHIPPED + NOT_SHIPPED, entrypoint="python")


def test_the_operator_and_its_dependencies_import(probed: dict[str, Any]) -> None:
    assert {name: probed["imports"][name] for name in SHIPPED} == dict.fromkeys(SHIPPED, "ok")


def test_no_test_rig_no_worker_no_torch_can_be_imported(probed: dict[str, Any]) -> None:
    # "missing <the module itself>": absent, not merely broken by a missing dependency.
    assert {name: probed["imports"][name] for name in NOT_SHIPPED} == {name: f"missing {name}" for name in NOT_SHIPPED}


def test_no_file_of_the_test_rig_or_the_worker_is_in_site_packages(probed: dict[str, Any]) -> None:
    files = probed["files"]
    assert any(f.startswith("rolloutfleet/reconcile/") for f in files), "the listing must see the operator"
    leaked = [
        f
        for f in files
        if f.startswith(("rolloutfleet/sim/", "rolloutfleet/sandbox/", "rolloutfleet_worker", "torch/", "vllm/"))
    ]
    assert leaked == []


def test_no_copy_of_them_anywhere_in_the_image(probed: dict[str, Any]) -> None:
    # The build stage's /src (the source tree) must not reach the final image either.
    leaked = [
        p
        for p in probed["paths"]
        if "rolloutfleet_worker" in p or p.endswith(("/rolloutfleet/sim", "/rolloutfleet/sandbox")) or p == "/src"
    ]
    assert leaked == []


def test_non_root_and_nothing_writable_but_tmp(
    probed: dict[str, Any], inspect: Callable[[str], dict[str, Any]], operator_image: str
) -> None:
    assert inspect(operator_image)["Config"]["User"] == f"{OPERATOR_UID}:{OPERATOR_UID}"
    assert probed["uid"] == OPERATOR_UID
    assert probed["writable"] == ["/tmp"]


def test_help_runs_read_only(run: Runner, operator_image: str) -> None:
    done = run(operator_image, "--help")
    assert done.returncode == 0, done.stderr
    assert "--standalone" in done.stdout


def test_without_credentials_it_exits_at_once_with_one_clear_line(run: Runner, operator_image: str) -> None:
    # No kubeconfig, no ServiceAccount token, no network: kopf alone would retry its login forever.
    # 60 s: far above a fast failure (seconds), far below kopf's retry loop, which never ends.
    try:
        done = run(operator_image, "--standalone", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the operator without cluster credentials was still running after 60 s")
    assert done.returncode != 0
    last = (done.stdout + done.stderr).strip().splitlines()[-1]
    # The line a user reads in `kubectl logs` / `podman logs` must say what is missing.
    assert "no cluster credentials" in last, last
