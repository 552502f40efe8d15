"""Staged updates in the pure planner (docs/staging.md): stage while serving, verify, only then pause, commit.

The point of staging is that nothing about a revision's bytes is learned inside the pause: every check that
can fail (the files read, their digests) is decided while the pod still serves, and a pod that pauses has a
verified stage to commit. These tables pin that order, and the fallbacks that keep a fleet moving when a
stage cannot be used.
"""

from __future__ import annotations

import dataclasses

from rolloutfleet.api.engine import EngineState, StagedTarget, StagePhase, StageState, TargetState
from rolloutfleet.api.fleet import RolloutType, UpdateMode
from rolloutfleet.planning import rollout, verification
from rolloutfleet.planning.transaction import (
    IN_SERVICE_STEPS,
    Decision,
    Goal,
    Step,
    acknowledged,
    next_step,
    stage_eta,
)

D1 = "blake3:" + "1" * 64
DV = "blake3:" + "a" * 64
DD = "blake3:" + "b" * 64
BAD = "blake3:" + "f" * 64
LIMIT = 10 * 10**9
GOAL = Goal(revision=2, verifier_path="/w/2/v", draft_path="/w/2/d", sleep_mode=False, stage_limit=LIMIT)
SLEEP = dataclasses.replace(GOAL, sleep_mode=True)


def stage(
    phase: StagePhase = StagePhase.STAGED,
    *,
    revision: int = 2,
    vd: str | None = DV,
    dd: str | None = DD,
    committed: bool = False,
    limit: int | None = LIMIT,
    done: int = 100,
    seconds: float = 1.0,
) -> StageState:
    return StageState(
        revision=revision,
        phase=phase,
        verifier=StagedTarget(path=f"/w/{revision}/v", digest=vd, bytes=80, tensors=3, committed=committed),
        draft=StagedTarget(path=f"/w/{revision}/d", digest=dd, bytes=20, tensors=2),
        bytes_total=100,
        bytes_done=done,
        limit_bytes=limit,
        seconds=seconds,
        error_code="io" if phase == StagePhase.FAILED else None,
        error_message="short read" if phase == StagePhase.FAILED else None,
    )


def engine(
    staged: StageState | None = None, *, paused: bool = False, v: int = 1, d: int = 1, resident: bool = True
) -> EngineState:
    return EngineState(
        reachable=True,
        paused=paused,
        sleeping=paused,
        resident=resident,
        verifier=TargetState(revision=v, digest=D1 if v == 1 else DV),
        draft=TargetState(revision=d, digest=D1 if d == 1 else DD),
        weight_version=str(v),
        staged=staged,
    )


def test_a_serving_pod_stages_before_it_pauses() -> None:
    """Staging on: a pod that serves old weights first stages; it pauses only once its stage is verified."""
    assert next_step(GOAL, engine()).step == Step.STAGE
    assert next_step(GOAL, engine(stage(StagePhase.STAGING, done=40))).step == Step.AWAIT_STAGE
    assert next_step(GOAL, engine(stage())).step == Step.PAUSE


def test_without_staging_or_for_pushed_targets_nothing_is_staged() -> None:
    """Staging off (no limit) or a verifier the trainer pushes: there are no files to stage."""
    assert next_step(dataclasses.replace(GOAL, stage_limit=None), engine()).step == Step.PAUSE
    pushed = dataclasses.replace(GOAL, verifier_path=None, verifier_pushed=True)
    assert next_step(pushed, engine()).step != Step.STAGE


def test_a_stage_of_another_revision_or_path_is_replaced() -> None:
    """A stage is usable only for exactly the goal's revision and paths (a re-published path is another)."""
    assert next_step(GOAL, engine(stage(revision=3))).step == Step.STAGE
    other_path = dataclasses.replace(stage(), verifier=StagedTarget(path="/w/other", digest=DV))
    assert next_step(GOAL, engine(other_path)).step == Step.STAGE


