"""Helpers of the simulator's weight-transfer tests: tiny checkpoints, update bodies, raw calls."""

from __future__ import annotations

import base64
import dataclasses
import pathlib
from typing import Any

import aiohttp
import numpy as np
from engine_support import TOKEN
from safetensors.numpy import load_file, save_file

from rolloutfleet.sim import SimulatedEngine

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    verifier_a: str
    verifier_b: str
    draft_a: str
    draft_b: str


def write_checkpoint(directory: pathlib.Path, seed: int, *, layers: int = 2, extra: bool = False) -> str:
    """A tiny llama-shaped safetensors checkpoint; the same seed gives the same tensors."""
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((32, 8), dtype=np.float32)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((8, 8), dtype=np.float32)
    if extra:
        tensors["lm_head.weight"] = rng.standard_normal((32, 8), dtype=np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def checkpoints(root: pathlib.Path) -> Checkpoints:
    return Checkpoints(
        verifier_a=write_checkpoint(root / "verifier-a", 1),
        verifier_b=write_checkpoint(root / "verifier-b", 2),
        draft_a=write_checkpoint(root / "draft-a", 1, layers=1),
        draft_b=write_checkpoint(root / "draft-b", 2, layers=1),
    )


def update_info(
    checkpoint: str,
    *,
    only: list[str] | None = None,
    shapes: dict[str, list[int]] | None = None,
    rename: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The simulated transport's ``update_info`` for a checkpoint's tensors (all, or ``only``), in name order;
    ``shapes`` overrides a tensor's declared shape (same bytes), ``rename`` its name."""
    tensors = load_file(str(pathlib.Path(checkpoint) / "model.safetensors"))
    names = sorted(tensors) if only is None else only
    shapes, rename = shapes or {}, rename or {}
    return {
        "names": [rename.get(n, n) for n in names],
        "dtype_names": ["float32"] * len(names),
        "shapes": [shapes.get(n, list(tensors[n].shape)) for n in names],
        "simulated_payload_b64": [base64.b64encode(tensors[n].tobytes()).decode() for n in names],
    }


def names_of(checkpoint: str) -> list[str]:
    return sorted(load_file(str(pathlib.Path(checkpoint) / "model.safetensors")))


async def post(sim: SimulatedEngine, route: str, body: object = None, *, timeout: float = 10) -> tuple[int, Any]:
    """One control call: (status, JSON body, or the text when it is not JSON)."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(headers=AUTH, timeout=client_timeout) as s,
        s.post(sim.url + route, json=body if body is not None else {}) as r,
    ):
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


async def rpc(sim: SimulatedEngine, method: str, **kwargs: Any) -> dict[str, Any]:
    """An extension RPC through ``/collective_rpc``: rank 0's result."""
    status, body = await post(sim, "/collective_rpc", {"method": method, "kwargs": kwargs})
    assert status == 200, body
    result: dict[str, Any] = body["results"][0]
    return result


async def state(sim: SimulatedEngine) -> dict[str, Any]:
    return await rpc(sim, "rolloutfleet_state")


async def session(sim: SimulatedEngine, start: str, info: dict[str, Any]) -> tuple[int, int, int]:
    """start → update → finish: the three statuses."""
    started, _ = await post(sim, start)
    updated, _ = await post(sim, "/update_weights", {"update_info": info})
    finished, _ = await post(sim, "/finish_weight_update")
    return started, updated, finished


async def complete(sim: SimulatedEngine, max_tokens: int = 4) -> tuple[int, Any]:
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "return_token_ids": True}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def vllm_message(body: Any) -> str:
    assert isinstance(body, dict) and body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 500
    message: str = body["error"]["message"]
    return message
