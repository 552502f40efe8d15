"""Fake vLLM workers for the extension tests: real torch modules shaped like vLLM's, on CPU.

Used by test_worker_extension.py and test_worker_push.py. The models mirror what matters in vLLM: a Llama-style
``load_weights`` that stacks q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` by copying into
slices of existing parameters; an EAGLE-style draft that holds the verifier's ``embed_tokens`` and
``lm_head`` modules by reference; a CUDA-graph-like wrapper that forwards attributes to its runnable;
V1 (``drafter.model``) and V2 (``speculator.model``) runner layouts; and vLLM 0.26's weight-transfer
session (``TransferEngine`` + ``PushWorker``): start moves the target's parameters to the meta device,
``update_weights`` calls ``engine.model.load_weights(list)``, finish puts the kernel tensors back.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from rolloutfleet_worker.extension import RolloutFleetExtension

HIDDEN, INTER, VOCAB = 16, 24, 32
DTYPE = torch.bfloat16

# (param name, checkpoint name, shard) as in vLLM's LlamaForCausalLM.load_weights
STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=DTYPE), requires_grad=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Module()
        self.self_attn.qkv_proj.weight = _param(3 * HIDDEN, HIDDEN)
        self.self_attn.o_proj = nn.Module()
        self.self_attn.o_proj.weight = _param(HIDDEN, HIDDEN)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = nn.Module()
        self.mlp.gate_up_proj.weight = _param(2 * INTER, HIDDEN)
        self.mlp.down_proj = nn.Module()
        self.mlp.down_proj.weight = _param(HIDDEN, INTER)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _param(HIDDEN)


def _holder(*shape: int) -> nn.Module:
    m = nn.Module()
    m.weight = _param(*shape)
    return m


def stacked_load(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Any = None, *, lenient: bool = False
) -> set[str]:
    """vLLM-Llama-style loader: in-place copies, q/k/v and gate/up into stacked slices.

    Returns the names of the parameters it loaded, as vLLM's ``load_weights`` does. ``lenient``: names
    it has no parameter for are skipped silently, as many vLLM loaders do (``if name not in params_dict:
    continue``) for tensors they deliberately ignore.
    """
    # Inside a weight-transfer session the parameters sit on the meta device and loads land in the
    # kernel tensors the session keeps (``TransferEngine``), as vLLM's layerwise reload buffers them.
    params: dict[str, Any] = getattr(module, "_reload_kernels", None) or dict(module.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, w in weights:
        name = rename(ckpt_name) if rename else ckpt_name
        for param_name, shard_name, shard in STACKED:
            if shard_name not in name:
                continue
            target = name.replace(shard_name, param_name)
            if lenient and target not in params:
                break
            param = params[target]
            size = w.shape[0]
            param.data[shard * size : (shard + 1) * size].copy_(w)
            loaded.add(target)
            break
        else:
            if lenient and name not in params:
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {ckpt_name}")
            params[name].data.copy_(w)
            loaded.add(name)
    return loaded


class TinyLlama(nn.Module):
    """The verifier (or an independent draft_model draft): HF checkpoint names map 1:1 after stacking."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.lenient = False  # skip names it has no parameter for (see stacked_load)
        self.model = nn.Module()
        self.model.embed_tokens = _holder(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList([Layer() for _ in range(layers)])
        self.model.norm = _holder(HIDDEN)
        self.lm_head = _holder(VOCAB, HIDDEN)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return stacked_load(self, weights, lenient=self.lenient)


class EagleDraft(nn.Module):
    """An EAGLE-style draft: one layer + fc, embed_tokens and lm_head taken from the verifier by reference."""

    def __init__(self, verifier: TinyLlama) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = verifier.model.embed_tokens  # shared by reference, as vLLM's EAGLE does
        self.model.layers = nn.ModuleList([Layer()])
        self.model.fc = _holder(HIDDEN, 2 * HIDDEN)
        self.lm_head = verifier.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # EAGLE checkpoints have no "model." prefix; vLLM's EAGLE loader adds it.
        return stacked_load(self, weights, rename=lambda n: n if n.startswith("lm_head") else "model." + n)


class GraphWrapper:
    """Like vLLM's CUDAGraphWrapper: not a Module, keeps ``runnable``, forwards unknown attributes."""

    def __init__(self, runnable: Any) -> None:
        self.runnable = runnable

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runnable"], name)

    def unwrap(self) -> Any:
        return self.runnable


def llama_tensors(seed: int, layers: int = 2, prefix: str = "model.") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DTYPE)

    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        base = f"{prefix}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{base}self_attn.{proj}.weight"] = rnd(HIDDEN, HIDDEN)
        out[f"{base}mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
        out[f"{base}mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
        out[f"{base}mlp.down_proj.weight"] = rnd(HIDDEN, INTER)
        out[f"{base}input_layernorm.weight"] = rnd(HIDDEN)
    return out


def write_verifier(dirpath: Path, seed: int) -> Path:
    """A two-shard HF-style verifier checkpoint."""
    g = torch.Generator().manual_seed(seed + 1000)
    tensors = llama_tensors(seed)
    tensors["model.embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(DTYPE)
    tensors["model.norm.weight"] = torch.randn(HIDDEN, generator=g).to(DTYPE)
    tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(DTYPE)
    names = sorted(tensors)
    dirpath.mkdir(parents=True, exist_ok=True)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(dirpath / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(dirpath / "model-00002-of-00002.safetensors"))
    return dirpath


def write_eagle(dirpath: Path, seed: int) -> Path:
    """An EAGLE draft checkpoint, including its own copies of embed_tokens/lm_head (to be skipped)."""
    g = torch.Generator().manual_seed(seed + 2000)
    tensors = llama_tensors(seed + 7, layers=1, prefix="")
    tensors["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g).to(DTYPE)
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(DTYPE)
    tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(DTYPE)
    dirpath.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dirpath / "model.safetensors"))
    return dirpath


class WorkerV1(RolloutFleetExtension):
    """vLLM 0.26-like: get_model() on the worker, draft at model_runner.drafter.model behind a graph wrapper."""

    def __init__(self, draft: str = "eagle") -> None:
        self.verifier = TinyLlama()
        if draft == "eagle":
            self.draft: nn.Module | None = EagleDraft(self.verifier)
        elif draft == "draft_model":
            self.draft = TinyLlama(layers=1)
        else:
            self.draft = None
        drafter = SimpleNamespace(model=GraphWrapper(self.draft)) if self.draft is not None else None
        self.model_runner = SimpleNamespace(model=GraphWrapper(self.verifier), drafter=drafter)
        self.speculative_config = SimpleNamespace(method=draft) if self.draft is not None else None

    def get_model(self) -> Any:
        return self.model_runner.model


class WorkerV2(RolloutFleetExtension):
    """vLLM 0.33 V2-runner-like: get_draft_model() returns None for EAGLE; draft at speculator.model."""

    def __init__(self) -> None:
        self.verifier = TinyLlama()
        self.draft = EagleDraft(self.verifier)
        self.model_runner = SimpleNamespace(
            get_model=lambda: self.verifier,
            speculator=SimpleNamespace(model=self.draft),
        )
        self.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method="eagle3"))

    def get_draft_model(self) -> Any:
        return None


