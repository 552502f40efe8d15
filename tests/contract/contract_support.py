"""Helpers of the engine contract suite: the engine under test, checkpoints, metric parsing, senders."""

from __future__ import annotations

import base64
import dataclasses
import pathlib
import pickle
import re
from typing import Any, Protocol

import numpy as np
from safetensors.numpy import load_file, save_file

TOKEN = "contract-token"


@dataclasses.dataclass(frozen=True)
class Weights:
    verifier_a: str
    verifier_b: str
    draft_a: str
    draft_b: str
    empty: str | None  # a directory without *.safetensors (only when the engine shares our filesystem)


class Sender(Protocol):
    """Builds ``/update_weights`` bodies from a checkpoint's tensors, as a trainer would send them."""

    def update_info(self, checkpoint: str, *, flatten: str | None = None) -> dict[str, Any]:
        """Every tensor of ``checkpoint`` in name order; ``flatten`` names one sent with a 1-D shape (wrong)."""
        ...


@dataclasses.dataclass(frozen=True)
class Target:
    url: str
    token: str
    weights: Weights
    real: bool
    transfer: str | None = None  # the engine's --weight-transfer-config backend (None: started without)
    plain_url: str | None = None  # an engine started without --weight-transfer-config, if there is one
    sender: Sender | None = None  # how this test process can send tensors to ``url`` (None: it cannot)


class SimulatedSender:
    """The simulator's transport (``rolloutfleet.sim.transfer``): each tensor's raw bytes, base64."""

    def update_info(self, checkpoint: str, *, flatten: str | None = None) -> dict[str, Any]:
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(pathlib.Path(checkpoint).glob("*.safetensors")):
            tensors.update(load_file(str(shard)))
        names = sorted(tensors)
        return {
            "names": names,
            "dtype_names": [str(tensors[n].dtype) for n in names],  # numpy's float32 is torch's spelling too
            "shapes": [[tensors[n].size] if n == flatten else list(tensors[n].shape) for n in names],
            "simulated_payload_b64": [base64.b64encode(tensors[n].tobytes()).decode() for n in names],
        }


class IpcSender:
    """vLLM's IPC backend over HTTP (docs/gpu.md): the test process shares the engine's GPU and sends
    ``ipc_handles_pickled`` (the engine needs VLLM_ALLOW_INSECURE_SERIALIZATION=1). Keeps the tensors alive."""

    def __init__(self) -> None:
        self.keep: list[Any] = []

    def update_info(self, checkpoint: str, *, flatten: str | None = None) -> dict[str, Any]:
        import torch
        from safetensors.torch import load_file as load_torch
        from torch.multiprocessing.reductions import reduce_tensor

        tensors: dict[str, Any] = {}
        for shard in sorted(pathlib.Path(checkpoint).glob("*.safetensors")):
            tensors.update(load_torch(str(shard), device="cuda"))
        names = sorted(tensors)
        sent = [tensors[n].reshape(-1) if n == flatten else tensors[n].contiguous() for n in names]
        self.keep = sent
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        handles = [{uuid: reduce_tensor(t)[1]} for t in sent]
        return {
            "names": names,
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in sent],
            "shapes": [list(t.shape) for t in sent],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
        }


def write_checkpoint(directory: pathlib.Path, seed: int, *, layers: int = 2, hidden: int = 64) -> str:
    """A tiny llama-shaped safetensors checkpoint; the same seed gives the same tensors."""
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((128, hidden), dtype=np.float32)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def header_totals(path: str) -> tuple[int, int]:
    """(tensors, bytes) of a checkpoint directory from its headers: what a pre-flight or a stage must report."""
    from rolloutfleet_digest import scan_directory

    infos = scan_directory(path)
    return len(infos), sum(i.nbytes for i in infos)


def metric_sum(text: str, name: str) -> float:
    """The sum over label sets of one Prometheus sample name."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{.*\}})?\s+([0-9.eE+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


async def complete(target: Target, max_tokens: int = 8, **extra: object) -> tuple[int, dict[str, Any]]:
    """One greedy completion of a fixed prompt (open route): (status, body)."""
    import aiohttp

    body = {"prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "temperature": 0.0, **extra}
    async with aiohttp.ClientSession() as s, s.post(target.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


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
