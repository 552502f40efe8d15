"""Staging inside a rollout pass (docs/staging.md): when to read staging engines again, what each pod's
staging came to, the revision's staging status, and whether a failed revision left every pod serving.

Called by ``reconcile.rollout_pass``. The decisions themselves (stage, wait, commit, fall back) are the pure
planner's (``planning.transaction``); this module only keeps the pass's view of them. Pure functions over
the pass's decisions and engine observations: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rolloutfleet.api.engine import EngineState, StagePhase
from rolloutfleet.api.revision import PodProgress, StagingStatus
from rolloutfleet.planning import transaction
from rolloutfleet.planning.transaction import Decision, Goal, Step

POLL_MIN_SECONDS = 0.02  # never read a staging engine more often (4 requests per read)
POLL_MAX_SECONDS = 0.5  # nor less often: a finished stage should not wait long for its pause
POLL_FIRST_SECONDS = 0.1  # before a stage has reported any rate

STAGING, STAGED, COMMITTED, FALLBACK = "Staging", "Staged", "Committed", "Fallback"


def poll_seconds(decisions: Mapping[str, Decision], states: Mapping[str, EngineState]) -> float | None:
    """How long until the soonest staging engine should be read again (None: no engine is staging).

    From each stage's own rate so far: a 3.5 GB stage at 20 GB/s is read again about when it should be done,
    not every few milliseconds (each read is four requests per engine, and a fleet stages all at once).
    """
    waiting = [pod for pod, decision in decisions.items() if decision.step is Step.AWAIT_STAGE]  # every iteration
    if not waiting:
        return None
    etas: list[float] = []
    for pod in waiting:
        stage = states[pod].staged if pod in states else None
        eta = transaction.stage_eta(stage) if stage is not None else None
        etas.append(POLL_FIRST_SECONDS if eta is None else eta)
    return min(POLL_MAX_SECONDS, max(POLL_MIN_SECONDS, min(etas)))


def outcome(goal: Goal, state: EngineState, before: str | None) -> str | None:
    """What staging came to on one pod for ``goal`` (``before``: what was recorded for it last time).

    The engine releases its stage after the last commit, so "Committed" is only ever known from the record:
    a pod recorded Staged whose stage is gone and that holds the goal's verifier committed it.
    """
    if not goal.stages:
        return None
    stage = state.staged
    if stage is not None and transaction.stage_for(goal, stage):
        if stage.phase == StagePhase.OVER_BUDGET:
            return FALLBACK
        if stage.phase == StagePhase.STAGING:
            return STAGING
        if stage.phase == StagePhase.STAGED:
            committed = stage.verifier.committed
            return COMMITTED if committed else STAGED
        return before
    if before in (STAGED, COMMITTED) and state.verifier.revision == goal.revision:
        return COMMITTED
    return before


def seeded(pods: Iterable[PodProgress]) -> dict[str, str]:
    """The per-pod outcomes a revision's status recorded (after an operator restart, the pass starts from them)."""
    return {p.name: p.staging for p in pods if p.staging is not None}


def status(goal: Goal, outcomes: Mapping[str, str], states: Mapping[str, EngineState]) -> StagingStatus | None:
    """The revision's staging status: how many pods staged it, how many load it from the files, and why."""
    if not goal.stages:
        return None
    staged = sum(1 for o in outcomes.values() if o in (STAGED, COMMITTED))
    fallback = [p for p, o in outcomes.items() if o == FALLBACK]
    message = ""
    if fallback:
        stage = states[fallback[0]].staged if fallback[0] in states else None
        need = f"{stage.bytes_total / 1e9:.2f} GB" if stage is not None else "more"
        limit = f"{goal.stage_limit / 1e9:.2f} GB" if goal.stage_limit is not None else "the limit"
        message = (
            f"{len(fallback)} pods load the revision from the files in the pause: its checkpoints need {need} "
            f"per worker, the staging limit is {limit} (updateStrategy.staging.hostMemoryLimit)"
        )
    return StagingStatus(pods_staged=staged, pods_fallback=len(fallback), message=message)


def untouched(decisions: Mapping[str, Decision]) -> bool:
    """Every pod still serves what it served: none paused for this revision (all are before their pause)."""
    return bool(decisions) and all(d.step in transaction.IN_SERVICE_STEPS for d in decisions.values())
