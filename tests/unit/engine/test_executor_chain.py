"""``executor.execute_chain`` against a simulated engine on loopback: a step and the steps that follow it for
certain (``transaction.chain``) in one request, with the same calls, order, deadlines and failure rules as the
steps sent one by one.

What the engine did is read from its call log (order, never timing); how many requests the operator sent,
from the client's latency hook (one entry per HTTP request).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from engine_support import Latencies
from transfer_support import Checkpoints

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import LoadOutcomeUnknown
from rolloutfleet.api.engine import EngineState, LoadResult, StagePhase, Target
from rolloutfleet.api.fleet import StepTimeouts
from rolloutfleet.planning import transaction
from rolloutfleet.planning.transaction import Goal, Step
from rolloutfleet.reconcile import executor
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, SimulatedEngine, weights
from rolloutfleet.sim import sequence as sim_sequence

FAST = StepTimeouts.model_construct(pause_seconds=5, sleep_seconds=5, wake_seconds=5, load_seconds=5, verify_seconds=5)
NOT_FOUND = {"detail": "Not Found"}


@pytest.fixture
def spec(ckpts: Checkpoints) -> EngineSpec:
    return EngineSpec(verifier_path=ckpts.verifier_a, draft_path=ckpts.draft_a)


def goal_b(ckpts: Checkpoints, *, sleep_mode: bool, stages: bool = False) -> Goal:
    return Goal(
        revision=2,
        verifier_path=ckpts.verifier_b,
        draft_path=ckpts.draft_b,
        sleep_mode=sleep_mode,
        stage_limit=10**9 if stages else None,
    )


def calls(sim: SimulatedEngine) -> list[str]:
    """The engine's answered calls by their most specific name, in order (reads left out)."""
    reads = {"rolloutfleet_state", "is_paused", "is_sleeping", "ready", "observe"}
    return [str(e.get("key") or e["step"]) for e in sim.log.entries if "status" in e and e["step"] not in reads]


async def serving_admitted(client: EngineClient) -> EngineState:
    await client.admit(None)
    return await client.observe(deadline=5)


LOADS = ["rolloutfleet_load:verifier", "rolloutfleet_load:draft"]


async def test_a_sleep_mode_pause_sleep_wake_and_both_loads_are_one_request(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints, latencies: Latencies
) -> None:
    goal = goal_b(ckpts, sleep_mode=True)
    known = await serving_admitted(client)
    steps = transaction.chain(goal, known, Step.PAUSE)
    sim.log.entries.clear()
    latencies.calls.clear()
    done = await executor.execute_chain(client, steps, goal, FAST, executor.SessionContext(known=known))
    one = "sequence:withdraw+pause+sleep+wake_up:weights+rolloutfleet_load:verifier+rolloutfleet_load:draft"
    assert [step for step, _, _ in latencies.calls] == [one]
    assert calls(sim) == ["withdraw", "pause:keep", "sleep:2", "wake_up:weights", *LOADS]
    assert [d.step for d in done] == [Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS, Step.LOAD_VERIFIER, Step.LOAD_DRAFT]
    # Each step timed by the engine, apart (the step metrics and the status's timings stay per step).
    assert all(d.seconds is not None and d.seconds >= 0 for d in done)
    loads = [d.result for d in done[-2:]]
    assert all(isinstance(load, LoadResult) and load.revision == 2 for load in loads)
    assert [load.target for load in loads if isinstance(load, LoadResult)] == [Target.VERIFIER, Target.DRAFT]
    state = await client.observe(deadline=5)
    assert state.paused and state.admitted is False and state.pair == (2, 2)


async def test_a_verifier_load_that_fails_inside_the_chain_ends_it_before_the_draft_s(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """A verifier load that fails ends the request there, as a failed call ends any sequence: the draft's load
    does not run after it. (One that answers a digest that does not verify is not a failed call: the draft's
    load runs, and the pass judges the verifier's answer, transaction.chain.)"""
    goal = goal_b(ckpts, sleep_mode=False)
    known = await serving_admitted(client)
    sim.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.HTTP_ERROR, status=500, body="died", count=1))
    sim.log.entries.clear()
    with pytest.raises(executor.StepError) as err:
        await executor.execute_chain(client, transaction.chain(goal, known, Step.PAUSE), goal, FAST)
    assert err.value.step == Step.LOAD_VERIFIER
    assert calls(sim) == ["pause:keep"]  # (the refused load is the fault's, not an answered call)


