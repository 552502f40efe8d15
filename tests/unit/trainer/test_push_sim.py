"""The push client's simulated transport and the engine simulator speak the same wire: what
``SimulatedSender`` posts to ``/update_weights`` (with the control token) is what the simulator's session
loads, and the digest its extension reports after ``rolloutfleet_push_end`` is the one the trainer pinned
(``digest_tensors``) and the one ``rolloutfleet digest`` gives for a checkpoint of the same tensors."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp
import numpy as np
from safetensors.numpy import save_file

from rolloutfleet.digest import digest_directory
from rolloutfleet.sim import EngineSpec, SimulatedEngine, SimulatedFleet
from rolloutfleet.trainer.digest import digest_tensors
from rolloutfleet.trainer.senders import SimulatedSender

TOKEN = "trainer-unit-token"


def _tensors(seed: int, layers: int) -> dict[str, np.ndarray]:
    """A tiny llama-shaped model, the shapes the simulator serves from its checkpoints."""
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((32, 8), dtype=np.float32)}
    for i in range(layers):
        out[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((8, 8), dtype=np.float32)
    return out


def _checkpoint(directory: pathlib.Path, tensors: dict[str, np.ndarray]) -> str:
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


async def _post(sim: SimulatedEngine, route: str, body: object = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as s, s.post(sim.url + route, json=body or {}) as r:
        return r.status, await r.json(content_type=None)


async def _rpc(sim: SimulatedEngine, method: str, **kwargs: Any) -> dict[str, Any]:
    status, body = await _post(sim, "/collective_rpc", {"method": method, "kwargs": kwargs})
    assert status == 200, body
    result: dict[str, Any] = body["results"][0]
    return result


async def test_the_simulator_loads_and_verifies_what_the_simulated_sender_sends(tmp_path: pathlib.Path) -> None:
    initial = _checkpoint(tmp_path / "verifier-a", _tensors(1, 2))
    draft = _checkpoint(tmp_path / "draft-a", _tensors(1, 1))
    trained = _tensors(2, 2)  # the next step's weights, never written to disk by the trainer
    records = [(name, "F32", array.shape, array.tobytes()) for name, array in trained.items()]
    spec = EngineSpec(verifier_path=initial, draft_path=draft, weight_transfer={"backend": "ipc"})
    async with SimulatedFleet(token=TOKEN, spec=spec, admin_port=0) as fleet:
        sim = await fleet.add("127.0.0.1", 0)
        # The operator's bracket, as docs/push.md describes it: begin, vLLM's session ...
        assert (await _rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=3, epoch=1))["ok"]
        assert (await _post(sim, "/start_weight_update"))[0] == 200
        # ... the trainer's send (the client's own blocking HTTP call, off the event loop) ...
        sender = SimulatedSender()
        prepared = sender.prepare(list(reversed(records)), "verifier")  # any order: vLLM takes names as sent
        address = sim.url.removeprefix("http://")
        await asyncio.to_thread(sender.send, address, TOKEN, prepared, 10)
        # ... and the operator's finish.
        assert (await _post(sim, "/finish_weight_update"))[0] == 200
        ended = await _rpc(sim, "rolloutfleet_push_end")
    assert ended["ok"], ended
    assert ended["digest"] == digest_tensors(records) == digest_directory(_checkpoint(tmp_path / "b", trained))
    assert ended["tensors"] == len(trained)
