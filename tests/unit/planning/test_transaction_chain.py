"""``transaction.chain``: the steps that follow a step for certain, sent in one request by the executor.

A chain must be exactly the steps the step-by-step pass would take from each step's acknowledgement, and end
wherever the next step depends on what the engine answers (a load's digest, a resume's guard, a session, a
verdict): otherwise one request would run a step the planner would not have chosen. One departure, by design:
the draft's load follows the verifier's, as the pass would take it once the verifier verified (the draft's load
does not depend on the verifier's digest; a digest that does not verify is a verdict on the answer, and the
retry loads the verifier alone).

``through_resume`` (a Rolling pod): the resume joins the loads only where the revision names the digests both
must verify to, because the executor runs it behind a check that every rank holds exactly those
(``expected_after``); anywhere the pass would judge an answer against anything else, the chain still ends at
the loads.
"""

from __future__ import annotations

import dataclasses

import pytest

from rolloutfleet.api.engine import EngineState, LoadResult, StagedTarget, StagePhase, StageState, Target, TargetState
from rolloutfleet.planning.transaction import (
    CHAIN_THROUGH,
    Goal,
    Step,
    acknowledged,
    as_step_starts,
    chain,
    expected_after,
    next_step,
    resumes_on_check,
    shown_step,
)

D1 = "blake3:" + "1" * 64
DV = "blake3:" + "b" * 64
DD = "blake3:" + "c" * 64
SLEEP = Goal(revision=2, verifier_path="/w/2/v", draft_path="/w/2/d", sleep_mode=True)
INFLIGHT = dataclasses.replace(SLEEP, sleep_mode=False)
STAGED = dataclasses.replace(INFLIGHT, stage_limit=10**9)


def serving(staged: StageState | None = None) -> EngineState:
    return EngineState(
        reachable=True,
        paused=False,
        sleeping=False,
        resident=True,
        verifier=TargetState(revision=1, digest=D1),
        draft=TargetState(revision=1, digest=D1),
        weight_version="1",
        admitted=True,
        staged=staged,
    )


def stage_of_2() -> StageState:
    return StageState(
        revision=2,
        phase=StagePhase.STAGED,
        verifier=StagedTarget(path="/w/2/v", digest=DV, bytes=80, tensors=3),
        draft=StagedTarget(path="/w/2/d", digest=DD, bytes=20, tensors=2),
        bytes_total=100,
        bytes_done=100,
        limit_bytes=10**9,
        seconds=1.0,
    )


def test_a_sleep_mode_pause_takes_the_sleep_the_wake_and_both_loads_with_it() -> None:
    steps = chain(SLEEP, serving(), Step.PAUSE)
    assert steps == (Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS, Step.LOAD_VERIFIER, Step.LOAD_DRAFT)
    # Shown at the verifier's load while it runs (the long one), as the engine is then: asleep, nothing held.
    assert shown_step(steps) == Step.LOAD_VERIFIER
    shown = as_step_starts(SLEEP, serving(), steps)
    assert shown.paused and shown.verifier.revision is None and shown.mapped


def test_an_inflight_pause_takes_both_loads() -> None:
    assert chain(INFLIGHT, serving(), Step.PAUSE) == (Step.PAUSE, Step.LOAD_VERIFIER, Step.LOAD_DRAFT)


def test_the_draft_s_load_joins_only_where_the_pass_would_load_the_draft_next() -> None:
    """A pinned verifier digest: the chain assumes the answer verifies (else the pass judges it afterwards). No
    draft of the revision's own (a frozen draft is restored, not loaded; an engine without a draft): the chain
    ends at the verifier's load."""
    pinned = dataclasses.replace(SLEEP, verifier_digest=DV, draft_digest=DD)
    assert chain(pinned, serving(), Step.PAUSE)[-2:] == (Step.LOAD_VERIFIER, Step.LOAD_DRAFT)
    frozen = dataclasses.replace(SLEEP, draft_path=None, frozen_draft_path="/w/frozen")
    assert chain(frozen, serving(), Step.PAUSE)[-1] == Step.LOAD_VERIFIER
    no_draft = dataclasses.replace(SLEEP, draft_path=None)
    alone = dataclasses.replace(serving(), draft=None)
    assert chain(no_draft, alone, Step.PAUSE)[-1] == Step.LOAD_VERIFIER


def test_a_verifier_loaded_again_after_a_verdict_goes_alone() -> None:
    """After a verifier digest that did not verify, the retry loads the verifier; the draft it loaded with it is
    at the goal already, so nothing follows (the pass reads and resumes)."""
    paused = dataclasses.replace(serving(), paused=True, sleeping=True)
    loaded = LoadResult(Target.DRAFT, 2, "/w/2/d", DD, bytes=20, seconds=0.1, tensors=2)
    state = acknowledged(paused, Step.LOAD_DRAFT, INFLIGHT, loaded)
    assert chain(INFLIGHT, state, Step.LOAD_VERIFIER) == (Step.LOAD_VERIFIER,)


def test_a_staged_pause_takes_its_commit() -> None:
    """The AllAtOnce pause then holds one request per pod before the resume (issue 17's window)."""
    assert chain(STAGED, serving(stage_of_2()), Step.PAUSE) == (Step.PAUSE, Step.COMMIT_VERIFIER)


