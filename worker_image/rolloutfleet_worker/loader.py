"""Stream a safetensors checkpoint into a live model in place, hashing while it streams.

Called by ``rolloutfleet_worker.extension`` inside a vLLM worker (and by the unit tests and
``bench/gpu_update.py``). Owns the entry point and the choice of pipeline; the pipelines themselves are
``loader_mapped`` (GPU staging from pinned bounce buffers, or from the page cache locked in place, hashed
on the GPU: a single-GPU engine on a platform that allows read-only registration) and ``loader_read``
(copy the files into pinned buffers, hash on the host: tensor/pipeline parallel engines, platforms that
refuse, or ``ROLLOUTFLEET_LOAD_MODE=read``). On the H200 the mapped path with the worker's defaults loads
21 GB/s inside vLLM (28-29 GB/s in-process), the read path ~20 GB/s once warm after two slow first loads
(bench/results/gpu_update.md). Either way tensors reach vLLM's own per-model ``load_weights`` (q/k/v
stacking, tensor-parallel shards, copies into the existing parameters, so CUDA graphs keep their
pointers), reading and hashing run ahead of the model's copies, and the digest
(``rolloutfleet_worker.digest``) covers every tensor of the checkpoint, fed or skipped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolloutfleet_worker import digest, loader_cuda, loader_mapped, loader_read
from rolloutfleet_worker.loader_base import (
    CHUNK_BYTES,
    READAHEAD_BYTES,
    WINDOW_BYTES,
    HostPinner,
    LoadMode,
    LoadOptions,
    LoadWeightsError,
    Pipeline,
    default_read_threads,
    torch_dtype,
)

__all__ = [
    "CHUNK_BYTES",
    "READAHEAD_BYTES",
    "WINDOW_BYTES",
    "HostPinner",
    "LoadMode",
    "LoadOptions",
    "LoadOutcome",
    "LoadWeightsError",
    "default_read_threads",
    "stream_into",
    "torch_dtype",
]


@dataclass(slots=True)
class LoadOutcome:
    """What one streamed load did: the digest of every tensor read, and which ones were fed."""

    digest: str
    bytes: int
    tensors: int  # tensors handed to load_weights
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    path: str = "read"  # which pipeline ran: "mapped" or "read"
    unpinned_bytes: int = 0  # mapped path: bytes copied from pageable memory (a window was refused)
    device_hashed_bytes: int = 0  # mapped path with gpu_hash: bytes hashed on the GPU
    bounced_bytes: int = 0  # mapped path: bytes read into bounce buffers instead of page-locked in place
    # Where ``seconds`` went, for the load's log line: inside load_weights' own code, load_weights waiting
    # for the next tensor (the pipeline behind), and after it returned (last hashes, unlocking, clean-up).
    model_seconds: float = 0.0
    waiting_seconds: float = 0.0
    finish_seconds: float = 0.0


def _pipeline(infos: list[digest.TensorInfo], skip: Callable[[str], bool], options: LoadOptions) -> Pipeline:
    if options.mode != "read" and options.pinner is not None:
        copies = loader_cuda.CudaCopies() if options.pin else loader_cuda.HostCopies()
        return loader_mapped.MappedPipeline(infos, skip, options, options.pinner, copies)
    return loader_read.ReadPipeline(infos, skip, options)


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
    options = options or LoadOptions()
    pipeline = _pipeline(infos, skip, options)
    try:
        pipeline.start()
    except loader_mapped.MappingUnsupportedError:
        # Storage that cannot be mapped (some FUSE mounts) can still be read: nothing was fed yet.
        pipeline = _pipeline(infos, skip, dataclasses.replace(options, mode="read"))
        pipeline.start()
    try:
        fed = _Counter(pipeline.tensors())
        model_start = time.monotonic()
        try:
            model.load_weights(fed)
        except digest.CheckpointError:
            raise
        except Exception as exc:
            if pipeline.error is not None:
                raise pipeline.error from exc
            raise LoadWeightsError(f"{type(exc).__name__}: {exc}") from exc
        model_end = time.monotonic()
        # A loader that stops early must not shorten the digest: read and hash what it did not consume.
        for _ in fed.inner:
            pass
        pipeline.finish()
    finally:
        pipeline.close()
    end = time.monotonic()
    return LoadOutcome(
        digest=pipeline.builder.hexdigest(),
        bytes=pipeline.builder.bytes,
        tensors=fed.count,
        skipped=sorted(pipeline.skipped),
        seconds=round(end - start, 6),
        path=type(pipeline).__name__.removesuffix("Pipeline").lower(),
        unpinned_bytes=getattr(pipeline, "unpinned_bytes", 0),
        device_hashed_bytes=getattr(pipeline, "device_hashed_bytes", 0),
        bounced_bytes=getattr(pipeline, "bounced_bytes", 0),
        model_seconds=round(model_end - model_start - fed.waited, 6),
        waiting_seconds=round(fed.waited, 6),
        finish_seconds=round(end - model_end, 6),
    )


class _Counter:
    """Iterator wrapper counting what ``load_weights`` actually pulled, and how long it waited for it."""

    def __init__(self, inner: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.inner, self.count, self.waited = inner, 0, 0.0

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        started = time.monotonic()
        try:
            item = next(self.inner)
        finally:
            self.waited += time.monotonic() - started
        self.count += 1
        return item
