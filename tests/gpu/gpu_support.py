"""Helpers of the GPU tier: tiny checkpoints made on the fly, a real vLLM server, requests and metrics.

Used by ``tests/gpu`` (fixtures in conftest.py) and by ``bench/gpu_update.py``. Owns how a random-init
Llama is written as a revision directory (safetensors + config.json, no hub, no tokenizer), the
``vllm serve`` command line and environment the operator renders for a RolloutFleet (``resources``; our
extension and auth middleware, sleep mode, RL parity flags, a ``draft_model`` speculator), rewritten only
for loopback and local files, and the token-id requests the tests send. torch, vLLM and
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
import tempfile
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


# What a user puts in a fleet's extraArgs to run the suite's tiny models on a shared GPU: token-id prompts
# (no tokenizer files), a fixed seed, eager mode (CUDA graphs would add minutes of capture per server),
# and a small share of the GPU's memory.
def _suite_extra_args(gpu_memory_utilization: float, max_model_len: int) -> list[str]:
    return [
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--enforce-eager",
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "16",
    ]


def fleet_spec(
    verifier: str,
    draft: str,
    *,
    gpu_memory_utilization: float,
    max_model_len: int = 2048,
    num_speculative_tokens: int = 3,
    head_dtype: str | None = "float32",
    spec_method: str = "draft_model",
    transfer_backend: str | None = None,
) -> Any:
    """The RolloutFleet spec whose engines the suite runs, validated by the operator's own model.

    ``head_dtype=None`` turns the parity profile's fp32 LM head off (the parity test measures both);
    ``spec_method="eagle3"`` serves ``draft`` as an EAGLE-3 head; ``transfer_backend="ipc"`` starts the
    engines ready for pushed revisions. The weights volume is the directory holding the checkpoints and the
    tests' temporary copies, so the engine's own allowed-roots check (``ROLLOUTFLEET_WEIGHT_ROOTS``) is the
    one a pod gets.
    """
    from rolloutfleet.api.fleet import RolloutFleetSpec

    if head_dtype not in ("float32", None):
        raise ValueError(f"head_dtype {head_dtype!r}: the parity profile knows float32 or the model's own")
    root = os.path.commonpath([verifier, draft, tempfile.gettempdir()])
    body: dict[str, Any] = {
        "replicas": 1,
        "image": "rolloutfleet-worker:gpu-suite",
        "verifier": {"path": verifier, "servedModelName": "rolloutfleet-gpu"},
        "draft": {
            "method": spec_method,
            "path": draft,
            "numSpeculativeTokens": num_speculative_tokens,
            "policy": "coUpdate",
        },
        "weights": {"claimName": "gpu-suite", "mountPath": root, "allowedRoots": [root]},
        "updateStrategy": {"mode": "sleep"},
        "parity": {"enabled": True, "fp32LmHead": head_dtype == "float32"},
        "extraArgs": _suite_extra_args(gpu_memory_utilization, max_model_len),
    }
    if transfer_backend is not None:
        body["weightTransfer"] = {"backend": transfer_backend}
    return RolloutFleetSpec.model_validate(body)


def serve_command(spec: Any, port: int, token_file: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """The engine container's command line and environment as the operator renders them for ``spec``.

    Taken from the StatefulSet the operator would apply (``resources.children``), then rewritten only for
    this machine: ``vllm serve`` runs as this interpreter's module, the port is a free loopback one (plus
    ``--host 127.0.0.1``: a pod listens on its own address), and the control token is a local file instead
    of the mounted Secret. Every other flag and variable is exactly what a pod gets.
    """
    from rolloutfleet.resources import children, command

    owner = children.Owner(name="gpu-suite", namespace="default", uid="00000000-0000-0000-0000-000000000000")
    container = children.build_statefulset(owner, spec)["spec"]["template"]["spec"]["containers"][0]
    if container["command"] != ["vllm", "serve"]:
        raise AssertionError(f"the operator renders {container['command']!r}; the suite expects vllm serve")
    args = list(container["args"])
    at = args.index("--port")
    args[at + 1] = str(port)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args, "--host", "127.0.0.1"]
    env = {item["name"]: item["value"] for item in container["env"]}
    env[command.ENV_TOKEN_FILE] = str(token_file)
    return cmd, env


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
    transfer_backend: str | None = None,
    python_path: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """Start vLLM from the operator-rendered command line and wait for ``/health``.

    Raises with the log's tail if it dies or never answers. The server imports the worker package from the
    same place this process does minus the repository's source trees: on the device that is the wheel the
    worker Dockerfile installs (scripts/gpu/run-device-suite.sh), and the log records where it came from.
    ``python_path`` puts directories first (e.g. the ray stand-in of the IPC backend); ``env`` adds to the
    server's environment (e.g. the NCCL host identity of scripts/gpu/push_proof.py's one-GPU NCCL group).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / "control-token"
    token_file.write_text(token + "\n")
    port = free_port()
    spec = fleet_spec(
        verifier,
        draft,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        head_dtype=head_dtype,
        spec_method=spec_method,
        transfer_backend=transfer_backend,
    )
    cmd, rendered_env = serve_command(spec, port, token_file)
    env = {
        **os.environ,
        **rendered_env,
        "PYTHONPATH": engine_python_path(python_path),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    out = log.open("ab")
    out.write(("$ " + " ".join(cmd) + "\n").encode())
    out.write(("# rendered env: " + json.dumps(rendered_env, sort_keys=True) + "\n").encode())
    out.write(("# rolloutfleet_worker from: " + worker_origin(env) + "\n").encode())
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


def engine_python_path(first: list[str] | None = None) -> str:
    """This process's PYTHONPATH without the repository's source trees (an engine image has none of them)."""
    sources = {str(REPO / d) for d in ("operator", "worker_image", "digest")}
    paths = [*(first or []), *os.environ.get("PYTHONPATH", "").split(":")]
    return ":".join(p for p in paths if p and p.rstrip("/") not in sources)


def worker_origin(env: dict[str, str]) -> str:
    """Where a process with ``env`` imports ``rolloutfleet_worker`` from (recorded in each server log)."""
    probe = "import rolloutfleet_worker as w, rolloutfleet_digest as d; print(w.__file__, d.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=False, cwd="/"
    )
    return (out.stdout or out.stderr).strip()


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
