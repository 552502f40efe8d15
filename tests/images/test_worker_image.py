"""The worker image adds the worker and digest packages to its vLLM base, and nothing of the operator.

Built by scripts/images.sh on a stand-in base (python3 + pip on PATH, no vLLM, no torch: container
registries are unreachable there), so modules that need torch, Triton or vLLM cannot import in it; every
other module of the worker package must, including the ones vLLM loads by name (extension, middleware).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.images

# The ``probe`` fixture of conftest.py: probe.py's report from inside an image.
Probe = Callable[..., dict[str, Any]]

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "worker_image" / "rolloutfleet_worker"
WORKER_MODULES = sorted(f"rolloutfleet_worker.{p.stem}" for p in SOURCE.glob("*.py") if p.stem != "__init__")
# What vLLM's image brings and the stand-in base does not: the only modules a worker module may miss here.
FROM_THE_BASE = {"torch", "triton", "vllm"}
# Named on the vLLM command line the operator renders (--worker-extension-cls, --middleware): must import.
ENTRY_POINTS = ["rolloutfleet_worker.extension", "rolloutfleet_worker.auth", "rolloutfleet_digest"]
OPERATOR = ["rolloutfleet", "kopf", "kubernetes"]
NON_ROOT = "65532:65532"  # any uid but 0: the image must not need root to import its packages


@pytest.fixture(scope="module")
def probed(probe: Probe, worker_image: str) -> dict[str, Any]:
    modules = ["rolloutfleet_worker", *WORKER_MODULES, *ENTRY_POINTS, *OPERATOR]
    return probe(worker_image, modules, entrypoint="python3", options=("--user", NON_ROOT))


def test_the_entry_points_import(probed: dict[str, Any]) -> None:
    assert {name: probed["imports"][name] for name in ENTRY_POINTS} == dict.fromkeys(ENTRY_POINTS, "ok")


def test_every_worker_module_is_shipped_and_imports_or_needs_only_the_base(probed: dict[str, Any]) -> None:
    assert len(WORKER_MODULES) > 10, "the source tree's modules were not found"
    allowed = {"ok"} | {f"missing {name}" for name in FROM_THE_BASE}
    bad = {name: probed["imports"][name] for name in WORKER_MODULES if probed["imports"][name] not in allowed}
    assert bad == {}


def test_no_operator_package(probed: dict[str, Any]) -> None:
    assert {name: probed["imports"][name] for name in OPERATOR} == {name: f"missing {name}" for name in OPERATOR}
    leaked = [f for f in probed["files"] if f.startswith(("rolloutfleet/", "rolloutfleet-", "kopf"))]
    assert leaked == []
    assert not [p for p in probed["paths"] if p.endswith("/rolloutfleet/reconcile")]


def test_it_runs_as_non_root_with_a_read_only_root(probed: dict[str, Any]) -> None:
    assert probed["uid"] == 65532
    assert probed["writable"] == ["/tmp"]
