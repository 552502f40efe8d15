"""The CUDA side of the mapped load path: page-locking host ranges and queueing copies on a side stream.

Used by ``loader_mapped`` (and ``loader`` to choose it). Owns the calls into CUDA that the pipeline
makes: read-only ``cudaHostRegister``/``cudaHostUnregister`` (probed once per process), host→device
copies on a side stream handed to the model's stream with events, and the once-per-device self-test that
gates hashing on the GPU. ``HostCopies`` is the same interface for a model on the CPU (the unit tests).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from rolloutfleet_worker import blake3_device
from rolloutfleet_worker.loader_base import REGISTER_READ_ONLY, HostPinner


class CudaPinner:
    """``cudaHostRegister(..., cudaHostRegisterReadOnly)`` through torch's bundled cudart binding."""

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def register(self, address: int, length: int) -> bool:
        if int(self._cudart.cudaHostRegister(address, length, REGISTER_READ_ONLY)) == 0:
            return True
        # A refused registration leaves a (non-sticky) last error behind, and torch's next kernel-launch
        # check would report it as that kernel's failure: consume it here.
        _clear_last_error()
        return False

    def unregister(self, address: int) -> None:
        self._cudart.cudaHostUnregister(address)


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error (torch's cudart binding has no cudaGetLastError).

    Loading libcudart by name could reach a different copy of the runtime than torch's, so the error is
    consumed the way torch would meet it: a tiny kernel whose launch check reads (and resets) it.
    """
    with contextlib.suppress(RuntimeError):
        torch.ones(1, device="cuda").add_(1)


log = logging.getLogger("vllm.rolloutfleet")

_probed: dict[str, CudaPinner | None] = {}
_hash_checked: dict[int, bool] = {}  # device → the self-test's verdict
_hash_running: set[int] = set()  # devices whose self-test (which compiles the kernels) is under way
_hash_lock = threading.Lock()


def check_device_hash(device: int) -> bool:
    """Run the GPU hash self-test on ``device`` once (compiling the Triton kernels: ~30 s on the H200
    host the first time a machine runs them); later calls return the verdict. Thread-safe."""
    with _hash_lock:
        if device in _hash_checked:
            return _hash_checked[device]
        _hash_running.add(device)
    started = time.monotonic()
    try:
        works = blake3_device.self_test(torch.device("cuda", device))
        if works:
            log.info("rolloutfleet: GPU hashing on for cuda:%d (self-test %.1f s)", device, time.monotonic() - started)
        else:
            log.warning("rolloutfleet: GPU hashing off: BLAKE3 on cuda:%d disagrees with the blake3 package", device)
    except Exception as exc:  # no Triton, no compiler, a driver problem: the host hashes instead
        works = False
        name = type(exc).__name__
        log.warning("rolloutfleet: GPU hashing off: its self-test on cuda:%d failed: %s: %s", device, name, exc)
    with _hash_lock:
        _hash_checked[device] = works
        _hash_running.discard(device)
    return works


def device_hash_works(copies: CudaCopies | HostCopies) -> bool:
    """Whether this load may hash on the GPU: the self-test passed (run here if nobody started it).

    While the warm-up thread is still compiling, False: that load hashes on the host rather than wait.
    """
    if not isinstance(copies, CudaCopies):
        return True  # the unit tests: the kernels run in Triton's CPU interpreter
    with _hash_lock:
        if copies.device in _hash_checked:
            return _hash_checked[copies.device]
        if copies.device in _hash_running:
            return False
    return check_device_hash(copies.device)


def device_hash_ready(device: int) -> bool:
    """Whether tensors on ``device`` may be hashed there now: the self-test's verdict when known.

    Never waits: while the self-test runs, or before anyone started it (it is then started on a thread of
    its own), False, and the caller hashes on the host. Used by the push sessions (``push``), whose
    tensors arrive on the GPU in the middle of vLLM's ``/update_weights``, where a ~30 s compile must not
    land; ``push_begin`` calls it early so the verdict is usually in by the time tensors arrive.
    """
    with _hash_lock:
        if device in _hash_checked:
            return _hash_checked[device]
        if device in _hash_running:
            return False
        _hash_running.add(device)

    def run() -> None:
        try:
            torch.cuda.set_device(device)  # a new thread starts on device 0
        except Exception as exc:
            log.warning("rolloutfleet: GPU hashing off: cuda:%d unusable: %s: %s", device, type(exc).__name__, exc)
            with _hash_lock:
                _hash_checked[device] = False
                _hash_running.discard(device)
            return
        check_device_hash(device)

    threading.Thread(target=run, name="rolloutfleet-hash-self-test", daemon=True).start()
    return False


def warm_up(device: int, gpu_hash: bool, pinned_sizes: list[int]) -> threading.Thread:
    """Prepare a GPU worker's first load in the background (called once when the extension starts).

    Runs the GPU hash self-test (its compile would otherwise land on the first load) and allocates the
    bounce buffers once, so torch's pinned-memory cache holds them before a load needs them (a fresh
    ``cudaHostAlloc`` of 2 GiB cost the first load ~1 s on the H200 host).
    """

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            if gpu_hash:
                check_device_hash(device)
            started = time.monotonic()
            buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in pinned_sizes]
            if buffers:
                log.info(
                    "rolloutfleet: %.2f GB of pinned bounce buffers ready in %.2f s",
                    sum(pinned_sizes) / 1e9,
                    time.monotonic() - started,
                )
            del buffers  # back to torch's pinned cache, where the loads find them
        except Exception as exc:  # a warm-up is an optimisation: the loads work without it
            log.warning("rolloutfleet: loader warm-up failed: %s: %s", type(exc).__name__, exc)

    thread = threading.Thread(target=run, name="rolloutfleet-warm-up", daemon=True)
    thread.start()
    return thread


def cuda_pinner(sample: Path | None = None) -> HostPinner | None:
    """A CUDA pinner when this platform locks a read-only file mapping (probed once per process).

    ``sample``: a checkpoint file to probe with, so the answer holds for the storage the weights come from
    (a network filesystem may refuse what local disk allows); without one, a temporary file.
    """
    if "cuda" not in _probed:
        _probed["cuda"] = _probe(sample)
    return _probed["cuda"]


def _probe(sample: Path | None) -> CudaPinner | None:
    if not torch.cuda.is_available():
        return None
    try:
        pinner = CudaPinner()
        with contextlib.ExitStack() as stack:
            f: IO[bytes]
            if sample is not None:
                f = stack.enter_context(sample.open("rb"))
            else:
                f = stack.enter_context(tempfile.TemporaryFile())
                f.write(b"\0" * mmap.PAGESIZE)
                f.flush()
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                address = _address(mm)
                ok = pinner.register(address, mmap.PAGESIZE)
                if ok:
                    pinner.unregister(address)
        return pinner if ok else None
    except Exception:
        return None


def _address(mm: mmap.mmap) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mapping: torch warns, we only read from it
        return torch.frombuffer(mm, dtype=torch.uint8).data_ptr()


class CudaCopies:
    """Host→device copies on a side stream of the caller's device, handed over with events."""

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self.stream: Any = None

    def on_stream(self) -> Any:
        """Work queued inside runs on the copy stream, behind the copies."""
        return torch.cuda.stream(self.stream)

    def bind(self) -> None:
        """Called first in the copier thread: a new thread would default to device 0."""
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def empty(self, n: int) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return torch.empty(n, dtype=torch.uint8, device=f"cuda:{self.device}")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue one copy; ``src`` must lie inside one registration (the driver refuses a span of two)."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        """An event after every copy queued so far."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def hand_over(self, tensor: torch.Tensor, event: Any) -> None:
        """On the model's thread: its stream waits for the copy; the allocator keeps the block until then."""
        if event is None:
            return
        current = torch.cuda.current_stream()
        current.wait_event(event)
        tensor.record_stream(current)

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


class HostCopies:
    """The same interface for a model on the CPU (the unit tests): plain synchronous copies."""

    def on_stream(self) -> Any:
        return contextlib.nullcontext()

    def bind(self) -> None:
        pass

    def empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        return None

    def hand_over(self, tensor: torch.Tensor, event: Any) -> None:
        pass

    def wait(self, event: Any) -> None:
        pass
