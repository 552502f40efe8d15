"""Find the verifier and draft modules inside a vLLM worker, and what they share.

Called by ``rolloutfleet_worker.extension``. Owns every lookup into vLLM's private object graph, each
with a fallback, because the image runs vLLM 0.33 and the lent GPU 0.26 and the names moved between
them: ``get_model()`` / ``get_draft_model()`` on the worker or its model runner, ``drafter.model`` (V1
runner), ``speculator.model`` (V2 runner), and CUDA-graph wrappers around any of them. A fallback is a
place not yet looked at, never a swallowed error: an accessor that raises, or a configured draft found
nowhere, fails the RPC. Also owns what a load must fill (parameter names and element counts) and the
cheap on-device fingerprint that tells whether the loaded weights are still resident (a level-2 sleep
discards them and a wake without reload brings back zeros). torch is imported inside functions so that
importing the extension never needs it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

MAX_UNWRAP = 8  # wrappers nest at most a couple deep; the bound stops a self-referencing wrapper
FINGERPRINT_PARAMS = 8
FINGERPRINT_SAMPLES = 1024


def unwrap(obj: Any) -> Any | None:
    """Peel CUDA-graph/compile wrappers until an object whose class defines ``load_weights``.

    The check is on the class, not the instance, because vLLM's ``CUDAGraphWrapper`` forwards unknown
    attributes to its runnable via ``__getattr__`` and would otherwise look like a model. A real model
    also has a ``.model`` attribute (its inner transformer), which is why ``.model``/``.module`` are only
    followed while the class has no ``load_weights``. Returns None when no model is found.
    """
    for _ in range(MAX_UNWRAP):
        if obj is None:
            return None
        if callable(getattr(type(obj), "load_weights", None)):
            return obj
        nxt = None
        unwrap_fn = getattr(type(obj), "unwrap", None)
        if callable(unwrap_fn):
            nxt = unwrap_fn(obj)
        for attr in ("runnable", "model", "module"):
            if nxt is not None:
                break
            nxt = _own_attr(obj, attr)
        if nxt is None or nxt is obj:
            return None
        obj = nxt
    return None


def _own_attr(obj: Any, name: str) -> Any | None:
    """An attribute really held by ``obj`` (instance dict or nn.Module child), not forwarded."""
    found = getattr(obj, "__dict__", {}).get(name)
    if found is None:
        found = getattr(obj, "__dict__", {}).get("_modules", {}).get(name)
    return found


class LookupFailedError(Exception):
    """The worker's object graph did not answer as this module expects: the RPC must fail, not guess."""


def _call(obj: Any, name: str) -> Any | None:
    """``obj.name()`` when ``obj`` has such a method, else None.

    Exceptions propagate: an accessor that raises means this vLLM is not laid out as we expect, and
    treating that as "no model here" would report an engine without a draft when it has one.
    """
    fn = getattr(obj, name, None)
    if not callable(fn):
        return None
    return fn()


def verifier_model(worker: Any) -> Any | None:
    """The target model: ``worker.get_model()``, else ``worker.model_runner.get_model()``."""
    for owner in (worker, getattr(worker, "model_runner", None)):
        model = unwrap(_call(owner, "get_model")) if owner is not None else None
        if model is not None:
            return model
    return None


# Speculative methods that propose without a draft module (vLLM's SpeculativeMethod literals).
MODEL_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


def draft_model(worker: Any) -> Any | None:
    """The draft model, or None when the engine has none (or this pipeline rank does not hold it).

    Order: ``get_draft_model()`` on the worker, then on the runner (both return None in vLLM V2 for
    EAGLE-style speculators), then ``model_runner.drafter.model`` (V1) and ``model_runner.speculator.model``
    (V2). Raises (``LookupFailedError`` or the accessor's own exception) instead of answering None when
    the engine is configured with a speculative method that needs a draft module and this rank should
    hold it: "no draft" must only ever be the truth.
    """
    runner = getattr(worker, "model_runner", None)
    for owner in (worker, runner):
        model = unwrap(_call(owner, "get_draft_model")) if owner is not None else None
        if model is not None:
            return model
    for attr in ("drafter", "speculator"):
        holder = getattr(runner, attr, None) if runner is not None else None
        model = unwrap(getattr(holder, "model", None)) if holder is not None else None
        if model is not None:
            return model
    method = draft_method(worker)
    if method is not None and method not in MODEL_FREE_METHODS and last_pipeline_rank():
        raise LookupFailedError(
            f"speculative method {method!r} is configured but no draft model was found (get_draft_model(), "
            "model_runner.drafter.model, model_runner.speculator.model): unknown vLLM layout"
        )
    return None


