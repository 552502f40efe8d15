"""Table tests of the per-pod transaction: the next step is derived from the engine's state alone."""

from __future__ import annotations

import dataclasses

import pytest

from rolloutfleet.api.engine import DraftPolicy, EngineState, TargetState
from rolloutfleet.planning.transaction import Goal, Step, at_goal, next_step

D = "blake3:" + "a" * 64
DV = "blake3:" + "b" * 64
DD = "blake3:" + "c" * 64
SLEEP = Goal(revision=2, verifier_path="/w/2/v", draft_path="/w/2/d", sleep_mode=True)
INFLIGHT = dataclasses.replace(SLEEP, sleep_mode=False)
FROZEN = Goal(revision=2, verifier_path="/w/2/v", sleep_mode=True, frozen_draft_path="/w/draft", frozen_draft_digest=DD)


def state(
    *,
    paused: bool = False,
    resident: bool = True,
    v: int | None = 1,
    d: int | None = 1,
    version: str | None = "1",
    vd: str | None = D,
    dd: str | None = D,
    policy: DraftPolicy = DraftPolicy.CO_UPDATE,
) -> EngineState:
    return EngineState(
        reachable=True,
        paused=paused,
        sleeping=paused,  # /is_sleeping is true while paused
        resident=resident,
        verifier=TargetState(revision=v, digest=vd if v is not None or vd != D else None),
        draft=TargetState(revision=d, digest=dd if d is not None or dd != D else None, policy=policy),
        weight_version=version,
    )


CASES = [
    ("serving old weights", SLEEP, state(), Step.PAUSE),
    ("paused, old weights resident: free them", SLEEP, state(paused=True), Step.SLEEP),
    (
        "asleep, weights discarded",
        SLEEP,
        state(paused=True, resident=False, v=None, d=None, vd=None, dd=None),
        Step.LOAD_VERIFIER,
    ),
    ("inflight never sleeps", INFLIGHT, state(paused=True), Step.LOAD_VERIFIER),
    ("verifier loaded, draft behind", SLEEP, state(paused=True, resident=False, v=2, d=None, dd=None), Step.LOAD_DRAFT),
    ("both loaded, version not stamped: the resume stamps it", SLEEP, state(paused=True, v=2, d=2), Step.RESUME),
    ("loaded, verified, stamped, paused", SLEEP, state(paused=True, v=2, d=2, version="2"), Step.RESUME),
    ("serving the goal", SLEEP, state(v=2, d=2, version="2"), Step.DONE),
    ("serving goal pair but wrong version", SLEEP, state(v=2, d=2, version="1"), Step.PAUSE),
    ("mixed pair serving (manual edit)", SLEEP, state(v=2, d=1, version="2"), Step.PAUSE),
    (
        "failed load left verifier unknown",
        SLEEP,
        state(paused=True, resident=False, v=None, vd=None, d=None, dd=None),
        Step.LOAD_VERIFIER,
    ),
    ("unreachable", SLEEP, EngineState.unreachable("connection refused"), Step.UNREACHABLE),
]


@pytest.mark.parametrize(("why", "goal", "observed", "expected"), CASES, ids=[c[0] for c in CASES])
def test_next_step(why: str, goal: Goal, observed: EngineState, expected: Step) -> None:
    assert next_step(goal, observed).step == expected, why


def test_expected_digest_mismatch_is_a_verification_failure() -> None:
    goal = dataclasses.replace(SLEEP, verifier_digest=DV)
    decision = next_step(goal, state(paused=True, v=2, d=2))
    assert decision.step == Step.VERIFY_FAILED and "verifier digest" in decision.reason
    assert next_step(goal, state(paused=True, v=2, d=2, vd=DV)).step == Step.RESUME


def test_draft_never_before_verifier() -> None:
    # Whatever the draft holds, a verifier behind the goal is loaded first.
    for d in (None, 1, 2):
        observed = state(paused=True, resident=False, v=None, vd=None, d=d, dd=None if d is None else D)
        assert next_step(SLEEP, observed).step == Step.LOAD_VERIFIER


def test_frozen_draft_is_restored_never_loaded() -> None:
    after_sleep = state(paused=True, resident=False, v=2, d=None, dd=None, policy=DraftPolicy.FROZEN)
    assert next_step(FROZEN, after_sleep).step == Step.RESTORE_DRAFT
    restored = state(paused=True, v=2, d=None, dd=DD, policy=DraftPolicy.FROZEN)
    assert next_step(FROZEN, restored).step == Step.RESUME
    wrong = state(paused=True, v=2, d=None, dd=DV, policy=DraftPolicy.FROZEN)
    decision = next_step(FROZEN, wrong)
    assert decision.step == Step.VERIFY_FAILED and "frozen draft digest" in decision.reason


def test_no_draft_engine() -> None:
    goal = Goal(revision=2, verifier_path="/w/2/v", sleep_mode=False)
    observed = EngineState(
        reachable=True, paused=True, sleeping=True, resident=True, verifier=TargetState(2, D), weight_version="2"
    )
    assert next_step(goal, observed).step == Step.RESUME
    assert at_goal(goal, observed)


