"""The simulated engine's staged updates (``rolloutfleet.sim.staging``), beyond the shared contract suite.

``tests/contract/test_staging_contract.py`` pins what a real engine and the simulator both do; here is what
only the simulator can be made to do on demand, and what the operator's tests lean on: its fault hooks
(a stage whose reading fails, a commit the GPU check refuses), its call log (every stage finished before
the first pause), its latencies (a commit costs the commit's time, not a load's), a restarted engine
without its stage, an older image without staging, and tensor-parallel ranks.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import time
from collections.abc import AsyncIterator

import pytest
from engine_support import TOKEN
from transfer_support import Checkpoints

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import EngineHTTPError, EngineInconsistent, EngineRPCError
from rolloutfleet.api.engine import StagePhase, StageState
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, Latencies, SimulatedEngine, SimulatedFleet
from rolloutfleet_digest import digest_directory

# None of these tests is about a timeout (conftest.py).
ROOMY_DEADLINES = True

WAIT = 10.0  # seconds: bounds a hang; every stage here takes well under one


@pytest.fixture
def spec(ckpts: Checkpoints) -> EngineSpec:
    return EngineSpec(verifier_path=ckpts.verifier_a, draft_path=ckpts.draft_a)


@pytest.fixture
def sim_latencies() -> Latencies:
    return Latencies(stage_s=0.05)


@pytest.fixture
async def fleet(spec: EngineSpec, sim_latencies: Latencies) -> AsyncIterator[SimulatedFleet]:
    async with SimulatedFleet(token=TOKEN, spec=spec, latencies=sim_latencies) as f:
        yield f


async def settled(client: EngineClient) -> StageState:
    """The stage once it is no longer ``staging`` (polled with a deadline)."""
    end = time.monotonic() + WAIT
    while True:
        stage = await staged(client)
        assert stage is not None
        if stage.phase != StagePhase.STAGING:
            return stage
        assert time.monotonic() < end, f"still staging: {stage}"
        await asyncio.sleep(0.005)


async def staged(client: EngineClient) -> StageState | None:
    """The engine's stage, observed. The conftest client's 0.25 s deadlines can expire on a loaded test
    machine, and a failed observation says nothing about the stage: these reads get a longer one."""
    state = await client.observe(deadline=WAIT)
    assert state.reachable, state.error
    return state.staged


async def staged_pair(client: EngineClient, ckpts: Checkpoints) -> StageState:
    """Revision 1 loaded from its files, revision 2 staged."""
    await client.load("verifier", ckpts.verifier_a, 1)
    await client.load("draft", ckpts.draft_a, 1)
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    stage = await settled(client)
    assert stage.phase == StagePhase.STAGED
    return stage


def steps(sim: SimulatedEngine, prefix: str = "stage_") -> list[dict[str, object]]:
    return [e for e in sim.log.entries if str(e["step"]).startswith(prefix)]


# --- the stage runs beside serving and the RPCs --------------------------------------------------------


@pytest.mark.parametrize("sim_latencies", [Latencies(stage_s=3.0)])
async def test_a_long_stage_holds_no_rpc_lock_and_no_scheduler(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """vLLM runs RPCs one at a time between scheduler steps: a stage that held either for its whole
    reading would pause serving, the very thing staging exists to avoid."""
    started = time.monotonic()
    answer = await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    assert answer.phase == StagePhase.STAGING
    # A state read, a load and a completion all go through while the 3 s stage is still filling.
    assert (await staged(client)) is not None
    await client.load("verifier", ckpts.verifier_a, 1)
    out = await sim.core.complete([1, 2, 3], 4)
    assert len(out["tokens"]) == 4
    assert time.monotonic() - started < 2.0
    staging = await staged(client)
    assert staging is not None and staging.phase == StagePhase.STAGING
    assert 0 < staging.bytes_done < staging.bytes_total  # progress in simulated time


async def test_the_call_log_shows_every_stage_finished_before_the_first_pause(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    stage = await staged_pair(client, ckpts)
    await client.pause("keep")
    await client.load("verifier", ckpts.verifier_b, 2, staged=True)
    await client.load("draft", ckpts.draft_b, 2, staged=True)
    log = sim.log.entries
    started, finished = (next(e for e in log if e["step"] == s) for s in ("stage_started", "stage_finished"))
    pause = next(e for e in log if e["step"] == "pause")
    assert started["t"] <= finished["t"] <= pause["t"]
    assert finished["phase"] == "staged"
    assert finished["digests"] == {"verifier": stage.verifier.digest, "draft": stage.draft and stage.draft.digest}
    assert [(e["step"], e.get("target"), e.get("reason")) for e in steps(sim)[2:]] == [
        ("stage_committed", "verifier", None),
        ("stage_committed", "draft", None),
        ("stage_released", None, "committed"),
    ]
    assert all(e["t"] >= pause["t"] for e in steps(sim)[2:])


# --- idempotence, replacement, release -----------------------------------------------------------------


@pytest.mark.parametrize("sim_latencies", [Latencies(stage_s=0.3)])
async def test_restaging_while_staging_keeps_the_running_stage(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    first = await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    again = await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    assert again.phase == StagePhase.STAGING and again.seconds >= first.seconds
    assert [e["step"] for e in steps(sim)] == ["stage_started"]  # one reader, not restarted
    await client.stage(2, ckpts.verifier_b, None)  # another draft path: replaced
    assert [(e["step"], e.get("reason")) for e in steps(sim)] == [
        ("stage_started", None),
        ("stage_released", "replaced"),
        ("stage_started", None),
    ]
    stage = await settled(client)
    assert stage.draft is None and stage.bytes_total == stage.verifier.bytes


@pytest.mark.parametrize("spec", [EngineSpec(verifier_path="/synthetic/v/1", draft_path=None)])
async def test_an_engine_without_a_draft_stages_the_verifier_only(client: EngineClient, sim: SimulatedEngine) -> None:
    with pytest.raises(EngineRPCError) as err:
        await client.stage(2, "/synthetic/v/2", "/synthetic/d/2")
    assert err.value.code == "no_draft"
    await client.stage(2, "/synthetic/v/2")
    stage = await settled(client)
    assert stage.verifier.bytes == sim.weights.verifier_bytes and stage.verifier.tensors == sim.weights.tensors
    loaded = await client.load("verifier", "/synthetic/v/2", 2, staged=True)
    assert loaded.staged and loaded.digest == stage.verifier.digest
    assert (await staged(client)) is None  # the verifier was the stage's last target


@pytest.mark.parametrize("sim_latencies", [Latencies(stage_s=0.0, stage_bytes_per_s=64 * 2**30)])
async def test_synthetic_checkpoints_stage_in_their_configured_time(client: EngineClient, sim: SimulatedEngine) -> None:
    """Benchmarks of many engines stage synthetic paths: never read, sized by ``WeightsConfig``."""
    started = time.monotonic()
    await client.stage(2, "/synthetic/v/2", "/synthetic/d/2")
    stage = await settled(client)
    took = time.monotonic() - started
    total = sim.weights.verifier_bytes + sim.weights.draft_bytes
    assert stage.bytes_total == total and stage.phase == StagePhase.STAGED
    assert total / (64 * 2**30) <= took < 5.0
    assert stage.verifier.digest is not None and stage.verifier.digest.startswith("blake3:")


# --- failures, and the fault hooks ----------------------------------------------------------------------


@pytest.mark.parametrize("sim_latencies", [Latencies(stage_s=0.2)])
async def test_the_fail_stage_fault_fails_the_reading_with_io(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    sim.add_fault(FaultRule(step="rolloutfleet_stage", kind=FaultKind.FAIL_STAGE))
    answer = await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    assert answer.phase == StagePhase.STAGING  # the answer is as usual: the readers fail later
    stage = await settled(client)
    assert stage.phase == StagePhase.FAILED and stage.error_code == "io" and stage.verifier.digest is None
    assert 0 < stage.bytes_done < stage.bytes_total  # it failed half way
    with pytest.raises(EngineRPCError) as err:
        await client.load("verifier", ckpts.verifier_b, 2, staged=True)
    assert err.value.code == "not_staged"
    # The fault fired once: the next stage of the same revision (a failed one is replaced) succeeds.
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    assert (await settled(client)).phase == StagePhase.STAGED


@pytest.mark.parametrize("sim_latencies", [Latencies(stage_s=0.3)])
async def test_a_file_that_vanishes_while_staging_fails_the_stage(
    client: EngineClient, ckpts: Checkpoints, tmp_path: pathlib.Path
) -> None:
    doomed = shutil.copytree(ckpts.verifier_b, tmp_path / "doomed")
    await client.stage(2, str(doomed), ckpts.draft_b)
    shutil.rmtree(doomed)
    stage = await settled(client)
    assert stage.phase == StagePhase.FAILED and stage.error_code == "io"
    assert await client.unstage() == 0  # a failed stage holds nothing


async def test_a_corrupt_commit_is_a_staged_mismatch_that_fails_the_stage(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """The GPU-side hash caught bytes that changed in host memory: neither the target nor the rest of the
    stage can be trusted, so the target stays unknown and the stage fails (as the extension does)."""
    stage = await staged_pair(client, ckpts)
    sim.add_fault(FaultRule(step="rolloutfleet_load:staged", kind=FaultKind.CORRUPT_LOAD))
    await client.pause("keep")
    with pytest.raises(EngineRPCError) as err:
        await client.load("verifier", ckpts.verifier_b, 2, staged=True)
    assert err.value.code == "staged_mismatch"
    state = await client.observe(deadline=WAIT)
    assert state.verifier.digest is None and not state.verifier.verified  # fail closed: nothing claimed
    assert sim.core.verifier.content is not None and sim.core.verifier.content[0] == "corrupt"
    failed = state.staged
    assert failed is not None and failed.phase == StagePhase.FAILED and failed.error_code == "staged_mismatch"
    assert await client.unstage() == 0  # its memory went with the failure
    # A fresh stage of the same revision commits (the fault fired once).
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    assert (await settled(client)).verifier.digest == stage.verifier.digest
    retried = await client.load("verifier", ckpts.verifier_b, 2, staged=True)
    assert retried.digest == stage.verifier.digest
    assert [e["step"] for e in steps(sim)][2:4] == ["stage_mismatch", "stage_released"]


async def test_the_staged_fault_key_leaves_loads_from_files_alone(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    sim.add_fault(FaultRule(step="rolloutfleet_load:staged", kind=FaultKind.CORRUPT_LOAD, count=None))
    loaded = await client.load("verifier", ckpts.verifier_b, 2)
    assert loaded.digest == digest_directory(ckpts.verifier_b) and not loaded.staged


async def test_a_commit_copies_the_staged_bytes_not_the_files(
    client: EngineClient, ckpts: Checkpoints, tmp_path: pathlib.Path
) -> None:
    """What was checked before the pause is what the pause commits, even if the files changed since; the
    directory must still be there, though (the extension checks a commit's path as a load's)."""
    copy = str(shutil.copytree(ckpts.verifier_b, tmp_path / "rewritten"))
    await client.load("verifier", ckpts.verifier_a, 1)
    await client.stage(2, copy)
    stage = await settled(client)
    shutil.rmtree(copy)
    with pytest.raises(EngineRPCError) as err:
        await client.load("verifier", copy, 2, staged=True)
    assert err.value.code == "invalid_path"
    assert await staged(client) == stage  # a refused commit changes nothing
    shutil.copytree(ckpts.verifier_a, copy)  # back, with other bytes than were staged
    assert digest_directory(copy) != stage.verifier.digest
    loaded = await client.load("verifier", copy, 2, staged=True)
    assert loaded.staged and loaded.digest == stage.verifier.digest == digest_directory(ckpts.verifier_b)


@pytest.mark.parametrize(
    "sim_latencies", [Latencies(steps={"rolloutfleet_load": 2.0}, load_bytes_per_s=1.0, commit_s=0.2)]
)
async def test_a_commit_costs_the_commit_latency_instead_of_the_loads(client: EngineClient, ckpts: Checkpoints) -> None:
    await client.stage(2, ckpts.verifier_b)
    await settled(client)
    started = time.monotonic()
    await client.load("verifier", ckpts.verifier_b, 2, staged=True, deadline=5.0)
    assert 0.2 <= time.monotonic() - started < 1.5  # a load would take 2 s + 40 KB at 1 B/s


async def test_a_restarted_engine_has_no_stage(client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints) -> None:
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    await settled(client)
    await sim.restart()
    assert (await staged(client)) is None
    with pytest.raises(EngineRPCError) as err:
        await client.load("verifier", ckpts.verifier_b, 2, staged=True)
    assert err.value.code == "not_staged"


@pytest.mark.parametrize("sim_latencies", [Latencies(stage_s=30.0)])
async def test_a_restart_while_staging_ends_the_reader(
    client: EngineClient, sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    """The reader is part of the process: it must not finish into the next one's log or state."""
    old = sim.core
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    assert old.staging.stage is not None and old.staging.stage.task is not None
    reader = old.staging.stage.task
    await sim.restart()
    await asyncio.wait({reader}, timeout=WAIT)
    assert reader.cancelled()
    assert (await staged(client)) is None
    assert "stage_finished" not in [e["step"] for e in steps(sim)]


