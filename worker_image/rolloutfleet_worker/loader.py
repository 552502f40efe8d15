"""Stream a safetensors checkpoint into a live model in place, hashing while it streams.

Called by ``rolloutfleet_worker.extension`` inside a vLLM worker (and by the unit tests and
``bench/gpu_update.py``). Owns the read → hash → hand-over pipeline of one load:

- a scheduler thread walks the tensors in file order, allocates one host buffer per tensor (pinned when
  the model lives on a GPU, so the host→device copy runs at link speed) within a read-ahead byte budget,
  and splits it into chunks;
- a pool of reader threads fills the chunks with ``preadv`` straight from the page cache into the buffer
  (one copy, no mmap page faults, the GIL released; one core cannot keep up with a PCIe 5 link);
- a hasher thread feeds the filled chunks to blake3 in order (multi-threaded, GIL released) — it hashes
  the buffer, so the digest covers exactly the bytes the model receives;
- the calling thread hands each completely filled tensor to ``model.load_weights`` — vLLM's own per-model
  loader, which stacks q/k/v, shards for tensor parallelism and copies into the existing parameters (CUDA
  graphs hold their pointers, so nothing is rebound).

All four run at once: while the model copies tensor k to the device, later tensors are being read and
hashed. Buffers are ordinary torch tensors (torch caches pinned blocks, so later loads allocate nothing),
never a reused ring: a ``load_weights`` that keeps a reference to a tensor can never see it overwritten.
The digest definition lives in ``rolloutfleet_worker.digest``; this module only feeds it.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolloutfleet_worker import digest

CHUNK_BYTES = 16 << 20  # per preadv and per hash update: large enough for blake3 to use every core
READAHEAD_BYTES = 2 << 30  # host bytes read ahead of the model; one tensor is always admitted
_POLL = 0.05  # seconds between stop checks while a thread waits


def default_read_threads() -> int:
    """Reader threads when not configured: half the cores (the other half hash), between 2 and 8."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How one load reads; the extension fills it from ROLLOUTFLEET_LOAD_* / ROLLOUTFLEET_HASH_THREADS."""

    pin: bool = False  # page-locked host buffers (the model is on a GPU)
    read_threads: int = field(default_factory=default_read_threads)
    hash_threads: int | None = None  # None: blake3 uses every core
    readahead_bytes: int = READAHEAD_BYTES
    chunk_bytes: int = CHUNK_BYTES


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


class _StoppedError(Exception):
    """The pipeline was stopped while a thread waited."""


