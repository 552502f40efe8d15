"""The simulator's own surface: the admin API, call logs that prove ordering and served pairs, the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib

import aiohttp
from engine_support import D1, D2, TOKEN, V1, V2

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.sim import SimulatedEngine, SimulatedFleet, commands

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def complete(sim: SimulatedEngine, **extra: object) -> dict:
    body = {"prompt": [5, 6], "max_tokens": 4, **extra}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json=body) as r:
        return await r.json()


async def test_served_completions_record_the_pair_that_generated_them(
    client: EngineClient, sim: SimulatedEngine
) -> None:
    await client.load("verifier", V1, 1)
    await client.load("draft", D1, 1)
    await complete(sim)
    await client.load("verifier", V2, 2)  # not paused: a careless operator serves a mixed pair
    await complete(sim)
    served = [e["result"] for e in sim.log.entries if e["step"] == "completions"]
    assert [s["mixed"] for s in served] == [False, True]
    assert served[1]["runs"][0]["verifier"] == 2 and served[1]["runs"][0]["draft"] == 1
    await client.load("draft", D2, 2)
    await client.update_weight_version("2")
    body = await complete(sim, return_weight_versions=True)
    assert body["choices"][0]["weight_versions"] == [{"version": "2", "start": 0, "end": 4}]


async def test_keep_pause_spans_two_weight_versions(client: EngineClient, sim: SimulatedEngine) -> None:
    import dataclasses

    sim.core.lat = dataclasses.replace(sim.core.lat, token_s=0.02)
    await client.update_weight_version("1")
    pending = asyncio.ensure_future(complete(sim, return_weight_versions=True))
    await asyncio.sleep(0.05)
    await client.pause("keep")
    await client.load("verifier", V2, 2)
    await client.load("draft", D2, 2)
    await client.update_weight_version("2")
    await client.resume()
    spans = (await pending)["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["1", "2"] and spans[-1]["end"] == 4
    log = sim.log.entries
    t_resume = next(e["t"] for e in log if e["step"] == "resume")
    t_load = [e["t"] for e in log if e["step"] == "rolloutfleet_load"]
    assert t_load[0] < t_load[1] < t_resume  # the order an issue-6 test proves from the log


async def test_admin_api_adds_engines_arms_faults_and_serves_logs(fleet: SimulatedFleet) -> None:
    base = fleet.admin_url
    assert base is not None
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(base + "/admin/engines", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with s.post(base + "/admin/engines", json={"ip": "127.1.9.9", "port": 0}) as r:
            assert r.status == 201
            key = (await r.json())["key"]
        fault = {"step": "resume", "kind": "http_error", "status": 503, "body": {"error": "x"}}
        async with s.post(f"{base}/admin/engines/{key}/faults", json=fault) as r:
            assert (await r.json()) == {"armed": 1}
        engine_url = fleet.engines[key].url
        async with s.post(engine_url + "/resume") as r:
            assert r.status == 503
        async with s.get(f"{base}/admin/engines/{key}/faults") as r:
            assert (await r.json())[0]["fired"] == 1
        async with s.get(f"{base}/admin/engines/{key}/log") as r:
            log = await r.json()
            assert any(e.get("fault", {}).get("kind") == "http_error" for e in log)
        async with s.post(f"{base}/admin/engines/{key}/crash") as r:
            assert r.status == 200
        async with s.get(f"{base}/admin/engines/{key}/state") as r:
            assert (await r.json())["running"] is False
        async with s.post(f"{base}/admin/engines/{key}/restart") as r, s.get(engine_url + "/health") as h:
            assert r.status == 200 and h.status == 200
        async with s.get(f"{base}/admin/logs") as r:
            assert key in await r.json()
        async with s.delete(f"{base}/admin/engines/{key}") as r:
            assert r.status == 200 and key not in fleet.engines


async def test_cli_config_builds_a_fleet(tmp_path: pathlib.Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    config = {
        "defaults": {"tp_size": 2},
        "latencies": {"steps": {"pause": 0.01}},
        "faults": [{"engine": "127.1.7.1:0", "step": "sleep", "kind": "crash"}],
    }
    (tmp_path / "sim.json").write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    commands.register(parser)
    args = parser.parse_args(
        [
            "serve",
            "--ip",
            "127.1.7.1",
            "--port",
            "0",
            "--token-file",
            str(tmp_path / "token"),
            "--config",
            str(tmp_path / "sim.json"),
        ]
    )
    plan = commands.build(args)
    assert plan.addresses == [("127.1.7.1", 0)] and plan.fleet.token == TOKEN and plan.fleet.spec.tp_size == 2
    assert plan.faults[0][0] == "127.1.7.1:0" and plan.faults[0][1].kind == "crash"
    assert commands.expand_range("127.1.0.254-127.1.1.1") == ["127.1.0.254", "127.1.0.255", "127.1.1.0", "127.1.1.1"]


async def test_admission_is_lost_with_the_process_and_visible_to_an_observer(fleet: SimulatedFleet) -> None:
    """A crashed engine restarts on its initial weights: it must come back un-admitted (its readiness
    probe fails) until the operator checked it again, and the admin state shows what the probe sees."""
    base = fleet.admin_url
    assert base is not None
    sim = await fleet.add("127.0.0.1", 0)
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/rolloutfleet/ready") as r:
            assert r.status == 503 and {k: v for k, v in (await r.json()).items() if k != "instance"} == {
                "admitted": False
            }
        async with s.post(sim.url + "/rolloutfleet/admit", json={"revision": 4}) as r:
            assert r.status == 401
        async with s.post(sim.url + "/rolloutfleet/admit", json={"revision": 4}, headers=AUTH) as r:
            assert r.status == 200 and (await r.json())["revision"] == 4
        async with s.get(sim.url + "/rolloutfleet/ready") as r:
            assert r.status == 200 and (await r.json())["admitted"] is True
        assert sim.admitted and sim.core.summary()["admitted_revision"] == 4
        async with s.get(f"{base}/admin/engines/{sim.key}/state", headers=AUTH) as r:
            assert (await r.json())["admitted"] is True
        async with s.post(f"{base}/admin/engines/{sim.key}/crash", headers=AUTH) as r:
            assert r.status == 200
        async with s.get(f"{base}/admin/engines/{sim.key}/state", headers=AUTH) as r:
            state = await r.json()
            assert state["running"] is False and state["admitted"] is False
        async with s.post(f"{base}/admin/engines/{sim.key}/restart", headers=AUTH) as r:
            assert r.status == 200
        async with s.get(sim.url + "/health") as h, s.get(sim.url + "/rolloutfleet/ready") as r:
            assert h.status == 200 and r.status == 503  # alive, but not admitted: no traffic yet
        assert not sim.admitted
        async with s.post(sim.url + "/rolloutfleet/admit", json={"revision": None}, headers=AUTH) as r:
            assert r.status == 200
        async with s.post(sim.url + "/rolloutfleet/withdraw", headers=AUTH) as r:
            assert r.status == 200 and (await r.json())["admitted"] is False
    steps = [e["step"] for e in sim.log.entries if e["step"] in ("admit", "withdraw", "crash", "restart")]
    assert steps == ["admit", "crash", "restart", "admit", "withdraw"]