async def test_a_staged_pause_and_both_commits_are_one_request(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints, latencies: Latencies
) -> None:
    goal = goal_b(ckpts, sleep_mode=False, stages=True)
    await client.admit(None)
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    known = await client.observe(deadline=5)
    while known.staged is not None and known.staged.phase == StagePhase.STAGING:
        known = await client.observe(deadline=5)
    steps = transaction.chain(goal, known, Step.PAUSE)
    assert steps == (Step.PAUSE, Step.COMMIT_VERIFIER)
    sim.log.entries.clear()
    latencies.calls.clear()
    done = await executor.execute_chain(client, steps, goal, FAST, executor.SessionContext(known=known))
    assert len(latencies.calls) == 1
    assert calls(sim) == ["withdraw", "pause:keep", "rolloutfleet_load:staged", "rolloutfleet_load:staged"]
    commits = done[-1].result
    assert isinstance(commits, tuple) and [c.target for c in commits] == [Target.VERIFIER, Target.DRAFT]


async def test_a_load_that_fails_inside_the_chain_names_its_step_and_leaves_its_outcome_unknown(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """A 5xx load inside a sequence says no more about the load's outcome than on its own: no later load goes
    to this engine before it was observed again (``LoadOutcomeUnknown``)."""
    goal = goal_b(ckpts, sleep_mode=False)
    known = await serving_admitted(client)
    sim.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.HTTP_ERROR, status=500, body="worker died"))
    with pytest.raises(executor.StepError) as err:
        await executor.execute_chain(client, transaction.chain(goal, known, Step.PAUSE), goal, FAST)
    assert err.value.step == Step.LOAD_VERIFIER and err.value.reason == "EngineHTTPError"
    with pytest.raises(LoadOutcomeUnknown):
        await client.load("verifier", ckpts.verifier_b, 2)


async def test_a_commit_of_both_answered_5xx_leaves_the_load_unknown(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """The staged commit of both targets (one sequence) read its 5xx part without marking the load unknown:
    the retry could then send a second commit while the first may still run (found writing the chains)."""
    goal = goal_b(ckpts, sleep_mode=False, stages=True)
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    known = await client.observe(deadline=5)
    while known.staged is not None and known.staged.phase == StagePhase.STAGING:
        known = await client.observe(deadline=5)
    await client.pause("keep", clear_cache=False)
    sim.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.HTTP_ERROR, status=500, body="worker died"))
    with pytest.raises(executor.StepError):
        await executor.execute(client, Step.COMMIT_VERIFIER, goal, FAST, executor.SessionContext(known=known))
    with pytest.raises(LoadOutcomeUnknown):
        await client.load("verifier", ckpts.verifier_b, 2, staged=True)


