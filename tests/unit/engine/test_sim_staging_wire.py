"""The operator's client side of staged updates: ``EngineClient.stage``/``unstage``/``load(staged=True)``
and the ``staged`` field of an observation, against a simulated engine made to answer what a broken,
older or tensor-parallel engine would (``http_error`` faults with a 200 and a crafted body).

Why strict: the operator compares staged digests on every pod before any pod pauses, and commits only
what every rank staged. A stage it cannot read must surface as a protocol error (another image), ranks
holding different stages as ``inconsistent`` (never commit), and absent fields of an older image as
"nothing staged", so a fleet of old images keeps rolling out from the files.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.adapters.engine import EngineClient, EnginePool
from rolloutfleet.adapters.engine_wire import (
    EngineProtocolError,
    EngineRPCError,
    LoadOutcomeUnknown,
    stage_of_ranks,
)
from rolloutfleet.api.engine import EngineFault, StagedTarget, StagePhase, StageState
from rolloutfleet.sim import FaultKind, FaultRule, SimulatedEngine

# None of these tests is about a timeout (conftest.py).
ROOMY_DEADLINES = True


D_V, D_D = "blake3:" + "1" * 64, "blake3:" + "2" * 64


def stage_wire(**over: Any) -> dict[str, Any]:
    """A well-formed ``StageState`` of the wire (worker_image/rolloutfleet_worker/payloads.py), staged."""
    base: dict[str, Any] = {
        "revision": 2,
        "phase": "staged",
        "verifier": {"path": "/w/v2", "digest": D_V, "bytes": 100, "tensors": 3, "committed": False},
        "draft": {"path": "/w/d2", "digest": D_D, "bytes": 20, "tensors": 2, "committed": False},
        "bytes_total": 120,
        "bytes_done": 120,
        "limit_bytes": None,
        "seconds": 1.5,
        "error": None,
    }
    return {**base, **over}


def answer(sim: SimulatedEngine, step: str, results: list[Any]) -> None:
    """The engine's next ``step`` answers 200 with these per-rank results."""
    sim.add_fault(FaultRule(step=step, kind=FaultKind.HTTP_ERROR, status=200, body={"results": results}))


async def state_results(client: EngineClient) -> list[dict[str, Any]]:
    """The simulated engine's real state results, to be altered."""
    return [dict(r) for r in await client.collective_rpc("rolloutfleet_state")]


# --- a stage answer --------------------------------------------------------------------------------------


async def test_a_well_formed_stage_answer_parses_to_the_api_value(client: EngineClient, sim: SimulatedEngine) -> None:
    answer(sim, "rolloutfleet_stage", [{"ok": True, "stage": stage_wire(limit_bytes=500), "rank": 0}])
    stage = await client.stage(2, "/w/v2", "/w/d2", 500)
    assert stage == StageState(
        revision=2,
        phase=StagePhase.STAGED,
        verifier=StagedTarget(path="/w/v2", digest=D_V, bytes=100, tensors=3, committed=False),
        draft=StagedTarget(path="/w/d2", digest=D_D, bytes=20, tensors=2, committed=False),
        bytes_total=120,
        bytes_done=120,
        limit_bytes=500,
        seconds=1.5,
    )
    sent = next(e for e in sim.log.entries if e["step"] == "rolloutfleet_stage")["args"]["kwargs"]
    assert sent == {"revision": 2, "verifier_path": "/w/v2", "draft_path": "/w/d2", "limit_bytes": 500}


def _without(key: str) -> dict[str, Any]:
    wire = stage_wire()
    del wire[key]
    return wire


def _verifier(**over: Any) -> dict[str, Any]:
    wire = stage_wire()
    wire["verifier"] = {**wire["verifier"], **over}
    return wire


