"""The commit pipeline of a staged update: staged host bytes → GPU staging → ``load_weights``, hashed again.

Used by ``loader.commit_into`` (the extension's staged ``rolloutfleet_load``, docs/staging.md) over a
checkpoint that ``rolloutfleet_worker.staging_area`` already read into host memory (page-locked on a GPU worker)
and hashed. It is the mapped path (``loader_mapped``) with the files already read: no windows to lock, no
reads, so the pause holds only the host→device copies and the GPU hash.

Two threads run ahead of the calling thread: a copier that, tensor by tensor in file order and within the
read-ahead budget, copies the staged bytes to a fresh staging tensor on the GPU on a side stream, records
an event, and queues their BLAKE3 behind it on a hash stream of its own (``blake3_device``, tensors of at
least ``max(gpu_hash_min_bytes, 2 KiB)`` once the device self-test passed); and a hasher that collects the
device digests and hashes the other fed tensors on the host from the staged bytes. The calling thread makes
the model's stream wait for each copy and hands the GPU tensor to ``model.load_weights``, so its own copies
into the parameters are device to device and overlap the next tensors' copies in.

The model never sees the staging memory: it gets a private GPU tensor (or, with ``HostCopies`` on the CPU,
a private host copy), so a ``load_weights`` that edits what it is given cannot change the staged bytes
that a later commit (after another sleep) would copy again. Tensors the caller skips (a draft's tensors
shared with the verifier) never reach the model: they enter the digest with the hash the stage computed
for exactly those staged bytes. ``close`` waits for every copy queued, so the caller may release the staging
memory as soon as the load returned.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

import rolloutfleet_digest as digest
from rolloutfleet_worker import blake3_device
from rolloutfleet_worker.blake3_device import CHUNK_LEN
from rolloutfleet_worker.loader_base import (
    POLL,
    Budget,
    ErrorLatch,
    LoadOptions,
    Queued,
    StoppedError,
    device_buffer,
    handed_out,
    memory,
    next_queued,
    torch_dtype,
)
from rolloutfleet_worker.loader_cuda import CudaCopies, HostCopies, device_hash_works


class StagedCheckpoint(Protocol):
    """One checkpoint held in host memory, as ``rolloutfleet_worker.staging_area.Checkpoint`` keeps it."""

    @property
    def infos(self) -> list[digest.TensorInfo]:
        """Every tensor of the checkpoint, in file then offset order (as ``digest.scan_directory``)."""
        ...

    def address(self, info: digest.TensorInfo) -> int:
        """Where the staged bytes of ``info`` start in host memory (CheckpointError once released)."""
        ...

    def tensor_hash(self, name: str) -> bytes:
        """The per-tensor hash (docs/digest.md ``h_t``) of the staged bytes, computed while staging."""
        ...


@dataclass(slots=True)
class _Tensor:
    info: digest.TensorInfo
    fed: bool
    staged: threading.Event = field(default_factory=threading.Event)  # the copier is done with it
    ready: Any = None  # event after its copy on the copy stream
    device_hash: Any = None  # blake3_device result (8 words on the GPU), when hashed there
    hashed: Any = None  # event after its device hash (on the hash stream; None: ``ready`` covers it)


class StagedPipeline:
    """The threads of one commit; ``tensors()`` is what ``load_weights`` iterates (calling thread)."""

    def __init__(
        self,
        source: StagedCheckpoint,
        skip: Callable[[str], bool],
        options: LoadOptions,
        copies: CudaCopies | HostCopies,
    ) -> None:
        self.source, self.skip, self.options, self.copies = source, skip, options, copies
        self.infos = source.infos
        self.builder = digest.DigestBuilder()
        self.skipped: list[str] = []
        self.device_hashed_bytes = 0  # bytes hashed on the GPU (blake3_device)
        self.host_fallback_bytes = 0  # bytes handed over in host memory (no GPU room for staging)
        self.gpu_hash = options.gpu_hash and device_hash_works(copies)
        self.latch = ErrorLatch()
        self.budget = Budget(options.readahead_bytes)  # GPU staging tensors not yet taken by the model
        self.all: list[_Tensor] = []
        self.fed: list[_Tensor] = []
        self.to_feed: queue.Queue[tuple[_Tensor, torch.Tensor, Any] | None] = queue.Queue()
        self.bound = False  # the copier set up its stream (copies may be queued on it)
        self.hash_stream: Any = None  # CUDA: device hashes run here, beside the copies (see _hash_on_device)
        self.threads = [
            threading.Thread(target=self._copy, name="rolloutfleet-commit-copy", daemon=True),
            threading.Thread(target=self._hash, name="rolloutfleet-commit-hash", daemon=True),
        ]

    @property
    def error(self) -> BaseException | None:
        return self.latch.error

    # -- lifecycle (calling thread) ------------------------------------------------------------------

    def start(self) -> None:
        for info in self.infos:
            tensor = _Tensor(info, fed=not self.skip(info.name))
            self.all.append(tensor)
            if tensor.fed:
                torch_dtype(info.dtype, info.file)  # refuse an unsupported dtype before any copy
                self.source.address(info)  # refuse a released stage before any copy
                self.fed.append(tensor)
            else:
                self.skipped.append(info.name)
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        """After ``tensors()`` ran out: wait for the hash of every tensor; raise a thread's error."""
        for thread in self.threads:
            while thread.is_alive():
                thread.join(POLL)
        if self.latch.error is not None:
            raise self.latch.error

    def close(self) -> None:
        """Stop both threads and wait for every copy queued: nothing reads the staging memory after this."""
        self.latch.stop.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join()
        if self.bound:
            # An event behind everything queued on the copy stream, even a copy whose own event the copier
            # never recorded (it failed in between): the staging memory may be released after this.
            self.copies.wait(self.copies.record())
        if isinstance(self.copies, CudaCopies):
            torch.cuda.empty_cache()  # give the GPU staging blocks back before the KV cache wakes

    # -- copier thread -------------------------------------------------------------------------------

    def _copy(self) -> None:
        try:
            self.copies.bind()
            self.bound = True
            if self.gpu_hash and isinstance(self.copies, CudaCopies):
                self.hash_stream = torch.cuda.Stream(self.copies.device)  # type: ignore[no-untyped-call]
            for t in self.fed:
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

    def _stage(self, t: _Tensor) -> tuple[_Tensor, torch.Tensor, Any]:
        info = t.info
        self.budget.acquire(info.nbytes, self.latch.stop)
        if info.nbytes == 0:
            return t, self.copies.empty(0), None
        source = torch.frombuffer(memory(self.source.address(info), info.nbytes), dtype=torch.uint8)
        try:
            staging = self._device_buffer(info.nbytes)
        except torch.cuda.OutOfMemoryError:
            staging = None
        if staging is None:  # no room on the GPU even with nothing staged: a private host copy
            self.host_fallback_bytes += info.nbytes
            return t, source.clone(), None
        self.copies.copy(staging, source)
        event = self.copies.record()
        t.ready = event
        if self.gpu_hash and info.nbytes >= max(self.options.gpu_hash_min_bytes, 2 * CHUNK_LEN):
            t.device_hash, t.hashed = self._hash_on_device(info, staging, event)
        return t, staging, event

    def _hash_on_device(self, info: digest.TensorInfo, staging: torch.Tensor, copied: Any) -> tuple[Any, Any]:
        """Queue the tensor's BLAKE3 behind its copy: the result, and an event after it (None: on the copy
        stream itself, the CPU stand-in).

        On CUDA the hash runs on a stream of its own that waits for the copy: queued on the copy stream it
        held back every later copy until it finished (0.79 x the pinned ceiling on the H200), while the
        copy engine and the SMs can run side by side. The model's stream waits for the copy only."""
        full, rest = divmod(info.nbytes, CHUNK_LEN)
        tail = bytes(memory(self.source.address(info) + full * CHUNK_LEN, rest)) if rest else None
        self.device_hashed_bytes += info.nbytes
        if self.hash_stream is None:
            with self.copies.on_stream():
                return blake3_device.hash_on_device(staging, tail), None
        self.hash_stream.wait_event(copied)
        with torch.cuda.stream(self.hash_stream):
            result = blake3_device.hash_on_device(staging, tail)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.hash_stream)
        staging.record_stream(self.hash_stream)  # the block is not reused before the hash has read it
        return result, done

    def _device_buffer(self, n: int) -> torch.Tensor | None:
        return device_buffer(self.copies, n, self.budget, self.latch)

    # -- hasher thread -------------------------------------------------------------------------------

    def _hash(self) -> None:
        try:
            for t in self.all:
                if self.latch.stop.is_set():
                    return
                if not t.fed:
                    self.builder.add(t.info, self.source.tensor_hash(t.info.name))
                    continue
                if self._device_hashed(t):
                    self.copies.wait(t.hashed if t.hashed is not None else t.ready)
                    self.builder.add(t.info, blake3_device.digest_of(t.device_hash))
                    t.device_hash = t.hashed = None
                    continue
                hasher = digest.TensorHasher(t.info, threads=self.options.hash_threads)
                if t.info.nbytes:
                    hasher.update(memory(self.source.address(t.info), t.info.nbytes))
                self.builder.add(t.info, hasher.finish())
        except StoppedError:
            return
        except BaseException as exc:
            self.latch.fail(exc)

    def _device_hashed(self, t: _Tensor) -> bool:
        """Whether the copier hashed ``t`` on the GPU (waits for the copier to get that far when it may)."""
        if not self.gpu_hash:
            return False
        while not t.staged.wait(POLL):
            if self.latch.stop.is_set():
                raise StoppedError
        return t.device_hash is not None

    # -- calling thread ------------------------------------------------------------------------------

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each fed tensor once its copy is queued, in file order; raises the first thread error."""
        return handed_out(self._queued, self.copies, self.budget, self.latch)

    def _queued(self) -> Queued | None:
        item = next_queued(self.to_feed, self.latch)
        return None if item is None else (item[0].info, item[1], item[2])
