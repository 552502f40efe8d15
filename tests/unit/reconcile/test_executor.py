"""``reconcile.executor`` against a simulated engine on loopback: step order, deadlines, fail-closed resume.

The executor is the one place that maps a transaction step to engine calls and to the deadline the fleet's
``updateStrategy.timeouts`` gives it. These tests drive it through the real engine client over HTTP and
read what happened from the simulated engine's call log (``EngineLog``): order, never timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from rolloutfleet.adapters.engine import EngineClient, EnginePool, EngineTimeouts, ResetPolicy, RetryPolicy
from rolloutfleet.api.fleet import StepTimeouts
from rolloutfleet.planning.transaction import Goal, Step
from rolloutfleet.reconcile import executor
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, SimulatedEngine, SimulatedFleet

TOKEN = "executor-token"
V2, D2 = "/synthetic/v/2", "/synthetic/d/2"
# Whole seconds in a spec (the CRD validates them); sub-second ones here keep the tests fast.
# The tests' own calls that put an engine where a step starts from: not what is tested, so not under the pool's
# short timeouts (a pause while a request runs took over 0.25 s once, under a full `make test` on 2 cores).
SETUP = 5.0
FAST = StepTimeouts.model_construct(pause_seconds=5, sleep_seconds=5, wake_seconds=5, load_seconds=5, verify_seconds=5)


def goal(*, sleep_mode: bool, reset: bool = True) -> Goal:
    return Goal(revision=2, verifier_path=V2, draft_path=D2, sleep_mode=sleep_mode, reset_prefix_cache=reset)


@pytest.fixture
def spec() -> EngineSpec:
    return EngineSpec()


@pytest.fixture
async def sim(spec: EngineSpec) -> AsyncIterator[SimulatedEngine]:
    async with SimulatedFleet(token=TOKEN, spec=spec) as fleet:
        yield await fleet.add("127.0.0.1", 0)


@pytest.fixture
async def pool() -> AsyncIterator[EnginePool]:
    # The pool's own timeouts are short on purpose: a step must run under the fleet's deadline, not these.
    short = EngineTimeouts(default=0.25, pause=0.25, sleep=0.25, wake_up=0.25, load=0.25, reset_prefix_cache=0.25)
    async with EnginePool(
        token=TOKEN,
        timeouts=short,
        retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02),
        reset=ResetPolicy(attempts=3, base_delay=0.01, max_delay=0.02),
    ) as p:
        yield p


@pytest.fixture
def client(pool: EnginePool, sim: SimulatedEngine) -> EngineClient:
    return pool.client(sim.url)


def steps(sim: SimulatedEngine, *names: str) -> list[dict[str, Any]]:
    """The engine's answered calls of the given kinds, in the order the engine handled them."""
    return [e for e in sim.log.entries if e["step"] in names and "status" in e]


async def hold_a_running_request(sim: SimulatedEngine, session: aiohttp.ClientSession) -> asyncio.Future[Any]:
    """A generation that is running (it holds KV blocks) when this returns; it runs until the engine pauses."""
    sim.core.lat = dataclasses.replace(sim.core.lat, token_s=0.01)  # a finite generation speed, like a GPU
    body = {"prompt": [1, 2, 3], "max_tokens": 10_000}
    request = asyncio.ensure_future(session.post(sim.url + "/v1/completions", json=body))
    await sim.core.until(lambda: sim.core.blocks_held)
    return request


async def finish_quickly(sim: SimulatedEngine, request: asyncio.Future[Any]) -> dict[str, Any]:
    sim.core.lat = dataclasses.replace(sim.core.lat, token_s=0.0)
    async with await request as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


# --- defect 3: the prefix cache is reset before the engine serves again, or the engine stays paused ------------


