"""The engine client's policies against a simulated engine over real HTTP on loopback.

Retries only for idempotent calls, typed errors for each failure class, TP-rank agreement, the
``reset_prefix_cache`` loop, 0.26's empty bodies, and the token never leaking into logs or errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import aiohttp
import pytest
from engine_support import D1, D2, TOKEN, V1, V2, Latencies

from rolloutfleet.adapters.engine import EngineClient, EnginePool
from rolloutfleet.adapters.engine_wire import (
    EngineError,
    EngineHTTPError,
    EngineInconsistent,
    EngineRPCError,
    EngineUnreachable,
)
from rolloutfleet.api.engine import EngineFault, derive_sleep_level
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, SimulatedEngine, SimulatedFleet


def faults_fired(sim: SimulatedEngine, step: str) -> int:
    return sum(1 for e in sim.log.entries if "fault" in e and e["step"] == step)


def acted(sim: SimulatedEngine, step: str) -> int:
    return sum(1 for e in sim.log.entries if e["step"] == step and e.get("status") == 200)


async def test_idempotent_read_is_retried_through_transient_errors(client: EngineClient, sim: SimulatedEngine) -> None:
    sim.add_fault(FaultRule(step="is_paused", kind=FaultKind.HTTP_ERROR, status=503, body={"error": "busy"}, count=2))
    assert await client.is_paused() is False
    assert faults_fired(sim, "is_paused") == 2


async def test_idempotent_read_gives_up_after_the_policy_attempts(client: EngineClient, sim: SimulatedEngine) -> None:
    sim.add_fault(FaultRule(step="weight_info", kind=FaultKind.HTTP_ERROR, status=503, body={"e": 1}, count=None))
    with pytest.raises(EngineHTTPError) as err:
        await client.weight_info()
    assert err.value.status == 503 and faults_fired(sim, "weight_info") == client.retry.attempts


async def test_state_rpc_is_retried_but_a_load_is_not(client: EngineClient, sim: SimulatedEngine) -> None:
    sim.add_fault(FaultRule(step="rolloutfleet_state", kind=FaultKind.HTTP_ERROR, status=503, body="x"))
    await client.extension_state()
    assert faults_fired(sim, "rolloutfleet_state") == 1
    sim.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.HTTP_ERROR, status=503, body="x"))
    with pytest.raises(EngineHTTPError):
        await client.load("verifier", V2, 2)
    assert faults_fired(sim, "rolloutfleet_load") == 1 and acted(sim, "rolloutfleet_load") == 0


@pytest.mark.parametrize("kind", [FaultKind.HTTP_ERROR, FaultKind.TIMEOUT])
async def test_non_idempotent_call_is_sent_exactly_once(
    client: EngineClient, sim: SimulatedEngine, kind: FaultKind
) -> None:
    sim.add_fault(FaultRule(step="pause", kind=kind, status=503, body={"error": "unavailable"}))
    with pytest.raises(EngineError):
        await client.pause("keep")
    assert faults_fired(sim, "pause") == 1
    assert acted(sim, "pause") == 0 and not sim.core.paused  # and nothing was re-sent behind our back


async def test_extension_errors_are_typed_with_their_code(client: EngineClient) -> None:
    with pytest.raises(EngineRPCError) as err:
        await client.load("draft", D2, 2)  # the verifier does not hold revision 2
    assert err.value.code == "order" and err.value.rank == 0 and "verifier" in err.value.message
    with pytest.raises(EngineRPCError) as err:
        await client.load("verifier", "/synthetic/v/3", -1)
    assert err.value.code == "invalid_revision"


@pytest.mark.parametrize("spec", [EngineSpec(tp_size=2)])
async def test_tensor_parallel_ranks_must_agree(client: EngineClient, sim: SimulatedEngine) -> None:
    assert len(await client.extension_state()) == 2
    assert (await client.observe()).ranks == 2
    sim.add_fault(FaultRule(step="rolloutfleet_state", kind=FaultKind.SPLIT_RANKS))
    with pytest.raises(EngineInconsistent) as err:
        await client.extension_state()
    assert len(err.value.results) == 2
    sim.add_fault(FaultRule(step="rolloutfleet_state", kind=FaultKind.SPLIT_RANKS))
    assert (await client.observe()).fault == EngineFault.INCONSISTENT  # observe reports it, never serves it
    sim.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.SPLIT_RANKS))
    with pytest.raises(EngineInconsistent):
        await client.load("verifier", V1, 1)


@pytest.mark.parametrize("spec", [EngineSpec(draft_policy="frozen")])
async def test_frozen_draft_is_restored_never_loaded(client: EngineClient) -> None:
    with pytest.raises(EngineRPCError) as err:
        await client.load("draft", D1, 1)
    assert err.value.code == "frozen"
    await client.pause("keep")
    await client.sleep(2)
    await client.wake_up(["weights"])
    await client.load("verifier", V1, 1)
    assert not (await client.observe()).resident  # the draft is still lost
    restored = await client.restore_draft("/synthetic/draft/initial")
    assert restored.revision is None and restored.target == "draft"
    state = await client.observe()
    assert state.resident and state.draft is not None and state.draft.policy == "frozen"


async def test_reset_prefix_cache_retries_while_blocks_are_held(client: EngineClient, sim: SimulatedEngine) -> None:
    sim.core.lat = dataclasses.replace(sim.core.lat, token_s=0.02)  # requests stay running a while
    async with aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(s.post(sim.url + "/v1/completions", json={"prompt": [1], "max_tokens": 50}))
        await sim.core.until(lambda: sim.core.blocks_held)  # scheduled: it holds KV blocks
        await client.pause("keep")  # the running request keeps its KV blocks
        assert await client.reset_prefix_cache() is False
        resets = [e for e in sim.log.entries if e["step"] == "reset_prefix_cache"]
        assert [e["result"]["success"] for e in resets] == [False] * client.reset.attempts
        await client.resume()
        (await running).release()
    assert await client.reset_prefix_cache() is True


@pytest.mark.parametrize("spec", [EngineSpec(vllm_version="0.26")])
async def test_vllm_026_empty_bodies_are_understood(client: EngineClient, sim: SimulatedEngine) -> None:
    assert await client.reset_prefix_cache() is True  # 0.26 answers {"success": bool} like 0.33
    await client.pause("keep")
    await client.sleep(2)  # empty 200
    await client.wake_up()  # empty 200
    assert await client.is_sleeping()  # still paused


async def test_wrong_token_is_an_http_401_with_the_middleware_body(pool: EnginePool, sim: SimulatedEngine) -> None:
    async with EnginePool(token="not-the-token") as other:
        with pytest.raises(EngineHTTPError) as err:
            await other.client(sim.url).pause()
    assert err.value.status == 401 and err.value.body["error"]["type"] == "Unauthorized"
    assert "not-the-token" not in str(err.value)


async def test_unreachable_engine(pool: EnginePool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connection refused
        client = pool.client(f"http://127.0.0.1:{port}")
        with pytest.raises(EngineUnreachable):
            await client.resume()
        state = await client.observe()
    assert not state.reachable and f"cannot connect to 127.0.0.1:{port}" in (state.error or "")


async def test_an_engine_at_an_ipv6_pod_address_is_reached(fleet: SimulatedFleet, pool: EnginePool) -> None:
    """On an IPv6 cluster (or a dual-stack one listing IPv6 first) a pod's status.podIP is an IPv6 address. The
    revision loop reaches each engine at ``for_address(podIP, spec.port)``; written bare into the URL
    (``http://::1:8000``) the address's colons ran into the port's and every engine of such a cluster failed
    with a ValueError before any request: no pod could ever be updated or marked Ready."""
    try:
        sim = await fleet.add("::1", 0)
    except OSError as exc:  # a machine whose loopback has no IPv6 address
        pytest.skip(f"no IPv6 loopback here: {exc}")
    client = pool.for_address("::1", sim.port)
    assert client.base_url == f"http://[::1]:{sim.port}"
    state = await client.observe()
    assert state.reachable and state.error is None, state
    await client.resume()
    assert acted(sim, "resume") == 1


async def test_token_never_appears_in_logs_reprs_or_errors(
    pool: EnginePool, client: EngineClient, sim: SimulatedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sim.add_fault(FaultRule(step="resume", kind=FaultKind.HTTP_ERROR, status=500, body={"error": "x"}))
    with pytest.raises(EngineHTTPError) as err:
        await client.resume()
    await client.observe()
    texts = [repr(pool), repr(client), str(err.value), repr(err.value), caplog.text]
    assert all(TOKEN not in t for t in texts)


async def test_open_routes_get_no_token(client: EngineClient, sim: SimulatedEngine) -> None:
    await client.health()
    assert "vllm:spec_decode_num_draft_tokens_total" in await client.metrics()


async def test_pool_shares_one_transport_across_engines(fleet: SimulatedFleet, pool: EnginePool) -> None:
    engines = [await fleet.add(f"127.1.0.{i}", 0) for i in range(1, 6)]
    clients = [pool.for_address(e.ip, e.port) for e in engines]
    states = await asyncio.gather(*(c.observe() for c in clients))
    assert all(s.reachable for s in states)
    assert len({id(c._http) for c in clients}) == 1


def test_sleep_level_derivation() -> None:
    assert derive_sleep_level(is_sleeping=False) == 0
    assert derive_sleep_level(is_sleeping=True) is None


@pytest.mark.parametrize("spec", [EngineSpec(vllm_version="0.26")])
async def test_missing_version_routes_are_remembered_until_the_engine_drops_out(
    pool: EnginePool, sim: SimulatedEngine, latencies: Latencies
) -> None:
    """An image without ``/rolloutfleet/observe`` is read route by route; then 0.26 answers /weight_info with
    404: asked once per engine, not on every observation, until it restarts (each observation of a large
    fleet is one request per engine fewer)."""
    sim.add_fault(FaultRule(step="observe", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}))

    def asked(step: str) -> int:
        return sum(1 for s, _s, _o in latencies.calls if s == step)

    first = await pool.client(sim.url).observe()
    second = await pool.client(sim.url).observe()  # a new client of the same pool, as each pass makes
    assert not first.versioned and not second.versioned and asked("weight_info") == 1
    assert asked("observe") == 1  # the missing route is remembered too
    await sim.crash(restart_after=0.3)
    assert (await pool.client(sim.url).observe()).reachable is False
    await asyncio.sleep(0.5)
    assert not (await pool.client(sim.url).observe()).versioned
    assert asked("observe") == 2 and asked("weight_info") == 1  # asked again: a restarted engine may be newer


@pytest.mark.parametrize("spec", [EngineSpec(vllm_version="0.26"), EngineSpec()])
async def test_an_observation_is_one_request(pool: EnginePool, sim: SimulatedEngine, latencies: Latencies) -> None:
    """Issue 18: the admission, pause, sleep, weight version and extension state come back in one request
    (``GET /rolloutfleet/observe``), and read the same as the five requests they replace."""
    together = await pool.client(sim.url).observe()
    assert [s for s, _s, _o in latencies.calls] == ["observe"]
    sim.add_fault(FaultRule(step="observe", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}))
    apart = await EnginePool(token=TOKEN).__aenter__()
    try:
        alone = await apart.client(sim.url).observe()
    finally:
        await apart.close()
    assert together == alone
    assert together.versioned == (sim.spec.vllm_version != "0.26")


async def test_a_rotated_token_falls_back_to_the_previous_one_while_engines_catch_up(sim: SimulatedEngine) -> None:
    """Issue 15 defect 8 (found again by the soak): the operator reads a replaced Secret at once, an engine
    only when its kubelet refreshes the mounted copy; the 401s in between failed steps and rolled revisions
    back. A 401 is answered before anything is done, so one retry with the previous token is safe, and only
    within the grace period (an old token must not stay usable for ever)."""
    from rolloutfleet.adapters.engine import Credentials

    now = [0.0]
    async with EnginePool(token=TOKEN) as pool:
        pool.credentials = Credentials(TOKEN, grace=60.0, clock=lambda: now[0])
        pool.credentials.rotate("the-new-token")  # the engine still holds TOKEN
        await pool.client(sim.url).pause()  # 401 with the new token, then accepted with the previous one
        now[0] = 61.0
        with pytest.raises(EngineHTTPError) as err:
            await pool.client(sim.url).resume()
    assert err.value.status == 401
    assert "the-new-token" not in repr(pool.credentials) and TOKEN not in repr(pool.credentials)
