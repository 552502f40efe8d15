"""The engine contract (DESIGN.md §4): every behaviour of vLLM + our extension that the operator relies on.

Written once, run against the simulator in CI and against real vLLM on the GPU (see conftest.py). A
difference between the two is a simulator bug. Assertions go through the operator's own client
(``rolloutfleet.adapters.engine``) except where the raw HTTP answer is the point (auth).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import time
from typing import Any

import aiohttp
import pytest
from contract_support import (
    ADMIT_PATH,
    READY_PATH,
    WITHDRAW_PATH,
    Target,
    call,
    complete,
    header_totals,
    metric_sum,
)

from rolloutfleet.adapters.engine import OBSERVE_CALL, EngineClient, preflight_calls
from rolloutfleet.adapters.engine_wire import Call, EngineRPCError, load_result_from_wire
from rolloutfleet.api import engine as api
from rolloutfleet_digest import digest_directory

pytestmark = pytest.mark.contract

CONTROL_ROUTES = [
    ("GET", "/is_paused"),
    ("GET", "/is_sleeping"),
    ("GET", "/weight_info"),
    ("POST", "/pause?mode=keep&clear_cache=false"),
    ("POST", "/resume"),
    ("POST", "/sleep?level=2"),
    ("POST", "/wake_up"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/update_weight_version"),
    ("POST", "/collective_rpc"),
]


async def load_pair(engine: EngineClient, verifier: str, draft: str, revision: int) -> None:
    await engine.load("verifier", verifier, revision)
    await engine.load("draft", draft, revision)


async def test_control_routes_require_the_bearer_token(target: Target, engine: EngineClient) -> None:
    async with aiohttp.ClientSession() as s:
        for method, route in CONTROL_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {target.token}"}):
                async with s.request(method, target.url + route, headers=headers, json={}) as resp:
                    assert resp.status == 401, (method, route, headers)
                    assert resp.headers.get("WWW-Authenticate") == "Bearer"
                    assert "error" in await resp.json()
    # Nothing above acted: the engine is neither paused nor asleep.
    assert not await engine.is_paused()
    assert not await engine.is_sleeping()


async def test_probe_metrics_and_generation_routes_are_open(target: Target) -> None:
    async with aiohttp.ClientSession() as s:
        for route in ("/health", "/metrics", "/v1/models"):
            async with s.get(target.url + route) as resp:
                assert resp.status == 200, route


async def test_extension_state_reports_both_models(target: Target, engine: EngineClient) -> None:
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    (state, *_) = await engine.extension_state()
    assert state["ok"] is True and state["resident"] is True
    assert isinstance(state["rank"], int)
    assert state["verifier"]["revision"] == 1 and state["verifier"]["path"] == target.weights.verifier_a
    assert state["draft"] is not None and state["draft"]["policy"] == "coUpdate"
    assert state["draft"]["revision"] == 1
    observed = await engine.observe()
    assert observed.reachable and observed.resident and observed.pair == (1, 1)
    assert observed.verifier.verified and observed.draft is not None and observed.draft.verified


async def test_digests_equal_the_publishers_digest_of_the_files(target: Target, engine: EngineClient) -> None:
    v = await engine.load("verifier", target.weights.verifier_b, 2)
    d = await engine.load("draft", target.weights.draft_b, 2)
    assert v.digest == digest_directory(target.weights.verifier_b)
    assert d.digest == digest_directory(target.weights.draft_b)
    assert v.digest.startswith("blake3:") and len(v.digest) == len("blake3:") + 64
    assert v.bytes > 0 and v.tensors > 0
    observed = await engine.observe()
    assert (observed.verifier.digest, observed.draft and observed.draft.digest) == (v.digest, d.digest)


async def test_draft_loads_only_after_the_verifier_holds_its_revision(target: Target, engine: EngineClient) -> None:
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    with pytest.raises(EngineRPCError) as err:
        await engine.load("draft", target.weights.draft_b, 2)
    assert err.value.code == "order"
    await engine.load("verifier", target.weights.verifier_b, 2)
    result = await engine.load("draft", target.weights.draft_b, 2)
    assert result.revision == 2 and (await engine.observe()).pair == (2, 2)


async def test_bad_loads_fail_with_the_extension_codes(target: Target, engine: EngineClient) -> None:
    cases = [
        ("verifier", "relative/path", "invalid_path"),
        ("verifier", target.weights.verifier_a + "/../verifier-a", "invalid_path"),
        ("verifier", "/nonexistent/rolloutfleet/checkpoint", "invalid_path"),
        ("embedding", target.weights.verifier_a, "invalid_target"),
    ]
    if target.weights.empty is not None:
        cases.append(("verifier", target.weights.empty, "io"))
    for tgt, path, code in cases:
        with pytest.raises(EngineRPCError) as err:
            await engine.load(tgt, path, 3)
        assert err.value.code == code, (tgt, path)


async def test_pause_modes_and_is_paused(target: Target, engine: EngineClient) -> None:
    for mode in ("keep", "wait", "abort"):
        await engine.pause(mode=mode, clear_cache=False)  # type: ignore[arg-type]
        assert await engine.is_paused()
        assert await engine.is_sleeping()  # vLLM reports a paused engine as sleeping
        await engine.health()  # /health ignores pause
        await engine.resume()
        assert not await engine.is_paused()
        assert not await engine.is_sleeping()


async def test_keep_mode_holds_requests_until_resume(target: Target, engine: EngineClient) -> None:
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    pending = asyncio.ensure_future(complete(target, max_tokens=8))
    await asyncio.sleep(0.3)
    assert not pending.done(), "a request was served while the engine was paused in keep mode"
    await engine.resume()
    status, body = await asyncio.wait_for(pending, 30)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 8


async def test_abort_mode_serves_nothing_while_paused(target: Target, engine: EngineClient) -> None:
    await engine.pause(mode="abort", clear_cache=False)
    pending = asyncio.ensure_future(complete(target, max_tokens=4))
    await asyncio.sleep(0.3)
    if pending.done():  # refused (DESIGN §4: 503), never served
        status, _ = pending.result()
        assert status == 503
    await engine.resume()
    if not pending.done():  # held by the scheduler instead: served only after resume
        status, _ = await asyncio.wait_for(pending, 30)
        assert status == 200


async def test_level2_sleep_discards_both_models(target: Target, engine: EngineClient) -> None:
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    await engine.sleep(2)
    assert await engine.is_sleeping()
    await engine.health()  # /health ignores sleep
    asleep = await engine.observe()
    assert not asleep.resident and asleep.pair == (None, None) and asleep.verifier.digest is None
    await engine.wake_up(["weights"])
    woken = await engine.observe()
    assert not woken.resident and woken.pair == (None, None), "weights came back without a reload"
    assert woken.sleeping
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    await engine.wake_up(["kv_cache"])
    await engine.resume()
    final = await engine.observe()
    assert final.resident and final.pair == (1, 1) and not final.sleeping and not final.paused


async def test_loading_into_sleeping_weights_fails_closed(target: Target, engine: EngineClient) -> None:
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    await engine.sleep(2)
    with pytest.raises(EngineRPCError) as err:
        await engine.load("verifier", target.weights.verifier_b, 2)
    assert err.value.code == "order"
    await engine.wake_up(["weights"])
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)


async def test_wake_without_reload_serves_garbage(target: Target, engine: EngineClient) -> None:
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    await engine.sleep(2)
    await engine.wake_up()
    await engine.resume()
    status, body = await complete(target, max_tokens=6, return_token_ids=True)
    assert status == 200 and body["choices"][0]["token_ids"] == [0] * 6  # measured on the H200
    assert not (await engine.observe()).resident  # only the extension tells
    await engine.pause(mode="keep", clear_cache=False)
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)


async def test_weight_version_is_set_read_and_stamped(target: Target, engine: EngineClient) -> None:
    if not (await engine.observe()).versioned:
        pytest.skip("this engine has no weight-version routes (vLLM 0.26: /weight_info answers 404)")
    await engine.update_weight_version("step-7")
    assert await engine.weight_info() == "step-7"
    status, body = await complete(target, max_tokens=3, return_weight_versions=True, return_token_ids=True)
    assert status == 200
    spans = body["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["step-7"] and spans[0]["start"] == 0 and spans[0]["end"] == 3
    _, plain = await complete(target, max_tokens=2)
    assert "weight_versions" not in plain["choices"][0]


async def test_reset_prefix_cache_succeeds_when_idle(engine: EngineClient) -> None:
    assert await engine.reset_prefix_cache()


LONG = 1000  # tokens: a generation still running when the test pauses the engine


async def until_a_request_runs(engine: EngineClient) -> None:
    """Until the scheduler runs a request, i.e. it holds KV blocks (an engine offers no event: poll)."""
    for _ in range(1000):
        if metric_sum(await engine.metrics(), "vllm:num_requests_running") >= 1:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("no request was ever scheduled")


async def test_held_blocks_refuse_a_plain_reset_and_preempting_them_resets(
    target: Target, engine: EngineClient
) -> None:
    """What the resume step relies on (vLLM 0.26 and 0.33, ``vllm/v1/core/sched/scheduler.py``): a request
    frozen by pause(keep) holds its KV blocks, so a plain reset answers ``{"success": false}``; with
    ``reset_running_requests=true`` vLLM preempts it first and the reset succeeds while the engine stays
    paused; after resume the request is recomputed and completes in full."""
    held = asyncio.ensure_future(complete(target, max_tokens=LONG))
    await until_a_request_runs(engine)
    await engine.pause(mode="keep", clear_cache=False)
    headers = {"Authorization": f"Bearer {target.token}"}
    async with aiohttp.ClientSession() as s, s.post(target.url + "/reset_prefix_cache", headers=headers) as resp:
        assert resp.status == 200
        assert await resp.json() == {"success": False}
    assert await engine.reset_prefix_cache(reset_running_requests=True) is True
    assert await engine.is_paused()  # the reset resumes nothing
    assert await engine.reset_prefix_cache() is True  # nothing is held any more
    await engine.resume()
    status, body = await asyncio.wait_for(held, 120)
    assert status == 200
    assert body["usage"]["completion_tokens"] == LONG and body["choices"][0]["finish_reason"] == "length"


async def test_full_sleep_mode_transaction(target: Target, engine: EngineClient) -> None:
    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    held = asyncio.ensure_future(complete(target, max_tokens=4))
    await engine.sleep(2)
    await engine.wake_up(["weights"])
    v = await engine.load("verifier", w.verifier_b, 2)
    d = await engine.load("draft", w.draft_b, 2)
    state = await engine.observe()
    assert (state.verifier.digest, state.draft and state.draft.digest) == (v.digest, d.digest)
    if state.versioned:  # vLLM 0.26 has no weight-version routes
        await engine.update_weight_version("2")
    await engine.wake_up(["kv_cache"])
    assert await engine.reset_prefix_cache()
    await engine.resume()
    final = await engine.observe()
    assert final.serving and final.resident and final.pair == (2, 2)
    assert final.weight_version == ("2" if state.versioned else None)
    status, body = await asyncio.wait_for(held, 30)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "abort", "stop")
    _, fresh = await complete(target, max_tokens=5, return_token_ids=True)
    assert any(t != 0 for t in fresh["choices"][0]["token_ids"])


async def test_stale_draft_collapses_spec_decode_acceptance(target: Target, engine: EngineClient) -> None:
    w = target.weights

    async def acceptance() -> float:
        before = await engine.metrics()
        await complete(target, max_tokens=32)
        after = await engine.metrics()
        drafted = metric_sum(after, "vllm:spec_decode_num_draft_tokens_total") - metric_sum(
            before, "vllm:spec_decode_num_draft_tokens_total"
        )
        accepted = metric_sum(after, "vllm:spec_decode_num_accepted_tokens_total") - metric_sum(
            before, "vllm:spec_decode_num_accepted_tokens_total"
        )
        assert drafted > 0
        return accepted / drafted

    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    assert await acceptance() > 0.5
    await engine.load("verifier", w.verifier_b, 2)  # draft left at revision 1: the stale-draft failure
    assert await acceptance() < 0.2
    await engine.load("draft", w.draft_b, 2)
    assert await acceptance() > 0.5


async def test_extension_reports_whether_weights_are_mapped(target: Target, engine: EngineClient) -> None:
    """The planner wakes weights only when they are unmapped: waking mapped ones is not harmless."""
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    assert (await engine.observe()).mapped is True
    await engine.sleep(2)
    asleep = await engine.observe()
    assert asleep.mapped is False and not asleep.resident
    await engine.wake_up(["weights"])
    woken = await engine.observe()
    assert woken.mapped is True and not woken.resident  # mapped, but the contents are gone until reloaded
    await load_pair(engine, target.weights.verifier_a, target.weights.draft_a, 1)


# --- admission: the readiness probe answers 200 only once the operator admitted this engine process -----
# (worker_image/README.md "Admission"). Every test that admits withdraws again, so the shared real engine
# starts each test un-admitted.


async def test_a_new_engine_is_not_ready_and_the_probe_needs_no_token(target: Target) -> None:
    for token in (None, "wrong", target.token):  # kubelet probes carry none; a token changes nothing
        status, _, text = await call(target, "GET", READY_PATH, token=token)
        assert status == 503 and _plain(json.loads(text)) == {"admitted": False}
    status, _, _ = await call(target, "GET", "/health")
    assert status == 200  # liveness and startup probes are unchanged


async def test_admission_changes_require_the_bearer_token(target: Target) -> None:
    for route in (ADMIT_PATH, WITHDRAW_PATH):
        for token in (None, "wrong"):
            status, headers, text = await call(target, "POST", route, token=token, json={"revision": 1})
            assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", (route, token)
            assert "error" in json.loads(text)
    status, _, _ = await call(target, "GET", READY_PATH)
    assert status == 503  # nothing above admitted the engine


async def test_admit_makes_the_engine_ready_and_withdraw_takes_it_back(target: Target) -> None:
    try:
        status, _, text = await call(target, "POST", ADMIT_PATH, token=target.token, json={"revision": 3})
        admitted = json.loads(text)
        assert status == 200 and admitted["admitted"] is True and admitted["revision"] == 3
        assert isinstance(admitted["since"], int | float) and abs(admitted["since"] - time.time()) < 300
        status, _, text = await call(target, "GET", READY_PATH)
        assert status == 200 and json.loads(text) == admitted
        assert target.token not in text
        status, _, text = await call(target, "POST", ADMIT_PATH, token=target.token, json={"revision": None})
        assert status == 200 and json.loads(text)["revision"] is None
    finally:
        status, _, text = await call(target, "POST", WITHDRAW_PATH, token=target.token)
    assert status == 200 and _plain(json.loads(text)) == {"admitted": False}
    status, _, text = await call(target, "GET", READY_PATH)
    assert status == 503 and _plain(json.loads(text)) == {"admitted": False}


def _plain(body: dict[str, object]) -> dict[str, object]:
    """An admission answer without the process's ``instance`` (checked on its own below)."""
    assert isinstance(body.pop("instance"), str)
    return body


