"""The engine contract of vLLM's weight-transfer sessions (DESIGN.md §4b, docs/push.md): the simulator and a
real vLLM must answer alike.

What a push relies on, measured on vLLM 0.26 (H200, IPC backend) and read in its source: the routes fail
in the worker (HTTP 500 with a message) without ``--weight-transfer-config``; one session at a time, and
misuse (an update or finish without a session, a second start) answers 500 with a message while an open
session stays usable; a failed update destroys its target. Cases that send tensors need a sender: the
simulator's own transport, or CUDA IPC from this process when it shares the real engine's GPU
(``ROLLOUTFLEET_CONTRACT_SENDER=ipc``); elsewhere they skip. None of these cases runs a forward pass on a
destroyed target: real vLLM would raise inside its engine core, which would end the shared engine.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from contract_support import Sender, Target, call, metric_sum

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import EngineRPCError

pytestmark = pytest.mark.contract

SESSION_ROUTES = [
    ("/init_weight_transfer_engine", {"init_info": {}}),
    ("/start_weight_update", {}),
    ("/start_draft_weight_update", {}),
    ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}),
    ("/finish_weight_update", {}),
]


async def post(target: Target, route: str, body: object = None, *, url: str | None = None) -> tuple[int, Any]:
    """One control call: (status, JSON body or None)."""
    headers = {"Authorization": f"Bearer {target.token}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post((url or target.url) + route, headers=headers, json=body if body is not None else {}) as r,
    ):
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except ValueError:
            return r.status, text


def error_message(body: Any) -> str:
    """vLLM's error body: ``{"error": {"message", "type", "code"}}``."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    message = body["error"].get("message")
    assert isinstance(message, str), body
    return message


def needs_transfer(target: Target) -> None:
    if target.transfer is None:
        pytest.skip("this engine was started without --weight-transfer-config")


def needs_sender(target: Target) -> Sender:
    needs_transfer(target)
    if target.sender is None:
        pytest.skip("this process cannot send tensors to the engine (no simulator, no shared GPU)")
    return target.sender


async def push(target: Target, start: str, checkpoint: str, **kw: Any) -> tuple[int, int, int]:
    """One session: (start, update, finish) statuses."""
    assert target.sender is not None
    started, _ = await post(target, start)
    updated, _ = await post(target, "/update_weights", {"update_info": target.sender.update_info(checkpoint, **kw)})
    finished, _ = await post(target, "/finish_weight_update")
    return started, updated, finished


