"""Helpers of the GPU tier: tiny checkpoints made on the fly, a real vLLM server, requests and metrics.

Used by ``tests/gpu`` (fixtures in conftest.py) and by ``bench/gpu_update.py``. Owns how a random-init
Llama is written as a revision directory (safetensors + config.json, no hub, no tokenizer), the exact
``vllm serve`` command line of DESIGN.md §4 (our extension and auth middleware, sleep mode, RL parity
flags, a ``draft_model`` speculator), and the token-id requests the tests send. torch, vLLM and
transformers are imported inside functions so that collecting this module never needs them (CI has no GPU).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp

REPO = pathlib.Path(__file__).resolve().parents[2]
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama checkpoint; head_dim 64 or 128 (FA3 on the H200)."""

    vocab: int = 2048
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    max_positions: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> dict[str, Any]:
        """A config.json that both vLLM and transformers read as LlamaForCausalLM."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.3,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names (HF layout) and shapes."""
        h, i, d = self.hidden, self.intermediate, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            shapes |= {
                p + "self_attn.q_proj.weight": (self.heads * d, h),
                p + "self_attn.k_proj.weight": (self.kv_heads * d, h),
                p + "self_attn.v_proj.weight": (self.kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, self.heads * d),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        shapes |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return shapes

    def nbytes(self) -> int:
        """Bytes of the bf16 checkpoint (tensor data only)."""
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += 2 * n
        return total


def write_llama(
    directory: pathlib.Path,
    shape: LlamaShape,
    seed: int,
    *,
    std: float = 0.3,
    device: str = "cpu",
    shard_bytes: int = 2 << 30,
) -> pathlib.Path:
    """Write a random-init bf16 Llama (normal(0, std) matrices, unit norms) as a revision directory.

    Matches transformers' Llama init with ``initializer_range=std``; 0.3 makes the logits peaked, so
    greedy decoding is stable and a stale draft is obvious. Tensors are sharded into files of about
    ``shard_bytes`` with an index, as published checkpoints are. The same seed writes the same bytes.
    """
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, dims in shape.tensor_shapes().items():
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * std).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu().contiguous()
        size += nbytes
    weight_map = {}
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, fname)
    index = {"metadata": {"total_size": shape.nbytes()}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(shape.config(), indent=1))
    return directory


def eagle3_tensor_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of an EAGLE-3 head for ``shape`` (the layout vLLM's
    ``Eagle3LlamaForCausalLM`` loads): one decoder layer ``midlayer`` whose attention reads the input
    embedding and the fused hidden state side by side (2 x hidden), ``fc`` fusing three of the verifier's
    hidden states, its own norm and LM head over the full vocabulary, and ``d2t``/``t2d`` (the identity
    vocabulary map). No ``embed_tokens``: vLLM then shares the verifier's."""
    h, i, d = shape.hidden, shape.intermediate, shape.head_dim
    p = "midlayer."
    return {
        p + "self_attn.q_proj.weight": (shape.heads * d, 2 * h),
        p + "self_attn.k_proj.weight": (shape.kv_heads * d, 2 * h),
        p + "self_attn.v_proj.weight": (shape.kv_heads * d, 2 * h),
        p + "self_attn.o_proj.weight": (h, shape.heads * d),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * h),
        "norm.weight": (h,),
        "lm_head.weight": (shape.vocab, h),
    }