async def test_an_admit_naming_another_process_is_refused(target: Target) -> None:
    # The operator reads the instance before the weights and names it in the admit: a process that came up
    # at the same address in between (on other weights) must refuse, or it would serve unverified weights.
    status, _, text = await call(target, "GET", READY_PATH)
    instance = json.loads(text)["instance"]
    status, _, text = await call(
        target, "POST", ADMIT_PATH, token=target.token, json={"revision": 1, "instance": "0" * 16}
    )
    assert status == 409 and json.loads(text)["error"]["type"] == "Conflict"
    status, _, _ = await call(target, "GET", READY_PATH)
    assert status == 503
    try:
        status, _, text = await call(
            target, "POST", ADMIT_PATH, token=target.token, json={"revision": 1, "instance": instance}
        )
        assert status == 200 and json.loads(text)["instance"] == instance
    finally:
        await call(target, "POST", WITHDRAW_PATH, token=target.token)


@pytest.mark.parametrize("body", [{}, {"revision": "3"}, {"revision": True}, {"revision": -1}, [3]])
async def test_admit_refuses_a_body_without_a_valid_revision(target: Target, body: object) -> None:
    status, _, text = await call(target, "POST", ADMIT_PATH, token=target.token, json=body)
    assert status == 400 and json.loads(text)["error"]["type"] == "BadRequestError"
    status, _, _ = await call(target, "GET", READY_PATH)
    assert status == 503


