"""One stage's host memory and threads: the checkpoints of a revision read into RAM and hashed in the background.

Used by ``rolloutfleet_worker.staging`` (which holds one ``Stage`` per worker and answers the RPCs) and, for
the commit, by ``loader_staged`` through ``Checkpoint`` (where each staged tensor sits, and its hash).
docs/staging.md is the contract; this module owns how a stage fills, fails, stops and gives memory back.

Host memory: anonymous page-aligned ``mmap`` areas (one per group of whole tensors of a file, at most
``AREA_BYTES`` each, so a stop never waits for a huge registration and no tensor spans two registrations),
page-locked with ``cudaHostRegister`` (``loader_cuda.CudaPinner``) on a GPU worker once each area is
filled (in one call, or in ``ROLLOUTFLEET_STAGE_PIN_CHUNK_BYTES`` pieces so no driver call holds the
engine's CUDA calls for long), so the commit copies at the pinned ceiling. Not torch's pinned allocator: its
caching host allocator keeps freed blocks for reuse, so a released stage would stay page-locked for the life of the
process; ``munmap`` gives the pages back at once. On the CPU the same areas, unregistered.

Threads: one stage thread maps the areas, hands the reads to a pool of ``ROLLOUTFLEET_STAGE_THREADS``
readers (``preadv`` in ``CHUNK`` pieces, paced by ``ROLLOUTFLEET_STAGE_GBPS``), and hashes every tensor in
order behind them (blake3 on at most as many threads), building each checkpoint's digest exactly as the
loader does, so it equals ``digest.digest_directory`` of the files. Every thread checks the stop event
between chunks, so stopping a stage returns within one chunk's read. torch is imported only to pin (on a
GPU worker).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rolloutfleet_digest as digest
from rolloutfleet_digest import TensorInfo
from rolloutfleet_worker.loader_base import (
    CHUNK_BYTES,
    POLL,
    ErrorLatch,
    HostPinner,
    OutsideRootsError,
    StoppedError,
    memory,
    open_file,
    read_into,
)
from rolloutfleet_worker.payloads import ErrorBody, ErrorCode, StagedTarget, StagePhase, StageState, Target

# A child of vLLM's logger, so the lines land in the engine's log with its format and level.
log = logging.getLogger("vllm.rolloutfleet")

AREA_BYTES = 1 << 30  # one mapping (and one registration) per group of whole tensors up to this size
ALIGN = 512  # each tensor's bytes start on this boundary inside its area (DMA-friendly, little waste)
CHUNK = CHUNK_BYTES  # bytes per read and per hash update; the stop is checked between chunks


# -- host memory ------------------------------------------------------------------------------------


@functools.cache
def _libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


class HostArea:
    """One anonymous mapping of at least ``length`` bytes; page-locked by ``pin`` once its bytes are in.

    Not Python's ``mmap`` object: tensors and memoryviews over it would pin it open (``close`` refuses
    while views are exported), and the point is that releasing really unmaps.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.size = max(1, -(-length // mmap.PAGESIZE)) * mmap.PAGESIZE
        lib = _libc()
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = lib.mmap(None, self.size, prot, flags, -1, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            raise MemoryError(f"cannot map {self.size} bytes of host memory: {os.strerror(ctypes.get_errno())}")
        self.address: int = int(address)
        madvise = getattr(mmap, "MADV_HUGEPAGE", None)
        if madvise is not None:
            lib.madvise(self.address, self.size, madvise)  # advisory: fewer page faults, faster pinning
        self.pinner: HostPinner | None = None
        self.registered: list[int] = []  # the start of every range registered (one, or one per chunk)

    @property
    def pinned(self) -> bool:
        return bool(self.registered)

    def pin(self, pinner: HostPinner, chunk: int | None = None, stop: threading.Event | None = None) -> bool:
        """Page-lock the area (after it was filled: the readers' page faults zero-fill it on many threads,
        where registering fresh memory first did it on one, inside the driver: 3.5 GB/s on the H200 host).

        ``chunk``: bytes per ``cudaHostRegister`` call (rounded up to whole pages), so no single driver call
        holds the driver for the whole area while the engine serves; None: the whole area in one call. All
        or nothing: a refused chunk unregisters the chunks before it. ``stop`` is checked between chunks
        (``StoppedError``; what was registered stays listed, and ``release`` unregisters it)."""
        if not self.address or self.registered:
            return self.pinned
        step = self.size if not chunk or chunk <= 0 else -(-chunk // mmap.PAGESIZE) * mmap.PAGESIZE
        self.pinner = pinner
        for start in range(0, self.size, step):
            if stop is not None and stop.is_set():
                raise StoppedError
            address = self.address + start
            if not pinner.register(address, min(step, self.size - start)):
                self._unregister()
                return False
            self.registered.append(address)
        return True

    def _unregister(self) -> None:
        if self.pinner is not None:
            for address in self.registered:
                self.pinner.unregister(address)
        self.registered = []
        self.pinner = None

    def release(self) -> int:
        """Unlock (every registered chunk) and unmap (once); the bytes given back, 0 when already released."""
        if not self.address:
            return 0
        self._unregister()
        _libc().munmap(self.address, self.size)
        self.address = 0
        return self.length


class Throttle:
    """A shared pace for the reader threads: each chunk waits for its slot at ``gbps`` (0: never waits)."""

    def __init__(self, gbps: float) -> None:
        self.rate = gbps * 1e9
        self.next = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int, stop: threading.Event) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            slot = max(self.next, now)
            self.next = slot + n / self.rate
        if slot > now and stop.wait(slot - now):
            raise StoppedError


# -- one checkpoint of a stage ----------------------------------------------------------------------


@dataclass
class Checkpoint:
    """One staged checkpoint: its tensors, where each sits in host memory, and the hashes of those bytes.

    Implements ``loader_staged.StagedCheckpoint`` for the commit.
    """

    target: Target
    path: str  # as asked (the operator's name for it; a staged load must name the same)
    real: str  # resolved directory the headers were read from
    infos: list[TensorInfo]
    areas: list[HostArea] = field(default_factory=list)
    places: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (area index, offset in it)
    hashes: dict[str, bytes] = field(default_factory=dict)  # name -> h_t of the staged bytes
    digest: str | None = None  # reported once the whole stage is staged
    committed: bool = False

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.infos)

    def layout(self) -> list[tuple[int, list[TensorInfo]]]:
        """Group the tensors into areas: (area length, its tensors), whole tensors of one file each."""
        groups: list[tuple[int, list[TensorInfo]]] = []
        members: list[TensorInfo] = []
        length, file = 0, None
        for info in self.infos:
            need = -(-info.nbytes // ALIGN) * ALIGN
            if members and (info.file != file or length + need > AREA_BYTES):
                groups.append((length, members))
                length, members = 0, []
            self.places[info.name] = (len(groups), length)
            length, file = length + need, info.file
            members.append(info)
        if members:
            groups.append((length, members))
        return groups

    def address(self, info: TensorInfo) -> int:
        index, offset = self.places[info.name]
        area = self.areas[index] if index < len(self.areas) else None
        if area is None or not area.address:
            raise digest.CheckpointError(self.real, "the staging area was released")
        return area.address + offset

    def tensor_hash(self, name: str) -> bytes:
        return self.hashes[name]

    def report(self, staged: bool) -> StagedTarget:
        """``staged``: the whole stage is; a digest counts only then (before, or once failed, none is)."""
        return StagedTarget(
            path=self.path,
            digest=self.digest if staged else None,
            bytes=self.nbytes,
            tensors=len(self.infos),
            committed=self.committed,
        )

    def release(self) -> int:
        return sum(area.release() for area in self.areas)


# -- the stage --------------------------------------------------------------------------------------


class Stage:
    """One revision's verifier (and draft) in host memory, filled by background threads."""

    def __init__(
        self,
        revision: int,
        verifier: Checkpoint,
        draft: Checkpoint | None,
        limit_bytes: int | None,
        *,
        threads: int,
        gbps: float,
        device: int | None,
        roots: tuple[str, ...],
        pin_chunk_bytes: int | None = None,
    ) -> None:
        self.revision, self.verifier, self.draft, self.limit_bytes = revision, verifier, draft, limit_bytes
        self.threads, self.gbps, self.device, self.roots = max(1, threads), gbps, device, roots
        self.pin_chunk_bytes = pin_chunk_bytes  # bytes per registration call; None: each area in one
        self.key = (revision, verifier.path, draft.path if draft is not None else None)
        self.phase: StagePhase = "staging"
        self.error: ErrorBody | None = None
        self.bytes_done = 0
        self.started = time.monotonic()
        self.ended: float | None = None
        self.pinned_bytes = 0
        self.refused = False  # a registration was refused (warned once)
        self.lock = threading.Lock()
        self.latch = ErrorLatch()  # a reader's error, and the stop every thread watches
        self.thread: threading.Thread | None = None

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return [self.verifier] if self.draft is None else [self.verifier, self.draft]

    @property
    def bytes_total(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)

    def report(self) -> StageState:
        with self.lock:
            end = self.ended if self.ended is not None else time.monotonic()
            staged = self.phase == "staged"
            return StageState(
                revision=self.revision,
                phase=self.phase,
                verifier=self.verifier.report(staged),
                draft=self.draft.report(staged) if self.draft is not None else None,
                bytes_total=self.bytes_total,
                bytes_done=self.bytes_done,
                limit_bytes=self.limit_bytes,
                seconds=round(end - self.started, 6),
                error=self.error,
            )

    def end(self, phase: StagePhase, error: ErrorBody | None = None) -> None:
        """Settle a stage that never reads (over budget, a corrupt header) or that failed."""
        with self.lock:
            self.phase, self.error = phase, error
            self.ended = time.monotonic()

    # -- lifecycle (RPC thread) ----------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="rolloutfleet-stage", daemon=True)
        self.thread.start()

    def stop(self) -> int:
        """Stop the threads (within a chunk), release every area; the bytes given back."""
        self.latch.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        return self.release()

    def release(self) -> int:
        with self.lock:
            return sum(c.release() for c in self.checkpoints)

    # -- the stage thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rolloutfleet-stage-read")
        fds: dict[Path, int] = {}
        failure: BaseException | None = None
        digests: list[str] = []
        try:
            digests = self._hash(self._fill(pool, fds))
        except StoppedError:
            failure = self.latch.error  # a reader failed; None: stopped from outside (the stopper releases)
        except BaseException as exc:
            failure = exc
        finally:
            if failure is not None:
                self.latch.stop.set()
            # No reader writes into an area after this: only then may a failure release the memory.
            pool.shutdown(wait=True, cancel_futures=True)
            for fd in fds.values():
                os.close(fd)
        if failure is not None:
            self._fail(failure)
            return
        with self.lock:
            if self.latch.stop.is_set():
                return  # stopped from outside as it finished: the stopper releases
            for c, value in zip(self.checkpoints, digests, strict=True):
                c.digest = value
            self.phase, self.ended = "staged", time.monotonic()
        self._log_staged()

    def _fill(self, pool: ThreadPoolExecutor, fds: dict[Path, int]) -> list[tuple[Checkpoint, list[_Read]]]:
        """Map every area and queue its reads at once (mapping is lazy: nothing is touched yet)."""
        throttle = Throttle(self.gbps)
        out = []
        for c in self.checkpoints:
            reads: list[_Read] = []
            for length, members in c.layout():
                if self.latch.stop.is_set():
                    raise StoppedError
                area = HostArea(length)
                with self.lock:
                    c.areas.append(area)
                for info in members:
                    if info.file not in fds:
                        fds[info.file] = self._open(info.file)
                    reads.append(self._queue(pool, throttle, fds[info.file], c, info))
                reads[-1].then_pin = area
            out.append((c, reads))
        return out

    def _pinner(self) -> HostPinner | None:
        if self.device is None:
            return None
        import torch

        from rolloutfleet_worker import loader_cuda

        torch.cuda.set_device(self.device)  # a registration belongs to the current device's context
        return loader_cuda.CudaPinner()

    def _open(self, file: Path) -> int:
        fd = open_file(file, self.roots)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger kernel read-ahead from disk
        return fd

    def _queue(self, pool: ThreadPoolExecutor, throttle: Throttle, fd: int, c: Checkpoint, info: TensorInfo) -> _Read:
        base = c.address(info)
        pieces = []
        for start in range(0, info.nbytes, max(1, CHUNK)):
            n = min(CHUNK, info.nbytes - start)
            job = pool.submit(self._read, throttle, fd, info.file, base + start, info.offset + start, n)
            pieces.append((job, base + start, n))
        return _Read(info, pieces)

    def _read(self, throttle: Throttle, fd: int, file: Path, address: int, offset: int, n: int) -> None:
        """One chunk (reader thread): the stop is checked before it and while it waits for its slot."""
        try:
            if self.latch.stop.is_set():
                raise StoppedError
            throttle.take(n, self.latch.stop)
            read_into(fd, file, address, offset, n)
        except StoppedError:
            raise
        except BaseException as exc:
            self.latch.fail(exc)  # stop every other reader at once: the stage has failed
            raise

    def _hash(self, staged: list[tuple[Checkpoint, list[_Read]]]) -> list[str]:
        """Hash every tensor in file order behind the readers, chunk by chunk as each is read, and
        page-lock each area once its last tensor is in; each checkpoint's digest, built as the loader's."""
        pinner = self._pinner()
        digests = []
        for c, reads in staged:
            builder = digest.DigestBuilder()
            for read in reads:
                hasher = digest.TensorHasher(read.info, threads=self.threads)
                for job, address, n in read.pieces:
                    self._wait(job)
                    hasher.update(memory(address, n))
                    with self.lock:
                        self.bytes_done += n
                h = hasher.finish()
                c.hashes[read.info.name] = h
                builder.add(read.info, h)
                if pinner is not None and read.then_pin is not None:
                    self._pin(read.then_pin, pinner)
            digests.append(builder.hexdigest())
        return digests

    def _pin(self, area: HostArea, pinner: HostPinner) -> None:
        # Only this thread or, after joining it, the stopper releases areas: no lock needed to register.
        if self.latch.stop.is_set():
            raise StoppedError
        pinned = area.pin(pinner, self.pin_chunk_bytes, self.latch.stop)
        with self.lock:
            self.pinned_bytes += area.length if pinned else 0
        if not pinned and not self.refused:
            self.refused = True
            log.warning("rolloutfleet: staging area not page-locked: the commit copies from pageable memory")

    def _wait(self, job: Future[None]) -> None:
        while True:
            if self.latch.stop.is_set():
                raise StoppedError
            try:
                job.result(timeout=POLL)
                return
            except TimeoutError:
                continue

    def _fail(self, exc: BaseException) -> None:
        """Failed while staging: the error in the load's codes, and the memory given back at once."""
        code: ErrorCode = "io"
        if isinstance(exc, OutsideRootsError):
            code = "invalid_path"
        elif not isinstance(exc, digest.CheckpointError | MemoryError | OSError):
            code = "internal"
        message = str(exc) if isinstance(exc, digest.CheckpointError) else f"{type(exc).__name__}: {exc}"
        self.release()
        self.end("failed", ErrorBody(code=code, message=message))
        log.warning(
            "rolloutfleet: staging revision %s failed after %.3f s: %s", self.revision, self._seconds(), message
        )

    def _seconds(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def _log_staged(self) -> None:
        seconds = self._seconds()
        total = self.bytes_total
        log.info(
            "rolloutfleet: staged revision %s (verifier %s%s): %.2f GB in %.3f s (%.1f GB/s, %d threads%s, "
            "%.2f GB page-locked%s)",
            self.revision,
            self.verifier.path,
            f", draft {self.draft.path}" if self.draft is not None else "",
            total / 1e9,
            seconds,
            total / 1e9 / max(seconds, 1e-9),
            self.threads,
            f", capped at {self.gbps:g} GB/s" if self.gbps > 0 else "",
            self.pinned_bytes / 1e9,
            f" in chunks of {self.pin_chunk_bytes} B" if self.pin_chunk_bytes else "",
        )


@dataclass
class _Read:
    """One tensor's queued chunk reads: (future, host address, length) in order."""

    info: TensorInfo
    pieces: list[tuple[Future[None], int, int]]
    then_pin: HostArea | None = None  # the last tensor of this area: page-lock the area once it is in