def last_pipeline_rank() -> bool:
    """Whether this worker is on the last pipeline-parallel rank, the only one vLLM gives a drafter.

    Without vLLM (the unit tests) the engine counts as a single rank.
    """
    try:
        from vllm.distributed import get_pp_group
    except ImportError:
        return True
    return bool(get_pp_group().is_last_rank)


def _spec_config(worker: Any) -> Any | None:
    """``speculative_config`` from the worker, its vllm_config or its model runner; None when unset."""
    for owner in (worker, getattr(worker, "vllm_config", None), getattr(worker, "model_runner", None)):
        spec = getattr(owner, "speculative_config", None) if owner is not None else None
        if spec is not None:
            return spec
    return None


def draft_method(worker: Any) -> str | None:
    """The configured ``speculative_config.method``, or None when the engine has no speculative config.

    Reported as configured so the operator can compare it with the fleet spec; a config whose method is
    not a name raises instead of reading as "no speculation".
    """
    spec = _spec_config(worker)
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    if isinstance(method, enum.Enum):
        method = method.value
    if not isinstance(method, str) or not method:
        raise LookupFailedError(f"speculative_config.method is {method!r}, not a method name")
    return method


def required_parameters(model: Any, shared: Iterable[str] = ()) -> list[str]:
    """The parameter names a load of ``model`` must fill: all of them, except those in ``shared``.

    The same set vLLM's own start-up load requires (``named_parameters()``, so a tied ``lm_head`` that is
    the embedding's parameter counts once); ``shared`` are the draft's parameters owned by the verifier,
    which a draft load skips on purpose.
    """
    skip = set(shared)
    return sorted(n for n, _p in model.named_parameters() if n not in skip)


def parameter_elements(model: Any, shared: Iterable[str] = ()) -> int:
    """How many elements a load must fill in ``model``: its parameters (this rank's shards), minus ``shared``.

    Each parameter counts once, however many modules hold it (tied embeddings), as in ``named_parameters``.
    Rows a vocabulary-parallel embedding or LM head pads its vocabulary with (vLLM pads to a multiple of
    64; modules carrying ``org_vocab_size``) are in no checkpoint, so they are not counted.
    """
    skip = set(shared)
    seen: set[int] = set()  # a tied parameter (lm_head = embed_tokens) is filled once
    total = 0
    for module_name, module in model.named_modules():
        vocab = getattr(module, "org_vocab_size", None)
        for name, p in module.named_parameters(prefix=module_name, recurse=False):
            if name in skip or id(p) in seen:
                continue
            seen.add(id(p))
            n = int(p.numel())
            if isinstance(vocab, int) and p.dim() >= 1 and p.shape[0] > vocab:
                n = n // int(p.shape[0]) * vocab
            total += n
    return total


def quantization(worker: Any, target: str) -> str | None:
    """The engine's quantization method for ``target`` ("verifier" | "draft"), or None when unquantized.

    Verifier: ``model_config.quantization`` on the worker or its vllm_config; draft:
    ``speculative_config.draft_model_config.quantization``.
    """
    if target == "draft":
        owners = [_spec_config(worker)]
        attr = "draft_model_config"
    else:
        owners = [worker, getattr(worker, "vllm_config", None)]
        attr = "model_config"
    for owner in owners:
        config = getattr(owner, attr, None) if owner is not None else None
        method = getattr(config, "quantization", None) if config is not None else None
        if method is not None:
            return str(method)
    return None


def _storage_ptr(t: Any) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # tensor subclasses without storage (meta, quantised wrappers) share nothing
        return 0


def shared_parameters(draft: Any, verifier: Any | None) -> list[str]:
    """Draft parameter names whose storage is also a verifier parameter's storage (shared by reference)."""
    if verifier is None:
        return []
    ptrs = {_storage_ptr(p) for p in verifier.parameters()}
    ptrs.discard(0)
    return sorted(n for n, p in draft.named_parameters(remove_duplicate=False) if _storage_ptr(p) in ptrs)


