"""The simulator's vLLM weight-transfer routes (``rolloutfleet.sim.transfer``): what DESIGN.md §4b records of
vLLM 0.26 (measured on the H200) and its source (0.26 and 0.33), down to the status codes and messages the
operator and the trainer meet. The extension's push RPCs are in ``test_sim_push.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from transfer_support import (
    AUTH,
    Checkpoints,
    complete,
    names_of,
    post,
    session,
    state,
    update_info,
    vllm_message,
)

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import EngineRPCError
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, SimulatedEngine, SimulatedFleet
from rolloutfleet.sim.config import weight_transfer_from_args
from rolloutfleet.sim.follower import engine_args, engine_spec_for

# None of these tests is about a timeout (conftest.py).
ROOMY_DEADLINES = True
T = TypeVar("T")
PREFIX = "Call to collective_rpc method failed: "
ROUTES = [
    ("/init_weight_transfer_engine", {"init_info": {}}),
    ("/start_weight_update", {}),
    ("/start_draft_weight_update", {}),
    ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}),
    ("/finish_weight_update", {}),
]


@pytest.fixture
def spec(ckpts: Checkpoints) -> EngineSpec:
    return EngineSpec(verifier_path=ckpts.verifier_a, draft_path=ckpts.draft_a, weight_transfer={"backend": "ipc"})


async def load_pair(client: EngineClient, ckpts: Checkpoints, revision: int = 1) -> None:
    await client.load("verifier", ckpts.verifier_a if revision == 1 else ckpts.verifier_b, revision)
    await client.load("draft", ckpts.draft_a if revision == 1 else ckpts.draft_b, revision)


async def acceptance(sim: SimulatedEngine) -> float:
    before = dict(sim.core.counters)
    status, _ = await complete(sim, max_tokens=8)
    assert status == 200
    drafted = sim.core.counters["draft_tokens"] - before["draft_tokens"]
    return (sim.core.counters["accepted"] - before["accepted"]) / drafted


# --- configuration -------------------------------------------------------------------------------------


async def test_without_the_flag_every_session_route_fails_in_the_worker(
    fleet: SimulatedFleet, spec: EngineSpec
) -> None:
    plain = await fleet.add("127.0.0.3", 0, spec=dataclasses.replace(spec, weight_transfer=None))
    for route, body in ROUTES:
        status, answer = await post(plain, route, body)
        assert status == 500, route
        assert vllm_message(answer) == PREFIX + (
            "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
        )
    assert plain.core.transfer.vllm is None and not plain.core.verifier.on_meta


async def test_several_workers_wrap_the_worker_message_as_the_multiprocessing_executor(
    fleet: SimulatedFleet, spec: EngineSpec
) -> None:
    tp = await fleet.add("127.0.0.4", 0, spec=dataclasses.replace(spec, tp_size=2))
    status, answer = await post(tp, "/finish_weight_update")
    assert status == 500
    assert vllm_message(answer) == (
        PREFIX + "Worker failed with error 'finish_weight_update called without a matching start_weight_update.', "
        "please check the stack trace above for the root cause"
    )


async def test_the_session_routes_need_the_token(sim: SimulatedEngine) -> None:
    async with aiohttp.ClientSession() as s:
        for route, body in ROUTES:
            async with s.post(sim.url + route, json=body) as r:
                assert r.status == 401, route
    assert not [e for e in sim.log.entries if e["step"] == "start_weight_update" and e.get("status") == 200]


def test_the_flag_reaches_the_simulator_from_the_command_line() -> None:
    assert weight_transfer_from_args(["--model", "m", "--weight-transfer-config", '{"backend":"ipc"}']) == {
        "backend": "ipc"
    }
    assert weight_transfer_from_args(['--weight-transfer-config={"backend": "nccl"}']) == {"backend": "nccl"}
    assert weight_transfer_from_args(["--weight-transfer-config", "{}"]) == {"backend": "nccl"}  # vLLM's default
    assert weight_transfer_from_args(["--model", "m"]) is None
    with pytest.raises(ValueError):
        weight_transfer_from_args(["--weight-transfer-config", '{"backend": "gloo"}'])
    assert EngineSpec.from_dict({"weight_transfer": {"backend": "ipc"}}).weight_transfer == {"backend": "ipc"}


def test_the_pod_follower_reads_the_flag_from_the_pod_or_the_fleet() -> None:
    fleet = {"spec": {"weightTransfer": {"backend": "nccl", "nccl": {"port": 29600}}}}
    assert engine_spec_for(fleet).weight_transfer == {"backend": "nccl"}
    assert engine_spec_for({"spec": {}}).weight_transfer is None
    container = {"name": "engine", "args": ["--weight-transfer-config", '{"backend":"ipc"}']}
    pod = {"spec": {"containers": [{"name": "sidecar"}, container]}}
    # The pod's own arguments win: a pod created before the fleet changed keeps the flags it started with.
    assert engine_spec_for(fleet, engine_args(pod)).weight_transfer == {"backend": "ipc"}
    assert engine_spec_for(fleet, []).weight_transfer is None
    assert engine_args({"spec": {"containers": []}}) is None


# --- init ----------------------------------------------------------------------------------------------


async def test_ipc_init_takes_an_empty_init_info(sim: SimulatedEngine) -> None:
    assert await post(sim, "/init_weight_transfer_engine", {"init_info": {}}) == (
        200,
        {"message": "Weight transfer initialized"},
    )
    status, answer = await post(sim, "/init_weight_transfer_engine", {"init_info": {"master_port": 1}})
    assert status == 500 and vllm_message(answer).startswith(PREFIX + "Invalid init_info")
    status, answer = await post(sim, "/init_weight_transfer_engine", {})
    assert status == 400 and "init_info" in answer["error"]["message"]  # 0.26's route check; 0.33's validation
    route = sim.url + "/init_weight_transfer_engine"
    async with aiohttp.ClientSession(headers=AUTH) as s, s.post(route, data="{") as r:
        assert r.status == 400 and (await r.json())["error"]["message"] == "Invalid JSON format"


async def test_nccl_needs_its_rendezvous_before_an_update(fleet: SimulatedFleet, spec: EngineSpec) -> None:
    nccl = await fleet.add("127.0.0.5", 0, spec=dataclasses.replace(spec, weight_transfer={"backend": "nccl"}))
    status, answer = await post(nccl, "/init_weight_transfer_engine", {"init_info": {"master_address": "h"}})
    assert status == 500 and "missing ['master_port', 'rank_offset', 'world_size']" in vllm_message(answer)
    # An update into a session without the group fails, and like every failed update it breaks the target.
    assert (await post(nccl, "/start_weight_update"))[0] == 200
    status, answer = await post(nccl, "/update_weights", {"update_info": update_info(spec.verifier_path)})
    assert status == 500 and "NCCL weight transfer not initialized" in vllm_message(answer)
    assert nccl.core.verifier.broken
    group = {"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 2}
    assert (await post(nccl, "/init_weight_transfer_engine", {"init_info": group}))[0] == 200
    assert nccl.core.transfer.initialized


# --- sessions ------------------------------------------------------------------------------------------


async def test_a_session_commits_what_was_sent_and_the_log_proves_the_order(
    sim: SimulatedEngine, client: EngineClient, ckpts: Checkpoints
) -> None:
    await load_pair(client, ckpts)
    _, before = await complete(sim)
    await client.pause("keep", clear_cache=False)
    assert await post(sim, "/start_weight_update") == (200, {"message": "Weight update started"})
    assert sim.core.verifier.on_meta  # vLLM's layerwise reload: no forward pass until the finish
    info = update_info(ckpts.verifier_b)
    assert await post(sim, "/update_weights", {"update_info": info}) == (200, {"message": "Weights updated"})
    assert await post(sim, "/finish_weight_update") == (200, {"message": "Weight update finished"})
    await client.resume()
    _, after = await complete(sim)
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert sim.core.pair()["verifier_content"] == "pushed"
    # A bare vLLM session changed the weights under the extension: it claims nothing for the verifier.
    assert (await state(sim))["verifier"] == {
        "revision": None,
        "digest": None,
        "path": None,
        "verified": False,
        "destroyed": False,
    }
    steps = [e["step"] for e in sim.log.entries if e.get("status") == 200]
    i = steps.index("start_weight_update")
    assert steps[i : i + 3] == ["start_weight_update", "update_weights", "finish_weight_update"]
    update = next(e for e in sim.log.entries if e["step"] == "update_weights")
    assert update["args"] == {"names": info["names"]} and update["result"] == {"bytes": 32 * 8 * 4 + 2 * 8 * 8 * 4}


async def test_misuse_answers_500_with_vllms_messages_and_keeps_the_open_session(
    sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    status, answer = await post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)})
    assert (status, vllm_message(answer)) == (500, PREFIX + "start_weight_update must be called before update_weights.")
    status, answer = await post(sim, "/finish_weight_update")
    assert vllm_message(answer) == PREFIX + "finish_weight_update called without a matching start_weight_update."
    assert (await post(sim, "/start_weight_update"))[0] == 200
    for route in ("/start_weight_update", "/start_draft_weight_update"):
        status, answer = await post(sim, route)
        assert status == 500
        assert vllm_message(answer) == PREFIX + (
            "start_weight_update called while a weight update is already active. Call finish_weight_update first."
        )
    assert (await post(sim, "/update_weights", {}))[0] == 400  # the route's own check: nothing reached the worker
    assert (await post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)}))[0] == 200
    assert (await post(sim, "/finish_weight_update"))[0] == 200
    assert sim.core.pair()["verifier_content"] == "pushed" and not sim.core.verifier.on_meta


async def test_a_draft_session_needs_a_draft_model(fleet: SimulatedFleet, spec: EngineSpec) -> None:
    solo = await fleet.add("127.0.0.6", 0, spec=dataclasses.replace(spec, draft_path=None))
    status, answer = await post(solo, "/start_draft_weight_update")
    assert status == 500
    assert vllm_message(answer) == PREFIX + "Draft model weight update requested, but no draft model is configured."
    assert (await post(solo, "/start_weight_update"))[0] == 200  # nothing was left open


async def test_an_empty_session_gives_every_layer_its_tensors_back(
    sim: SimulatedEngine, client: EngineClient, ckpts: Checkpoints
) -> None:
    await load_pair(client, ckpts)
    _, before = await complete(sim)
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert (await post(sim, "/finish_weight_update"))[0] == 200
    _, after = await complete(sim)
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert (await state(sim))["verifier"]["revision"] == 1  # nothing changed under the extension


async def test_no_forward_pass_while_parameters_are_on_meta(sim: SimulatedEngine) -> None:
    """vLLM's session start moves the target to meta: a forward pass there raises (the sim answers 500)."""
    assert (await post(sim, "/start_draft_weight_update"))[0] == 200
    status, body = await complete(sim)
    assert status == 500 and "meta device" in body["error"]["message"]
    assert (await post(sim, "/finish_weight_update"))[0] == 200
    assert (await complete(sim))[0] == 200


