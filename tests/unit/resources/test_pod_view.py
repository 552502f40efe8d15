"""The slim engine-pod view kept in the operator's pod index, and the context reading pods through it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rolloutfleet.planning import fleet_status
from rolloutfleet.reconcile.context import OperatorContext
from rolloutfleet.resources import labels, pod_view

pytestmark = pytest.mark.unit


def pod(name: str, fleet: str = "pol", **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {**labels.selector_labels(fleet), "controller-revision-hash": "h1"},
            "annotations": {"big": "x" * 10_000},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": "127.1.0.5",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T00:00:00Z"}],
            "containerStatuses": [{"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}],
            **status,
        },
    }


def test_slim_keeps_what_the_reconcilers_read_and_nothing_else() -> None:
    full = pod("pol-0")
    slim = pod_view.slim(full)
    assert pod_view.fleet_of(full) == "pol" and pod_view.fleet_of({"metadata": {}}) is None
    assert "annotations" not in slim["metadata"] and "spec" not in slim
    assert len(repr(slim)) < 600
    # The fleet status reads the same from either.
    for reader in (fleet_status._pod_ready, fleet_status._pod_failing):
        assert reader(slim) == reader(full)  # type: ignore[operator]


def test_context_reads_the_index_when_it_has_one_and_lists_otherwise() -> None:
    class Kube:
        calls = 0

        async def list(self, *_args: Any) -> list[dict[str, Any]]:
            Kube.calls += 1
            return [pod("pol-9")]

    ctx = OperatorContext(kube=Kube(), metrics=None)  # type: ignore[arg-type]
    assert [p["metadata"]["name"] for p in asyncio.run(ctx.fleet_pods("ns", "pol"))] == ["pol-9"]
    assert Kube.calls == 1
    entry = pod_view.slim(pod("pol-0"))
    ctx.pod_index = {("ns", "pol"): [entry]}
    got = asyncio.run(ctx.fleet_pods("ns", "pol"))
    assert got == [entry] and got[0] is not entry  # a copy: a pass may annotate what it read
    assert asyncio.run(ctx.fleet_pods("ns", "other")) == [] and Kube.calls == 1