def test_failed_and_mismatching_stages_are_verdicts_before_the_pause() -> None:
    """A checkpoint that cannot be staged, or staged bytes that do not hash to the pinned digest, are found
    while the pod serves: the verdict is not a pause (the rollout pass fails the revision, no pod touched)."""
    failed = next_step(GOAL, engine(stage(StagePhase.FAILED)))
    assert failed.step == Step.STAGE_FAILED and "io: short read" in failed.reason
    pinned = dataclasses.replace(GOAL, verifier_digest=BAD)
    mismatch = next_step(pinned, engine(stage()))
    assert mismatch.step == Step.STAGE_MISMATCH and "staged verifier digest" in mismatch.reason
    assert failed.step in IN_SERVICE_STEPS and mismatch.step in IN_SERVICE_STEPS


def test_over_budget_falls_back_to_loads_from_the_files() -> None:
    """Beyond the limit nothing is staged: the pod pauses and loads as without staging (status says so)."""
    over = stage(StagePhase.OVER_BUDGET, vd=None, dd=None)
    assert next_step(GOAL, engine(over)).step == Step.PAUSE
    assert next_step(GOAL, engine(over, paused=True)).step == Step.LOAD_VERIFIER
    # Decided under another limit (the fleet raised it meanwhile): decided again.
    assert next_step(dataclasses.replace(GOAL, stage_limit=LIMIT * 2), engine(over)).step == Step.STAGE


def test_in_the_pause_the_loads_are_commits_from_the_stage() -> None:
    """Inflight: pause → commit verifier → commit draft; sleep mode wakes the weights first."""
    paused = engine(stage(), paused=True)
    assert next_step(GOAL, paused).step == Step.COMMIT_VERIFIER
    after_verifier = acknowledged(paused, Step.COMMIT_VERIFIER, GOAL, _load("verifier", DV))
    assert after_verifier.staged is not None and after_verifier.staged.verifier.committed
    assert next_step(GOAL, after_verifier).step == Step.COMMIT_DRAFT
    after_draft = acknowledged(after_verifier, Step.COMMIT_DRAFT, GOAL, _load("draft", DD))
    assert after_draft.staged is None  # the engine releases the stage after its last commit
    assert next_step(GOAL, after_draft).step == Step.RESUME  # then resume, as after any load
    asleep = EngineState(
        reachable=True, paused=True, sleeping=True, resident=False, mapped=False, draft=TargetState(), staged=stage()
    )
    assert next_step(SLEEP, asleep).step == Step.WAKE_WEIGHTS
    assert next_step(SLEEP, dataclasses.replace(asleep, mapped=True)).step == Step.COMMIT_VERIFIER


def test_a_stage_that_does_not_verify_is_never_committed_in_the_pause() -> None:
    """Paused with a stage whose digest does not match: load from the files (that load is verified) instead
    of committing bytes known to be wrong."""
    pinned = dataclasses.replace(GOAL, verifier_digest=BAD)
    assert next_step(pinned, engine(stage(), paused=True)).step == Step.LOAD_VERIFIER


def test_a_stale_stage_on_a_pod_at_its_goal_is_released() -> None:
    """Pinned host memory held for a revision nobody will commit (cancelled, failed, staging turned off) is
    given back; a finished or failed stage holds none and is left alone."""
    at_goal = dict(v=2, d=2)
    assert next_step(GOAL, engine(stage(revision=3), **at_goal)).step == Step.UNSTAGE
    off = dataclasses.replace(GOAL, stage_limit=None)
    assert next_step(off, engine(stage(), **at_goal)).step == Step.UNSTAGE
    assert next_step(GOAL, engine(stage(StagePhase.FAILED, revision=3), **at_goal)).step == Step.DONE
    assert next_step(GOAL, engine(None, **at_goal)).step == Step.DONE