def test_pods_must_agree_without_a_pinned_digest() -> None:
    from rolloutfleet.planning import verification

    good = state(paused=True, v=2, d=2, vd=DV, dd=DD)
    corrupt = state(paused=True, v=2, d=2, vd=DV, dd=D)
    goal = verification.with_reference_digests(SLEEP, [good, good, corrupt])
    assert goal.draft_digest == DD and goal.verifier_digest is None
    assert next_step(goal, corrupt).step == Step.VERIFY_FAILED
    assert next_step(goal, good).step == Step.RESUME
    tie = verification.with_reference_digests(SLEEP, [good, corrupt])
    assert next_step(tie, good).step == Step.VERIFY_FAILED and next_step(tie, corrupt).step == Step.VERIFY_FAILED
    assert verification.with_reference_digests(SLEEP, [good, good]) == SLEEP


def test_weights_are_woken_only_when_unmapped() -> None:
    asleep = dataclasses.replace(state(paused=True, resident=False, v=None, d=None, vd=None, dd=None), mapped=False)
    assert next_step(SLEEP, asleep).step == Step.WAKE_WEIGHTS
    woken = dataclasses.replace(asleep, mapped=True)
    assert next_step(SLEEP, woken).step == Step.LOAD_VERIFIER


def test_engines_without_weight_versions_skip_the_version_step() -> None:
    loaded = dataclasses.replace(state(paused=True, v=2, d=2, version=None), versioned=False)
    assert next_step(SLEEP, loaded).step == Step.RESUME


def test_every_action_is_an_action() -> None:
    from rolloutfleet.planning.transaction import ACTIONS

    verdicts = {
        Step.DONE,
        Step.VERIFY_FAILED,
        Step.UNREACHABLE,
        Step.ENGINE_MISMATCH,
        Step.ENGINE_ERROR,
        Step.AWAIT_PUSH,  # a wait for the trainer, not something the operator does to the engine
        Step.NO_RENDEZVOUS,  # the trainer never said where to join: a failed attempt
        Step.AWAIT_STAGE,  # the engine stages by itself: the pass reads it again
        Step.STAGE_FAILED,  # a failed attempt, retried by staging again (the pass decides)
        Step.STAGE_MISMATCH,  # a failed attempt, retried by releasing the stage first
    }
    assert set(Step) - verdicts == ACTIONS


# --- issue 15, defect 2: an engine without the fleet's draft never satisfies a goal that has one ---------

DRAFT_GOAL = dataclasses.replace(SLEEP, draft_method="draft_model")


def _no_draft(**kw: object) -> EngineState:
    base = state(paused=True, v=2, d=2, version="2")
    return dataclasses.replace(base, draft=None, **kw)  # type: ignore[arg-type]


def test_co_updated_draft_goal_and_an_engine_without_a_draft_is_a_verdict() -> None:
    """A co-updated draft that the engine does not have cannot be loaded or skipped: serving the verifier
    alone would drop the fleet's speculative decoding silently, so the pod is never resumed or done."""
    decision = next_step(SLEEP, _no_draft())
    assert decision.step == Step.ENGINE_MISMATCH and "draft" in decision.reason
    assert not at_goal(SLEEP, _no_draft())
    serving = dataclasses.replace(_no_draft(), paused=False, sleeping=False)
    assert next_step(SLEEP, serving).step == Step.ENGINE_MISMATCH


def test_frozen_draft_goal_and_an_engine_without_a_draft_is_a_verdict() -> None:
    """A frozen draft is part of the pair as much as a co-updated one."""
    assert next_step(FROZEN, _no_draft()).step == Step.ENGINE_MISMATCH


def test_draft_method_differing_from_the_fleet_spec_is_a_verdict() -> None:
    """An engine started with another speculative method (eagle instead of a draft model) serves another
    pair than the fleet declares, whatever its digests say."""
    eagle = dataclasses.replace(state(paused=True, v=2, d=2, version="2"), draft_method="eagle")
    decision = next_step(DRAFT_GOAL, eagle)
    assert decision.step == Step.ENGINE_MISMATCH and "eagle" in decision.reason
    same = dataclasses.replace(eagle, draft_method="draft_model")
    assert next_step(DRAFT_GOAL, same).step == Step.RESUME


def test_a_fleet_without_speculation_ignores_the_draft_slot() -> None:
    """``method: none``: no draft expected, none loaded (the engine may report none)."""
    goal = Goal(revision=2, verifier_path="/w/2/v", sleep_mode=False)
    assert next_step(goal, _no_draft()).step == Step.RESUME


def test_engine_faults_other_than_the_network_are_their_own_verdict() -> None:
    """Issue 15 defect 11: a 401 or a protocol error is not a network blip: distinct verdict and reason."""
    from rolloutfleet.api.engine import EngineFault

    unauthorized = EngineState.failed(EngineFault.UNAUTHORIZED, "HTTP 401")
    decision = next_step(SLEEP, unauthorized)
    assert decision.step == Step.ENGINE_ERROR and "unauthorized" in decision.reason.lower()
    assert next_step(SLEEP, EngineState.unreachable("refused")).step == Step.UNREACHABLE