async def test_an_image_without_sequences_gets_the_chains_steps_one_by_one(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    goal = goal_b(ckpts, sleep_mode=True)
    known = await serving_admitted(client)
    sim.add_fault(FaultRule(step="sequence", kind=FaultKind.HTTP_ERROR, status=404, body=NOT_FOUND, count=None))
    sim.log.entries.clear()
    done = await executor.execute_chain(
        client, transaction.chain(goal, known, Step.PAUSE), goal, FAST, executor.SessionContext(known=known)
    )
    assert calls(sim) == ["withdraw", "pause:keep", "sleep:2", "wake_up:weights", *LOADS]
    assert [d.step for d in done] == [Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS, Step.LOAD_VERIFIER, Step.LOAD_DRAFT]


async def test_a_withdrawal_that_fails_is_logged_and_the_steps_go_on_one_by_one(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints, caplog: pytest.LogCaptureFixture
) -> None:
    """As a pause on its own: the readiness gate is already closed, so a failed withdrawal (the second switch)
    does not keep the pod from its update; the sequence stopped before the pause, the rest is sent apart."""
    goal = goal_b(ckpts, sleep_mode=False)
    known = await serving_admitted(client)
    sim.add_fault(FaultRule(step="withdraw", kind=FaultKind.HTTP_ERROR, status=500, body="no"))
    sim.log.entries.clear()
    done = await executor.execute_chain(
        client, transaction.chain(goal, known, Step.PAUSE), goal, FAST, executor.SessionContext(known=known)
    )
    assert "not withdrawn" in caplog.text  # (the refused withdrawal is the fault's, not an answered call)
    assert calls(sim) == ["pause:keep", *LOADS]
    assert [d.step for d in done] == [Step.PAUSE, Step.LOAD_VERIFIER, Step.LOAD_DRAFT]


def pinned_b(ckpts: Checkpoints, *, sleep_mode: bool = True, verifier_digest: str | None = None) -> Goal:
    """Revision 2 with the digests its checkpoints have (the trainer's, as a WeightRevision names them)."""
    digest = weights.digest_function()
    return dataclasses.replace(
        goal_b(ckpts, sleep_mode=sleep_mode),
        verifier_digest=verifier_digest or digest(ckpts.verifier_b),
        draft_digest=digest(ckpts.draft_b),
    )


async def test_a_rolling_pod_s_whole_update_is_one_request_its_resume_behind_a_check_of_the_digests(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints, latencies: Latencies
) -> None:
    """``transaction.chain(through_resume=True)``: pause, sleep, wake, both loads, a read of the engine's state
    that every rank must hold (the revision's digests), the resume's calls and the admission, in one request;
    the resume's answer is a step like the others (Resumed, admitted), timed by the engine."""
    goal = pinned_b(ckpts)
    known = await serving_admitted(client)
    steps = transaction.chain(goal, known, Step.PAUSE, through_resume=True)
    sim.log.entries.clear()
    latencies.calls.clear()
    done = await executor.execute_chain(client, steps, goal, FAST, executor.SessionContext(known=known))
    assert len(latencies.calls) == 1
    assert calls(sim) == [
        "withdraw",
        "pause:keep",
        "sleep:2",
        "wake_up:weights",
        *LOADS,
        "update_weight_version",
        "wake_up:kv_cache",
        "resume",
        "admit",
    ]
    assert [d.step for d in done] == list(steps) and steps[-1] == Step.RESUME
    assert done[-1].result == executor.Resumed(admitted=True) and done[-1].seconds is not None
    state = await client.observe(deadline=5)
    assert state.serving and state.admitted is True and state.pair == (2, 2)
    assert client.chains_resume


async def test_a_chained_resume_never_runs_on_weights_that_do_not_hold_the_revision_s_digests(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """The check ends the request before the resume: the loads are answered (the pass judges them, as without
    the chain), the engine stays paused and withdrawn, and the image is not taken for one without the rule."""
    goal = pinned_b(ckpts, verifier_digest="blake3:" + "0" * 64)
    known = await serving_admitted(client)
    steps = transaction.chain(goal, known, Step.PAUSE, through_resume=True)
    sim.log.entries.clear()
    done = await executor.execute_chain(client, steps, goal, FAST, executor.SessionContext(known=known))
    assert [d.step for d in done] == list(steps[:-1])
    assert "resume" not in calls(sim) and "wake_up:kv_cache" not in calls(sim)
    state = await client.observe(deadline=5)
    assert state.paused and state.admitted is False and state.pair == (2, 2)
    assert client.chains_resume


async def test_an_image_that_holds_the_check_against_the_whole_body_gets_its_resumes_apart(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image from before the rule compares the check with the RPC's whole body and stops there whatever the
    ranks hold: nothing resumes, and the client notes it (its next resumes go in requests of their own)."""

    def body_level(path: str, part: dict[str, Any], expect: Any = None) -> bool:
        if not 200 <= int(part["status"]) < 300:
            return True
        return expect is not None and not sim_sequence.holds(part["body"], expect)

    monkeypatch.setattr(sim_sequence, "failed", body_level)
    goal = pinned_b(ckpts)
    known = await serving_admitted(client)
    steps = transaction.chain(goal, known, Step.PAUSE, through_resume=True)
    done = await executor.execute_chain(client, steps, goal, FAST, executor.SessionContext(known=known))
    assert [d.step for d in done] == list(steps[:-1])
    state = await client.observe(deadline=5)
    assert state.paused and state.pair == (2, 2)
    assert not client.chains_resume


async def test_an_inflight_rolling_update_is_one_request_too(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints, latencies: Latencies
) -> None:
    """In flight (no sleep: the weights are replaced in place while ``pause(keep)`` holds the requests), the
    state the check expects after the loads (resident, both digests) is what the engine reports: the resume runs."""
    goal = pinned_b(ckpts, sleep_mode=False)
    known = await serving_admitted(client)
    steps = transaction.chain(goal, known, Step.PAUSE, through_resume=True)
    assert steps == (Step.PAUSE, Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.RESUME)
    latencies.calls.clear()
    done = await executor.execute_chain(client, steps, goal, FAST, executor.SessionContext(known=known))
    assert len(latencies.calls) == 1 and done[-1].result == executor.Resumed(admitted=True)
    state = await client.observe(deadline=5)
    assert state.serving and state.admitted is True and state.pair == (2, 2)
