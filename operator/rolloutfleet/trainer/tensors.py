"""The trainer client's one torch module: what pushing needs to know about, and do with, a torch tensor.

Called by ``rolloutfleet.trainer.digest`` (dtype, shape and the BLAKE3 of each tensor's raw bytes, on the
GPU where a CUDA tensor lives, so the model is not copied to host) and ``rolloutfleet.trainer.senders``
(raw bytes for the engine simulator, CUDA IPC handles for vLLM). torch is imported inside functions only,
and only once a caller holds a torch tensor: a trainer that pushes raw records, and the operator image,
never import it (torch is the optional extra ``trainer-push``).

Owns the two dtype vocabularies — safetensors' (``BF16``: the digest's, docs/digest.md) and torch's
(``bfloat16``: vLLM's ``dtype_names``) — and the GPU hash: the worker's Triton BLAKE3
(``rolloutfleet_worker.blake3_device``), used on a device only after its self-test there agreed with the
``blake3`` package; otherwise (no Triton, a failed self-test) each tensor is copied to host and hashed there.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import blake3

# torch's dtype names (``str(dtype)`` without ``torch.``) -> safetensors' spelling; the inverse of the
# worker's loader table (rolloutfleet_worker.loader_base.torch_dtype; a unit test keeps them equal).
SAFETENSORS_DTYPES: Final[dict[str, str]] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
TORCH_DTYPES: Final[dict[str, str]] = {st: name for name, st in SAFETENSORS_DTYPES.items()}

CHUNK_LEN: Final = 1024  # BLAKE3's chunk; the GPU hash takes tensors of more than one chunk
_HEAD_ALIGN: Final = 16  # the GPU hash reads the bytes as int32 words: a misaligned view is copied first


def dtype_pair(dtype: str) -> tuple[str, str]:
    """``(safetensors, torch)`` spellings of a dtype given in either; ValueError if unknown."""
    if dtype in TORCH_DTYPES:
        return dtype, TORCH_DTYPES[dtype]
    if dtype in SAFETENSORS_DTYPES:
        return SAFETENSORS_DTYPES[dtype], dtype
    raise ValueError(f"unknown dtype {dtype!r} (use a safetensors name such as BF16, or a torch one such as bfloat16)")


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch (no torch loaded: it cannot be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def describe(tensor: Any) -> tuple[str, tuple[int, ...], int]:
    """``(torch dtype name, shape, bytes)`` of a dense tensor; ValueError for what cannot be sent as bytes."""
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ValueError(f"a {tensor.layout} tensor has no raw bytes to send (make it dense)")
    if tensor.device.type == "meta":
        raise ValueError("a tensor on the meta device has no data")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {name} has no safetensors name (supported: {', '.join(SAFETENSORS_DTYPES)})")
    return name, tuple(int(d) for d in tensor.shape), int(tensor.numel()) * tensor.element_size()


def _flat_bytes(tensor: Any) -> Any:
    """The tensor's bytes as a contiguous uint8 tensor on its device (a copy only when it is not dense)."""
    import torch

    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def host_bytes(tensor: Any) -> memoryview:
    """The tensor's raw bytes in host memory (copied from the device when it is not on the CPU)."""
    flat = _flat_bytes(tensor)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.numpy())


def _host_hash(flat: Any) -> bytes:
    if flat.device.type != "cpu":
        flat = flat.cpu()
    digest: bytes = blake3.blake3(memoryview(flat.numpy()), max_threads=blake3.blake3.AUTO).digest()
    return digest


@functools.cache
def gpu_hash_works(index: int) -> bool:
    """Whether BLAKE3 on ``cuda:index`` agrees with the blake3 package (its self-test, once per process).

    The first call compiles the Triton kernels (seconds to tens of seconds); any failure means False.
    """
    import torch

    from rolloutfleet_worker import blake3_device

    try:
        return bool(blake3_device.self_test(torch.device("cuda", index)))
    except Exception:  # no Triton, no compiler, a driver problem: the host hashes instead
        return False


def hash_tensors(
    tensors: Sequence[Any], *, gpu: bool = True, progress: Callable[[int], None] | None = None
) -> list[bytes]:
    """The BLAKE3 of each tensor's raw bytes (32 bytes each, in order).

    CUDA tensors are hashed on their device when ``gpu`` and the device passed its self-test: the hashes are
    queued on the current stream and read back together (only the tails shorter than a BLAKE3 chunk and
    tensors of at most one chunk cross to host). ``progress(bytes)`` is called as each tensor is done or queued.
    """
    import torch

    out: list[bytes | None] = [None] * len(tensors)
    queued: list[tuple[int, Any]] = []
    for i, tensor in enumerate(tensors):
        flat = _flat_bytes(tensor)
        n = int(flat.numel())
        device = flat.device
        if device.type == "cuda" and n > CHUNK_LEN and gpu and gpu_hash_works(device.index or 0):
            queued.append((i, _queue_gpu_hash(flat)))
        else:
            out[i] = _host_hash(flat)
        if progress is not None:
            progress(n)
    if queued:
        words = torch.stack([result.to("cpu", non_blocking=False) for _, result in queued]).tolist()
        for (i, _), row in zip(queued, words, strict=True):
            out[i] = b"".join((w & 0xFFFFFFFF).to_bytes(4, "little") for w in row)
    return [h for h in out if h is not None]


def _queue_gpu_hash(flat: Any) -> Any:
    """Queue BLAKE3 of a uint8 CUDA tensor of more than one chunk on its device; 8 int32 words back."""
    import torch

    from rolloutfleet_worker import blake3_device

    if flat.data_ptr() % _HEAD_ALIGN:
        flat = flat.clone()  # a view at an odd offset into a larger buffer (a fused weight's slice)
    full, rest = divmod(int(flat.numel()), CHUNK_LEN)
    tail = bytes(flat[full * CHUNK_LEN :].cpu().numpy()) if rest else None
    with torch.cuda.device(flat.device):
        return blake3_device.hash_on_device(flat, tail)


def ipc_handles(tensors: Sequence[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """vLLM's IPC ``update_info`` handles: one ``{gpu_uuid: args}`` per tensor, and what to keep alive.

    ``args`` is the second half of ``torch.multiprocessing.reductions.reduce_tensor(t)``: what vLLM's IPC
    engine (0.26 and 0.33, ``receive_weights``) passes to ``rebuild_cuda_tensor`` after setting index 6 to
    its own device. The second list holds the (contiguous) tensors the handles point into: ``args`` do not
    keep that memory alive, so the caller must, until every engine's ``/update_weights`` call returned.
    ValueError names a tensor that is not on a GPU.
    """
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    handles: list[dict[str, Any]] = []
    keep: list[Any] = []
    uuids: dict[int, str] = {}
    for name, tensor in tensors:
        if tensor.device.type != "cuda":
            raise ValueError(f"{name}: CUDA IPC sends GPU tensors, this one is on {tensor.device}")
        weight = tensor.detach().contiguous()
        keep.append(weight)
        index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        if index not in uuids:
            uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
        _, args = reduce_tensor(weight)  # type: ignore[no-untyped-call]
        handles.append({uuids[index]: args})
    return handles, keep


def ipc_collect() -> None:
    """Free the CUDA IPC memory whose consumers have closed it (vLLM's IPC sender does the same after a send)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
