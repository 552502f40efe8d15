"""The digest of the tensors a trainer sends: the project's one definition, over a stream of tensors.

Called by ``rolloutfleet.trainer.push`` (the digest a pushed WeightRevision pins, computed over exactly
what it will send) and by trainers directly (``digest_tensors``). The definition and the combining rule
are ``rolloutfleet_digest``'s (``DigestBuilder``; docs/digest.md): per tensor the BLAKE3 of its raw
bytes, combined in name order with its name, safetensors dtype and shape. So the value equals ``rolloutfleet
digest`` of a safetensors checkpoint holding the same tensors, and what the engines' extension reports
after receiving them.

This module owns the inputs. A *tensor provider* is a mapping ``{name: tensor}`` (a ``state_dict()``), an
iterable of ``(name, tensor)`` pairs (a one-shot iterator is read once and kept), or a callable returning
either (``model.named_parameters``: called again for each send). A tensor is a torch tensor (CPU or CUDA,
through ``rolloutfleet.trainer.tensors``, hashed on its GPU) or a ``RawTensor`` (bytes with a dtype and a
shape, for callers and tests without torch); a ``(name, dtype, shape, bytes)`` 4-tuple is a RawTensor too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import blake3

import rolloutfleet_digest as wdigest
from rolloutfleet.trainer import tensors as torch_tensors
from rolloutfleet.trainer.errors import InvalidTensors


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """A tensor as raw bytes: ``dtype`` in safetensors (``BF16``) or torch (``bfloat16``) spelling."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    def __post_init__(self) -> None:
        st, _ = torch_tensors.dtype_pair(self.dtype)
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"shape must be non-negative integers, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        size = wdigest.DTYPE_SIZES.get(st)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = memoryview(self.data).nbytes
        if size is not None and numel * size != nbytes:
            raise ValueError(f"{st}{list(shape)} needs {numel * size} bytes, got {nbytes}")


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What the digest and vLLM's ``update_info`` say about one tensor."""

    name: str
    dtype: str  # safetensors spelling (the digest's)
    torch_dtype: str  # torch spelling (vLLM's dtype_names)
    shape: tuple[int, ...]
    nbytes: int


TensorProvider = (
    Mapping[str, Any]
    | Iterable[tuple[str, Any]]
    | Iterable[tuple[str, str, Sequence[int], bytes]]
    | Callable[[], Iterable[Any]]
)


class TensorSource:
    """A tensor provider the push client can read more than once: for the digest, then for every session.

    ``target`` (verifier, draft) names the tensors in errors. ``items()`` returns ``(name, tensor)`` pairs
    in the provider's order (the order vLLM receives them) with 4-tuples turned into RawTensors; it raises
    InvalidTensors for no tensors, a duplicate or empty name, or a value that is not a tensor.
    """

    def __init__(self, provider: TensorProvider, target: str = "tensors") -> None:
        self.target = target
        self._factory: Callable[[], Iterable[Any]]
        if isinstance(provider, (TensorSource, Mapping)):
            self._factory = provider.items
        elif isinstance(provider, (str, bytes, Path)):
            raise InvalidTensors(target, f"expected tensors, got {type(provider).__name__} {provider!r}")
        elif callable(provider):
            self._factory = provider
        elif isinstance(provider, Iterator):
            kept = list(provider)  # a generator can be read once: keep the (references to the) tensors
            self._factory = lambda: kept
        elif isinstance(provider, Iterable):
            self._factory = lambda: provider
        else:
            raise InvalidTensors(target, f"expected tensors, got {type(provider).__name__}")

    def items(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        seen: set[str] = set()
        try:
            produced = self._factory()
            entries = produced.items() if isinstance(produced, Mapping) else produced
            for entry in entries:
                name, value = self._entry(entry)
                if name in seen:
                    raise InvalidTensors(self.target, f"tensor {name!r} appears twice")
                seen.add(name)
                out.append((name, value))
        except ValueError as exc:
            raise InvalidTensors(self.target, str(exc)) from None
        except TypeError as exc:
            raise InvalidTensors(self.target, f"not an iterable of (name, tensor): {exc}") from None
        if not out:
            raise InvalidTensors(self.target, "no tensors")
        return out

    def _entry(self, entry: Any) -> tuple[str, Any]:
        if isinstance(entry, tuple) and len(entry) == 4:
            name, dtype, shape, data = entry
            value: Any = RawTensor(dtype, tuple(shape), data)
        elif isinstance(entry, tuple) and len(entry) == 2:
            name, value = entry
        else:
            raise ValueError(f"expected (name, tensor) or (name, dtype, shape, bytes), got {entry!r:.80}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tensor name must be a non-empty string, got {name!r}")
        if not isinstance(value, RawTensor) and not torch_tensors.is_tensor(value):
            raise ValueError(f"{name}: expected a torch tensor or a RawTensor, got {type(value).__name__}")
        return name, value


def describe(name: str, value: Any) -> TensorMeta:
    """The metadata of one named tensor (ValueError for a tensor that cannot be sent as bytes)."""
    if isinstance(value, RawTensor):
        st, torch_name = torch_tensors.dtype_pair(value.dtype)
        return TensorMeta(name, st, torch_name, value.shape, memoryview(value.data).nbytes)
    try:
        torch_name, shape, nbytes = torch_tensors.describe(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return TensorMeta(name, torch_tensors.SAFETENSORS_DTYPES[torch_name], torch_name, shape, nbytes)


def describe_all(items: Sequence[tuple[str, Any]], target: str = "tensors") -> list[TensorMeta]:
    """``describe`` for every item; InvalidTensors names the first bad one."""
    try:
        return [describe(name, value) for name, value in items]
    except ValueError as exc:
        raise InvalidTensors(target, str(exc)) from None


def digest_tensors(
    tensors: TensorProvider | TensorSource,
    *,
    gpu: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """The digest (``blake3:`` + 64 hex) of a set of named tensors, as ``rolloutfleet digest`` would give it
    for a safetensors checkpoint holding them.

    ``gpu=False`` hashes CUDA tensors on the host (copying each); ``progress(bytes_done, bytes_total)``.
    Raises InvalidTensors for a bad provider or tensor.
    """
    source = tensors if isinstance(tensors, TensorSource) else TensorSource(tensors)
    items = source.items()
    metas = describe_all(items, source.target)
    total = sum(m.nbytes for m in metas)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    hashes: dict[str, bytes] = {}
    torch_items: list[tuple[str, Any]] = []
    for name, value in items:
        if isinstance(value, RawTensor):
            hashes[name] = blake3.blake3(value.data, max_threads=blake3.blake3.AUTO).digest()
            advance(memoryview(value.data).nbytes)
        else:
            torch_items.append((name, value))
    if torch_items:
        computed = torch_tensors.hash_tensors([v for _, v in torch_items], gpu=gpu, progress=advance)
        hashes.update(zip((n for n, _ in torch_items), computed, strict=True))
    builder = wdigest.DigestBuilder()
    for m in metas:
        # DigestBuilder is the checkpoint digest's own combiner; the "file" only names a tensor in its errors.
        info = wdigest.TensorInfo(m.name, m.dtype, m.shape, Path(f"<{source.target} tensor {m.name}>"), 0, m.nbytes)
        builder.add(info, hashes[m.name])
    return builder.hexdigest()
