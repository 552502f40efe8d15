"""Helpers of the engine contract suite: the engine under test, checkpoints, metric parsing."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np
from safetensors.numpy import save_file

TOKEN = "contract-token"


@dataclasses.dataclass(frozen=True)
class Weights:
    verifier_a: str
    verifier_b: str
    draft_a: str
    draft_b: str
    empty: str | None  # a directory without *.safetensors (only when the engine shares our filesystem)


@dataclasses.dataclass(frozen=True)
class Target:
    url: str
    token: str
    weights: Weights
    real: bool


def write_checkpoint(directory: pathlib.Path, seed: int, *, layers: int = 2, hidden: int = 64) -> str:
    """A tiny llama-shaped safetensors checkpoint; the same seed gives the same tensors."""
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((128, hidden), dtype=np.float32)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def metric_sum(text: str, name: str) -> float:
    """The sum over label sets of one Prometheus sample name."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{.*\}})?\s+([0-9.eE+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


READY_PATH = "/rolloutfleet/ready"
ADMIT_PATH = "/rolloutfleet/admit"
WITHDRAW_PATH = "/rolloutfleet/withdraw"


async def call(
    target: Target, method: str, route: str, *, token: str | None = None, json: object = None
) -> tuple[int, dict[str, str], str]:
    """One raw HTTP call to the engine: (status, headers, body text). ``token`` None sends no header."""
    import aiohttp

    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as s, s.request(method, target.url + route, headers=headers, json=json) as r:
        return r.status, dict(r.headers), await r.text()
