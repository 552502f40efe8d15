"""``transaction.chain``: the steps that follow a step for certain, sent in one request by the executor.

A chain must be exactly the steps the step-by-step pass would take from each step's acknowledgement, and end
wherever the next step depends on what the engine answers (a load's digest, a resume's guard, a session, a
verdict): otherwise one request would run a step the planner would not have chosen.
"""

from __future__ import annotations

import dataclasses

import pytest

from rolloutfleet.api.engine import EngineState, StagedTarget, StagePhase, StageState, TargetState
from rolloutfleet.planning.transaction import CHAIN_THROUGH, Goal, Step, acknowledged, chain, next_step

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


def test_a_sleep_mode_pause_takes_the_sleep_the_wake_and_the_verifier_load_with_it() -> None:
    assert chain(SLEEP, serving(), Step.PAUSE) == (Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS, Step.LOAD_VERIFIER)


def test_an_inflight_pause_takes_the_verifier_load() -> None:
    assert chain(INFLIGHT, serving(), Step.PAUSE) == (Step.PAUSE, Step.LOAD_VERIFIER)


def test_a_staged_pause_takes_its_commit() -> None:
    """The AllAtOnce pause then holds one request per pod before the resume (issue 17's window)."""
    assert chain(STAGED, serving(stage_of_2()), Step.PAUSE) == (Step.PAUSE, Step.COMMIT_VERIFIER)


def test_a_fleet_that_limits_loads_keeps_each_load_its_own_step() -> None:
    """``maxConcurrentLoads`` is enforced per load step: a load inside another step's request would escape it."""
    assert chain(SLEEP, serving(), Step.PAUSE, loads=False) == (Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS)
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
    """The same decisions as observe → next_step → acknowledge, step after step, up to the first load or commit."""
    state = serving(stage_of_2() if goal.stages else None)
    expected = [next_step(goal, state).step]
    while expected[-1] in CHAIN_THROUGH:
        state = acknowledged(state, expected[-1], goal)
        expected.append(next_step(goal, state).step)
    assert list(chain(goal, serving(stage_of_2() if goal.stages else None), expected[0])) == expected
