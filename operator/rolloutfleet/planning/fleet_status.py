"""Pure construction of a RolloutFleet's status from what was observed.

Called by ``reconcile.fleet``. Given the previous status, the spec, the StatefulSet and the pods, it
returns the new status; conditions move their timestamps only on a flip, so equal observations give an
equal status and nothing is written. The revision fields (currentRevision, targetRevision and each pod's
revision/draftRevision/step/weightVersion) belong to the revision loop and are carried over unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rolloutfleet.api import conditions
from rolloutfleet.api.common import Condition
from rolloutfleet.api.fleet import PodState, RolloutFleetSpec, RolloutFleetStatus
from rolloutfleet.planning import pod_readiness
from rolloutfleet.resources import labels

Manifest = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class EngineSummary:
    """What the revision loop last saw of one engine (for the fleet's per-pod status)."""

    revision: int | None
    draft_revision: int | None
    step: str | None
    weight_version: str | None


AVAILABLE, PROGRESSING, DEGRADED = "Available", "Progressing", "Degraded"


def _pod_ready(pod: Manifest) -> bool:
    # Ready as the Service sees it: with the weights gate, only pods serving the fleet's verified pair.
    return pod_readiness.routed(pod)


def _pod_failing(pod: Manifest) -> str | None:
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"pod {pod['metadata']['name']} failed"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerError"):
            return f"pod {pod['metadata']['name']}: {waiting['reason']}"
    return None


def observed(
    old: RolloutFleetStatus,
    spec: RolloutFleetSpec,
    fleet_name: str,
    generation: int,
    sts: Manifest | None,
    pods: list[Manifest],
    engines: dict[str, EngineSummary] | None = None,
) -> RolloutFleetStatus:
    """The status of a valid fleet; ``engines`` is the revision loop's latest view of each engine."""
    previous = {p.name: p for p in old.pods}
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    sts_status = (sts or {}).get("status") or {}
    update_revision = sts_status.get("updateRevision")
    engines = engines or {}
    entries = []
    # One entry per pod, built once: this runs for every fleet status write, at 1,024 pods every two seconds
    # during a pass and at each resync (a second model per pod for what it carried over was a third of it).
    for pod in sorted(live, key=lambda p: _ordinal(p["metadata"]["name"])):
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        seen = engines.get(name)
        before = previous.get(name)
        carried = seen if seen is not None else before
        values = {
            "name": name,
            "ip": status.get("podIP"),
            "phase": status.get("phase") or "Pending",
            "ready": _pod_ready(pod),
            "revision": carried.revision if carried else None,
            "draft_revision": carried.draft_revision if carried else None,
            "step": carried.step if carried else None,
            "weight_version": carried.weight_version if carried else None,
        }
        # An entry that did not change is the previous one (most pods between two writes: a pass rewrites the
        # status every 1-2 s while a quarter of a Rolling fleet moves); building it again was half of a write.
        # A model's ``__dict__`` is its fields by name: a field added to PodState and not set here makes every
        # comparison unequal, so the shortcut can only rebuild too often, never keep a stale entry.
        entries.append(before if before is not None and before.__dict__ == values else PodState(**values))
    ready = sum(1 for e in entries if e.ready)
    updated = sum(
        1
        for p in live
        if update_revision and (p["metadata"].get("labels") or {}).get("controller-revision-hash") == update_revision
    )
    failing = [msg for msg in (_pod_failing(p) for p in live) if msg]
    conds = list(old.conditions)
    if spec.replicas == 0:
        conds = conditions.set_condition(
            conds, AVAILABLE, True, "ScaledToZero", "replicas is 0", observed_generation=generation
        )
    elif ready >= spec.replicas:
        conds = conditions.set_condition(
            conds,
            AVAILABLE,
            True,
            "AllReplicasReady",
            f"{ready}/{spec.replicas} engines ready",
            observed_generation=generation,
        )
    else:
        conds = conditions.set_condition(
            conds,
            AVAILABLE,
            False,
            "ReplicasNotReady",
            f"{ready}/{spec.replicas} engines ready",
            observed_generation=generation,
        )
    converged = len(live) == spec.replicas and ready == spec.replicas and updated == len(live)
    if converged:
        conds = conditions.set_condition(
            conds,
            PROGRESSING,
            False,
            "Converged",
            "every engine runs the current pod template",
            observed_generation=generation,
        )
    else:
        conds = conditions.set_condition(
            conds,
            PROGRESSING,
            True,
            _progress_reason(len(live), spec.replicas, updated),
            f"{len(live)} pods, {updated} on the current template, {ready} ready, {spec.replicas} desired",
            observed_generation=generation,
        )
    if failing:
        conds = conditions.set_condition(
            conds, DEGRADED, True, "PodsFailing", "; ".join(failing[:5]), observed_generation=generation
        )
    else:
        conds = conditions.set_condition(conds, DEGRADED, False, "AsExpected", "", observed_generation=generation)
    return old.model_copy(
        update={
            "observed_generation": generation,
            "replicas": len(live),
            "ready_replicas": ready,
            "updated_replicas": updated,
            "selector": labels.selector_string(fleet_name),
            "pods": entries,
            "conditions": conds,
        }
    )


def _progress_reason(live: int, desired: int, updated: int) -> str:
    if live < desired:
        return "ScalingUp"
    if live > desired:
        return "ScalingDown"
    if updated < live:
        return "RollingPods"
    return "PodsStarting"


def _ordinal(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def invalid(old: RolloutFleetStatus, message: str, generation: int) -> RolloutFleetStatus:
    """The status of a fleet whose spec failed validation: only Degraded and observedGeneration change."""
    conds = conditions.set_condition(
        list(old.conditions), DEGRADED, True, "ValidationFailed", message, observed_generation=generation
    )
    return old.model_copy(update={"observed_generation": generation, "conditions": conds})


def newly_invalid(old: RolloutFleetStatus, message: str) -> bool:
    """Whether this validation failure is news (one Warning event per distinct problem, not per pass)."""
    cond = conditions.find(old.conditions, DEGRADED)
    return cond is None or cond.reason != "ValidationFailed" or cond.message != message


def flipped_conditions(old: RolloutFleetStatus, new: RolloutFleetStatus) -> list[Condition]:
    """Conditions whose status changed (or appeared) between two statuses."""
    out = []
    for cond in new.conditions:
        before = conditions.find(old.conditions, cond.type)
        if before is None or before.status != cond.status:
            out.append(cond)
    return out
