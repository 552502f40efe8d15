"""Pure construction of a RolloutFleet's status from what was observed.

Called by ``reconcile.fleet``. Given the previous status, the spec, the StatefulSet and the pods, it
returns the new status; conditions move their timestamps only on a flip, so equal observations give an
equal status and nothing is written. The revision fields (currentRevision, targetRevision and each pod's
revision/draftRevision/step/weightVersion) belong to the revision loop and are carried over unchanged.
A fleet of more than ``MAX_POD_ENTRIES`` pods lists only the pods unlike its most common state (``listing``).
``PodFactsMemo`` is the one state here: what was read of each pod object, so that a pod unchanged since the
previous status is not read again (its results are the same as reading it anew).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

from rolloutfleet.api import conditions, validation
from rolloutfleet.api.common import MAX_POD_ENTRIES, Condition
from rolloutfleet.api.fleet import CommonPodState, PodState, RolloutFleetSpec, RolloutFleetStatus
from rolloutfleet.planning import pod_readiness, pod_view
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
# Set only on a fleet with ``weightTransfer``: whether a pushed revision can list every pod (docs/push.md).
PUSH_WITHIN_LIMIT = "PushWithinLimit"


@dataclasses.dataclass(slots=True, eq=False)
class PodFacts:
    """What the fleet status reads of one pod object (``PodFactsMemo``), and the entry last built from them."""

    pod: Manifest  # the object these were read from
    conditions: object  # its conditions list when read (``reconcile.gates.set_gate`` replaces it in place)
    name: str
    ordinal: tuple[int, str]
    ip: str | None
    phase: str
    ready: bool
    deleting: bool
    template_hash: str | None
    failing: str | None
    incarnation: str
    seen: EngineSummary | None = None  # the engine summary ``entry`` was built with
    entry: PodState | None = None


class PodFactsMemo:
    """Each pod's facts, read again only from a pod object not read before.

    Called by ``reconcile.fleet`` (one per fleet, in its ``FleetMemory``): a pass rewrites a 1,024-pod fleet's
    status every two seconds while a few of its pods changed, and reading every pod's conditions, labels and
    containers again for each write was most of the write (issue 18). The watch replaces a pod's object on every
    change, and the one change made to a listed object in place (the gate the operator wrote replaces the pod's
    conditions list) is told by the list's identity; a pod listed by a plain read is a new object, read anew.
    """

    def __init__(self) -> None:
        self._facts: dict[str, PodFacts] = {}

    def __len__(self) -> int:
        return len(self._facts)

    def facts(self, pod: Manifest) -> PodFacts:
        """``pod``'s facts: the ones read from this very object (and conditions list) before, or read now."""
        meta = pod["metadata"]
        name = meta["name"]
        status = pod.get("status") or {}
        conds = status.get("conditions")
        known = self._facts.get(name)
        if known is not None and known.pod is pod and known.conditions is conds:
            return known
        known = self._facts[name] = PodFacts(
            pod=pod,
            conditions=conds,
            name=name,
            ordinal=pod_view.ordinal(name),
            ip=status.get("podIP"),
            phase=status.get("phase") or "Pending",
            ready=_pod_ready(pod),
            deleting=bool(meta.get("deletionTimestamp")),
            template_hash=(meta.get("labels") or {}).get("controller-revision-hash"),
            failing=_pod_failing(pod),
            incarnation=pod_readiness.incarnation(pod),
        )
        return known

    def keep_only(self, names: set[str]) -> None:
        """Forget the pods not listed any more."""
        for gone in self._facts.keys() - names:
            del self._facts[gone]


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
    memo: PodFactsMemo | None = None,
) -> RolloutFleetStatus:
    """The status of a valid fleet; ``engines`` is the revision loop's latest view of each engine. ``memo``:
    the pods' facts as read for this fleet's previous statuses (``PodFactsMemo``; without it, read anew)."""
    previous = {p.name: p for p in old.pods}
    # A large fleet's status leaves out the pods in its most common state: a pod it does not list was in that
    # state if it was Ready then and is now (a Ready pod serves what its gate says; one not Ready, or new since,
    # is not claimed to hold anything until its engine is read, as a pod the status never listed).
    shared = old.pods_common
    memo = memo if memo is not None else PodFactsMemo()
    every = [memo.facts(p) for p in pods]
    if len(memo) != len(every):  # (every name listed now is in the memo: as many entries, none is a pod gone)
        memo.keep_only({f.name for f in every})
    live = [f for f in every if not f.deleting]
    live.sort(key=_BY_ORDINAL)
    sts_status = (sts or {}).get("status") or {}
    update_revision = sts_status.get("updateRevision")
    engines = engines or {}
    entries = []
    ready = updated = 0
    failing: list[str] = []
    # One entry per pod, built once: this runs for every fleet status write, at 1,024 pods every two seconds
    # during a pass and at each resync (a second model per pod for what it carried over was a third of it). The
    # counts are made in the same walk: in place, each walk over a large fleet costs more than its few
    # operations say (bench/results/rollout_overhead.md, "What the status builds cost in place").
    for facts in live:
        if update_revision and facts.template_hash == update_revision:
            updated += 1
        if facts.failing:
            failing.append(facts.failing)
        seen = engines.get(facts.name)
        before = previous.get(facts.name)
        # The same pod object, the same engine summary, and (without one) the same previous entry: the entry
        # built from them last time (most pods between two writes of a pass).
        last = facts.entry
        if last is not None and (facts.seen is seen or facts.seen == seen) and (seen is not None or before is last):
            entries.append(last)
            ready += last.ready
            continue
        carried: EngineSummary | PodState | CommonPodState | None = seen if seen is not None else before
        if carried is None and shared is not None and shared.ready and facts.ready:
            carried = shared
        values = {
            "name": facts.name,
            "ip": facts.ip,
            "phase": facts.phase,
            "ready": facts.ready,
            "revision": carried.revision if carried else None,
            "draft_revision": carried.draft_revision if carried else None,
            "step": carried.step if carried else None,
            "weight_version": carried.weight_version if carried else None,
        }
        # An entry that did not change is the previous one (most pods between two writes: a pass rewrites the
        # status every 1-2 s while a quarter of a Rolling fleet moves); building it again was half of a write.
        # A model's ``__dict__`` is its fields by name: a field added to PodState and not set here makes every
        # comparison unequal, so the shortcut can only rebuild too often, never keep a stale entry.
        entry = before if before is not None and before.__dict__ == values else PodState(**values)
        facts.seen, facts.entry = seen, entry
        entries.append(entry)
        ready += entry.ready
    listed, common, truncated = listing(entries)
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
    conds = _push_limit(conds, spec, fleet_name, generation)
    return old.model_copy(
        update={
            "observed_generation": generation,
            "replicas": len(live),
            "ready_replicas": ready,
            "updated_replicas": updated,
            "selector": labels.selector_string(fleet_name),
            "pods": listed,
            "pods_common": common,
            "pods_truncated": truncated,
            "conditions": conds,
        }
    )


