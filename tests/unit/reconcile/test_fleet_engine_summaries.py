"""``reconcile.fleet._engines``: each pod's engine summary for the fleet status, kept between status writes.

A pass rewrites a large fleet's status every 1-2 s while a few of its pods moved, so a summary is kept with what
it was made from (the observation, the step, the pod object and the incarnation the observation was read
through) and a pod whose four are the same is not read again. The risk of that shortcut is a change it misses,
the worst being a pod recreated or restarted under the same name while the revision loop's observation is the
predecessor's: the status would then claim what the old engine served for a new process on the initial
checkpoint. Every kind of change is made here, at random, and the summaries must always equal ones made from
nothing.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from rolloutfleet.api.engine import EngineFault, EngineState, TargetState
from rolloutfleet.planning import fleet_status, pod_readiness
from rolloutfleet.reconcile import fleet
from rolloutfleet.reconcile.context import FleetMemory

pytestmark = pytest.mark.unit


def _pod(i: int, uid: str = "a", restarts: int = 0) -> dict[str, Any]:
    return {
        "metadata": {"name": f"policy-{i}", "namespace": "ns", "uid": f"{uid}-{i}"},
        "status": {
            "phase": "Running",
            "podIP": f"127.2.0.{i + 1}",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"restartCount": restarts, "ready": True}],
        },
    }


def _state(revision: int, reachable: bool = True) -> EngineState:
    if not reachable:
        return EngineState.failed(EngineFault.UNREACHABLE, "connection refused")
    return EngineState(reachable=True, verifier=TargetState(revision=revision), draft=TargetState(revision=revision))


def _from_nothing(memory: FleetMemory, pods: list[dict[str, Any]]) -> dict[str, fleet_status.EngineSummary]:
    fresh = FleetMemory(
        engine_view=dict(memory.engine_view),
        engine_view_incarnations=dict(memory.engine_view_incarnations),
        steps=dict(memory.steps),
    )
    return fleet._engines(fresh, fleet_status.PodFactsMemo(), copy.deepcopy(pods))


def test_summaries_kept_between_writes_equal_summaries_made_from_nothing() -> None:
    rng = random.Random(18)
    pods = [_pod(i) for i in range(10)]
    memory, facts = FleetMemory(), fleet_status.PodFactsMemo()
    memory.remember({f"policy-{i}": _state(1) for i in range(10)}, {p["metadata"]["name"]: "" for p in pods})
    memory.engine_view_incarnations = {p["metadata"]["name"]: pod_readiness.incarnation(p) for p in pods}
    hows = [
        "observed",  # the revision loop read the engine again (a new observation)
        "unreachable",
        "step",
        "gate in place",  # the operator's own gate write, on the listed object
        "new object",  # the watch's next object of the same pod (same uid, same restarts)
        "recreated",  # another pod under the same name: another uid
        "restarted",  # the container restarted: another restart count
        "read through",  # the revision loop read it again through the pod as it is now
        "forgotten",  # the loop holds no observation of it any more
        "gone",  # no longer listed
    ]
    seen = set()
    kept_checked = 0
    for step in range(400):
        for _ in range(rng.randint(0, 3)):
            i, how = rng.randrange(len(pods)), rng.choice(hows)
            name = pods[i]["metadata"]["name"]
            ordinal = int(name.rsplit("-", 1)[1])
            seen.add(how)
            if how == "observed":
                memory.engine_view = {**memory.engine_view, name: _state(step)}
            elif how == "unreachable":
                memory.engine_view = {**memory.engine_view, name: _state(step, reachable=False)}
            elif how == "step":
                memory.steps = {**memory.steps, name: rng.choice(["Pause", "LoadVerifier", "Resume", "Done"])}
            elif how == "gate in place":
                pods[i]["status"]["conditions"] = [{"type": "Ready", "status": rng.choice(["True", "False"])}]
            elif how == "new object":
                pods[i] = copy.deepcopy(pods[i])
            elif how == "recreated":
                pods[i] = _pod(ordinal, uid=f"u{step}")
            elif how == "restarted":
                restarts = pods[i]["status"]["containerStatuses"][0]["restartCount"] + 1
                pods[i] = _pod(ordinal, uid=pods[i]["metadata"]["uid"].rsplit("-", 1)[0], restarts=restarts)
            elif how == "read through":
                memory.engine_view_incarnations = {
                    **memory.engine_view_incarnations,
                    name: pod_readiness.incarnation(pods[i]),
                }
            elif how == "forgotten":
                memory.engine_view = {k: v for k, v in memory.engine_view.items() if k != name}
                memory.engine_view_incarnations = {
                    k: v for k, v in memory.engine_view_incarnations.items() if k != name
                }
            elif how == "gone" and len(pods) > 6:
                pods = pods[:i] + pods[i + 1 :]
        before = dict(memory.summaries)
        summaries = fleet._engines(memory, facts, pods)
        assert summaries == _from_nothing(memory, pods), step
        # The shortcut is taken: a pod whose inputs are all as before keeps its summary (the same object).
        for pod in pods:
            name = pod["metadata"]["name"]
            last = before.get(name)
            if (
                last is not None
                and last[0] is memory.engine_view.get(name)
                and last[2] is pod
                and last[1] == memory.steps.get(name)
                and last[3] == memory.engine_view_incarnations.get(name)
            ):
                assert summaries[name] is last[4], (step, name)
                kept_checked += 1
        assert set(memory.summaries) <= {p["metadata"]["name"] for p in pods}  # a pod gone is forgotten
    assert seen == set(hows)
    assert kept_checked > 1000


def test_a_pod_recreated_under_its_name_claims_nothing_until_read_through_the_new_pod() -> None:
    """The case the shortcut must never miss: the observation is the predecessor's (the same object), the pod is
    another; and once the loop reads the engine through the new pod, its summary is what that read says."""
    pods = [_pod(0)]
    memory, facts = FleetMemory(), fleet_status.PodFactsMemo()
    memory.remember({"policy-0": _state(3)}, {"policy-0": pod_readiness.incarnation(pods[0])})
    assert fleet._engines(memory, facts, pods)["policy-0"].revision == 3

    pods = [_pod(0, uid="again")]
    assert fleet._engines(memory, facts, pods)["policy-0"] == fleet_status.EngineSummary(None, None, None, None)
    assert fleet._engines(memory, facts, pods)["policy-0"] == fleet_status.EngineSummary(None, None, None, None)

    fresh = _state(0)
    memory.remember({"policy-0": fresh}, {"policy-0": pod_readiness.incarnation(pods[0])})
    assert fleet._engines(memory, facts, pods)["policy-0"].revision == 0
