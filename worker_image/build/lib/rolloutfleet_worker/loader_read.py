"""The read path of the loader: copy the files into per-tensor (pinned) buffers, hash them, feed them.

Used by ``loader.stream_into`` whenever the mapped path does not run: tensor or pipeline parallel engines
(each rank copies only its shard from host memory), no GPU, storage or a platform that refuses mapping or
read-only host registration, or ``ROLLOUTFLEET_LOAD_MODE=read``. Four stages run at once:

- a scheduler thread walks the tensors in file order, allocates one host buffer per tensor (pinned when
  the model lives on a GPU) within the read-ahead budget, and splits it into chunks;
- a pool of reader threads fills the chunks with ``preadv`` straight from the page cache (one copy, no
  mmap page faults, the GIL released; one core reads ~5.5 GB/s on the H200 host);
- a hasher thread feeds the filled chunks to blake3 in order — it hashes the buffer, so the digest covers
  exactly the bytes the model receives;
- the calling thread hands each completely filled tensor to ``model.load_weights``.

Buffers are ordinary torch tensors (torch caches pinned blocks, so later loads allocate nothing), never a
reused ring: a ``load_weights`` that keeps a reference to a tensor can never see it overwritten.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

import rolloutfleet_digest as digest
from rolloutfleet_worker.loader_base import (
    POLL,
    Budget,
    LoadOptions,
    StoppedError,
    memory,
    open_file,
    read_into,
    torch_dtype,
)


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


class ReadPipeline:
    """The threads of one read-path load; ``tensors()`` is what ``load_weights`` iterates (calling thread)."""

    def __init__(self, infos: list[digest.TensorInfo], skip: Callable[[str], bool], options: LoadOptions) -> None:
        self.infos, self.skip, self.options = infos, skip, options
        self.builder = digest.DigestBuilder()
        self.skipped: list[str] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.budget = Budget(max(1, options.readahead_bytes))
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
            self.hasher.join(POLL)
        if self.error is not None:
            raise self.error

    def _open(self, file: Path) -> int:
        fd = open_file(file, self.options.roots)
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
        except StoppedError:
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
            fut = self.pool.submit(
                read_into, self.fds[info.file], info.file, address + start, info.offset + start, length
            )
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
                    hasher.update(memory(address + start, length))
                self.builder.add(staged.info, hasher.finish())
                self._release(staged)
        except (StoppedError, CancelledError):
            return
        except BaseException as exc:
            self._fail(exc)

    def _next(self, source: queue.Queue[_Staged | None]) -> _Staged | None:
        while True:
            if self.stop.is_set():
                raise StoppedError
            try:
                return source.get(timeout=POLL)
            except queue.Empty:
                continue

    # -- calling thread ------------------------------------------------------------------------------

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each fed tensor once it is completely read, in file order; raises the first stage error."""
        while True:
            try:
                staged = self._next(self.to_feed)
            except StoppedError:
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