def _push_limit(conds: list[Condition], spec: RolloutFleetSpec, fleet_name: str, generation: int) -> list[Condition]:
    """``PushWithinLimit`` on a fleet the trainer may push to. A fleet past the limit still serves and loads
    revisions from paths, so it is not Degraded; but every pushed revision would be refused, and the condition
    (with a Warning event when it turns False) says so when the fleet is scaled, not when a trainer first pushes."""
    if spec.weight_transfer is None:
        return conditions.remove_condition(conds, PUSH_WITHIN_LIMIT)
    most, problem = validation.push_limit_problem(fleet_name, spec)
    if problem is not None:
        return conditions.set_condition(
            conds, PUSH_WITHIN_LIMIT, False, "TooManyPodsToPush", problem, observed_generation=generation
        )
    message = f"{spec.replicas} pods; a pushed revision can list up to {most}"
    return conditions.set_condition(
        conds, PUSH_WITHIN_LIMIT, True, "WithinPushLimit", message, observed_generation=generation
    )


def listing(entries: list[PodState]) -> tuple[list[PodState], CommonPodState | None, int | None]:
    """What ``status.pods`` shows of ``entries`` (every live pod, in ordinal order): (the entries listed, the state
    the others share, how many unlike it found no room).

    A fleet of up to ``MAX_POD_ENTRIES`` pods lists them all. A larger one lists the pods unlike its most common
    state (ties: the state met first), the pods not Ready first, at most ``MAX_POD_ENTRIES``: the API server
    stores and sends the fleet whole on every write, and with a row per pod a fleet past 7,500-14,000 pods (by
    its names' and IPs' length) had a status larger than etcd accepts (``tests/integration/operator/
    test_crds_on_server.py``), its every status write refused.
    """
    if len(entries) <= MAX_POD_ENTRIES:
        return entries, None, None
    states = list(map(_shared_state, entries))
    state, count = collections.Counter(states).most_common(1)[0]
    others = [e for e, s in zip(entries, states, strict=True) if s != state]
    others.sort(key=lambda e: e.ready)  # (stable: ordinal order within each)
    common = CommonPodState(pods=count, **dict(zip(_SHARED_FIELDS, state, strict=True)))
    return others[:MAX_POD_ENTRIES], common, (len(others) - MAX_POD_ENTRIES if len(others) > MAX_POD_ENTRIES else None)


# What the pods left out of a large fleet's list share: every field of a pod's entry but its name and IP.
_SHARED_FIELDS = ("phase", "ready", "revision", "draft_revision", "step", "weight_version")
_shared_state: Callable[[PodState], tuple[Any, ...]] = operator.attrgetter(*_SHARED_FIELDS)


_BY_ORDINAL: Callable[[PodFacts], tuple[int, str]] = operator.attrgetter("ordinal")


def _progress_reason(live: int, desired: int, updated: int) -> str:
    if live < desired:
        return "ScalingUp"
    if live > desired:
        return "ScalingDown"
    if updated < live:
        return "RollingPods"
    return "PodsStarting"


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