# --- an older image, tensor-parallel ranks ---------------------------------------------------------------


@pytest.mark.parametrize("spec", [EngineSpec(staging=False)])
async def test_an_older_image_without_staging(client: EngineClient, sim: SimulatedEngine) -> None:
    """The operator must keep working with images that predate staging: no ``staged`` in their state or
    load results, and the stage RPCs fail like any method the worker lacks."""
    state = await client.observe(deadline=WAIT)
    assert state.reachable and state.staged is None
    loaded = await client.load("verifier", "/synthetic/v/2", 2)
    assert not loaded.staged
    assert "staged" not in sim.log.entries[-1]["args"]["kwargs"]  # a plain load does not send it
    for call in (client.stage(2, "/synthetic/v/2"), client.load("verifier", "/synthetic/v/2", 2, staged=True)):
        with pytest.raises(EngineHTTPError) as err:
            await call
        assert err.value.status == 500


@pytest.mark.parametrize("spec", [EngineSpec(tp_size=2)])
async def test_ranks_agree_and_release_together(client: EngineClient, sim: SimulatedEngine) -> None:
    answer = await client.stage(2, "/synthetic/v/2", "/synthetic/d/2")
    stage = await settled(client)
    assert stage.revision == answer.revision == 2
    assert await client.unstage() == 2 * stage.bytes_total  # each rank released its area
    sim.add_fault(FaultRule(step="rolloutfleet_stage", kind=FaultKind.SPLIT_RANKS))
    with pytest.raises(EngineInconsistent):
        await client.stage(2, "/synthetic/v/2", "/synthetic/d/2")


async def test_a_malformed_limit_is_refused_and_keeps_the_stage(client: EngineClient, ckpts: Checkpoints) -> None:
    await client.stage(2, ckpts.verifier_b, ckpts.draft_b)
    held = await settled(client)
    for limit in (-1, True, "1"):
        results = await client.collective_rpc(
            "rolloutfleet_stage", kwargs={"revision": 3, "verifier_path": ckpts.verifier_a, "limit_bytes": limit}
        )
        assert results[0]["ok"] is False and results[0]["error"]["code"] == "internal", limit
    assert (await staged(client)) == held