@pytest.mark.parametrize("sleep_mode", [False, True], ids=["inflight", "sleep"])
async def test_resume_resets_the_prefix_cache_before_the_engine_serves_again(
    client: EngineClient, sim: SimulatedEngine, sleep_mode: bool
) -> None:
    """Requests frozen by pause(keep) hold KV blocks computed with the old weights; a plain reset is refused
    while they do. The reset must free them (they are recomputed after resume, with the new weights) and
    come before the resume: once resumed, the engine serves from whatever the cache holds."""
    async with aiohttp.ClientSession() as session:
        request = await hold_a_running_request(sim, session)
        await client.pause("keep", clear_cache=False, deadline=SETUP)
        if sleep_mode:
            await client.sleep(2, mode="keep", deadline=SETUP)
            await client.wake_up(["weights"], deadline=SETUP)
        await executor.execute(client, Step.RESUME, goal(sleep_mode=sleep_mode), FAST)
        body = await finish_quickly(sim, request)
    order = steps(sim, "reset_prefix_cache", "resume")
    assert [e["step"] for e in order] == ["reset_prefix_cache", "resume"]
    assert order[0]["result"] == {"success": True}
    assert order[0]["args"]["reset_running_requests"] is True
    assert body["usage"]["completion_tokens"] == 10_000  # preempted, not aborted: it completed after resume
    assert not await client.is_paused()


@pytest.mark.parametrize("sleep_mode", [False, True], ids=["inflight", "sleep"])
@pytest.mark.parametrize(
    "refusal",
    [
        FaultRule(
            step="reset_prefix_cache", kind=FaultKind.HTTP_ERROR, status=200, body={"success": False}, count=None
        ),
        FaultRule(step="reset_prefix_cache", kind=FaultKind.HTTP_ERROR, status=500, body={"error": "x"}, count=None),
    ],
    ids=["success-false", "http-500"],
)
async def test_a_pod_whose_reset_failed_stays_paused_and_the_step_fails(
    client: EngineClient, sim: SimulatedEngine, sleep_mode: bool, refusal: FaultRule
) -> None:
    """A failed reset must fail the RESUME step while the engine is still paused, so the planner derives
    RESUME again and retries it; resuming first would leave a serving pod that the planner calls Done with a
    cache of the old weights (a revision ended Succeeded with the cache never reset)."""
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    if sleep_mode:
        await client.sleep(2, mode="keep", deadline=SETUP)
        await client.wake_up(["weights"], deadline=SETUP)
    sim.add_fault(refusal)
    with pytest.raises(executor.StepError) as err:
        await executor.execute(client, Step.RESUME, goal(sleep_mode=sleep_mode), FAST)
    assert err.value.step == Step.RESUME and err.value.reason[0].isupper() and "_" not in err.value.reason
    assert await client.is_paused()
    assert steps(sim, "resume") == []
    sim.clear_faults()  # the retry of the same step goes through
    await executor.execute(client, Step.RESUME, goal(sleep_mode=sleep_mode), FAST)
    assert [e["step"] for e in steps(sim, "reset_prefix_cache", "resume")][-2:] == ["reset_prefix_cache", "resume"]


async def test_without_prefix_caching_resume_sends_no_reset(client: EngineClient, sim: SimulatedEngine) -> None:
    """``reset_prefix_cache=False`` in the goal means the fleet runs without prefix caching: nothing to reset."""
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    await executor.execute(client, Step.RESUME, goal(sleep_mode=False, reset=False), FAST)
    assert [e["step"] for e in steps(sim, "reset_prefix_cache", "resume")] == ["resume"]


# --- defect 7: every engine call waits exactly the deadline the fleet's spec gives its step -------------------


async def slow_loads(sim: SimulatedEngine, seconds: float) -> None:
    """Make a verifier load take ``seconds`` inside the engine (where vLLM runs it: one RPC at a time)."""
    sim.core.lat = dataclasses.replace(sim.core.lat, load_bytes_per_s=sim.weights.verifier_bytes / seconds)


async def test_a_load_waits_the_fleets_load_deadline_not_the_pools_default(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    """The fleet says a load may take ``loadSeconds``; a shorter HTTP timeout in the client (the pool's
    default) would fail a load the spec allows, and retry it while the first is still running."""
    await slow_loads(sim, 0.6)  # longer than the pool's 0.25 s, well inside the fleet's 5 s
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    _, load = await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), FAST)
    assert load is not None and load.revision == 2


