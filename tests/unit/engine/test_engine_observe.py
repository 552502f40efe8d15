"""``EngineClient.observe()`` says *why* an engine could not be observed, and per-call deadlines.

Each fault asks for different handling: a network blip passes, a refused token needs a human, a body
that breaks the contract means another image, an extension error carries its code, ranks that disagree
must never serve. So observe returns ``EngineState.failed(fault, error)`` for engine-side faults instead
of calling them all "unreachable", and lets a genuine programming error propagate.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator

import pytest
from engine_support import TOKEN, Latencies

from rolloutfleet.adapters import engine_wire
from rolloutfleet.adapters.engine import EngineClient, EnginePool
from rolloutfleet.adapters.engine_wire import EngineProtocolError, EngineTimeout
from rolloutfleet.api.engine import EngineFault, EngineState
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, SimulatedEngine


@pytest.fixture
async def patient(sim: SimulatedEngine) -> AsyncIterator[EngineClient]:
    """A client with the pool's default timeouts, for the tests that classify an answer (not the module
    fixture's 0.25 s, made for the timeout tests): on a loaded box the first read of a fresh pool took
    longer than 0.25 s (a garbage collection late in a long test session, say), the read then counted as
    unreachable, and the test failed for the box, not for the classification (seen twice: here and in
    ``test_a_reachable_engine_has_no_fault``)."""
    async with EnginePool(token=TOKEN) as pool:
        yield pool.client(sim.url)


async def test_refused_token_is_unauthorized(sim: SimulatedEngine) -> None:
    async with EnginePool(token="not-the-token") as other:
        state = await other.client(sim.url).observe()
    assert state == EngineState.failed(EngineFault.UNAUTHORIZED, state.error or "")
    assert not state.reachable and "401" in (state.error or "")
    assert "not-the-token" not in (state.error or "") and TOKEN not in (state.error or "")


@pytest.mark.parametrize("status", [403])
async def test_forbidden_is_unauthorized(patient: EngineClient, sim: SimulatedEngine, status: int) -> None:
    sim.add_fault(FaultRule(step="is_paused", kind=FaultKind.HTTP_ERROR, status=status, body={"error": "no"}))
    assert (await patient.observe()).fault == EngineFault.UNAUTHORIZED


@pytest.mark.parametrize(
    "fault",
    [
        FaultRule(step="is_paused", kind=FaultKind.HTTP_ERROR, status=200, body={"paused": "maybe"}),
        FaultRule(step="rolloutfleet_state", kind=FaultKind.HTTP_ERROR, status=200, body={"results": "nope"}),
        FaultRule(step="rolloutfleet_state", kind=FaultKind.HTTP_ERROR, status=200, body={"results": [{"ok": True}]}),
        # No extension in the image: vLLM's worker raises AttributeError, FastAPI answers a plain 500.
        FaultRule(step="rolloutfleet_state", kind=FaultKind.HTTP_ERROR, status=500, body="Internal Server Error"),
        FaultRule(step="is_sleeping", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}),
    ],
    ids=["bad-field", "results-not-a-list", "state-without-fields", "no-extension-500", "route-missing-404"],
)
async def test_an_answer_outside_the_contract_is_a_protocol_fault(
    patient: EngineClient, sim: SimulatedEngine, fault: FaultRule
) -> None:
    sim.add_fault(fault)
    state = await patient.observe()
    assert not state.reachable and state.fault == EngineFault.PROTOCOL and state.error, state.error


async def test_an_extension_error_is_an_extension_fault_with_its_code(
    patient: EngineClient, sim: SimulatedEngine
) -> None:
    body = {"results": [{"ok": False, "error": {"code": "state_unavailable", "message": "no model runner"}}]}
    sim.add_fault(FaultRule(step="rolloutfleet_state", kind=FaultKind.HTTP_ERROR, status=200, body=body))
    state = await patient.observe()
    assert state.fault == EngineFault.EXTENSION and "state_unavailable" in (state.error or "")


@pytest.mark.parametrize("spec", [EngineSpec(tp_size=2)])
async def test_disagreeing_ranks_are_an_inconsistent_fault(patient: EngineClient, sim: SimulatedEngine) -> None:
    sim.add_fault(FaultRule(step="rolloutfleet_state", kind=FaultKind.SPLIT_RANKS))
    state = await patient.observe()
    assert state.fault == EngineFault.INCONSISTENT and not state.reachable


async def test_no_connection_and_no_answer_are_unreachable(client: EngineClient, sim: SimulatedEngine) -> None:
    sim.add_fault(FaultRule(step="is_paused", kind=FaultKind.TIMEOUT, count=None))
    assert (await client.observe()).fault == EngineFault.UNREACHABLE
    await sim.stop()
    state = await client.observe()
    assert state.fault == EngineFault.UNREACHABLE and state == EngineState.unreachable(state.error or "")


async def test_a_reachable_engine_has_no_fault(patient: EngineClient) -> None:
    state = await patient.observe()
    assert state.reachable and state.fault is None


@pytest.mark.parametrize("route", ["one-request", "five-requests"])
async def test_a_programming_error_is_not_disguised_as_an_engine_fault(
    client: EngineClient, sim: SimulatedEngine, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A bug in the operator must surface as itself, not as an engine to wait for or to fail, whether the
    observation came in one request (``/rolloutfleet/observe``) or, from an image without it, in five."""

    def broken(*args: object, **kwargs: object) -> bool:
        raise TypeError("a bug")

    async def broken_read(*, deadline: float | None = None) -> bool:
        raise TypeError("a bug")

    if route == "one-request":
        monkeypatch.setattr(engine_wire, "states_from_wire", broken)
    else:
        sim.add_fault(FaultRule(step="observe", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}))
        monkeypatch.setattr(client, "is_sleeping", broken_read)
    with pytest.raises(TypeError):
        await client.observe()