def test_staged_digests_vote_for_the_majority_before_anything_loads() -> None:
    """Without pinned digests a minority that staged other bytes is caught before it pauses."""
    states = [engine(stage()), engine(stage()), engine(stage(vd=BAD))]
    goal = verification.with_reference_digests(GOAL, states)
    assert goal.verifier_digest == DV
    assert next_step(goal, states[2]).step == Step.STAGE_MISMATCH
    assert next_step(goal, states[0]).step == Step.PAUSE


def test_stage_eta_from_the_rate_so_far() -> None:
    assert stage_eta(stage(StagePhase.STAGING, done=25, seconds=1.0)) == 3.0
    assert stage_eta(stage(StagePhase.STAGING, done=0)) is None
    assert stage_eta(stage()) is None


def _plan(kind: RolloutType, loads: int | None = None, max_unavailable: int = 1) -> rollout.Budget:
    return rollout.Budget(
        mode=UpdateMode.INFLIGHT,
        rollout=kind,
        max_unavailable=max_unavailable,
        max_concurrent_loads=loads,
        canary=0,
        max_retries=2,
    )


PODS = [f"p-{i}" for i in range(4)]


def test_all_at_once_pauses_nobody_while_any_pod_still_stages() -> None:
    """AllAtOnce: the fleet leaves service only once every pod staged and verified — so the out-of-service
    window is the commit, and a bad checkpoint is found with every pod serving."""
    steps = {"p-0": Step.PAUSE, "p-1": Step.PAUSE, "p-2": Step.AWAIT_STAGE, "p-3": Step.PAUSE}
    chosen = rollout.admit({p: Decision(s) for p, s in steps.items()}, PODS, _plan(RolloutType.ALL_AT_ONCE))
    assert chosen == {}
    steps["p-2"] = Step.PAUSE
    chosen = rollout.admit({p: Decision(s) for p, s in steps.items()}, PODS, _plan(RolloutType.ALL_AT_ONCE))
    assert set(chosen) == set(PODS)


def test_rolling_stages_ahead_of_the_wave_outside_max_unavailable() -> None:
    """Rolling: staging costs no availability, so every pod stages while maxUnavailable pods move."""
    steps = {"p-0": Step.PAUSE, "p-1": Step.STAGE, "p-2": Step.STAGE, "p-3": Step.PAUSE}
    chosen = rollout.admit({p: Decision(s) for p, s in steps.items()}, PODS, _plan(RolloutType.ROLLING))
    assert set(chosen) == {"p-0", "p-1", "p-2"}  # one pause (the budget), both stages


def test_stages_respect_max_concurrent_loads() -> None:
    """Stages read the same shared storage as loads: at most maxConcurrentLoads stage at once."""
    steps = {"p-0": Step.AWAIT_STAGE, "p-1": Step.STAGE, "p-2": Step.STAGE, "p-3": Step.STAGE}
    chosen = rollout.admit({p: Decision(s) for p, s in steps.items()}, PODS, _plan(RolloutType.ALL_AT_ONCE, loads=2))
    assert set(chosen) == {"p-1"}


def test_staging_pods_count_as_serving_for_max_unavailable() -> None:
    """A pod that stages is not out of service: it does not use up the Rolling budget."""
    steps = {"p-0": Step.AWAIT_STAGE, "p-1": Step.STAGE_FAILED, "p-2": Step.UNSTAGE, "p-3": Step.PAUSE}
    chosen = rollout.admit({p: Decision(s) for p, s in steps.items()}, PODS, _plan(RolloutType.ROLLING))
    assert "p-3" in chosen


def _load(target: str, digest: str) -> object:
    from rolloutfleet.api.engine import LoadResult, Target

    return LoadResult(
        target=Target(target),
        revision=2,
        path=f"/w/2/{target[0]}",
        digest=digest,
        bytes=1,
        seconds=0.1,
        tensors=1,
        staged=True,
    )
