"""The mapped path of the loader: GPU staging from pinned bounce buffers or from the page cache locked in place.

Used by ``loader.stream_into`` for a single-GPU engine whose platform locks read-only mappings. The files
are mapped read-only and walked in windows (``WINDOW_BYTES``); each window reaches the GPU one of two ways,
interleaved by ``LoadOptions.bounce_share``:

- **bounced** (the worker's default for every window): reader threads ``preadv`` it into a pinned buffer
  (torch's pinned cache keeps the buffers between loads); costs host cores and host memory bandwidth, which
  bounds it near 31-34 GB/s on the H200 host;
- **locked in place**: ``cudaHostRegister`` (read-only) pins the page cache itself; costs no copy, but the
  driver caps lock + copy near 19 GB/s there however many threads lock, and ``cudaHostUnregister`` waits
  for the copies in flight (so unlocking can run on a thread of its own).

Stages, all running at once: a scheduler thread readies windows in order within the read-ahead budget; a
copier thread, once a tensor's windows are ready, copies its bytes to a staging tensor on the GPU on a side
stream, queues its BLAKE3 there (``blake3_device``, for tensors of 1 MiB and more once the self-test
passed) and records an event; a hasher thread collects the device digests and hashes the rest on the host
from the mapping; the calling thread makes the model's stream wait for the copy and hands the GPU tensor to
``model.load_weights`` (whose copies into the parameters are then device to device).

The model never sees host memory: a loader that edits a tensor in place edits its private GPU copy, and
the mapping stays read-only. Windows are released once the copies that read them have finished. A window
the driver refuses to lock is copied from pageable memory instead (slower, same bytes); a staging tensor
the GPU has no room for is handed over as a private host copy.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import rolloutfleet_digest as digest
from rolloutfleet_worker import blake3_device
from rolloutfleet_worker.blake3_device import CHUNK_LEN
from rolloutfleet_worker.loader_base import (
    POLL,
    Budget,
    ErrorLatch,
    HostPinner,
    LoadOptions,
    Queued,
    StoppedError,
    device_buffer,
    handed_out,
    memory,
    next_queued,
    open_file,
    read_into,
    torch_dtype,
)
from rolloutfleet_worker.loader_cuda import CudaCopies, HostCopies, device_hash_works


class MappingUnsupportedError(Exception):
    """A checkpoint file opens but cannot be memory-mapped; ``loader.stream_into`` then reads it instead."""


@dataclass(slots=True)
class _Mapped:
    """One checkpoint file, mapped read-only; ``base`` is a uint8 tensor over the whole mapping."""

    file: Path
    mm: mmap.mmap
    base: torch.Tensor
    address: int
    fd: int = -1  # open while bounce windows read from it


@dataclass(slots=True)
class _Window:
    """A page-aligned span of one mapping, locked and unlocked as a unit (or read into a bounce buffer)."""

    address: int
    length: int
    file_offset: int
    readable: int  # bytes of the file inside the window (the last page may run past its end)
    bounce: bool = False  # read into ``buffer`` instead of locked in place
    buffer: torch.Tensor | None = None  # the bounce buffer, filled (pinned when the model is on a GPU)
    reads_left: int = 0  # bounce reads still running
    mapped: _Mapped | None = None
    pending: int = 0  # fed tensors overlapping it whose copy is not issued yet
    locked: threading.Event = field(default_factory=threading.Event)  # set once the attempt finished
    pinned: bool = False
    last_copy: Any = None  # event of the latest copy reading it (copies are ordered on one stream)


@dataclass(slots=True)
class _Tensor:
    info: digest.TensorInfo
    mapped: _Mapped
    windows: list[_Window]
    fed: bool = False  # handed to load_weights (else only hashed)
    staged: threading.Event = field(default_factory=threading.Event)  # the copier is done with it
    ready: Any = None  # event after its copy (and device hash) on the copy stream
    device_hash: Any = None  # blake3_device result (8 words on the GPU), when hashed there


class MappedPipeline:
    """The threads of one mapped-path load; ``tensors()`` is what ``load_weights`` iterates."""

    def __init__(
        self,
        infos: list[digest.TensorInfo],
        skip: Callable[[str], bool],
        options: LoadOptions,
        pinner: HostPinner,
        copies: CudaCopies | HostCopies,
    ) -> None:
        self.infos, self.skip, self.options = infos, skip, options
        self.pinner, self.copies = pinner, copies
        self.builder = digest.DigestBuilder()
        self.skipped: list[str] = []
        self.unpinned_bytes = 0  # bytes copied from pageable memory (a window the driver refused)
        self.device_hashed_bytes = 0  # bytes hashed on the GPU (blake3_device)
        self.bounced_bytes = 0  # bytes copied from bounce buffers (read, not page-locked in place)
        self.gpu_hash = options.gpu_hash and device_hash_works(copies)
        self.host_fallback_bytes = 0  # bytes handed over in host memory (no GPU room for staging)
        self.latch = ErrorLatch()
        self.locked = Budget(options.readahead_bytes)  # limit raised in _map to fit the widest tensor
        self.staged = Budget(options.readahead_bytes)
        self.files: dict[Path, _Mapped] = {}
        self.windows: list[_Window] = []
        self.fed: list[_Tensor] = []
        self.all: list[_Tensor] = []
        self.to_feed: queue.Queue[tuple[_Tensor, torch.Tensor, Any, bool] | None] = queue.Queue()
        self.pool = ThreadPoolExecutor(max(1, options.register_threads), thread_name_prefix="rolloutfleet-lock")
        self.unlock_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="rolloutfleet-unlock") if options.unlock_apart else self.pool
        )
        self.readers = (
            ThreadPoolExecutor(max(1, options.bounce_threads), thread_name_prefix="rolloutfleet-read")
            if options.bounce_share > 0
            else None
        )
        self.jobs: list[Future[None]] = []
        self.device = copies.device if isinstance(copies, CudaCopies) else None
        self.count_lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._schedule, name="rolloutfleet-schedule", daemon=True),
            threading.Thread(target=self._copy, name="rolloutfleet-copy", daemon=True),
            threading.Thread(target=self._hash, name="rolloutfleet-hash", daemon=True),
        ]

    @property
    def error(self) -> BaseException | None:
        return self.latch.error

    # -- lifecycle (calling thread) ------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._map()
        except BaseException:
            self.close()
            raise
        for thread in self.threads:
            thread.start()

    def _map(self) -> None:
        page = mmap.PAGESIZE
        step = max(page, self.options.window_bytes // page * page)
        windows: dict[Path, list[_Window]] = {}
        for info in self.infos:
            if info.file not in self.files:
                fd = open_file(info.file, self.options.roots)
                try:
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as exc:  # e.g. a FUSE mount without mmap support
                    raise MappingUnsupportedError(f"{info.file}: cannot be mapped: {exc}") from exc
                finally:
                    os.close(fd)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only mapping; nothing writes through it
                    base = torch.frombuffer(mm, dtype=torch.uint8)
                mapped = _Mapped(info.file, mm, base, base.data_ptr())
                self.files[info.file] = mapped
                # Whole pages only: the driver locks pages, and the mapping's last page is readable to its end.
                size = -(-len(mm) // page) * page
                spans = range(0, size, step)
                windows[info.file] = [
                    _Window(mapped.address + s, min(step, size - s), s, min(step, len(mm) - s), mapped=mapped)
                    for s in spans
                ]
                self.windows.extend(windows[info.file])
                if self.readers is not None:
                    mapped.fd = open_file(info.file, self.options.roots)
            mapped = self.files[info.file]
            if len(mapped.mm) < info.offset + info.nbytes:
                raise digest.CheckpointError(info.file, "truncated while reading")
            first, last = info.offset // step, max(info.offset, info.offset + info.nbytes - 1) // step
            tensor = _Tensor(info, mapped, windows[info.file][first : last + 1] if info.nbytes else [])
            self.all.append(tensor)
            if self.skip(info.name):
                self.skipped.append(info.name)
            else:
                tensor.fed = True
                torch_dtype(info.dtype, info.file)  # refuse an unsupported dtype before any copy
                for w in tensor.windows:
                    w.pending += 1
                self.fed.append(tensor)
                # A tensor is staged only once all its windows are locked, and windows unlock only after
                # that: the lock budget must hold the widest tensor's windows, plus room to read ahead.
                span = sum(w.length for w in tensor.windows) + 2 * step
                self.locked.limit = max(self.locked.limit, span)

    def close(self) -> None:
        """Stop every thread, wait for the copies, unlock every window; nothing reads the mappings after."""
        self.latch.stop.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.readers is not None:
            self.readers.shutdown(wait=True, cancel_futures=True)
        self.unlock_pool.shutdown(wait=True, cancel_futures=True)
        for w in self.windows:
            if w.pinned:
                self.copies.wait(w.last_copy)
                self.pinner.unregister(w.address)
                w.pinned = False
            if w.buffer is not None:
                self.copies.wait(w.last_copy)
                w.buffer = None
        for mapped in self.files.values():
            if mapped.fd >= 0:
                os.close(mapped.fd)
                mapped.fd = -1
        # The mappings close when the last tensor over them is gone (a loader may still hold one).
        self.files.clear()
        if isinstance(self.copies, CudaCopies):
            torch.cuda.empty_cache()  # give the staging blocks back before the KV cache wakes

    def finish(self) -> None:
        """After ``tensors()`` ran out: wait for the hash of every tensor and every unlock; raise an error."""
        for thread in self.threads:
            while thread.is_alive():
                thread.join(POLL)
        for job in list(self.jobs):
            job.result()
        if self.latch.error is not None:
            raise self.latch.error

    # -- scheduler thread: lock windows in order -----------------------------------------------------

    def _schedule(self) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)  # bounce buffers are pinned in this device's context
            share, copied = self.options.bounce_share if self.readers is not None else 0.0, 0
            for w in self.windows:
                if self.latch.stop.is_set():
                    return
                if w.pending == 0:  # only skipped tensors (or none) here: nothing to copy from it
                    w.locked.set()
                    continue
                self.locked.acquire(w.length, self.latch.stop)
                # Interleave: the n-th window copied from is bounced when the share's running total says so.
                w.bounce = int((copied + 1) * share + 1e-9) > int(copied * share + 1e-9)
                copied += 1
                if w.bounce:
                    self._bounce(w)
                else:
                    self.jobs.append(self.pool.submit(self._lock, w))
        except StoppedError:
            return
        except BaseException as exc:
            self.latch.fail(exc)

    def _lock(self, w: _Window) -> None:
        try:
            w.pinned = self.pinner.register(w.address, w.length)
        except BaseException as exc:
            self.latch.fail(exc)
        finally:
            if not w.pinned:
                self.locked.release(w.length)
            w.locked.set()

    def _bounce(self, w: _Window) -> None:
        """Read the window's bytes into a fresh buffer on the reader pool, in ``chunk_bytes`` pieces."""
        assert self.readers is not None
        w.buffer = torch.empty(w.length, dtype=torch.uint8, pin_memory=self.device is not None)
        assert w.mapped is not None
        fd, file = w.mapped.fd, w.mapped.file
        base, step = w.buffer.data_ptr(), max(1, self.options.chunk_bytes)
        pieces = range(0, w.readable, step)
        w.reads_left = len(pieces)
        for start in pieces:
            length = min(step, w.readable - start)
            job = self.readers.submit(read_into, fd, file, base + start, w.file_offset + start, length)
            job.add_done_callback(lambda done, w=w: self._bounced(w, done))  # type: ignore[misc]

    def _bounced(self, w: _Window, done: Future[None]) -> None:
        """A bounce read finished (reader thread): the window is ready after its last one."""
        exc = None if done.cancelled() else done.exception()
        if exc is not None:
            self.latch.fail(exc)
        with self.count_lock:
            w.reads_left -= 1
            last = w.reads_left == 0
        if last or exc is not None or done.cancelled():
            w.locked.set()

    def _unlock(self, w: _Window) -> None:
        try:
            self.copies.wait(w.last_copy)
            if w.buffer is not None:
                w.buffer = None
                self.locked.release(w.length)
            if w.pinned:
                self.pinner.unregister(w.address)
                w.pinned = False
                self.locked.release(w.length)
        except BaseException as exc:
            self.latch.fail(exc)

    # -- copier thread: GPU staging in order ---------------------------------------------------------

    def _copy(self) -> None:
        try:
            self.copies.bind()
            for t in self.fed:
                for w in t.windows:
                    while not w.locked.wait(POLL):
                        if self.latch.stop.is_set():
                            return
                # A failed bounce read stops the pipeline before it marks its window ready: never stage
                # a window that was only partly read.
                if self.latch.stop.is_set():
                    return
                self.to_feed.put(self._stage(t))
                t.staged.set()
        except StoppedError:
            return
        except BaseException as exc:
            self.latch.fail(exc)
        finally:
            self.to_feed.put(None)

    def _stage(self, t: _Tensor) -> tuple[_Tensor, torch.Tensor, Any, bool]:
        info = t.info
        source = t.mapped.base[info.offset : info.offset + info.nbytes]
        if any(not w.pinned and w.buffer is None for w in t.windows):
            self.unpinned_bytes += info.nbytes
        self.staged.acquire(info.nbytes, self.latch.stop)
        try:
            staging = self._device_buffer(info.nbytes)
        except torch.cuda.OutOfMemoryError:
            staging = None
        if staging is None:  # no room on the GPU even with nothing staged: a private host copy
            self.host_fallback_bytes += info.nbytes
            event, staging, on_device = None, source.clone(), False
        else:
            # One copy per window: a source spanning two registrations is an invalid argument to the driver.
            start, end = info.offset, info.offset + info.nbytes
            for w in t.windows:
                lo = max(start, w.file_offset)
                hi = min(end, w.file_offset + w.length)
                if lo >= hi:
                    continue
                if w.buffer is not None:
                    src = w.buffer[lo - w.file_offset : hi - w.file_offset]
                    self.bounced_bytes += hi - lo
                else:
                    src = source[lo - start : hi - start]
                self.copies.copy(staging[lo - start : hi - start], src)
            if self.gpu_hash and info.nbytes >= max(self.options.gpu_hash_min_bytes, 2 * CHUNK_LEN):
                t.device_hash = self._hash_on_device(t, staging)
            event, on_device = self.copies.record(), True
            t.ready = event
        for w in t.windows:
            w.last_copy = event if event is not None else w.last_copy
            w.pending -= 1
            if w.pending == 0:
                self.jobs.append(self.unlock_pool.submit(self._unlock, w))
        return t, staging, event, on_device

    def _hash_on_device(self, t: _Tensor, staging: torch.Tensor) -> Any:
        """Queue the tensor's BLAKE3 behind its copy; the model's stream will wait for both."""
        full, rest = divmod(t.info.nbytes, CHUNK_LEN)
        tail = bytes(memory(t.mapped.address + t.info.offset + full * CHUNK_LEN, rest)) if rest else None
        with self.copies.on_stream():
            result = blake3_device.hash_on_device(staging, tail)
        self.device_hashed_bytes += t.info.nbytes
        return result

    def _device_buffer(self, n: int) -> torch.Tensor | None:
        return device_buffer(self.copies, n, self.staged, self.latch)

    # -- hasher thread -------------------------------------------------------------------------------

    def _hash(self) -> None:
        try:
            for t in self.all:
                # Hash behind the locker: locking faults the pages in, so blake3's threads then read
                # without page faults. Faulting the same mapping while the driver pins it serialised the
                # two on the H200 (20 GB/s together; 42 and 56 GB/s alone).
                for w in t.windows:
                    while not w.locked.wait(POLL):
                        if self.latch.stop.is_set():
                            return
                if self.latch.stop.is_set():
                    return
                if self._device_hashed(t):
                    self.copies.wait(t.ready)
                    self.builder.add(t.info, blake3_device.digest_of(t.device_hash))
                    t.device_hash = None
                    continue
                hasher = digest.TensorHasher(t.info, threads=self.options.hash_threads)
                if t.info.nbytes:
                    hasher.update(memory(t.mapped.address + t.info.offset, t.info.nbytes))
                self.builder.add(t.info, hasher.finish())
        except StoppedError:
            return
        except BaseException as exc:
            self.latch.fail(exc)

    def _device_hashed(self, t: _Tensor) -> bool:
        """Whether the copier hashed ``t`` on the GPU (waits for the copier to get that far when it may)."""
        if not self.gpu_hash or not t.fed:
            return False
        while not t.staged.wait(POLL):
            if self.latch.stop.is_set():
                raise StoppedError
        return t.device_hash is not None

    # -- calling thread ------------------------------------------------------------------------------

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each fed tensor once its copy is issued, in file order; raises the first stage error."""
        return handed_out(self._queued, self.copies, self.staged, self.latch)

    def _queued(self) -> Queued | None:
        item = next_queued(self.to_feed, self.latch)
        return None if item is None else (item[0].info, item[1], item[2])