async def test_finish_takes_a_weight_version_on_0_33_only(fleet: SimulatedFleet, spec: EngineSpec) -> None:
    for version, expected in (("0.33", "step-9"), ("0.26", None)):
        engine = await fleet.add("127.0.0.7", 0, spec=dataclasses.replace(spec, vllm_version=version))
        assert (await post(engine, "/start_weight_update"))[0] == 200
        assert (await post(engine, "/finish_weight_update", {"weight_version": "step-9"}))[0] == 200
        assert engine.core.weight_version == expected, version
        await fleet.remove(engine.ip, engine.port)


async def test_update_info_may_be_one_per_rank_on_0_33_only(
    fleet: SimulatedFleet, spec: EngineSpec, ckpts: Checkpoints
) -> None:
    for version, expected in (("0.33", 200), ("0.26", 500)):
        engine = await fleet.add("127.0.0.8", 0, spec=dataclasses.replace(spec, vllm_version=version))
        info = [update_info(ckpts.verifier_b)]
        assert await session(engine, "/start_weight_update", info) == (200, expected, 200 if expected == 200 else 500)
        await fleet.remove(engine.ip, engine.port)


async def test_a_verifier_push_alone_leaves_the_draft_stale(
    sim: SimulatedEngine, client: EngineClient, ckpts: Checkpoints
) -> None:
    """Measured on the H200: acceptance 0.000 after the verifier session, 0.973 after the draft's."""
    await load_pair(client, ckpts)
    assert await acceptance(sim) > 0.9
    assert await session(sim, "/start_weight_update", update_info(ckpts.verifier_b)) == (200, 200, 200)
    assert await acceptance(sim) == 0.0
    assert await session(sim, "/start_draft_weight_update", update_info(ckpts.draft_b)) == (200, 200, 200)
    assert await acceptance(sim) > 0.9