# --- pre-flight: rolloutfleet_preflight reads headers and sizes only and changes nothing ----------------
# (worker_image/README.md "RPCs"). The same codes as a load; no order or policy rule applies.


async def test_preflight_reports_the_checkpoints_tensors_and_bytes(target: Target, engine: EngineClient) -> None:
    w = target.weights
    for tgt, path in (("verifier", w.verifier_b), ("draft", w.draft_b)):
        result = await engine.preflight(tgt, path)
        assert result.target == tgt and result.path == path, (tgt, path)
        assert (result.tensors, result.bytes) == header_totals(path), (tgt, path)
    loaded = await engine.load("verifier", w.verifier_b, 2)
    assert loaded.tensors == (await engine.preflight("verifier", w.verifier_b)).tensors  # nothing skipped


async def test_preflight_changes_nothing_and_applies_no_order_rule(target: Target, engine: EngineClient) -> None:
    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    before = await engine.observe()
    # A draft of another revision than the verifier holds: a load would fail with ``order``, a check passes.
    await engine.preflight("draft", w.draft_b)
    await engine.preflight("verifier", w.verifier_b)
    with pytest.raises(EngineRPCError):
        await engine.preflight("verifier", "/nonexistent/rolloutfleet/checkpoint")
    assert await engine.observe() == before
    # Also while asleep: it reads files, never the model's (unmapped) memory.
    await engine.pause(mode="keep", clear_cache=False)
    await engine.sleep(2)
    asleep = await engine.observe()
    assert (await engine.preflight("verifier", w.verifier_b)).tensors > 0
    assert await engine.observe() == asleep
    await engine.wake_up(["weights"])
    await load_pair(engine, w.verifier_a, w.draft_a, 1)


