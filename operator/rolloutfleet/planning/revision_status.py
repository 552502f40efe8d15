"""Pure construction of a WeightRevision's status from one pass's observations.

Called by ``reconcile.revision``. Builds per-pod progress (step, digests, attempts, last error), the
updated count, per-step timings and the Ready/Progressing/Verified conditions; timestamps of conditions
move only on flips, so rebuilding from the same observations writes nothing.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping

from rolloutfleet.api import common, conditions
from rolloutfleet.api.engine import EngineState
from rolloutfleet.api.revision import (
    Phase,
    PodFailure,
    PodProgress,
    PushGroupStatus,
    PushSessionStatus,
    PushStatus,
    StagingStatus,
    StepTiming,
    WeightRevisionStatus,
)
from rolloutfleet.planning import revisions
from rolloutfleet.planning.transaction import Decision, Goal, Step

READY, PROGRESSING, VERIFIED = "Ready", "Progressing", "Verified"
# status.pods lists every pod up to this many; beyond, only pods that are not done or have a message (an
# entry with two digests is ~300 bytes: 4,096 of them would approach the API server's object size limit).
MAX_POD_ENTRIES = common.MAX_POD_ENTRIES


def timestamp() -> str:
    """Now, as the API server writes times (RFC 3339, seconds, UTC)."""
    return conditions.now().strftime("%Y-%m-%dT%H:%M:%SZ")


TimingsMemo = dict[str, tuple[list[float], int, StepTiming]]


def timings(durations: dict[str, list[float]], memo: TimingsMemo) -> list[StepTiming]:
    """Each step's count, median and longest duration. ``memo``: the timings made before from the same lists,
    which their owner (``reconcile.rollout_pass``) only appends to: a list that is the same object with the same
    length has the same values, and its median is not sorted out again (a pass writes its progress every
    second at 1,024 pods, over lists of up to a duration per pod and step)."""
    out = []
    for step, values in sorted(durations.items()):
        if not values:
            continue
        known = memo.get(step)
        if known is None or known[0] is not values or known[1] != len(values):
            timing = StepTiming(
                step=step,
                count=len(values),
                median_seconds=round(statistics.median(values), 4),
                max_seconds=round(max(values), 4),
            )
            known = memo[step] = (values, len(values), timing)
        out.append(known[2])
    return out


def progressing(
    old: WeightRevisionStatus,
    *,
    goal: Goal,
    order: list[str],
    states: dict[str, EngineState],
    decisions: dict[str, Decision],
    attempts: dict[str, int],
    messages: dict[str, str],
    durations: dict[str, list[float]],
    total: int,
    rolling_back: bool,
    generation: int,
    staging: Mapping[str, str] | None = None,
    staging_status: StagingStatus | None = None,
    timings_memo: TimingsMemo | None = None,
) -> WeightRevisionStatus:
    """The status while a pass works (also after its last round). ``staging``: what each pod's staging came
    to, ``staging_status`` the summary (docs/staging.md; both None when the fleet does not stage).
    ``timings_memo``: see ``timings``."""
    pods = []
    listed = order
    if len(order) > MAX_POD_ENTRIES:
        # (The walk stops at the last entry listed: most of a large fleet once the revision is under way.)
        listed = list(
            itertools.islice(
                (n for n in order if messages.get(n) or decisions.get(n) is None or decisions[n].step != Step.DONE),
                MAX_POD_ENTRIES,
            )
        )
    for name in listed:
        state = states.get(name)
        decision = decisions.get(name)
        pods.append(
            PodProgress(
                name=name,
                step=decision.step.value if decision else "Pending",
                verifier_digest=state.verifier.digest if state else None,
                draft_digest=state.draft.digest if state and state.draft else None,
                attempts=attempts.get(name, 0),
                message=messages.get(name),
                staging=(staging or {}).get(name),
            )
        )
    done = verified_pods = 0
    for decision in decisions.values():  # (one walk over the fleet's decisions for both counts)
        if decision.step is Step.DONE:
            done += 1
            verified_pods += 1
        elif decision.step is Step.RESUME:
            verified_pods += 1
    updated = 0 if rolling_back else done
    conds = list(old.conditions)
    conds = conditions.set_condition(
        conds,
        READY,
        False,
        "RollingBack" if rolling_back else "InProgress",
        f"{updated}/{total} pods serve revision {goal.revision}" if not rolling_back else old.message or "rolling back",
        observed_generation=generation,
    )
    conds = conditions.set_condition(
        conds,
        PROGRESSING,
        True,
        "RollingBack" if rolling_back else "UpdatingPods",
        f"{verified_pods}/{total} pods loaded and verified",
        observed_generation=generation,
    )
    if not rolling_back:
        conds = conditions.set_condition(
            conds,
            VERIFIED,
            verified_pods >= total and total > 0,
            "DigestsMatch" if verified_pods >= total else "Verifying",
            f"{verified_pods}/{total} pods report the expected digests",
            observed_generation=generation,
        )
    return old.model_copy(
        update={
            "observed_generation": generation,
            "phase": Phase.PROGRESSING,
            "pods_updated": updated,
            "pods_total": total,
            "updated": f"{updated}/{total}",
            "start_time": old.start_time or conditions.now(),
            "pods": pods,
            "timings": timings(durations, timings_memo if timings_memo is not None else {}) or old.timings,
            "conditions": conds,
            "staging": staging_status if staging_status is not None else old.staging,
        }
    )


def rolling_back(
    old: WeightRevisionStatus, message: str, generation: int, failures: list[PodFailure] | None = None
) -> WeightRevisionStatus:
    """The decision to roll back, recorded so a restarted operator keeps rolling back."""
    conds = conditions.set_condition(
        list(old.conditions), READY, False, revisions.ROLLING_BACK, message, observed_generation=generation
    )
    conds = conditions.set_condition(conds, VERIFIED, False, "UpdateFailed", message, observed_generation=generation)
    return old.model_copy(
        update={
            "phase": Phase.PROGRESSING,
            "reason": revisions.ROLLING_BACK,
            "message": message,
            "failures": failures or old.failures,
            "pods": [p.model_copy(update={"attempts": 0}) for p in old.pods],
            "conditions": conds,
        }
    )


def finalized(
    old: WeightRevisionStatus, phase: Phase, reason: str, message: str, generation: int
) -> WeightRevisionStatus:
    """A final phase with its conditions."""
    ok = phase == Phase.SUCCEEDED
    conds = conditions.set_condition(list(old.conditions), READY, ok, reason, message, observed_generation=generation)
    conds = conditions.set_condition(conds, PROGRESSING, False, reason, message, observed_generation=generation)
    if ok:
        conds = conditions.set_condition(conds, VERIFIED, True, "DigestsMatch", message, observed_generation=generation)
    elif conditions.find(conds, VERIFIED) is None:
        conds = conditions.set_condition(conds, VERIFIED, False, reason, message, observed_generation=generation)
    if conditions.find(conds, SESSIONS_OPEN) is not None:  # a final revision waits for no trainer
        conds = conditions.set_condition(conds, SESSIONS_OPEN, False, reason, message, observed_generation=generation)
    # Superseded keeps the count it had reached (those pods did serve it); failures serve it on no pod.
    updated = old.pods_total if ok else old.pods_updated if phase == Phase.SUPERSEDED else 0
    return old.model_copy(
        update={
            "observed_generation": generation,
            "phase": phase,
            "reason": reason,
            "message": message,
            "pods_updated": updated,
            "updated": f"{updated}/{old.pods_total}",
            "completion_time": conditions.now(),
            "conditions": conds,
            "push": None if old.push is None else old.push.model_copy(update={"sessions": []}),
        }
    )


def waiting_for_fleet(old: WeightRevisionStatus, message: str, generation: int) -> WeightRevisionStatus:
    """A revision whose fleet does not exist: it stays Pending (GitOps may create the fleet later)."""
    conds = conditions.set_condition(
        list(old.conditions), READY, False, "FleetNotFound", message, observed_generation=generation
    )
    return old.model_copy(
        update={"observed_generation": generation, "phase": Phase.PENDING, "message": message, "conditions": conds}
    )


SESSIONS_OPEN = "SessionsOpen"


def with_push(
    status: WeightRevisionStatus,
    *,
    epoch: int,
    sessions: list[PushSessionStatus],
    generation: int,
    group: PushGroupStatus | None = None,
) -> WeightRevisionStatus:
    """The push handshake's part of a status: the open sessions of complete epochs and ``SessionsOpen``.

    The condition is what a trainer waits on; its reason names the target the sessions are for (all open
    sessions of one pass are for one target at a time per pod, but pods may differ: draft wins only when
    no verifier session is open, since the trainer sends the verifier first).
    """
    targets = {s.target for s in sessions}
    target = "Verifier" if "verifier" in targets else "Draft" if targets else None
    conds = conditions.set_condition(
        list(status.conditions),
        SESSIONS_OPEN,
        bool(sessions),
        f"{target}SessionsOpen" if target else "NoSessionOpen",
        f"{len(sessions)} sessions of epoch <= {epoch} wait for the trainer" if sessions else "no session waits",
        observed_generation=generation,
    )
    push = PushStatus(epoch=epoch, sessions=sorted(sessions, key=lambda s: s.pod), group=group)
    return status.model_copy(update={"push": push, "conditions": conds})