async def test_the_rpc_carries_vllms_own_timeout_just_below_the_http_deadline(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    """vLLM's ``collective_rpc`` takes a ``timeout``: sent a little below the HTTP deadline, the engine gives
    up (and answers) before the client does, so the client sees the engine's verdict, not a lost answer."""
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), FAST)
    (load,) = steps(sim, "rolloutfleet_load")
    assert 0 < load["args"]["timeout"] < FAST.load_seconds
    assert load["args"]["timeout"] >= FAST.load_seconds - 5  # "slightly": not a silent cap either


async def test_a_load_that_outlives_its_deadline_fails_with_a_timeout(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    timeouts = StepTimeouts.model_construct(
        pause_seconds=5, sleep_seconds=5, wake_seconds=5, load_seconds=0.3, verify_seconds=5
    )
    sim.core.load_gate = asyncio.Event()  # the load runs until the test lets it finish
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    with pytest.raises(executor.StepError) as err:
        await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), timeouts)
    assert err.value.reason == "StepTimeout"
    sim.core.load_gate.set()


async def test_no_second_load_is_sent_while_the_first_ones_outcome_is_unknown(
    pool: EnginePool, sim: SimulatedEngine
) -> None:
    """After a load's HTTP call times out the engine may still be loading; vLLM would queue a retried load
    behind it and run both. The retry is refused (without sending) until a state read that started after
    the timeout succeeded: that read queues behind the running load, so its answer proves the load ended."""
    timeouts = StepTimeouts.model_construct(
        pause_seconds=5, sleep_seconds=5, wake_seconds=5, load_seconds=0.3, verify_seconds=5
    )
    first = pool.client(sim.url)
    await first.pause("keep", clear_cache=False)
    sim.core.load_gate = asyncio.Event()
    with pytest.raises(executor.StepError) as timed_out:
        await executor.execute(first, Step.LOAD_VERIFIER, goal(sleep_mode=False), timeouts)
    assert timed_out.value.reason == "StepTimeout"

    second = pool.client(sim.url)  # each reconcile pass makes new clients; the pool remembers
    with pytest.raises(executor.StepError) as refused:
        await executor.execute(second, Step.LOAD_VERIFIER, goal(sleep_mode=False), timeouts)
    assert refused.value.reason == "LoadOutcomeUnknown"
    assert [e["step"] for e in sim.log.entries if e["step"] == "rpc_started"] == ["rpc_started"]  # never sent

    stuck = await second.observe(deadline=0.2)  # the state read queues behind the load still running
    assert not stuck.reachable
    with pytest.raises(executor.StepError) as still:
        await executor.execute(second, Step.LOAD_VERIFIER, goal(sleep_mode=False), timeouts)
    assert still.value.reason == "LoadOutcomeUnknown"

    sim.core.load_gate.set()
    state = await second.observe(deadline=5)
    assert state.reachable and state.verifier.revision == 2  # the "lost" load did complete
    _, load = await executor.execute(second, Step.LOAD_VERIFIER, goal(sleep_mode=False), FAST)
    assert load is not None
    rpcs = [(e["step"], e["method"]) for e in sim.log.entries if e["step"] in ("rpc_started", "rpc_finished")]
    load_rpcs = [r for r in rpcs if r[1] == "rolloutfleet_load"]
    assert load_rpcs == [("rpc_started", "rolloutfleet_load"), ("rpc_finished", "rolloutfleet_load")] * 2