def _half_of(checkpoint: str, directory: pathlib.Path) -> str:
    """A checkpoint with the first half of ``checkpoint``'s tensors: too few elements for its model.

    Written by the test (the engine shares this filesystem in both tiers): the GPU tier's draft is a copy of
    its verifier, so no checkpoint it ships is smaller than the verifier's parameters.
    """
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for shard in sorted(pathlib.Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())[: len(tensors) // 2]), str(directory / "model.safetensors"))
    return str(directory)


async def test_bad_preflights_fail_with_the_extension_codes(
    target: Target, engine: EngineClient, tmp_path: pathlib.Path
) -> None:
    w = target.weights
    cases = [
        ("verifier", "relative/path", "invalid_path"),
        ("verifier", w.verifier_a + "/../verifier-a", "invalid_path"),
        ("verifier", "/nonexistent/rolloutfleet/checkpoint", "invalid_path"),
        ("embedding", w.verifier_a, "invalid_target"),
        ("verifier", _half_of(w.verifier_a, tmp_path / "half-verifier"), "incomplete"),
    ]
    if w.empty is not None:
        cases.append(("verifier", w.empty, "io"))
    before = await engine.observe()
    for tgt, path, code in cases:
        with pytest.raises(EngineRPCError) as err:
            await engine.preflight(tgt, path)
        assert err.value.code == code, (tgt, path, err.value)
    assert await engine.observe() == before  # a refused pre-flight changes nothing either


# --- one observation request (issue 18): the image answers the operator's five reads in one body ------------

OBSERVE_PATH = "/rolloutfleet/observe"
OBSERVED_ROUTES = {"is_paused": "/is_paused", "is_sleeping": "/is_sleeping", "weight_info": "/weight_info"}


async def test_one_observation_answers_what_each_route_answers(target: Target, engine: EngineClient) -> None:
    """``GET /rolloutfleet/observe`` carries each route's own status and body (the middleware calls vLLM's
    routes in process), so the operator parses one request exactly as it parsed five. Compared on an
    engine that holds a pair and is paused, so no field is a default that would match by accident."""
    await load_pair(engine, target.weights.verifier_b, target.weights.draft_b, 2)
    await engine.pause(mode="keep")
    try:
        status, _, text = await call(target, "GET", OBSERVE_PATH, token=target.token)
        assert status == 200, text
        together = json.loads(text)
        for key, route in OBSERVED_ROUTES.items():
            alone_status, _, alone_text = await call(target, "GET", route, token=target.token)
            part = together["routes"][key]
            assert part["status"] == alone_status, (key, part, alone_text)
            if alone_status == 200:
                assert part["body"] == json.loads(alone_text), key
        assert together["routes"]["is_paused"]["body"] == {"is_paused": True}
        state = together["routes"]["state"]
        assert state["status"] == 200
        assert [r["verifier"]["digest"] for r in state["body"]["results"]] == [
            r["verifier"]["digest"] for r in await engine.extension_state()
        ]
        _, _, ready = await call(target, "GET", READY_PATH)
        assert together["admission"] == json.loads(ready)  # same process, same (un-admitted) answer
        observed = await engine.observe()
        assert observed.paused and observed.pair == (2, 2) and observed.instance == together["admission"]["instance"]
    finally:
        await engine.resume()


async def test_the_observation_needs_the_bearer_token(target: Target) -> None:
    for token in (None, "wrong"):
        status, headers, _ = await call(target, "GET", OBSERVE_PATH, token=token)
        assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", token


# --- a step's calls in one request (POST /rolloutfleet/sequence; rolloutfleet_worker.sequence) -----------

RESET = Call("/reset_prefix_cache", "reset_prefix_cache", query=(("reset_running_requests", "true"),))


RESUME = Call("/resume", "resume")


async def test_a_resume_sequence_runs_each_call_as_on_its_own(target: Target, engine: EngineClient) -> None:
    """The resume of issue 17 in one request: guarded by what the operator saw, then reset and resume."""
    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    known = await engine.observe()
    answer = await engine.sequence([RESET, RESUME], known=known)
    assert answer is not None, "the image has no /rolloutfleet/sequence"
    assert answer.held is None and len(answer.parts) == 2
    assert engine.part(answer, 0, RESET) == {"success": True}
    assert answer.instance == known.instance
    assert not await engine.is_paused()
    status, body = await complete(target, max_tokens=2)
    assert status == 200, body


async def test_the_sequence_guard_runs_nothing_on_weights_or_a_process_not_seen(
    target: Target, engine: EngineClient
) -> None:
    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    known = await engine.observe()
    other_bytes = dataclasses.replace(known, verifier=dataclasses.replace(known.verifier, digest="blake3:" + "0" * 64))
    for stale, held in ((other_bytes, "state"), (dataclasses.replace(known, instance="0" * 16), "instance")):
        answer = await engine.sequence([RESET, RESUME], known=stale)
        assert answer is not None and answer.held == held and answer.parts == (), held
        assert await engine.is_paused(), f"resumed although the guard ({held}) did not hold"
    await engine.resume()


async def test_a_failed_call_ends_the_sequence(target: Target, engine: EngineClient) -> None:
    """An extension error (an RPC answered 200 with ``ok: false``) stops what follows: nothing paused here."""
    bad = {
        "method": "rolloutfleet_load",
        "args": [],
        "kwargs": {"target": "verifier", "path": "relative", "revision": 3},
    }
    calls = [
        Call("/collective_rpc", "rolloutfleet_load:verifier", json=bad),
        Call("/pause", "pause", query=(("mode", "keep"),)),
    ]
    answer = await engine.sequence(calls)
    assert answer is not None and len(answer.parts) == 1
    with pytest.raises(EngineRPCError) as err:
        load_result_from_wire(engine.rpc_part(answer, 0, calls[0]), url=engine.base_url, step=calls[0].step)
    assert err.value.code == "invalid_path"
    assert not await engine.is_paused()


async def test_a_pause_sequence_withdraws_the_engine_first(target: Target, engine: EngineClient) -> None:
    """The pause of the transaction: the admission (ours, answered by the middleware) and vLLM's pause in
    one request; the readiness probe fails from the withdrawal on."""
    await engine.admit(None)
    withdraw = Call("/rolloutfleet/withdraw", "withdraw")
    pause = Call("/pause", "pause", query=(("mode", "keep"), ("clear_cache", "false")))
    answer = await engine.sequence([withdraw, pause])
    assert answer is not None and len(answer.parts) == 2
    assert engine.part(answer, 0, withdraw)["admitted"] is False
    assert await engine.admitted() is False and await engine.is_paused()
    await engine.resume()


async def test_a_call_whose_answer_does_not_hold_its_expectation_ends_the_sequence(
    target: Target, engine: EngineClient
) -> None:
    """vLLM refuses a prefix-cache reset with 200 ``{"success": false}``: the call's ``expect`` must end the
    sequence there, or the resume after it would run. Shown with a read whose answer is known: a running
    engine is not paused, so a pause after ``is_paused`` expected true never runs."""
    await engine.resume()
    probe = Call("/is_paused", "is_paused", method="GET", expect={"is_paused": True})
    calls = [probe, Call("/pause", "pause", query=(("mode", "keep"),))]
    answer = await engine.sequence(calls)
    assert answer is not None and len(answer.parts) == 1
    assert engine.part(answer, 0, probe) == {"is_paused": False}
    assert not await engine.is_paused()


async def test_both_pre_flights_in_one_request_each_answer_their_own(target: Target, engine: EngineClient) -> None:
    """The pre-flight of the verifier and the draft in one request (``stop: false``): a refused verifier does
    not hide the draft's answer, and each reads exactly as its own request would."""
    w = target.weights
    good = await engine.preflights([(api.Target.VERIFIER, w.verifier_b), (api.Target.DRAFT, w.draft_b)])
    alone = await engine.preflight(api.Target.VERIFIER, w.verifier_b)
    assert good[0] == alone and not isinstance(good[1], BaseException)
    mixed = await engine.preflights(
        [(api.Target.VERIFIER, "/nonexistent/rolloutfleet/x"), (api.Target.DRAFT, w.draft_b)]
    )
    assert isinstance(mixed[0], EngineRPCError) and mixed[0].code == "invalid_path"
    assert mixed[1] == good[1]


async def test_the_pre_flights_and_the_read_after_them_in_one_request(target: Target, engine: EngineClient) -> None:
    """A revision's pre-flight and its first read of the engine in one request (issue 18): the observation is
    the sequence's last call, read after the pre-flights, and the client makes of it exactly the state a read
    of its own makes (on a paused engine too, so that the read is not of a default); the pre-flights answer as
    on their own, a refused one included."""
    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.pause(mode="keep", clear_cache=False)
    checks = [(api.Target.VERIFIER, "/nonexistent/rolloutfleet/x"), (api.Target.DRAFT, w.draft_b)]
    alone = await engine.observe()
    answer = await engine.sequence([*preflight_calls(checks), OBSERVE_CALL], stop=False)
    assert answer is not None and [p["status"] for p in answer.parts] == [200, 200, 200]
    results, state = await engine.preflights_then_observe(checks)
    assert state == alone and state.paused
    assert isinstance(results[0], EngineRPCError) and results[0].code == "invalid_path"
    assert results[1] == (await engine.preflights(checks))[1]
    await engine.resume()


async def test_a_sleep_mode_pause_sleep_wake_and_load_in_one_request(target: Target, engine: EngineClient) -> None:
    """The operator's chain (``transaction.chain``, ``executor.execute_chain``): withdraw, pause, sleep(2),
    wake(weights), the verifier's load and the draft's in one request, each call answered and timed as on its
    own; then the guarded resume (which admits the process again) leaves the engine serving the new pair."""
    from rolloutfleet.api.fleet import StepTimeouts
    from rolloutfleet.planning import transaction
    from rolloutfleet.reconcile import executor

    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.admit(1)
    goal = transaction.Goal(revision=2, verifier_path=w.verifier_b, draft_path=w.draft_b, sleep_mode=True)
    known = await engine.observe()
    steps = transaction.chain(goal, known, transaction.Step.PAUSE)
    assert steps[-2:] == (transaction.Step.LOAD_VERIFIER, transaction.Step.LOAD_DRAFT), steps
    done = await executor.execute_chain(engine, steps, goal, StepTimeouts(), executor.SessionContext(known=known))
    assert [d.step for d in done] == list(steps)
    assert all(d.seconds is not None for d in done), "each call of the sequence carries its own seconds"
    assert [d.result.revision for d in done[-2:] if isinstance(d.result, api.LoadResult)] == [2, 2]
    state = await engine.observe()
    assert state.paused and state.admitted is False and state.pair == (2, 2) and state.resident
    known = state
    ctx = executor.SessionContext(known=known)
    _, resumed = await executor.execute(engine, transaction.Step.RESUME, goal, StepTimeouts(), ctx)
    # The guarded resume admits the withdrawn process last, in its own request.
    assert resumed == executor.Resumed(admitted=True)
    final = await engine.observe()
    assert final.serving and final.resident and final.pair == (2, 2) and final.admitted is True
    status, body = await complete(target, max_tokens=2)
    assert status == 200, body


async def test_a_rolling_update_resumes_in_its_loads_request_only_behind_a_state_check_every_rank_holds(
    target: Target, engine: EngineClient
) -> None:
    """A Rolling pod's whole update in one request (``transaction.chain(through_resume=True)``, issue 18): the
    chain, then ``rolloutfleet_state`` expecting the revision's digests (held by every rank's result), then the
    resume and the admission. With a digest the loaded bytes do not hash to, the check ends the sequence: the
    loads are answered, the engine stays paused and withdrawn, and nothing resumes on those weights."""
    from rolloutfleet.api.fleet import StepTimeouts
    from rolloutfleet.planning import transaction
    from rolloutfleet.reconcile import executor

    w = target.weights
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.admit(1)
    pinned = transaction.Goal(
        revision=2,
        verifier_path=w.verifier_b,
        draft_path=w.draft_b,
        sleep_mode=True,
        verifier_digest=digest_directory(w.verifier_b),
        draft_digest=digest_directory(w.draft_b),
    )
    known = await engine.observe()
    steps = transaction.chain(pinned, known, transaction.Step.PAUSE, through_resume=True)
    assert steps[-3:] == (transaction.Step.LOAD_VERIFIER, transaction.Step.LOAD_DRAFT, transaction.Step.RESUME)
    ctx = executor.SessionContext(known=known)
    done = await executor.execute_chain(engine, steps, pinned, StepTimeouts(), ctx)
    assert [d.step for d in done] == list(steps)
    assert done[-1].result == executor.Resumed(admitted=True)
    state = await engine.observe()
    assert state.serving and state.admitted is True and state.pair == (2, 2)
    status, body = await complete(target, max_tokens=2)
    assert status == 200, body

    wrong = dataclasses.replace(
        pinned, revision=3, verifier_path=w.verifier_a, draft_path=w.draft_a, verifier_digest="blake3:" + "0" * 64
    )
    steps = transaction.chain(wrong, state, transaction.Step.PAUSE, through_resume=True)
    done = await executor.execute_chain(engine, steps, wrong, StepTimeouts(), executor.SessionContext(known=state))
    assert [d.step for d in done] == list(steps[:-1])
    held = await engine.observe()
    assert held.paused and held.admitted is False and held.pair == (3, 3)
    assert engine.chains_resume  # refused by the check, not taken for an image without the rule
    await engine.resume()
