"""What both load pipelines share: options, the dtype table, the read-ahead budget, the stop signal.

Imported by ``loader`` (the entry point), ``loader_read`` (copy files into pinned buffers) and
``loader_mapped`` (page-lock the page cache in place). No pipeline logic lives here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

import torch

import rolloutfleet_digest as digest
from rolloutfleet_worker.paths import under_roots

T = TypeVar("T")

CHUNK_BYTES = 16 << 20  # read path: per preadv and per hash update
WINDOW_BYTES = 256 << 20  # mapped path: page-locked per cudaHostRegister
READAHEAD_BYTES = 2 << 30  # host bytes staged or page-locked ahead of the model; one unit always admitted
POLL = 0.05  # seconds between stop checks while a thread waits
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the driver pins without asking for write access

LoadMode = Literal["auto", "mapped", "read"]


def default_read_threads() -> int:
    """Reader threads when not configured: 6 of 16 cores measured best on the H200 host (the rest hash)."""
    return min(8, max(2, (os.cpu_count() or 2) * 3 // 8))


def default_bounce_threads() -> int:
    """Mapped-path bounce readers when not configured: 12 of 16 cores measured best on the H200 host with
    the hash on the GPU (14: 27.8, 16: 22.5 GB/s; the copies in then compete with memory bandwidth)."""
    return min(16, max(2, (os.cpu_count() or 2) * 3 // 4))


class HostPinner(Protocol):
    """Page-locks host ranges for direct device copies (CUDA here; a recording fake in the unit tests)."""

    def register(self, address: int, length: int) -> bool:
        """Pin ``length`` bytes at page-aligned ``address``; False when the platform refuses."""
        ...

    def unregister(self, address: int) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How one load reads; the extension fills it from ROLLOUTFLEET_LOAD_* / ROLLOUTFLEET_HASH_THREADS.

    ``mode``: ``mapped`` page-locks the checkpoint's page cache in place and copies from it (no host copy,
    no pinned buffers; needs a pinner, else it reads); ``read`` copies the files into (pinned) buffers
    first; ``auto`` is ``mapped`` when a pinner is given, else ``read``.
    """

    pin: bool = False  # the model is on a GPU: pinned buffers / page-locked windows pay off
    mode: LoadMode = "auto"
    read_threads: int = field(default_factory=default_read_threads)
    hash_threads: int | None = None  # None: blake3 uses every core
    readahead_bytes: int = READAHEAD_BYTES
    chunk_bytes: int = CHUNK_BYTES
    window_bytes: int = WINDOW_BYTES
    register_threads: int = 2
    pinner: HostPinner | None = None
    # Mapped path: hash tensors of at least ``gpu_hash_min_bytes`` on the GPU after their copy
    # (blake3_device; only once its self-test passed), and unlock windows on a thread of their own
    # (cudaHostUnregister waits for in-flight copies and stalled the lock pool). Off here, on in the worker
    # (``extension.load_options``): the unit tests turn them on where they test them.
    gpu_hash: bool = False
    gpu_hash_min_bytes: int = 1 << 20
    unlock_apart: bool = False
    # Mapped path: the share of windows read (``preadv`` on ``bounce_threads``) into pinned bounce buffers
    # instead of being page-locked in place. Page-locking tops out at ~19 GB/s on the H200 host however
    # many threads lock; reading spends host cores instead (29 GB/s with the hash on the GPU, bounded by
    # host memory bandwidth). 0: lock every window; 1: bounce every window; in between: windows interleaved.
    bounce_share: float = 0.0
    bounce_threads: int = field(default_factory=default_bounce_threads)
    # Resolved directories every opened checkpoint file must lie under (``confine``/``open_file``); empty:
    # no restriction. The extension sets it from ROLLOUTFLEET_WEIGHT_ROOTS.
    roots: tuple[str, ...] = ()


class LoadWeightsError(Exception):
    """``model.load_weights`` raised; the original exception is ``__cause__``."""


class IncompleteLoadError(Exception):
    """``model.load_weights`` returned without taking every tensor, or without loading every parameter."""


class StoppedError(Exception):
    """The pipeline was stopped while a thread waited."""


class Pipeline(Protocol):
    """One load's threads, as ``loader.stream_into`` drives them."""

    builder: digest.DigestBuilder
    skipped: list[str]

    @property
    def error(self) -> BaseException | None: ...

    def start(self) -> None: ...
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class OutsideRootsError(digest.CheckpointError):
    """A checkpoint file that resolves, or was opened, outside the allowed weight roots."""


def check_files(directory: Path | str, roots: tuple[str, ...]) -> None:
    """OutsideRootsError for a ``*.safetensors`` entry of ``directory`` that resolves outside ``roots``.

    Run before any header is read, so not even a header of a file outside the roots is opened.
    """
    try:
        entries = sorted(Path(directory).iterdir())
    except OSError as exc:
        raise digest.CheckpointError(directory, f"unreadable: {exc.strerror or exc}") from exc
    for entry in entries:
        if entry.name.endswith(".safetensors") and not under_roots(os.path.realpath(entry), roots):
            raise OutsideRootsError(entry, f"resolves to {os.path.realpath(entry)!r}, outside the allowed weight roots")