def test_a_fleet_that_limits_loads_keeps_each_load_its_own_step() -> None:
    """``maxConcurrentLoads`` is enforced per load step: a load inside another step's request would escape it."""
    assert chain(SLEEP, serving(), Step.PAUSE, loads=False) == (Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS)
    paused = dataclasses.replace(serving(), paused=True, sleeping=True)
    assert chain(INFLIGHT, paused, Step.LOAD_VERIFIER, loads=False) == (Step.LOAD_VERIFIER,)
    # A commit reads pinned host memory, not the shared storage: it is not a load.
    assert chain(STAGED, serving(stage_of_2()), Step.PAUSE, loads=False) == (Step.PAUSE, Step.COMMIT_VERIFIER)


def test_pushed_weights_stop_before_the_session() -> None:
    """Opening a session takes the pass's epoch and its confirmation read: never part of a chain."""
    pushed = dataclasses.replace(SLEEP, verifier_path=None, verifier_pushed=True, draft_path=None, draft_pushed=True)
    assert chain(pushed, serving(), Step.PAUSE) == (Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS)


@pytest.mark.parametrize("first", [Step.RESUME, Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.STAGE, Step.UNSTAGE])
def test_other_steps_are_chains_of_one(first: Step) -> None:
    assert chain(SLEEP, serving(), first) == (first,)


@pytest.mark.parametrize("goal", [SLEEP, INFLIGHT, STAGED], ids=["sleep", "inflight", "staged"])
def test_a_chain_is_the_steps_the_pass_would_take_one_by_one(goal: Goal) -> None:
    """The same decisions as observe → next_step → acknowledge, step after step, up to the first load or commit,
    and the draft's load after a verifier's load that verified."""
    state = serving(stage_of_2() if goal.stages else None)
    expected = [next_step(goal, state).step]
    while expected[-1] in CHAIN_THROUGH:
        state = acknowledged(state, expected[-1], goal)
        expected.append(next_step(goal, state).step)
    if expected[-1] == Step.LOAD_VERIFIER:
        verified = LoadResult(Target.VERIFIER, 2, "/w/2/v", DV, bytes=80, seconds=0.1, tensors=3)
        expected.append(next_step(goal, acknowledged(state, Step.LOAD_VERIFIER, goal, verified)).step)
    assert list(chain(goal, serving(stage_of_2() if goal.stages else None), expected[0])) == expected


PINNED = dataclasses.replace(SLEEP, verifier_digest=DV, draft_digest=DD)


@pytest.mark.parametrize("goal", [PINNED, dataclasses.replace(PINNED, sleep_mode=False)], ids=["sleep", "inflight"])
def test_a_rolling_pod_s_resume_joins_its_loads_where_the_revision_names_both_digests(goal: Goal) -> None:
    """Behind the check, the resume is the step the pass would take next: ``next_step`` on the state the check
    expects says Resume, and that state holds exactly the revision's digests."""
    steps = chain(goal, serving(), Step.PAUSE, through_resume=True)
    assert steps[-3:] == (Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.RESUME)
    after = expected_after(goal, serving(), steps[:-1])
    assert next_step(goal, after).step == Step.RESUME
    assert (after.verifier.revision, after.verifier.digest) == (2, DV)
    assert after.draft is not None and (after.draft.revision, after.draft.digest) == (2, DD)
    assert after.resident and after.session is None
    assert chain(goal, serving(), Step.PAUSE) == steps[:-1]  # not asked: the loads end it, as before


def test_a_resume_never_joins_loads_the_pass_would_judge_against_anything_but_the_revision_s_digests() -> None:
    """No digest named (the pass would verify against the fleet's majority), only one of the two, a frozen draft
    (restored, not loaded), staged commits, pushed weights: the chain ends where it did."""
    unpinned = [
        SLEEP,
        dataclasses.replace(SLEEP, verifier_digest=DV),
        dataclasses.replace(SLEEP, draft_digest=DD),
        dataclasses.replace(PINNED, draft_path=None, frozen_draft_path="/w/frozen"),
    ]
    for goal in unpinned:
        assert not resumes_on_check(goal)
        assert chain(goal, serving(), Step.PAUSE, through_resume=True)[-1] != Step.RESUME, goal
    staged = dataclasses.replace(PINNED, sleep_mode=False, stage_limit=10**9)
    assert chain(staged, serving(stage_of_2()), Step.PAUSE, through_resume=True) == (Step.PAUSE, Step.COMMIT_VERIFIER)
    pushed = dataclasses.replace(PINNED, verifier_path=None, verifier_pushed=True, draft_path=None, draft_pushed=True)
    assert not resumes_on_check(pushed)


def test_a_verifier_alone_takes_its_resume_and_a_limited_fleet_s_loads_stay_apart() -> None:
    """A fleet without a draft resumes after the verifier's load; a fleet that limits concurrent loads keeps
    each load its own step, and no resume follows a chain that ends before a load."""
    no_draft = dataclasses.replace(PINNED, draft_path=None, draft_digest=None)
    alone = dataclasses.replace(serving(), draft=None)
    assert chain(no_draft, alone, Step.PAUSE, through_resume=True)[-2:] == (Step.LOAD_VERIFIER, Step.RESUME)
    assert chain(PINNED, serving(), Step.PAUSE, loads=False, through_resume=True)[-1] == Step.WAKE_WEIGHTS
    paused = dataclasses.replace(serving(), paused=True, sleeping=True)
    loaded = LoadResult(Target.DRAFT, 2, "/w/2/d", DD, bytes=20, seconds=0.1, tensors=2)
    state = acknowledged(paused, Step.LOAD_DRAFT, PINNED, loaded)  # a verifier loaded again after a verdict
    assert chain(PINNED, state, Step.LOAD_VERIFIER, through_resume=True) == (Step.LOAD_VERIFIER, Step.RESUME)
