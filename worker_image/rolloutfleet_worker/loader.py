"""Stream a safetensors checkpoint into a live model in place, hashing while it streams.

Called by ``rolloutfleet_worker.extension`` inside a vLLM worker (and by the unit tests on CPU). Owns
the read → hash → hand-over pipeline: a reader thread mmaps each file, feeds each tensor's stored bytes
straight from the page cache to blake3's multi-threaded hasher, copies them once into a host buffer
(pinned when the model lives on a GPU, so the host→device copy runs at link speed) and queues it; the
calling thread hands the tensors to ``model.load_weights`` — vLLM's own per-model loader, which stacks
q/k/v, shards for tensor parallelism and copies into the existing parameters (CUDA graphs hold their
pointers, so nothing is rebound). Reading and hashing tensor k+1 overlaps the copies of tensor k.
The digest definition lives in ``rolloutfleet_worker.digest``; this module only feeds it.
"""

from __future__ import annotations

import mmap
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolloutfleet_worker import digest

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
            by_file: dict[Path, list[digest.TensorInfo]] = {}
            for info in self.infos:
                by_file.setdefault(info.file, []).append(info)
            for file, infos in by_file.items():
                if not self._read_file(file, infos):
                    return
            self._put(None)
        except OSError as exc:
            self.error = digest.CheckpointError(getattr(exc, "filename", None) or "?", f"unreadable: {exc}")
            self._put(self.error)
        except BaseException as exc:
            self.error = exc
            self._put(exc)

    def _read_file(self, file: Path, infos: list[digest.TensorInfo]) -> bool:
        """Hash straight from the page cache (mmap, all cores), then one copy into the staging buffer."""
        with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm.size() < max(t.offset + t.nbytes for t in infos):
                raise digest.CheckpointError(file, "truncated while reading")
            view = memoryview(mm)
            try:
                for info in infos:
                    if self.stop.is_set():
                        return False
                    with view[info.offset : info.offset + info.nbytes] as part:
                        item = self._read(part, info)
                    if item is not None:
                        self._put(item)
            finally:
                view.release()
        return True

    def _read(self, part: memoryview, info: digest.TensorInfo) -> tuple[digest.TensorInfo, torch.Tensor] | None:
        dtype = torch_dtype(info.dtype, info.file)
        hasher = digest.TensorHasher(info, threads=self.threads)
        hasher.update(part)
        self.builder.add(info, hasher.finish())
        # Skipped tensors are still hashed (the digest covers the whole checkpoint) but never copied.
        if self.skip(info.name):
            self.skipped.append(info.name)
            return None
        staged = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        if info.nbytes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only mmap: torch warns, we only read from it
                source = torch.frombuffer(part, dtype=torch.uint8)
            staged.copy_(source)
            del source  # drop the buffer export before the slice is released
        return info, staged.view(dtype).reshape(info.shape)

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