def confine(infos: list[digest.TensorInfo], roots: tuple[str, ...]) -> list[digest.TensorInfo]:
    """``infos`` re-pointed at their files' resolved paths; CheckpointError for a file outside ``roots``.

    A shard may be a symlink (a Hugging Face snapshot links every file into ``blobs/``): allowed while it
    resolves under the roots. The pipelines then open the resolved paths and check again what they opened
    (``open_file``), so a link swapped after this check is caught too.
    """
    resolved: dict[Path, Path] = {}
    out = []
    for info in infos:
        if info.file not in resolved:
            real = os.path.realpath(info.file)
            if not under_roots(real, roots):
                raise OutsideRootsError(info.file, f"resolves to {real!r}, outside the allowed weight roots")
            resolved[info.file] = Path(real)
        out.append(dataclasses.replace(info, file=resolved[info.file]))
    return out


def open_file(file: Path, roots: tuple[str, ...]) -> int:
    """Open ``file`` read-only; with ``roots``, refuse it unless what was opened lies under them.

    The check is on the open descriptor (``/proc/self/fd``), not on the name, so no rename or symlink
    swap between a check and the open can make the worker read outside the roots.
    """
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise digest.CheckpointError(file, f"unreadable: {exc.strerror or exc}") from exc
    if roots:
        try:
            opened = str(Path(f"/proc/self/fd/{fd}").readlink())
        except OSError:
            opened = ""  # no /proc: refuse rather than read a file we cannot place
        if not under_roots(opened, roots):
            os.close(fd)
            raise OutsideRootsError(file, "opened a file outside the allowed weight roots")
    return fd


# safetensors dtype names -> torch attribute names. The loader reads checkpoints with it; the push session
# (``rolloutfleet_worker.push``) spells received tensors' dtypes with its inverse, so both digests agree.
TORCH_DTYPE_NAMES: dict[str, str] = {
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
}


def torch_dtype(name: str, file: Path) -> torch.dtype:
    """The torch dtype of a safetensors dtype string; CheckpointError naming ``file`` if unknown."""
    attr = TORCH_DTYPE_NAMES.get(name)
    dt = getattr(torch, attr, None) if attr else None
    if not isinstance(dt, torch.dtype):
        raise digest.CheckpointError(file, f"dtype {name!r} not supported by this torch")
    return dt


def memory(address: int, length: int) -> memoryview:
    """A byte view of ``length`` bytes of host memory at ``address`` (inside a live tensor or mapping)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def read_into(fd: int, file: Path, address: int, offset: int, length: int) -> None:
    """Read ``length`` bytes of ``file`` (open as ``fd``) at ``offset`` into host memory at ``address``.

    Runs on reader threads of both pipelines: ``preadv`` straight from the page cache, the GIL released.
    """
    view = memory(address, length)
    done = 0
    while done < length:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise digest.CheckpointError(file, f"unreadable: {exc.strerror or exc}") from exc
        if n == 0:
            raise digest.CheckpointError(file, "truncated while reading")
        done += n


class Budget:
    """Bytes in flight; waits while a new unit would exceed the limit (one unit is always admitted)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = max(1, limit), 0
        self.cond = threading.Condition()

    def acquire(self, n: int, stop: threading.Event) -> None:
        with self.cond:
            while self.used and self.used + n > self.limit:
                if stop.is_set():
                    raise StoppedError
                self.cond.wait(POLL)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class ErrorLatch:
    """The first error any stage raised, and the stop signal every stage watches."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        self.stop.set()


def device_buffer(copies: Any, n: int, staged: Budget, latch: ErrorLatch) -> torch.Tensor | None:
    """A GPU staging tensor of ``n`` bytes (``copies.empty``); on OOM wait until the model drained what is
    staged (``staged``: bytes handed out, ours counted already), then try once more; None: no room at all.
    Shared by the mapped and the staged pipelines' copier threads."""
    try:
        return cast(torch.Tensor, copies.empty(n))
    except torch.cuda.OutOfMemoryError:
        while staged.used > n:
            if latch.stop.is_set():
                raise StoppedError from None
            threading.Event().wait(POLL)
        try:
            return cast(torch.Tensor, copies.empty(n))
        except torch.cuda.OutOfMemoryError:
            return None


def next_queued(items: queue.Queue[T | None], latch: ErrorLatch) -> T | None:
    """The next item a copier thread queued for ``load_weights`` (None: the copier ended); raises the first
    error any stage latched. Polls so that a stop is seen even while nothing is queued."""
    while True:
        if latch.error is not None:
            raise latch.error
        if latch.stop.is_set() and items.empty():
            return None
        try:
            return items.get(timeout=POLL)
        except queue.Empty:
            continue


Queued = tuple[digest.TensorInfo, torch.Tensor, Any]  # a tensor's place, its GPU (or private host) copy, its event


def handed_out(
    next_item: Callable[[], Queued | None], copies: Any, staged: Budget, latch: ErrorLatch
) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``load_weights`` iterates, for the mapped and the staged pipelines: each queued copy once the model's
    stream may use it, viewed as its tensor; its bytes leave ``staged`` once the model let go of it. Raises
    the first stage error."""
    while True:
        item = next_item()
        if item is None:
            if latch.error is not None:
                raise latch.error
            return
        info, staging, event = item
        copies.hand_over(staging, event)
        tensor = staging.view(torch_dtype(info.dtype, info.file)).reshape(info.shape)
        try:
            yield info.name, tensor
        finally:
            del tensor, staging
            staged.release(info.nbytes)