def _strip_model(name: str) -> str:
    while name.startswith("model."):
        name = name[len("model.") :]
    return name


def matches_shared(tensor_name: str, shared: Iterable[str]) -> bool:
    """Whether a checkpoint tensor would land in a shared parameter.

    Checkpoint names and module names differ by wrapper prefixes (``model.``) that each model's
    ``load_weights`` maps, so compare with those stripped, allowing one to be a dotted suffix of the
    other (``embed_tokens.weight`` vs ``model.embed_tokens.weight``). A suffix must keep at least two
    components so a bare ``weight`` never matches everything.
    """
    a = _strip_model(tensor_name)
    for s in shared:
        b = _strip_model(s)
        if a == b:
            return True
        shorter, longer = (a, b) if len(a) < len(b) else (b, a)
        if shorter.count(".") >= 1 and longer.endswith("." + shorter):
            return True
    return False


def fingerprint(model: Any, exclude: Iterable[str] = ()) -> list[float]:
    """A cheap on-device summary of ``model``'s weights: sums of strided samples of a few parameters.

    Recorded right after a load and compared later: a level-2 sleep frees the weights and a wake without
    reload returns zero-filled memory at the same addresses, which this catches without reading the
    whole model. Parameters in ``exclude`` (shared with the verifier, rewritten by its loads) are left out.
    One device sync in total.
    """
    import torch

    skip = set(exclude)
    params = [p for n, p in sorted(model.named_parameters()) if n not in skip and p.numel() > 0]
    if not params:
        return []
    count = min(FINGERPRINT_PARAMS, len(params))
    picked = [params[i * len(params) // count] for i in range(count)]
    sums = []
    with torch.no_grad():
        for p in picked:
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = flat[::step][:FINGERPRINT_SAMPLES]
            sums.append(sample.double().sum())
            sums.append(sample.double().abs().sum())
        values: list[float] = torch.stack(sums).tolist()
    return values


def _pointer_mapped(cuda: Any, ptr: int) -> bool:
    """CU_POINTER_ATTRIBUTE_MAPPED (13) for one device pointer, via the driver API.

    A reserved-but-unmapped address (what vLLM's CuMemAllocator leaves while asleep) answers
    CUDA_ERROR_INVALID_VALUE or false; checked on the H200 against cuMemAddressReserve/cuMemMap/cuMemUnmap.
    The attribute is a C bool, so the zeroed buffer is read as "any byte set".
    """
    import ctypes

    out = (ctypes.c_ubyte * 8)()
    rc = cuda.cuPointerGetAttribute(ctypes.byref(out), ctypes.c_int(13), ctypes.c_uint64(ptr))
    return rc == 0 and any(out[:4])


def weights_mapped(model: Any, names: Iterable[str] | None = None) -> bool:
    """False when parameters of ``model`` sit on unmapped device memory (the engine sleeps).

    Reading an unmapped address would kill the worker with an illegal-address fault, so the fingerprint
    is taken only after this says True. CPU models, or no driver library, count as mapped.
    """
    import ctypes

    wanted = None if names is None else set(names)
    ptrs = [
        int(p.data_ptr())
        for n, p in model.named_parameters()
        if (wanted is None or n in wanted) and p.is_cuda and p.numel() > 0
    ]
    if not ptrs:
        return True
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return all(_pointer_mapped(cuda, ptr) for ptr in ptrs)


def on_meta(model: Any) -> list[str]:
    """Names of ``model``'s parameters on the meta device: vLLM's weight-transfer session keeps a target's
    parameters there between its start and finish, and leaves them there when an update failed (they
    have no data at all then). Reads metadata only, never a value."""
    return [n for n, p in model.named_parameters() if p.device.type == "meta"]


def on_cuda(model: Any) -> bool:
    """True when the model's first parameter lives on a CUDA device (pinned staging pays off then)."""
    for p in model.parameters():
        return bool(p.is_cuda)
    return False


def world_size() -> int:
    """How many ranks share this engine's checkpoint (torch.distributed's world; 1 when not initialised).

    The loader copies whole tensors to the GPU only when this is 1: with tensor or pipeline parallelism
    each rank keeps a shard, so each would move the whole checkpoint over its link for a fraction of it.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:
        return 1
    return 1


def rank() -> int:
    """This worker's global rank: torch.distributed when initialised, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-initialised process group must not break a state report
        return 0
    return 0
