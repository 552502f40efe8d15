"""Pure reads of a pod's readiness: engine up, weights gate, routed by the Service.

Called by ``reconcile.gates``, ``reconcile.revision`` and ``planning.fleet_status``. The kubelet marks a
pod Ready only when its containers are ready *and* every readiness gate of its spec is True; ``routed``
computes that rule from the pod itself rather than trusting ``Ready`` alone, so a kubelet stand-in that
ignores gates cannot make a pod that holds the wrong weights count as serving.
"""

from __future__ import annotations

from typing import Any

from rolloutfleet.resources import labels

Manifest = dict[str, Any]


def condition(pod: Manifest, type_: str) -> str | None:
    """The status ("True", "False", "Unknown") of a pod condition, None when absent."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("status"))
    return None


def gate_value(pod: Manifest) -> bool | None:
    """The weights gate as stored on the pod (None: never set)."""
    value = condition(pod, labels.WEIGHTS_READY_CONDITION)
    return None if value is None else value == "True"


def containers_ready(pod: Manifest) -> bool:
    """The engine container passed its readiness probe (the engine process was admitted)."""
    ready = condition(pod, "ContainersReady")
    return ready == "True" if ready is not None else condition(pod, "Ready") == "True"


def engine_up(pod: Manifest) -> bool:
    """The engine answers (its startup probe, ``/health``, passed), whatever it holds and whether or not it
    was admitted: the pods the revision loop can observe and move. Kubelets report ``started``; where a
    stand-in does not (kwok), ContainersReady stands in for it."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if statuses and all("started" in cs for cs in statuses):
        return all(cs.get("started") is True for cs in statuses)
    return containers_ready(pod)


def incarnation(pod: Manifest) -> str:
    """Which engine process a pod runs: its uid and its containers' restart counts. A pod recreated under the
    same name has another uid, a container the kubelet restarted another count; either way the engine came
    back on its initial checkpoint, and nothing read of the one before says anything of it."""
    statuses: list[Manifest] = (pod.get("status") or {}).get("containerStatuses") or []
    uid = pod["metadata"].get("uid") or ""
    if len(statuses) == 1:  # an engine pod's one container, without a generator (every pod, every status write)
        return f"{uid}/{statuses[0].get('restartCount', 0)}"
    return uid + "/" + ",".join(str(cs.get("restartCount", 0)) for cs in statuses)


def routed(pod: Manifest) -> bool:
    """The pod is behind the Service: containers ready, and every readiness gate of its spec True."""
    # The conditions by type, read once (each lookup walked the list again: the fleet status asks this of
    # every pod at every write). Reversed so that, as in ``condition``, the first of a type counts.
    conds = {c.get("type"): c.get("status") for c in reversed((pod.get("status") or {}).get("conditions") or [])}
    gated = _gated(pod)
    if not gated:
        return conds.get("Ready") == "True"
    ready = conds.get("ContainersReady")
    if (ready if ready is not None else conds.get("Ready")) != "True":
        return False
    return all(conds.get(gate) == "True" for gate in gated)


def _gated(pod: Manifest) -> list[str]:
    return [str(g.get("conditionType")) for g in (pod.get("spec") or {}).get("readinessGates") or []]