@pytest.mark.parametrize("spec", [EngineSpec(tp_size=2)])
async def test_an_rpc_timeout_answered_by_vllm_still_leaves_the_load_unknown(
    pool: EnginePool, sim: SimulatedEngine
) -> None:
    """With several workers vLLM stops waiting at the RPC ``timeout`` and answers 500, but the workers keep
    loading: that answer says nothing about the load's outcome, so the next load is refused as well."""
    timeouts = StepTimeouts.model_construct(
        pause_seconds=5, sleep_seconds=5, wake_seconds=5, load_seconds=0.4, verify_seconds=5
    )
    client = pool.client(sim.url)
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    sim.core.load_gate = asyncio.Event()
    with pytest.raises(executor.StepError) as err:
        await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), timeouts)
    assert err.value.reason == "EngineHTTPError" and "500" in str(err.value)
    with pytest.raises(executor.StepError) as refused:
        await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), timeouts)
    assert refused.value.reason == "LoadOutcomeUnknown"
    sim.core.load_gate.set()
    assert (await client.observe(deadline=5)).reachable
    await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), FAST)


async def test_a_refused_load_to_an_engine_never_reached_is_not_unknown(pool: EnginePool) -> None:
    """A connection that was never made cannot have started a load: the next attempt may go right away."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        client = pool.client(f"http://127.0.0.1:{sock.getsockname()[1]}")
        for _ in range(2):
            with pytest.raises(executor.StepError) as err:
                await executor.execute(client, Step.LOAD_VERIFIER, goal(sleep_mode=False), FAST)
            assert err.value.reason == "EngineUnreachable"


@pytest.mark.parametrize(
    "step",
    [Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS, Step.RESUME],
)
async def test_every_step_waits_its_spec_deadline(client: EngineClient, sim: SimulatedEngine, step: Step) -> None:
    """Each step's calls last as long as the fleet allows (here 5 s), not the pool's 0.25 s default."""
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    if step == Step.WAKE_WEIGHTS:
        await client.sleep(2, mode="keep", deadline=SETUP)
    keys = {
        Step.PAUSE: "pause",
        Step.SLEEP: "sleep",
        Step.WAKE_WEIGHTS: "wake_up",
        Step.RESUME: "resume",
    }
    sim.add_fault(FaultRule(step=keys[step], kind=FaultKind.SLOW, delay=0.5))
    await executor.execute(client, step, goal(sleep_mode=False), FAST)


def test_step_error_reasons_are_camel_case() -> None:
    """Reasons go to conditions and metric labels: CamelCase, as Kubernetes condition reasons are."""
    from rolloutfleet.adapters import engine_wire

    rpc = engine_wire.EngineRPCError("load_failed", "x")
    assert executor.reason_of(rpc) == "ExtensionLoadFailed"
    for exc in (
        engine_wire.EngineUnreachable("x"),
        engine_wire.EngineTimeout("x"),
        engine_wire.EngineHTTPError(500, "x"),
        engine_wire.EngineProtocolError("x"),
        engine_wire.EngineInconsistent("x", results=[]),
        engine_wire.LoadOutcomeUnknown("x", since=0.0),
    ):
        reason = executor.reason_of(exc)
        assert reason[0].isupper() and reason.isalnum(), reason


# --- a step's calls in one request (POST /rolloutfleet/sequence) ------------------------------------------
# Inside an AllAtOnce pause each request round is time the whole fleet is out of service (issue 17), and
# each request costs the operator CPU per pod (issue 18). An image without the route must still work.


def calls(sim: SimulatedEngine) -> list[str]:
    """The engine's answered state-changing calls by their most specific name, in order."""
    return [str(e.get("key") or e["step"]) for e in sim.log.entries if "status" in e]


async def paused_at_goal(client: EngineClient) -> Any:
    """The engine holding revision 2 (both targets), paused: what the planner resumes."""
    await client.load("verifier", V2, 2)
    await client.load("draft", D2, 2)
    await client.pause("keep", clear_cache=False, deadline=SETUP)
    return await client.observe()