class TransferEngine:
    """vLLM 0.26's weight-transfer engine as the extension meets it (facts from its source).

    ``model`` is the session's target (the verifier, or the draft after ``set_weight_update_target``).
    ``start_weight_update`` is layerwise reload's start: every parameter of the target is replaced by one
    on the meta device, and loads land in the kept kernel tensors; ``finish_weight_update`` puts those
    back (CUDA graphs keep their pointers). A failed update leaves the meta parameters in place.
    ``update_weights({"weights": [(name, tensor), ...]})`` hands the list to ``self.model.load_weights``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = self.default = model
        self.saved: list[tuple[nn.Module, str, nn.Parameter]] = []

    def set_weight_update_target(self, model: nn.Module) -> None:
        self.model = model

    def reset_weight_update_target(self) -> None:
        self.model = self.default

    def start_weight_update(self) -> None:
        model = self.model
        kernels = dict(model.named_parameters())
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    self.saved.append((module, name, p))
                    meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                    module._parameters[name] = nn.Parameter(meta, requires_grad=False)
        model.__dict__["_reload_kernels"] = kernels

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.model.load_weights(list(update_info["weights"]))

    def finish_weight_update(self) -> None:
        for module, name, p in self.saved:
            module._parameters[name] = p
        self.saved.clear()
        self.model.__dict__.pop("_reload_kernels", None)


class PushWorker(WorkerV1):
    """A V1 worker with vLLM 0.26's session methods (``gpu_worker.py``): start, update, finish, and what a
    failed update does (the session ends, the target is reset, the parameters stay on meta)."""

    def __init__(self, draft: str = "eagle") -> None:
        super().__init__(draft)
        self.weight_transfer_engine: TransferEngine | None = TransferEngine(self.verifier)
        self._weight_update_active = False

    def _engine(self) -> TransferEngine:
        if self.weight_transfer_engine is None:
            raise RuntimeError("Weight transfer not configured.")
        return self.weight_transfer_engine

    def start_weight_update(self, draft: bool = False) -> None:
        engine = self._engine()
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        if draft:
            assert self.draft is not None
            engine.set_weight_update_target(self.draft)
        engine.start_weight_update()
        self._weight_update_active = True

    def start_draft_weight_update(self) -> None:
        self.start_weight_update(draft=True)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        engine = self._engine()
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            engine.saved.clear()  # vLLM never finalizes a failed session: the parameters stay on meta
            engine.model.__dict__.pop("_reload_kernels", None)
            engine.reset_weight_update_target()
            raise

    def finish_weight_update(self) -> None:
        engine = self._engine()
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        engine.finish_weight_update()
        engine.reset_weight_update_target()
        self._weight_update_active = False