# --- a failed update destroys its target ---------------------------------------------------------------


async def test_a_wrong_shape_destroys_the_draft_until_weights_wake(
    sim: SimulatedEngine, client: EngineClient, ckpts: Checkpoints
) -> None:
    """The H200 run, step by step (DESIGN.md §4b)."""
    await load_pair(client, ckpts)
    await client.pause("keep", clear_cache=False)
    assert (await post(sim, "/start_draft_weight_update"))[0] == 200
    layer = names_of(ckpts.draft_b)[-1]
    wrong = update_info(ckpts.draft_b, shapes={layer: [64]})  # the same bytes, declared flat
    status, answer = await post(sim, "/update_weights", {"update_info": wrong})
    # vLLM answers the worker's exception text (torch's, for a wrong shape: measured on 2026-12-01).
    assert status == 500 and "shape [64] into a parameter of [8, 8]" in vllm_message(answer)
    draft = (await state(sim))["draft"]
    assert draft["destroyed"] is True and draft["revision"] is None and draft["verified"] is False
    assert (await client.observe()).resident is False
    assert (await post(sim, "/finish_weight_update"))[0] == 500  # the failure ended the session
    assert (await post(sim, "/sleep?level=2"))[0] == 500
    with pytest.raises(EngineRPCError) as err:
        await client.load("draft", ckpts.draft_a, 1)
    assert err.value.code == "destroyed"
    await client.resume()
    assert (await complete(sim))[0] == 500  # no token from parameters on meta
    # A second draft session fails too: its update cannot load into parameters on meta.
    assert await session(sim, "/start_draft_weight_update", update_info(ckpts.draft_b)) == (200, 500, 500)
    assert (await post(sim, "/wake_up?tags=weights"))[0] == 200
    assert (await state(sim))["draft"]["destroyed"] is False  # a bare session: no verdict of the extension
    assert await session(sim, "/start_weight_update", update_info(ckpts.verifier_b)) == (200, 200, 200)
    assert await session(sim, "/start_draft_weight_update", update_info(ckpts.draft_b)) == (200, 200, 200)
    await load_pair(client, ckpts, revision=2)
    assert (await client.observe()).pair == (2, 2)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda info: {**info, "names": ["model.no_such.weight", *info["names"][1:]]}, "has no parameter"),
        (lambda info: {**info, "ipc_handles_pickled": "gASV"}, "the simulator cannot open CUDA IPC handles"),
        (lambda info: {**info, "dtype_names": ["float7"] * len(info["names"])}, "module 'torch' has no attribute"),
        (lambda info: {**info, "shapes": [[1], *info["shapes"][1:]]}, "the payload holds"),
        (lambda info: {**info, "extra": 1}, "Invalid update_info: missing [], unexpected ['extra']"),
        (lambda info: {**info, "names": info["names"][:1]}, "must be lists of one length"),
    ],
    ids=["unknown-name", "ipc-handles", "dtype", "payload-length", "unknown-key", "ragged"],
)
async def test_every_failed_update_destroys_its_target(
    sim: SimulatedEngine, ckpts: Checkpoints, mutate: Callable[[dict[str, Any]], dict[str, Any]], message: str
) -> None:
    assert (await post(sim, "/start_weight_update"))[0] == 200
    info = mutate(update_info(ckpts.verifier_b))
    status, answer = await post(sim, "/update_weights", {"update_info": info})
    assert status == 500
    text = vllm_message(answer)
    assert (text == "") if message == "" else (message in text and text.startswith(PREFIX)), text
    assert sim.core.verifier.broken and (await state(sim))["verifier"]["destroyed"] is True
    assert sim.core.transfer.vllm is None