def _memory(address: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes of host memory at ``address`` (inside a live tensor)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def _fill(fd: int, file: Path, address: int, offset: int, length: int) -> None:
    """Read ``length`` bytes of ``file`` at ``offset`` into the buffer at ``address`` (reader thread)."""
    view = _memory(address, length)
    done = 0
    while done < length:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise digest.CheckpointError(file, f"unreadable: {exc.strerror or exc}") from exc
        if n == 0:
            raise digest.CheckpointError(file, "truncated while reading")
        done += n


@dataclass(slots=True)
class _Staged:
    """One tensor in flight: its buffer, the futures filling it, and how many stages still hold it."""

    info: digest.TensorInfo
    feed: bool  # handed to load_weights (else only hashed)
    buffer: torch.Tensor | None
    chunks: list[tuple[Future[None], int, int]]  # (fill, start, length) in order
    holders: int  # hasher, plus the feeder when ``feed``

    def wait_filled(self) -> None:
        for fut, _start, _length in self.chunks:
            fut.result()


class _Budget:
    """Bytes of host buffers in flight; waits while a new tensor would exceed the limit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    def acquire(self, n: int, stop: threading.Event) -> None:
        with self.cond:
            while self.used and self.used + n > self.limit:
                if stop.is_set():
                    raise _StoppedError
                self.cond.wait(_POLL)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class _Pipeline:
    """The threads of one load; ``tensors()`` is what ``load_weights`` iterates (calling thread)."""

    def __init__(self, infos: list[digest.TensorInfo], skip: Callable[[str], bool], options: LoadOptions) -> None:
        self.infos, self.skip, self.options = infos, skip, options
        self.builder = digest.DigestBuilder()
        self.skipped: list[str] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.budget = _Budget(max(1, options.readahead_bytes))
        self.lock = threading.Lock()
        self.to_hash: queue.Queue[_Staged | None] = queue.Queue()
        self.to_feed: queue.Queue[_Staged | None] = queue.Queue()
        self.fds: dict[Path, int] = {}
        self.pool = ThreadPoolExecutor(max(1, options.read_threads), thread_name_prefix="rolloutfleet-read")
        # Pinned allocations must happen in this worker's CUDA context, not device 0's (a new thread's
        # default): the scheduler thread adopts the caller's current device.
        self.device = torch.cuda.current_device() if options.pin and torch.cuda.is_available() else None
        self.scheduler = threading.Thread(target=self._schedule, name="rolloutfleet-schedule", daemon=True)
        self.hasher = threading.Thread(target=self._hash, name="rolloutfleet-hash", daemon=True)

    # -- lifecycle (calling thread) ------------------------------------------------------------------

    def start(self) -> None:
        try:
            for info in self.infos:
                if info.file not in self.fds:
                    self.fds[info.file] = self._open(info.file)
        except BaseException:
            self.close()
            raise
        self.scheduler.start()
        self.hasher.start()

    def close(self) -> None:
        """Stop every thread and wait for them: no reader writes into a buffer after this returns."""
        self.stop.set()
        for thread in (self.scheduler, self.hasher):
            if thread.is_alive():
                thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def finish(self) -> None:
        """Wait for the hasher to cover every tensor (after ``tensors()`` ran out); raise a stage's error."""
        while self.hasher.is_alive():
            self.hasher.join(_POLL)
        if self.error is not None:
            raise self.error

    @staticmethod
    def _open(file: Path) -> int:
        try:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise digest.CheckpointError(file, f"unreadable: {exc.strerror or exc}") from exc
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger kernel read-ahead from disk
        return fd

    def _fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        self.stop.set()

    def _release(self, staged: _Staged) -> None:
        with self.lock:
            staged.holders -= 1
            last = staged.holders == 0
            if last:
                staged.buffer = None
        if last:
            self.budget.release(staged.info.nbytes)

    # -- scheduler thread ----------------------------------------------------------------------------

    def _schedule(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            for info in self.infos:
                if self.stop.is_set():
                    return
                self.budget.acquire(info.nbytes, self.stop)
                self._stage(info)
        except _StoppedError:
            return
        except BaseException as exc:
            self._fail(exc)
        finally:
            self.to_hash.put(None)
            self.to_feed.put(None)

    def _stage(self, info: digest.TensorInfo) -> None:
        torch_dtype(info.dtype, info.file)  # refuse an unsupported dtype before reading it
        feed = not self.skip(info.name)
        if not feed:
            self.skipped.append(info.name)
        buffer = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=self.options.pin)
        address, chunks = buffer.data_ptr(), []
        step = max(1, self.options.chunk_bytes)
        for start in range(0, info.nbytes, step):
            length = min(step, info.nbytes - start)
            fut = self.pool.submit(_fill, self.fds[info.file], info.file, address + start, info.offset + start, length)
            chunks.append((fut, start, length))
        staged = _Staged(info=info, feed=feed, buffer=buffer, chunks=chunks, holders=2 if feed else 1)
        self.to_hash.put(staged)
        if feed:
            self.to_feed.put(staged)

    # -- hasher thread -------------------------------------------------------------------------------

    def _hash(self) -> None:
        try:
            while (staged := self._next(self.to_hash)) is not None:
                hasher = digest.TensorHasher(staged.info, threads=self.options.hash_threads)
                assert staged.buffer is not None  # the hasher holds it until _release below
                address = staged.buffer.data_ptr()
                for fut, start, length in staged.chunks:
                    fut.result()
                    hasher.update(_memory(address + start, length))
                self.builder.add(staged.info, hasher.finish())
                self._release(staged)
        except (_StoppedError, CancelledError):
            return
        except BaseException as exc:
            self._fail(exc)

    def _next(self, source: queue.Queue[_Staged | None]) -> _Staged | None:
        while True:
            if self.stop.is_set():
                raise _StoppedError
            try:
                return source.get(timeout=_POLL)
            except queue.Empty:
                continue

    # -- calling thread ------------------------------------------------------------------------------

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each fed tensor once it is completely read, in file order; raises the first stage error."""
        while True:
            try:
                staged = self._next(self.to_feed)
            except _StoppedError:
                staged = None
            if staged is None:
                if self.error is not None:
                    raise self.error
                return
            try:
                staged.wait_filled()
            except BaseException as exc:
                self._fail(exc)
                raise
            assert staged.buffer is not None
            info = staged.info
            tensor = staged.buffer.view(torch_dtype(info.dtype, info.file)).reshape(info.shape)
            try:
                yield info.name, tensor
            finally:
                del tensor
                self._release(staged)


def stream_into(
    model: Any,
    path: Path | str,
    *,
    skip: Callable[[str], bool] = lambda _name: False,
    options: LoadOptions | None = None,
) -> LoadOutcome:
    """Load every tensor of checkpoint directory ``path`` into ``model`` via its ``load_weights``.

    Raises CheckpointError (bad directory or file: nothing or part was fed) or LoadWeightsError (the
    model's loader raised). Either way the caller must treat the model's contents as unknown.
    """
    start = time.monotonic()
    # Every header is parsed and bounds-checked before the first byte reaches the model, so a truncated
    # or corrupt shard is refused while the parameters are still intact.
    infos = digest.scan_directory(path)
    pipeline = _Pipeline(infos, skip, options or LoadOptions())
    pipeline.start()
    try:
        fed = _Counter(pipeline.tensors())
        try:
            model.load_weights(fed)
        except digest.CheckpointError:
            raise
        except Exception as exc:
            if pipeline.error is not None:
                raise pipeline.error from exc
            raise LoadWeightsError(f"{type(exc).__name__}: {exc}") from exc
        # A loader that stops early must not shorten the digest: read and hash what it did not consume.
        for _ in fed.inner:
            pass
        pipeline.finish()
    finally:
        pipeline.close()
    return LoadOutcome(
        digest=pipeline.builder.hexdigest(),
        bytes=pipeline.builder.bytes,
        tensors=fed.count,
        skipped=sorted(pipeline.skipped),
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