async def acceptance(target: Target, engine: EngineClient) -> float:
    before = await engine.metrics()
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 32, "temperature": 0.0}
    async with aiohttp.ClientSession() as s, s.post(target.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    after = await engine.metrics()
    names = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")
    drafted, accepted = (metric_sum(after, n) - metric_sum(before, n) for n in names)
    assert drafted > 0
    return accepted / drafted


async def test_session_routes_fail_without_a_transfer_config(target: Target) -> None:
    if target.plain_url is None:
        pytest.skip("no engine started without --weight-transfer-config")
    for route, body in SESSION_ROUTES:
        status, answer = await post(target, route, body, url=target.plain_url)
        assert status == 500, (route, answer)
        assert "Weight transfer not configured" in error_message(answer), route


async def test_session_routes_are_control_routes(target: Target) -> None:
    for route, body in SESSION_ROUTES:
        status, headers, _ = await call(target, "POST", route, token="wrong", json=body)
        assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", route


async def test_ipc_init_takes_an_empty_init_info(target: Target) -> None:
    needs_transfer(target)
    if target.transfer != "ipc":
        pytest.skip("the IPC backend's init")
    assert await post(target, "/init_weight_transfer_engine", {"init_info": {}}) == (
        200,
        {"message": "Weight transfer initialized"},
    )
    status, _ = await post(target, "/init_weight_transfer_engine", {})
    assert status == 400  # the route's own check: no init_info


async def test_session_misuse_answers_500_and_keeps_the_open_session(target: Target, engine: EngineClient) -> None:
    needs_transfer(target)
    w = target.weights
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    for route, body in SESSION_ROUTES[3:]:  # an update, a finish, without a session
        status, answer = await post(target, route, body)
        assert status == 500 and error_message(answer), route
    assert await post(target, "/start_weight_update") == (200, {"message": "Weight update started"})
    for route in ("/start_weight_update", "/start_draft_weight_update"):
        status, answer = await post(target, route)
        assert status == 500 and "already active" in error_message(answer), route
    status, _ = await post(target, "/update_weights", {})
    assert status == 400  # the route's own check: no update_info (the session is untouched)
    assert await post(target, "/finish_weight_update") == (200, {"message": "Weight update finished"})
    status, answer = await post(target, "/finish_weight_update")
    assert status == 500 and error_message(answer)
    assert await post(target, "/start_draft_weight_update") == (200, {"message": "Draft weight update started"})
    assert (await post(target, "/finish_weight_update"))[0] == 200
    # What nothing was sent into kept its tensors: the pair loads again and the engine serves.
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    await engine.resume()


async def test_an_open_session_stays_usable_after_a_refused_start(target: Target, engine: EngineClient) -> None:
    sender = needs_sender(target)
    w = target.weights
    await engine.pause(mode="keep", clear_cache=False)
    assert (await post(target, "/start_weight_update"))[0] == 200
    assert (await post(target, "/start_weight_update"))[0] == 500
    status, answer = await post(target, "/update_weights", {"update_info": sender.update_info(w.verifier_a)})
    assert (status, answer) == (200, {"message": "Weights updated"})
    assert (await post(target, "/finish_weight_update"))[0] == 200
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    await engine.resume()


async def test_a_verifier_push_alone_leaves_the_draft_stale(target: Target, engine: EngineClient) -> None:
    """Measured on the H200: acceptance 0.000 after the verifier session, 0.973 after the draft's."""
    needs_sender(target)
    w = target.weights
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    assert await acceptance(target, engine) > 0.5
    await engine.pause(mode="keep", clear_cache=False)
    assert await push(target, "/start_weight_update", w.verifier_b) == (200, 200, 200)
    await engine.resume()
    assert await acceptance(target, engine) < 0.2
    await engine.pause(mode="keep", clear_cache=False)
    assert await push(target, "/start_draft_weight_update", w.draft_b) == (200, 200, 200)
    await engine.resume()
    assert await acceptance(target, engine) > 0.5
    await engine.pause(mode="keep", clear_cache=False)
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    await engine.resume()


async def test_a_failed_update_destroys_its_target_until_weights_wake(target: Target, engine: EngineClient) -> None:
    """Measured on the H200 (vLLM 0.26): a wrong-shape tensor in a draft session → 500 (the worker's exception
    text, empty when it has none),
    the session is gone, a level-2 sleep answers 500 and a new draft session fails; after
    ``wake_up(tags=weights)`` fresh verifier and draft sessions succeed."""
    sender = needs_sender(target)
    w = target.weights
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    assert (await post(target, "/start_draft_weight_update"))[0] == 200
    # A tensor of two or more dimensions, sent flat: the same bytes, a shape vLLM cannot load. (The last
    # name of a real Llama checkpoint is model.norm.weight, 1-D already: flattening it changes nothing, and
    # vLLM rightly accepted it on the H200.)
    plain = sender.update_info(w.draft_b)
    layer = next(n for n, shape in zip(plain["names"], plain["shapes"], strict=True) if len(shape) >= 2)
    wrong = sender.update_info(w.draft_b, flatten=layer)
    status, answer = await post(target, "/update_weights", {"update_info": wrong})
    text = error_message(answer)
    assert status == 500 and (text == "" or text.startswith("Call to collective_rpc method failed")), text
    assert (await post(target, "/finish_weight_update"))[0] == 500  # the session ended with the failure
    assert (await post(target, "/sleep?level=2"))[0] == 500
    again = await push(target, "/start_draft_weight_update", w.draft_b)
    assert again[:2] != (200, 200), "a session into a destroyed draft succeeded"
    await engine.wake_up(["weights"])  # note: waking awake weights resumes the scheduler (vLLM 0.26)
    await engine.pause(mode="keep", clear_cache=False)
    assert await push(target, "/start_weight_update", w.verifier_b) == (200, 200, 200)
    assert await push(target, "/start_draft_weight_update", w.draft_b) == (200, 200, 200)
    await engine.load("verifier", w.verifier_a, 1)
    await engine.load("draft", w.draft_a, 1)
    await engine.resume()


async def test_the_extension_records_the_transfer_group_it_is_told(target: Target, engine: EngineClient) -> None:
    """NCCL groups (docs/push.md, "Transfer group"): once vLLM's init returned, the operator has the
    extension record the membership; ``rolloutfleet_state`` reports it from then on (the operator's own
    parser reads it) and a malformed one is refused without changing it. Needs no NCCL: the record is the
    extension's, so it holds on any engine running it (a new process reports none)."""
    before = await engine.observe()
    assert before.reachable and before.group is None
    await engine.push_group(3, 1, 2)
    after = await engine.observe()
    assert after.group is not None
    assert (after.group.epoch, after.group.rank_offset, after.group.world_size) == (3, 1, 2)
    with pytest.raises(EngineRPCError, match="invalid_group"):
        await engine.push_group(4, 2, 2)  # rank 2 is outside a group of 2
    assert (await engine.observe()).group == after.group