def write_eagle3_head(directory: pathlib.Path, shape: LlamaShape, seed: int, *, std: float = 0.05) -> pathlib.Path:
    """Write a random-init EAGLE-3 head for a verifier of ``shape`` as a revision directory.

    The verifier's hidden states it fuses are those after the embedding and after each of the first two
    layers (``eagle_aux_hidden_state_layer_ids`` [0, 1, 2]): vLLM's default picks layers (2, L/2, L-3),
    which a 2-layer verifier does not have. Random weights make a valid head that proposes poorly; greedy
    output is the verifier's either way (speculative decoding is lossless), which is what the test uses.
    """
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for name, dims in eagle3_tensor_shapes(shape).items():
        if len(dims) == 1:
            tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(dims, generator=gen) * std).to(torch.bfloat16).contiguous()
    tensors["d2t"] = torch.zeros(shape.vocab, dtype=torch.int64)  # draft id + d2t = target id
    tensors["t2d"] = torch.ones(shape.vocab, dtype=torch.bool)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = shape.config() | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": shape.vocab,
        "target_hidden_size": shape.hidden,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def copy_revision(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """A draft revision equal to its verifier (same bytes): it proposes exactly what the verifier predicts."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


@dataclasses.dataclass(frozen=True)
class Revisions:
    """The four revision directories the contract suite names (verifier/draft at A and B)."""

    root: pathlib.Path

    @property
    def verifier_a(self) -> str:
        return str(self.root / "verifier-a")

    @property
    def verifier_b(self) -> str:
        return str(self.root / "verifier-b")

    @property
    def draft_a(self) -> str:
        return str(self.root / "draft-a")

    @property
    def draft_b(self) -> str:
        return str(self.root / "draft-b")


def make_tiny_revisions(root: pathlib.Path, shape: LlamaShape | None = None) -> Revisions:
    """verifier-a/b (seeds 1 and 2) and draft-a/b identical to them, under ``root``."""
    shape = shape or LlamaShape()
    write_llama(root / "verifier-a", shape, seed=1)
    write_llama(root / "verifier-b", shape, seed=2)
    copy_revision(root / "verifier-a", root / "draft-a")
    copy_revision(root / "verifier-b", root / "draft-b")
    return Revisions(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Server:
    """A running ``vllm serve`` with our extension and middleware, on loopback."""

    url: str
    token: str
    proc: subprocess.Popen[bytes]
    log: pathlib.Path
    started_s: float

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def serve_command(
    verifier: str,
    draft: str,
    port: int,
    *,
    gpu_memory_utilization: float,
    max_model_len: int = 2048,
    num_speculative_tokens: int = 3,
    head_dtype: str | None = "float32",
    spec_method: str = "draft_model",
    extra: list[str] | None = None,
) -> list[str]:
    """The command line of DESIGN.md §4 on loopback (no tokenizer: token-id prompts only).

    ``head_dtype=None`` drops the fp32 LM head override (the parity test measures both);
    ``spec_method="eagle3"`` serves ``draft`` as an EAGLE-3 head.
    """
    spec = {"method": spec_method, "model": draft, "num_speculative_tokens": num_speculative_tokens}
    head = ["--hf-overrides", json.dumps({"head_dtype": head_dtype})] if head_dtype else []
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        verifier,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "rolloutfleet-gpu",
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--worker-extension-cls",
        "rolloutfleet_worker.extension.RolloutFleetExtension",
        "--middleware",
        "rolloutfleet_worker.auth.ControlAuthMiddleware",
        "--enable-sleep-mode",
        "--enforce-eager",
        "--logprobs-mode",
        "processed_logprobs",
        "--no-enable-prefix-caching",
        "--no-async-scheduling",
        *head,
        "--speculative-config",
        json.dumps(spec),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "16",
        *(extra or []),
    ]


def start_server(
    verifier: str,
    draft: str,
    workdir: pathlib.Path,
    log: pathlib.Path,
    *,
    gpu_memory_utilization: float = 0.2,
    max_model_len: int = 2048,
    token: str = "gpu-suite-token",
    startup_timeout: float = 420.0,
    head_dtype: str | None = "float32",
    spec_method: str = "draft_model",
) -> Server:
    """Start vLLM and wait for ``/health``; raise with the log's tail if it dies or never answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / "control-token"
    token_file.write_text(token + "\n")
    port = free_port()
    paths = [str(REPO / "operator"), str(REPO / "worker_image"), *os.environ.get("PYTHONPATH", "").split(":")]
    env = {
        **os.environ,
        "PYTHONPATH": ":".join(p for p in paths if p),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "ROLLOUTFLEET_CONTROL_TOKEN_FILE": str(token_file),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = serve_command(
        verifier,
        draft,
        port,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        head_dtype=head_dtype,
        spec_method=spec_method,
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    out = log.open("ab")
    out.write(("$ " + " ".join(cmd) + "\n").encode())
    out.flush()
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    url = f"http://127.0.0.1:{port}"
    server = Server(url=url, token=token, proc=proc, log=log, started_s=0.0)
    deadline = started + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} during start-up:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    server.started_s = time.monotonic() - started
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"vLLM did not answer /health within {startup_timeout:.0f}s:\n{tail(log)}")


def tail(path: pathlib.Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def prompts(count: int = 4, length: int = 16, vocab: int = 2048) -> list[list[int]]:
    """Fixed token-id prompts (ids 5.. vocab-1, no special ids)."""
    return [[5 + (97 * i + 31 * j + i * j) % (vocab - 5) for j in range(length)] for i in range(count)]


async def complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> tuple[int, dict[str, Any]]:
    """One greedy ``/v1/completions`` request by token ids; returns (status, body)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def generate(url: str, batch: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """Greedy outputs of each prompt, one request at a time (same batch shapes every call: deterministic)."""
    outs = []
    for p in batch:
        status, body = await complete(url, p, max_tokens)
        assert status == 200, body
        outs.append(list(body["choices"][0]["token_ids"]))
    return outs


def metric_sum(text: str, name: str) -> float:
    """Sum over label sets of one Prometheus sample (``name`` or ``name{...}``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def acceptance(url: str, batch: list[list[int]], max_tokens: int = 64) -> dict[str, float]:
    """Spec-decode acceptance over ``batch``: deltas of accepted / drafted tokens from ``/metrics``."""

    async def scrape() -> str:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
            return await resp.text()

    before = await scrape()
    outs = await asyncio.gather(*(complete(url, p, max_tokens) for p in batch))
    assert all(status == 200 for status, _ in outs), outs
    after = await scrape()
    drafted = metric_sum(after, DRAFTED) - metric_sum(before, DRAFTED)
    accepted = metric_sum(after, ACCEPTED) - metric_sum(before, ACCEPTED)
    return {"drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else float("nan")}


def generate_sync(url: str, batch: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """``generate`` without an event loop (for session fixtures)."""
    outs = []
    for p in batch:
        body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            outs.append(list(json.loads(resp.read())["choices"][0]["token_ids"]))
    return outs


def route_status(url: str, token: str, method: str, path: str) -> int:
    """The HTTP status of one control route (with the token); used to feature-detect vLLM versions."""
    req = urllib.request.Request(url + path, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
