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


# What the fleet's memo of pod facts must not miss (``PodFactsMemo``): a pass keeps one per fleet and builds
# every status write on it, so a change it failed to notice would stay in the status until the pod changed
# again. Each change a pod can go through is made the way it reaches the operator (the watch hands over a new
# object; ``reconcile.gates.set_gate`` replaces the conditions list of the object it wrote), and each status
# built on the memo must equal the one built without it (from copies of the pods, each status on its own last).


def _with_gate_written(pod: dict[str, Any], value: str) -> None:
    """As ``gates.set_gate`` records its write on the listed object: in place, a new conditions list."""
    kept = [c for c in pod["status"]["conditions"] if c["type"] != labels.WEIGHTS_READY_CONDITION]
    pod["status"]["conditions"] = [*kept, {"type": labels.WEIGHTS_READY_CONDITION, "status": value}]


def _changed(pod: dict[str, Any], how: str, step: int) -> dict[str, Any]:
    """``pod`` after one change, as the operator would hold it next."""
    if how == "gate in place":
        _with_gate_written(pod, "False" if pod["status"]["conditions"][-1]["status"] == "True" else "True")
        return pod
    new = copy.deepcopy(pod)  # the watch's next object for the pod
    if how == "ip":
        new["status"]["podIP"] = f"127.3.{step % 250}.1"
    elif how == "phase":
        new["status"]["phase"] = "Failed" if new["status"]["phase"] == "Running" else "Running"
    elif how == "template":
        new["metadata"]["labels"] = {"controller-revision-hash": f"rev-{step % 2}"}
    elif how == "deleting":
        new["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    elif how == "crash loop":
        new["status"]["containerStatuses"] = [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
    elif how == "restarted":
        new["status"]["containerStatuses"] = [{"restartCount": step, "ready": True}]
    return new


def test_statuses_built_on_the_memo_equal_statuses_built_without_it() -> None:
    import random

    rng = random.Random(18)
    spec = SPEC.model_copy(update={"replicas": 12})
    sts = {"status": {"updateRevision": "rev-1"}}
    pods = [_pod(i) for i in range(12)]
    engines = {f"policy-{i}": EngineSummary(4, 4, "Done", "4") for i in range(12)}
    memo = fleet_status.PodFactsMemo()
    status = plain = RolloutFleetStatus()
    hows = ["gate in place", "ip", "phase", "template", "deleting", "crash loop", "restarted", "engine", "gone"]
    seen_changes = set()
    for step in range(300):
        for _ in range(rng.randint(0, 3)):
            i, how = rng.randrange(len(pods)), rng.choice(hows)
            seen_changes.add(how)
            if how == "engine":
                name = pods[i]["metadata"]["name"]
                engines = {**engines, name: EngineSummary(step, step, rng.choice(["Done", "Load"]), str(step))}
            elif how == "gone":
                engines = {k: v for k, v in engines.items() if k != pods[i]["metadata"]["name"]}
            else:
                pods[i] = _changed(pods[i], how, step)
        if step % 50 == 49:  # a pod replaced by a new one (another uid), one removed for good
            pods[0] = _pod(0)
            pods[0]["metadata"]["uid"] = f"again-{step}"
            pods = pods[:-1] if len(pods) > 8 else pods
        if step % 37 == 36:  # the fleet read back after another writer's status (a 409): carried from there
            wire = plain.to_wire()
            wire["pods"] = [{**entry, "revision": 99} for entry in wire.get("pods", [])]
            status, plain = RolloutFleetStatus.model_validate(wire), RolloutFleetStatus.model_validate(wire)
        status = fleet_status.observed(status, spec, "policy", 1, sts, pods, engines, memo)
        plain = fleet_status.observed(plain, spec, "policy", 1, sts, copy.deepcopy(pods), engines)
        # (conditions' timestamps are the wall clock's: compared without them)
        assert status.to_wire()["pods"] == plain.to_wire()["pods"], step
        assert (status.ready_replicas, status.updated_replicas, status.replicas) == (
            plain.ready_replicas,
            plain.updated_replicas,
            plain.replicas,
        ), step
        assert [(c.type, c.status, c.reason, c.message) for c in status.conditions] == [
            (c.type, c.status, c.reason, c.message) for c in plain.conditions
        ], step
        assert len(memo) == len(pods)  # a pod no longer listed is forgotten
    assert seen_changes == set(hows)


def test_a_gate_written_on_the_listed_pod_shows_in_the_next_status() -> None:
    """The operator's own gate write changes the listed object in place (before the watch brings the pod's next
    object): the memo must read the pod again, or the status would show the gate as it was."""
    memo = fleet_status.PodFactsMemo()
    pods = [_pod(i) for i in range(3)]
    before = fleet_status.observed(RolloutFleetStatus(), SPEC, "policy", 1, None, pods, _engines(), memo)
    assert before.pods[1].ready is True
    _with_gate_written(pods[1], "False")
    after = fleet_status.observed(before, SPEC, "policy", 1, None, pods, _engines(), memo)
    assert after.pods[1].ready is False and after.ready_replicas == 2
    assert after.pods[0] is before.pods[0] and after.pods[2] is before.pods[2]
