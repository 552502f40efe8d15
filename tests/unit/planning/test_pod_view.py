"""``planning.pod_view.PodViewMemo``: the pods as a revision pass sees them, each pod object read once.

A fleet at rest is passed over every idle period, and each pass read every pod again (live, engine up, routed,
which engine process) to find it unchanged: most of what a 1,024-pod fleet at rest cost the operator. The memo
reads a pod again only from an object it has not read (the watch hands over a new object on each change;
``reconcile.gates.set_gate`` replaces the conditions list of the object it wrote). Its risk is a change it
misses: a pass that saw a pod as it was would route, move or rest on the wrong facts, and the rest signature
(which decides whether a resting fleet's engines are read again) would hide a restarted engine. So every view
and signature made on the memo must equal the ones made from nothing, through every change a pod goes through.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from rolloutfleet.planning import pod_readiness, pod_view
from rolloutfleet.resources import labels

pytestmark = pytest.mark.unit


def _pod(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"policy-{i}", "namespace": "ns", "uid": f"u-{i}"},
        "spec": {"readinessGates": [{"conditionType": labels.WEIGHTS_READY_CONDITION}]},
        "status": {
            "phase": "Running",
            "podIP": f"127.2.0.{i + 1}",
            "conditions": [
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "True"},
                {"type": labels.WEIGHTS_READY_CONDITION, "status": "True"},
            ],
            "containerStatuses": [{"name": "engine", "restartCount": 0, "ready": True, "started": True}],
        },
    }


def _expected_view(pods: list[dict[str, Any]]) -> pod_view.PodView:
    """The view as the revision loop built it before the memo, from the same pods, read anew."""
    live = {
        p["metadata"]["name"]: p
        for p in pods
        if (p.get("status") or {}).get("podIP")
        and not p["metadata"].get("deletionTimestamp")
        and (p.get("status") or {}).get("phase") == "Running"
    }
    up = [name for name, p in live.items() if pod_readiness.engine_up(p)]
    return pod_view.PodView(
        order=sorted(up, key=pod_view.ordinal),
        bodies=live,
        not_routed=frozenset(name for name, p in live.items() if not pod_readiness.routed(p)),
        starting=frozenset(set(live) - set(up)),
    )


def _expected_signature(view: pod_view.PodView) -> pod_view.Signature:
    """The rest signature as the revision loop made it before the memo."""
    return tuple(
        sorted(
            (
                name,
                pod_readiness.incarnation(body),
                (body.get("status") or {}).get("podIP"),
                name in view.not_routed,
                name in view.starting,
            )
            for name, body in view.bodies.items()
        )
    )


def _with_gate_written(pod: dict[str, Any], value: str) -> None:
    """As ``gates.set_gate`` records its write on the listed object: in place, a new conditions list."""
    kept = [c for c in pod["status"]["conditions"] if c["type"] != labels.WEIGHTS_READY_CONDITION]
    pod["status"]["conditions"] = [*kept, {"type": labels.WEIGHTS_READY_CONDITION, "status": value}]


def _changed(pod: dict[str, Any], how: str, step: int) -> dict[str, Any]:
    """``pod`` after one change, as the operator would hold it next (the watch's next object, or in place).
    Every change can be undone by a later one, so the pods keep moving between states instead of settling in
    one where no change shows (a pod being deleted comes back as its StatefulSet recreates it)."""
    if how == "gate in place":
        gate = next(c for c in pod["status"]["conditions"] if c["type"] == labels.WEIGHTS_READY_CONDITION)
        _with_gate_written(pod, "False" if gate["status"] == "True" else "True")
        return pod
    new = copy.deepcopy(pod)
    if how == "ip":
        new["status"]["podIP"] = f"127.3.{step % 250}.1"
    elif how == "no ip":
        if new["status"].pop("podIP", None) is None:
            new["status"]["podIP"] = f"127.4.{step % 250}.1"
    elif how == "phase":
        new["status"]["phase"] = "Pending" if new["status"]["phase"] == "Running" else "Running"
    elif how == "deleting":
        if new["metadata"].get("deletionTimestamp"):  # gone, and recreated under its name
            new = _pod(int(new["metadata"]["name"].rsplit("-", 1)[1]))
            new["metadata"]["uid"] = f"recreated-{step}"
        else:
            new["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    elif how == "not ready":  # the kubelet's Ready flip: the engine's readiness probe
        for cond in new["status"]["conditions"]:
            if cond["type"] in ("ContainersReady", "Ready"):
                cond["status"] = "False" if cond["status"] == "True" else "True"
    elif how == "not started":
        status = new["status"]["containerStatuses"][0]
        status["started"] = not status["started"]
    elif how == "restarted":
        new["status"]["containerStatuses"][0]["restartCount"] += 1
    elif how == "replaced":
        new["metadata"]["uid"] = f"again-{step}"
    return new


def test_views_and_signatures_on_the_memo_equal_ones_made_from_nothing() -> None:
    rng = random.Random(18)
    pods = [_pod(i) for i in range(12)]
    memo = pod_view.PodViewMemo()
    hows = ["gate in place", "ip", "no ip", "phase", "deleting", "not ready", "not started", "restarted", "replaced"]
    seen: dict[str, int] = {}  # each change, how often it changed the pod's facts as a pass sees them
    for step in range(800):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):  # most passes of a fleet at rest see nothing new
            # (the gate thrice as often: it shows only on a pod that is otherwise routed)
            i, how = rng.randrange(len(pods)), rng.choice([*hows, "gate in place", "gate in place"])
            before = _expected_signature(_expected_view([pods[i]]))
            pods[i] = _changed(pods[i], how, step)
            seen[how] = seen.get(how, 0) + (before != _expected_signature(_expected_view([pods[i]])))
        if step % 60 == 59:  # one pod gone for good, another listed anew
            pods = [*pods[1:], _pod(100 + step)]
        if step % 45 == 44:  # the same pods listed in another order (a list served after a new watch)
            rng.shuffle(pods)
        view = memo.view(pods)
        expected = _expected_view(copy.deepcopy(pods))
        assert view.order == expected.order, step
        assert view.not_routed == expected.not_routed and view.starting == expected.starting, step
        assert view.bodies.keys() == expected.bodies.keys(), step
        assert all(
            any(body is p for p in pods) and body["metadata"]["name"] == name for name, body in view.bodies.items()
        )
        assert memo.signature() == _expected_signature(expected), step
        assert len(memo) == len({p["metadata"]["name"] for p in pods}), step  # gone pods are forgotten
    assert set(seen) == set(hows)
    # The test is only as good as the changes that showed: each kind changed what a pass sees several times.
    assert all(count >= 5 for count in seen.values()), sorted(seen.items())


def test_an_unchanged_fleet_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the memo is for: the pass after a pass that saw the same pod objects reads none of them."""
    reads: list[str] = []
    routed = pod_readiness.routed
    monkeypatch.setattr(pod_readiness, "routed", lambda pod: reads.append(pod["metadata"]["name"]) or routed(pod))
    pods = [_pod(i) for i in range(8)]
    memo = pod_view.PodViewMemo()
    first = memo.view(pods)
    assert len(reads) == 8
    again = memo.view(list(pods))  # the watch's list: a new list of the same objects
    assert len(reads) == 8 and again == first
    pods[3] = _changed(pods[3], "not ready", 1)
    _with_gate_written(pods[5], "False")
    memo.view(pods)
    assert reads[8:] == ["policy-3", "policy-5"]


def test_each_view_is_the_callers_own() -> None:
    """A pass may change its view's order and bodies; the next pass's view must not show that."""
    pods = [_pod(i) for i in range(4)]
    memo = pod_view.PodViewMemo()
    first = memo.view(pods)
    first.order.clear()
    first.bodies.clear()
    second = memo.view(pods)
    assert second.order == ["policy-0", "policy-1", "policy-2", "policy-3"]
    assert list(second.bodies) == ["policy-0", "policy-1", "policy-2", "policy-3"]


def test_the_order_is_by_ordinal_and_pods_without_one_come_last() -> None:
    pods = [_pod(i) for i in (10, 2, 1)]
    odd = _pod(0)
    odd["metadata"]["name"] = "policy-canary"
    view = pod_view.PodViewMemo().view([odd, *pods])
    assert view.order == ["policy-1", "policy-2", "policy-10", "policy-canary"]
