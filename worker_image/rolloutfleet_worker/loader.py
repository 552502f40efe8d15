"""Stream a safetensors checkpoint into a live model in place, hashing while it streams.

Called by ``rolloutfleet_worker.extension`` inside a vLLM worker (and by the unit tests on CPU). Owns
the read → hash → hand-over pipeline: a reader thread reads each tensor's stored bytes into a host buffer
(pinned when the model lives on a GPU, so the host→device copy runs at link speed), feeds the same
buffer to blake3's multi-threaded hasher, and queues it; the calling thread hands the tensors to
``model.load_weights`` — vLLM's own per-model loader, which stacks q/k/v, shards for tensor parallelism
and copies into the existing parameters (CUDA graphs hold their pointers, so nothing is rebound). Reading
and hashing tensor k+1 overlaps the copies of tensor k. The digest definition lives in
``rolloutfleet_worker.digest``; this module only feeds it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolloutfleet_worker import digest

CHUNK_BYTES = 64 << 20  # large enough for blake3 to spread one update over all cores
QUEUE_DEPTH = 2  # tensors read ahead; bounds host memory to about three tensors


class LoadWeightsError(Exception):
    """``model.load_weights`` raised; the original exception is ``__cause__``."""


@dataclass(slots=True)
class LoadOutcome:
    """What one streamed load did: the digest of every tensor read, and which ones were fed."""

    digest: str
    bytes: int
    tensors: int  # tensors handed to load_weights
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def torch_dtype(name: str, file: Path) -> torch.dtype:
    """The torch dtype of a safetensors dtype string; CheckpointError naming ``file`` if unknown."""
    attr = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "I32": "int32",
        "U32": "uint32",
        "I64": "int64",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E8M0": "float8_e8m0fnu",
    }.get(name)
    dt = getattr(torch, attr, None) if attr else None
    if not isinstance(dt, torch.dtype):
        raise digest.CheckpointError(file, f"dtype {name!r} not supported by this torch")
    return dt


def _host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, memoryview]:
    """A uint8 host tensor and a writable memoryview over the same memory (read target and hash input)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    try:
        array: Any = buf.numpy()  # numpy ships with vLLM; a zero-copy view of the tensor's memory
        return buf, memoryview(array)
    except (RuntimeError, ImportError):
        raw = bytearray(nbytes)  # no numpy: pageable bytes, still zero-copy into torch
        tensor = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return tensor, memoryview(raw)


class _Reader(threading.Thread):
    """Reads and hashes every tensor in order; queues those not skipped for the model."""

    def __init__(
        self,
        infos: list[digest.TensorInfo],
        skip: Callable[[str], bool],
        pin: bool,
        threads: int | None,
    ) -> None:
        super().__init__(name="rolloutfleet-reader", daemon=True)
        self.infos, self.skip, self.pin, self.threads = infos, skip, pin, threads
        self.builder = digest.DigestBuilder()
        self.skipped: list[str] = []
        self.out: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_DEPTH)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            current: Path | None = None
            f = None
            try:
                for info in self.infos:
                    if self.stop.is_set():
                        return
                    if info.file != current:
                        if f is not None:
                            f.close()
                        current, f = info.file, info.file.open("rb")
                    assert f is not None
                    item = self._read(f, info)
                    if item is not None:
                        self._put(item)
            finally:
                if f is not None:
                    f.close()
            self._put(None)
        except OSError as exc:
            self.error = digest.CheckpointError(current or "?", f"unreadable: {exc.strerror or exc}")
            self._put(self.error)
        except BaseException as exc:
            self.error = exc
            self._put(exc)

    def _read(self, f: Any, info: digest.TensorInfo) -> tuple[digest.TensorInfo, torch.Tensor] | None:
        dtype = torch_dtype(info.dtype, info.file)
        skipped = self.skip(info.name)
        # Skipped tensors are still read and hashed: the digest covers the whole checkpoint.
        tensor, view = _host_buffer(info.nbytes, self.pin and not skipped)
        hasher = digest.TensorHasher(info, threads=self.threads)
        f.seek(info.offset)
        pos = 0
        while pos < info.nbytes:
            part = view[pos : min(info.nbytes, pos + CHUNK_BYTES)]
            got = f.readinto(part)
            if not got:
                raise digest.CheckpointError(info.file, f"truncated while reading tensor {info.name!r}")
            hasher.update(part[:got])
            pos += got
        self.builder.add(info, hasher.finish())
        if skipped:
            self.skipped.append(info.name)
            return None
        return info, tensor.view(dtype).reshape(info.shape)

    def _put(self, item: object) -> None:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            item = self.out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            info, tensor = item
            yield info.name, tensor


def stream_into(
    model: Any,
    path: Path | str,
    *,
    skip: Callable[[str], bool] = lambda _name: False,
    pin: bool = False,
    threads: int | None = None,
) -> LoadOutcome:
    """Load every tensor of checkpoint directory ``path`` into ``model`` via its ``load_weights``.

    Raises CheckpointError (bad directory or file: nothing or part was fed) or LoadWeightsError (the
    model's loader raised). Either way the caller must treat the model's contents as unknown.
    """
    start = time.monotonic()
    # Every header is parsed and bounds-checked before the first byte reaches the model, so a truncated
    # or corrupt shard is refused while the parameters are still intact.
    infos = digest.scan_directory(path)
    reader = _Reader(infos, skip, pin, threads)
    reader.start()
    stream = reader.tensors()
    try:
        fed = _Counter(stream)
        try:
            model.load_weights(fed)
        except digest.CheckpointError:
            raise
        except Exception as exc:
            if reader.error is not None:
                raise reader.error from exc
            raise LoadWeightsError(f"{type(exc).__name__}: {exc}") from exc
        # A loader that stops early must not shorten the digest: hash what it did not consume.
        for _ in stream:
            pass
    finally:
        reader.stop.set()
        reader.join(timeout=30)
    if reader.error is not None:
        raise reader.error
    return LoadOutcome(
        digest=reader.builder.hexdigest(),
        bytes=reader.builder.bytes,
        tensors=fed.count,
        skipped=sorted(reader.skipped),
        seconds=round(time.monotonic() - start, 6),
    )


class _Counter:
    """Iterator wrapper counting what ``load_weights`` actually pulled."""

    def __init__(self, inner: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.inner, self.count = inner, 0

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        item = next(self.inner)
        self.count += 1
        return item
