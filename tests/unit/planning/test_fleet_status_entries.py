"""``planning.fleet_status.observed``: each pod's entry of ``status.pods``, rebuilt only where it changed.

A pass rewrites a large fleet's status every 1-2 s while few of its pods moved, so an entry whose inputs are what
the previous status shows is carried over as it is. The risk of that shortcut is a change it misses: every field
of an entry is changed here on its own and must show in the next status, while the pods that did not change keep
their entries (the same objects) and the whole status stays equal to one built from nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from rolloutfleet.planning import fleet_status
from rolloutfleet.planning.fleet_status import EngineSummary
from rolloutfleet.resources import labels

pytestmark = pytest.mark.unit

SPEC = RolloutFleetSpec.model_validate(
    {
        "replicas": 3,
        "image": "rolloutfleet-worker:test",
        "verifier": {"path": "/weights/p/step-0/verifier"},
        "weights": {"claimName": "ckpt", "mountPath": "/weights", "allowedRoots": ["/weights/p"]},
    }
)


def _pod(i: int, *, gate: str = "True", phase: str = "Running", ip: str | None = None) -> dict[str, Any]:
    conditions = [
        {"type": "ContainersReady", "status": "True"},
        {"type": "Ready", "status": gate},
        {"type": labels.WEIGHTS_READY_CONDITION, "status": gate},
    ]
    return {
        "metadata": {"name": f"policy-{i}", "namespace": "ns", "uid": f"u-{i}"},
        "spec": {"readinessGates": [{"conditionType": labels.WEIGHTS_READY_CONDITION}]},
        "status": {"phase": phase, "podIP": ip or f"127.2.0.{i + 1}", "conditions": conditions},
    }


def _engines(**changed: Any) -> dict[str, EngineSummary]:
    base = {"revision": 4, "draft_revision": 4, "step": "Done", "weight_version": "4"}
    out = {f"policy-{i}": EngineSummary(**base) for i in range(3)}
    out["policy-1"] = EngineSummary(**{**base, **changed})
    return out


def _status(
    old: RolloutFleetStatus, pods: list[dict[str, Any]], engines: dict[str, EngineSummary]
) -> RolloutFleetStatus:
    return fleet_status.observed(old, SPEC, "policy", 1, None, pods, engines)


PODS = [_pod(i) for i in range(3)]
BEFORE = _status(RolloutFleetStatus(), PODS, _engines())


@pytest.mark.parametrize(
    ("pods", "engines", "field", "value"),
    [
        ([_pod(0), _pod(1, ip="127.2.0.9"), _pod(2)], _engines(), "ip", "127.2.0.9"),
        ([_pod(0), _pod(1, phase="Failed"), _pod(2)], _engines(), "phase", "Failed"),
        ([_pod(0), _pod(1, gate="False"), _pod(2)], _engines(), "ready", False),
        (PODS, _engines(revision=5), "revision", 5),
        (PODS, _engines(draft_revision=None), "draft_revision", None),
        (PODS, _engines(step="LoadVerifier"), "step", "LoadVerifier"),
        (PODS, _engines(weight_version="5"), "weight_version", "5"),
    ],
)
def test_each_field_of_a_changed_pod_shows_and_the_others_keep_their_entries(
    pods: list[dict[str, Any]], engines: dict[str, EngineSummary], field: str, value: object
) -> None:
    after = _status(BEFORE, copy.deepcopy(pods), engines)
    assert getattr(after.pods[1], field) == value
    assert getattr(BEFORE.pods[1], field) != value
    assert after.pods[0] is BEFORE.pods[0] and after.pods[2] is BEFORE.pods[2]
    # Carried or rebuilt, the status is the one built from nothing for the same observations.
    assert after.to_wire()["pods"] == _status(RolloutFleetStatus(), pods, engines).to_wire()["pods"]


def test_a_pod_without_an_engine_view_carries_what_the_status_showed() -> None:
    engines = _engines()
    del engines["policy-1"]
    after = _status(BEFORE, PODS, engines)
    assert after.pods[1] is BEFORE.pods[1]
    assert after.pods[1].revision == 4