async def test_the_resume_stamps_resets_and_resumes_in_one_guarded_request(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    known = await paused_at_goal(client)
    sim.log.entries.clear()
    ctx = executor.SessionContext(known=known)
    _, resumed = await executor.execute(client, Step.RESUME, goal(sleep_mode=False), FAST, ctx)
    # The withdrawn process is admitted last, in the same request: its guard verified process and weights.
    assert calls(sim) == ["update_weight_version", "reset_prefix_cache", "resume", "admit"]
    assert resumed == executor.Resumed(admitted=True)
    state = await client.observe()
    assert not state.paused and state.weight_version == "2" and state.admitted is True


async def test_an_admission_refused_after_the_resume_leaves_the_pod_to_the_service_sync(
    client: EngineClient, sim: SimulatedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The resume went through; the admission did not (here a fault; a process restarted in between answers
    409): the step succeeded, the pod stays out of the Service until ``gates.open_for`` admits it (fail-closed)."""
    known = await paused_at_goal(client)
    sim.add_fault(FaultRule(step="admit", kind=FaultKind.HTTP_ERROR, status=500, body="no"))
    _, resumed = await executor.execute(
        client, Step.RESUME, goal(sleep_mode=False), FAST, executor.SessionContext(known=known)
    )
    assert resumed == executor.Resumed(admitted=False) and "not admitted" in caplog.text
    state = await client.observe()
    assert not state.paused and state.admitted is False


async def test_a_resume_whose_guard_fails_runs_nothing(client: EngineClient, sim: SimulatedEngine) -> None:
    """The guard is the read that used to precede every resume: other weights (here a load behind the
    operator's back) or another process, and nothing runs; the pass decides again from a full read."""
    known = await paused_at_goal(client)
    await client.load("verifier", "/synthetic/v/3", 3)
    sim.log.entries.clear()
    with pytest.raises(executor.Held):
        await executor.execute(client, Step.RESUME, goal(sleep_mode=False), FAST, executor.SessionContext(known=known))
    assert calls(sim) == [] and (await client.observe()).paused


async def test_an_image_without_sequences_resumes_call_by_call_after_its_read(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    known = await paused_at_goal(client)
    sim.add_fault(FaultRule(step="sequence", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}))
    sim.log.entries.clear()
    reads: list[bool] = []

    async def ready() -> bool:
        reads.append(True)
        return True

    ctx = executor.SessionContext(known=known, ready=ready)
    await executor.execute(client, Step.RESUME, goal(sleep_mode=False), FAST, ctx)
    assert reads == [True]
    assert calls(sim) == ["update_weight_version", "reset_prefix_cache", "resume"]

    async def not_ready() -> bool:
        return False

    await client.pause("keep", clear_cache=False, deadline=SETUP)
    sim.log.entries.clear()
    with pytest.raises(executor.Held):
        ctx = executor.SessionContext(known=known, ready=not_ready)
        await executor.execute(client, Step.RESUME, goal(sleep_mode=False), FAST, ctx)
    assert calls(sim) == []


@pytest.mark.parametrize("sequences", [True, False], ids=["one-request", "call-by-call"])
async def test_the_pause_withdraws_the_engine_first(
    client: EngineClient, sim: SimulatedEngine, sequences: bool
) -> None:
    await client.admit(None)
    known = await client.observe()
    if not sequences:
        sim.add_fault(FaultRule(step="sequence", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}))
    sim.log.entries.clear()
    await executor.execute(client, Step.PAUSE, goal(sleep_mode=False), FAST, executor.SessionContext(known=known))
    assert calls(sim) == ["withdraw", "pause:keep"]
    assert await client.admitted() is False and await client.is_paused()


async def test_a_refused_reset_never_lets_the_sequence_resume(client: EngineClient, sim: SimulatedEngine) -> None:
    """Fail-closed in one request too: vLLM refuses a reset with 200 ``{"success": false}``, which ends the
    sequence (the call's ``expect``) before the resume; the engine stays paused and the step fails."""
    known = await paused_at_goal(client)
    refusal = FaultRule(step="reset_prefix_cache", kind=FaultKind.HTTP_ERROR, status=200, body={"success": False})
    sim.add_fault(refusal)
    sim.log.entries.clear()
    with pytest.raises(executor.StepError) as err:
        await executor.execute(client, Step.RESUME, goal(sleep_mode=False), FAST, executor.SessionContext(known=known))
    assert err.value.reason == "PrefixCacheNotReset"
    assert "resume" not in calls(sim) and (await client.observe()).paused
