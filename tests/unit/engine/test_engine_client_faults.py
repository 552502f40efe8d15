"""Every fault type at every step of the sleep-mode transaction, through the client: typed errors.

Each test runs the transaction on a fresh simulated engine with one fault armed on one step; the steps
before it must succeed and the faulted step must end the way the operator expects (DESIGN.md §4).
"""

from __future__ import annotations

import pytest
from engine_support import TRANSACTION, Latencies

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import EngineHTTPError, EngineTimeout, EngineUnreachable
from rolloutfleet.sim import FaultKind, FaultRule, SimulatedEngine

STEP_KEYS = [key for key, _ in TRANSACTION]


async def run_until(client: EngineClient, key: str) -> object:
    """Run the transaction's steps before ``key`` (they must succeed), then return ``key``'s result."""
    for step_key, call in TRANSACTION:
        if step_key == key:
            return await call(client)
        await call(client)
    raise AssertionError(key)


@pytest.mark.parametrize("key", STEP_KEYS)
async def test_http_error_is_typed_and_carries_vllms_body(client: EngineClient, sim: SimulatedEngine, key: str) -> None:
    body = {"error": {"message": "simulated failure", "type": "InternalServerError", "code": 500}}
    sim.add_fault(FaultRule(step=key, kind=FaultKind.HTTP_ERROR, status=500, body=body))
    with pytest.raises(EngineHTTPError) as err:
        await run_until(client, key)
    assert err.value.status == 500 and err.value.body == body and err.value.step.startswith(key.split(":")[0])
    fired = [e for e in sim.log.entries if "fault" in e]
    assert len(fired) == 1  # a 500 is not retried, not even for an idempotent read


@pytest.mark.parametrize("key", STEP_KEYS)
async def test_timeout_is_typed(client: EngineClient, sim: SimulatedEngine, key: str) -> None:
    """A call that outlives its deadline is an ``EngineTimeout``, idempotent or not: the deadline is the
    caller's budget for the call with all its retries, so a hung attempt leaves no time for another."""
    sim.add_fault(FaultRule(step=key, kind=FaultKind.TIMEOUT))
    with pytest.raises(EngineTimeout):
        await run_until(client, key)
    assert sum(1 for e in sim.log.entries if "fault" in e) == 1


@pytest.mark.parametrize("key", STEP_KEYS)
async def test_crash_is_unreachable_and_observe_says_so(client: EngineClient, sim: SimulatedEngine, key: str) -> None:
    sim.add_fault(FaultRule(step=key, kind=FaultKind.CRASH))
    with pytest.raises(EngineUnreachable):
        await run_until(client, key)
    assert not sim.running
    state = await client.observe()
    assert not state.reachable and state.error
    await sim.restart()  # a restarted container: fresh state, same call log
    fresh = await client.observe()
    assert fresh.reachable and not fresh.paused and fresh.pair == (None, None)
    assert [e["step"] for e in sim.log.entries if e["step"] in ("crash", "restart")] == ["crash", "restart"]


@pytest.mark.parametrize("key", STEP_KEYS)
async def test_slow_step_succeeds_and_latency_is_reported(
    client: EngineClient, sim: SimulatedEngine, latencies: Latencies, key: str
) -> None:
    sim.add_fault(FaultRule(step=key, kind=FaultKind.SLOW, delay=0.1))
    await run_until(client, key)
    # The delayed call succeeded and its latency shows the delay. (Not "the only call of 0.1 s or more": on a
    # loaded box another call of the run took that long too, and the test failed for the box, not the client.)
    slow = [s for s, secs, outcome in latencies.calls if secs >= 0.1 and outcome == "ok"]
    assert key.split(":")[0] in [s.split(":")[0] for s in slow], latencies.calls


@pytest.mark.parametrize("target", ["verifier", "draft"])
async def test_corrupt_load_reports_a_wrong_digest(client: EngineClient, sim: SimulatedEngine, target: str) -> None:
    from rolloutfleet.sim.weights import synthetic_digest

    sim.add_fault(FaultRule(step=f"rolloutfleet_load:{target}", kind=FaultKind.CORRUPT_LOAD))
    result = await run_until(client, f"rolloutfleet_load:{target}")
    expected = synthetic_digest("/synthetic/v/2" if target == "verifier" else "/synthetic/d/2")
    assert result.digest != expected  # type: ignore[attr-defined]
    state = await client.observe()
    reported = state.verifier if target == "verifier" else state.draft
    assert reported is not None and reported.digest == result.digest  # type: ignore[attr-defined]


async def test_a_failed_answer_after_acting_is_only_seen_by_observe(client: EngineClient, sim: SimulatedEngine) -> None:
    """phase=after: the engine paused but the answer was lost; only a fresh observe tells."""
    sim.add_fault(FaultRule(step="pause", kind=FaultKind.HTTP_ERROR, status=502, body="bad gateway", phase="after"))
    with pytest.raises(EngineHTTPError) as err:
        await client.pause("keep")
    assert err.value.status == 502 and err.value.body == "bad gateway"
    assert (await client.observe()).paused


async def test_full_transaction_without_faults(client: EngineClient, sim: SimulatedEngine) -> None:
    for _, call in TRANSACTION:
        await call(client)
    state = await client.observe()
    assert state.serving and state.pair == (2, 2) and state.weight_version == "2" and state.resident
    steps = [e["step"] for e in sim.log.entries if "status" in e]
    assert steps == [
        "pause",
        "sleep",
        "wake_up",
        "rolloutfleet_load",
        "rolloutfleet_load",
        "update_weight_version",
        "wake_up",
        "reset_prefix_cache",
        "resume",
    ]