# --- deadlines -----------------------------------------------------------------------------------------------


async def test_the_parity_probe_takes_its_deadline_from_the_caller(client: EngineClient, sim: SimulatedEngine) -> None:
    """The probe generates tokens: it gets the fleet's ``verifySeconds``, not the client's 0.25 s default."""
    sim.core.lat = dataclasses.replace(sim.core.lat, token_s=0.05)  # 8 tokens: 0.4 s
    with pytest.raises(EngineTimeout):
        await client.greedy_logprobs([1, 2, 3], 8)
    assert len(await client.greedy_logprobs([1, 2, 3], 8, deadline=5.0)) == 8


async def test_a_deadline_bounds_every_retry_of_a_read_together(pool: EnginePool, latencies: Latencies) -> None:
    """Retries of an idempotent read share one deadline: the first attempt that used it all is the last."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # the kernel accepts connections; nobody ever answers
        client = pool.client(f"http://127.0.0.1:{sock.getsockname()[1]}")
        with pytest.raises(EngineTimeout):
            await client.is_paused(deadline=0.3)
    assert [(step, outcome) for step, _s, outcome in latencies.calls] == [("is_paused", "timeout")]


async def test_a_reset_answer_without_success_is_not_a_reset(client: EngineClient, sim: SimulatedEngine) -> None:
    """vLLM 0.26 and 0.33 both answer ``{"success": bool}``; anything else cannot confirm the reset."""
    sim.add_fault(FaultRule(step="reset_prefix_cache", kind=FaultKind.HTTP_ERROR, status=200, body="", count=None))
    with pytest.raises(EngineProtocolError):
        await client.reset_prefix_cache()


# --- recheck: the read right before a resume ----------------------------------------------------------


async def test_recheck_reads_only_the_admission_and_the_extension_state(
    client: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a resume the operator has just set pause, sleep and version and seen them acknowledged; what
    can have changed is the weights (the extension's report) or the process (the admission's instance). Two
    requests instead of five per engine keep the fleet's resume from being one burst of reads."""
    known = await client.observe()
    assert known.instance is not None

    async def not_read(*_args: object, **_kwargs: object) -> object:
        raise AssertionError("recheck must not read this")

    for name in ("is_paused", "is_sleeping", "_weight_info_or_absent"):
        monkeypatch.setattr(client, name, not_read)
    stale = dataclasses.replace(known, verifier=dataclasses.replace(known.verifier, revision=99, digest=None))
    again = await client.recheck(stale)
    assert again == known  # the extension's report replaced the stale weights; the rest is what was known


async def test_recheck_of_another_process_is_a_full_observe(client: EngineClient) -> None:
    """A process other than the one observed (it restarted) makes everything known about it void."""
    known = await client.observe()
    other = dataclasses.replace(known, instance="a-process-that-is-gone", paused=True, sleeping=True)
    assert await client.recheck(other) == known