MALFORMED_STAGES = {
    "no-stage": None,
    "not-an-object": "staged",
    "unknown-phase": stage_wire(phase="done"),
    "revision-a-string": stage_wire(revision="2"),
    "revision-a-bool": stage_wire(revision=True),
    "negative-bytes": stage_wire(bytes_total=-1),
    "no-bytes-done": _without("bytes_done"),
    "limit-a-float": stage_wire(limit_bytes=1.5),
    "seconds-a-string": stage_wire(seconds="1"),
    "error-a-string": stage_wire(phase="failed", error="io"),
    "verifier-not-an-object": stage_wire(verifier=["/w/v2"]),
    "verifier-without-path": _verifier(path=None),
    "digest-a-number": _verifier(digest=7),
    "committed-a-string": _verifier(committed="yes"),
    "staged-without-a-digest": _verifier(digest=None),
}


@pytest.mark.parametrize("stage", MALFORMED_STAGES.values(), ids=MALFORMED_STAGES.keys())
async def test_a_malformed_stage_answer_is_a_protocol_error(
    client: EngineClient, sim: SimulatedEngine, stage: Any
) -> None:
    result: dict[str, Any] = {"ok": True, "rank": 0}
    if stage is not None:
        result["stage"] = stage
    answer(sim, "rolloutfleet_stage", [result])
    with pytest.raises(EngineProtocolError):
        await client.stage(2, "/w/v2", "/w/d2")


async def test_a_refused_stage_raises_the_extensions_code(client: EngineClient, sim: SimulatedEngine) -> None:
    answer(sim, "rolloutfleet_stage", [{"ok": False, "error": {"code": "invalid_path", "message": "no such dir"}}])
    with pytest.raises(EngineRPCError) as err:
        await client.stage(2, "/w/v2")
    assert err.value.code == "invalid_path"


async def test_a_stage_is_retried_after_a_gateway_error(client: EngineClient, sim: SimulatedEngine) -> None:
    """Re-sending the same stage answers the held one: safe to retry, unlike a load."""
    sim.add_fault(FaultRule(step="rolloutfleet_stage", kind=FaultKind.HTTP_ERROR, status=503, body={}))
    stage = await client.stage(2, "/synthetic/v/2", "/synthetic/d/2")
    assert stage.revision == 2


async def test_a_stage_is_sent_while_a_loads_outcome_is_unknown_but_a_commit_is_not(
    client: EngineClient, pool: EnginePool, sim: SimulatedEngine
) -> None:
    """A stage changes no weight; a commit does, so it waits for the state read like every load."""
    pool.loads.mark(client.base_url)
    assert (await client.stage(2, "/synthetic/v/2")).revision == 2
    with pytest.raises(LoadOutcomeUnknown):
        await client.load("verifier", "/synthetic/v/2", 2, staged=True)
    assert not [e for e in sim.log.entries if e["step"] == "rolloutfleet_load"]


# --- unstage, load results ---------------------------------------------------------------------------------