# --- faults --------------------------------------------------------------------------------------------


async def test_a_hung_update_holds_the_engine_core_until_a_restart(sim: SimulatedEngine, ckpts: Checkpoints) -> None:
    """A dead NCCL peer: the update never returns, a client giving up frees nothing, and every utility call
    (the extension's RPCs included) queues behind it; only a new engine process ends it."""
    sim.add_fault(FaultRule(step="update_weights", kind=FaultKind.HANG))
    assert (await post(sim, "/start_weight_update"))[0] == 200
    with pytest.raises(asyncio.TimeoutError):
        await post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)}, timeout=0.3)
    with pytest.raises(asyncio.TimeoutError):
        await state_with_timeout(sim, 0.3)
    assert [e["fault"]["kind"] for e in sim.log.entries if e.get("fault")] == ["hang"]
    await sim.restart()
    fresh = await state(sim)
    assert fresh["session"] is None and fresh["verifier"]["destroyed"] is False
    assert sim.core.transfer.vllm is None


async def state_with_timeout(sim: SimulatedEngine, timeout: float) -> object:
    return await post(sim, "/collective_rpc", {"method": "rolloutfleet_state"}, timeout=timeout)


async def test_a_hang_that_ends_fails_the_update_and_later_calls_run_after_it(
    sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    sim.add_fault(FaultRule(step="update_weights", kind=FaultKind.HANG, delay=0.2))
    assert (await post(sim, "/start_weight_update"))[0] == 200
    order: list[str] = []

    async def tracked(name: str, call: Awaitable[T]) -> T:
        result = await call
        order.append(name)
        return result

    update = asyncio.ensure_future(
        tracked("update", post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)}))
    )
    await sim.core.until(lambda: any(e.get("fault") for e in sim.log.entries))
    status_read = asyncio.ensure_future(tracked("state", state(sim)))
    status, answer = await update
    await status_read
    assert order == ["update", "state"]  # the state read waited for the engine core
    assert (status, vllm_message(answer)) == (500, "")
    assert sim.core.verifier.broken


async def test_a_hung_init_blocks_then_fails_without_joining(sim: SimulatedEngine) -> None:
    """A peer missing from the group: vLLM's TCPStore gives up after its timeout (300 s; here ``delay``)."""
    sim.add_fault(FaultRule(step="init_weight_transfer_engine", kind=FaultKind.HANG, delay=0.05))
    status, answer = await post(sim, "/init_weight_transfer_engine", {"init_info": {}})
    assert status == 500 and "TCPStore" in vllm_message(answer)
    assert not sim.core.transfer.initialized
    assert (await post(sim, "/init_weight_transfer_engine", {"init_info": {}}))[0] == 200


async def test_http_error_faults_reach_the_session_routes(sim: SimulatedEngine) -> None:
    sim.add_fault(FaultRule(step="finish_weight_update", kind=FaultKind.HTTP_ERROR, status=503, body={"x": 1}))
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert await post(sim, "/finish_weight_update") == (503, {"x": 1})
    assert sim.core.transfer.vllm is not None  # "before": nothing acted