async def test_unstage_sums_the_ranks_and_refuses_a_malformed_answer(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    answer(sim, "rolloutfleet_unstage", [{"ok": True, "released_bytes": 120}, {"ok": True, "released_bytes": 80}])
    assert await client.unstage() == 200
    for bad in ({"ok": True}, {"ok": True, "released_bytes": "120"}, {"ok": True, "released_bytes": -1}):
        answer(sim, "rolloutfleet_unstage", [bad])
        with pytest.raises(EngineProtocolError):
            await client.unstage()


async def test_load_sends_staged_only_when_true_and_reads_it_back(client: EngineClient, sim: SimulatedEngine) -> None:
    plain = await client.load("verifier", "/synthetic/v/2", 2)
    assert plain.staged is False
    assert "staged" not in sim.log.entries[-1]["args"]["kwargs"]  # an older image's method takes no such kwarg
    await client.stage(3, "/synthetic/v/3")
    for _ in range(1000):  # the simulated stage takes no time: staged after a few state reads
        stage = (await client.observe()).staged
        if stage is not None and stage.phase == StagePhase.STAGED:
            break
    committed = await client.load("verifier", "/synthetic/v/3", 3, staged=True)
    assert committed.staged is True
    assert sim.log.entries[-1]["args"]["kwargs"]["staged"] is True


@pytest.mark.parametrize("staged", ["yes", 1, None])
async def test_a_load_result_with_a_malformed_staged_flag_is_a_protocol_error(
    client: EngineClient, sim: SimulatedEngine, staged: object
) -> None:
    result = {
        "ok": True,
        "target": "verifier",
        "revision": 2,
        "path": "/w/v2",
        "digest": D_V,
        "bytes": 100,
        "seconds": 0.1,
        "tensors": 3,
        "skipped": [],
        "staged": staged,
    }
    answer(sim, "rolloutfleet_load", [result])
    with pytest.raises(EngineProtocolError):
        await client.load("verifier", "/w/v2", 2)


# --- the stage in an observation ----------------------------------------------------------------------------


async def test_a_malformed_stage_in_the_state_is_a_protocol_fault(client: EngineClient, sim: SimulatedEngine) -> None:
    results = await state_results(client)
    results[0]["staged"] = stage_wire(phase="done")
    answer(sim, "rolloutfleet_state", results)
    state = await client.observe()
    assert state.fault == EngineFault.PROTOCOL and not state.reachable, state.error


async def test_a_state_without_the_field_has_nothing_staged(client: EngineClient, sim: SimulatedEngine) -> None:
    """An image older than staging: its state has no ``staged`` at all, which is no protocol error."""
    results = await state_results(client)
    del results[0]["staged"]
    answer(sim, "rolloutfleet_state", results)
    state = await client.observe()
    assert state.reachable and state.staged is None


def _two_ranks(results: list[dict[str, Any]], first: Any, second: Any) -> list[dict[str, Any]]:
    return [{**results[0], "staged": first, "rank": 0}, {**results[0], "staged": second, "rank": 1}]


def _other_digest() -> dict[str, Any]:
    wire = stage_wire()
    wire["verifier"] = {**wire["verifier"], "digest": "blake3:" + "3" * 64}
    return wire


DISAGREEING = {
    "digests": (stage_wire(), _other_digest()),
    "revisions": (stage_wire(), stage_wire(revision=3)),
    "one-rank-has-none": (stage_wire(), None),
    "paths": (stage_wire(), stage_wire(draft=None, bytes_total=100, bytes_done=100)),
    "commits": (stage_wire(), _verifier(committed=True)),
}


@pytest.mark.parametrize("stages", DISAGREEING.values(), ids=DISAGREEING.keys())
async def test_ranks_holding_different_stages_are_an_inconsistent_fault(
    client: EngineClient, sim: SimulatedEngine, stages: tuple[Any, Any]
) -> None:
    """A commit would put different weights on different ranks: the engine must not be trusted."""
    answer(sim, "rolloutfleet_state", _two_ranks(await state_results(client), *stages))
    state = await client.observe()
    assert state.fault == EngineFault.INCONSISTENT and "stage" in (state.error or "")


async def test_ranks_at_different_progress_agree_on_the_slowest(client: EngineClient, sim: SimulatedEngine) -> None:
    """Each rank's readers run at their own pace: a rank still staging is no disagreement, and the engine
    is staged only once every rank is (a commit before would be refused on the slow rank)."""
    slow = stage_wire(phase="staging", bytes_done=60, seconds=2.0)
    slow["verifier"] = {**slow["verifier"], "digest": None}
    answer(sim, "rolloutfleet_state", _two_ranks(await state_results(client), stage_wire(), slow))
    stage = (await client.observe()).staged
    assert stage is not None and stage.phase == StagePhase.STAGING
    assert stage.verifier.digest is None  # not the engine's until every rank has it
    assert stage.draft is not None and stage.draft.digest == D_D  # both ranks have this one
    assert (stage.bytes_done, stage.seconds) == (60, 2.0)


def test_a_failed_rank_fails_the_engines_stage_with_its_error() -> None:
    failed = stage_wire(phase="failed", bytes_done=10, error={"code": "io", "message": "short read"})
    for target in ("verifier", "draft"):
        failed[target] = {**failed[target], "digest": None}
    stage = stage_of_ranks([stage_wire(), copy.deepcopy(failed)], url="http://engine", step="rolloutfleet_state")
    assert stage is not None and stage.phase == StagePhase.FAILED
    assert (stage.error_code, stage.error_message) == ("io", "short read")
    assert stage.verifier.digest is None
