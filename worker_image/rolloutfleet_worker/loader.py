"""Stream a safetensors checkpoint into a live model in place, hashing while it streams.

Called by ``rolloutfleet_worker.extension`` inside a vLLM worker (and by the unit tests and
``bench/gpu_update.py``). Owns the entry points and the choice of pipeline; the pipelines themselves are
``loader_mapped`` (GPU staging from pinned bounce buffers, or from the page cache locked in place, hashed
on the GPU: a single-GPU engine on a platform that allows read-only registration) and ``loader_read``
(copy the files into pinned buffers, hash on the host: tensor/pipeline parallel engines, platforms that
refuse, or ``ROLLOUTFLEET_LOAD_MODE=read``) for ``stream_into``, and ``loader_staged`` for ``commit_into``
(a staged update's commit: the bytes already sit in host memory, ``rolloutfleet_worker.staging``). On
the H200 the mapped path with the worker's defaults loads 21 GB/s inside vLLM (28-29 GB/s in-process),
the read path ~20 GB/s once warm after two slow first loads (bench/results/gpu_update.md). Either way
tensors reach vLLM's own per-model ``load_weights`` (q/k/v stacking, tensor-parallel shards, copies into
the existing parameters, so CUDA graphs keep their pointers), reading and hashing run ahead of the
model's copies, and the digest (``rolloutfleet_digest``) covers every tensor of the checkpoint,
fed or skipped.

A load succeeds only when it is complete: every tensor of the checkpoint was either taken by
``load_weights`` or deliberately skipped (shared with the verifier), and every parameter the caller
requires is in the set of names ``load_weights`` returns. Anything less raises ``IncompleteLoadError``
and produces no digest, so a partial load can never carry the publisher's digest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import rolloutfleet_digest as digest
from rolloutfleet_worker import loader_base, loader_cuda, loader_mapped, loader_read, loader_staged
from rolloutfleet_worker.loader_base import (
    CHUNK_BYTES,
    READAHEAD_BYTES,
    WINDOW_BYTES,
    HostPinner,
    IncompleteLoadError,
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
    "IncompleteLoadError",
    "LoadMode",
    "LoadOptions",
    "LoadOutcome",
    "LoadWeightsError",
    "commit_into",
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
    path: str = "read"  # which pipeline ran: "mapped", "read" or "staged" (a commit from the staging area)
    unpinned_bytes: int = 0  # mapped path: bytes copied from pageable memory (a window was refused)
    device_hashed_bytes: int = 0  # mapped or staged path with gpu_hash: bytes hashed on the GPU
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
    required: Collection[str] | None = None,
) -> LoadOutcome:
    """Load every tensor of checkpoint directory ``path`` into ``model`` via its ``load_weights``.

    ``required``: parameter names that ``load_weights`` must report loaded (vLLM's returns the set of
    parameters it filled); None checks the feed only. Raises CheckpointError (bad directory or file:
    nothing or part was fed), LoadWeightsError (the model's loader raised) or IncompleteLoadError (the
    model stopped early or left a required parameter out). Either way the caller must treat the model's
    contents as unknown.
    """
    start = time.monotonic()
    options = options or LoadOptions()
    if options.roots:
        loader_base.check_files(path, options.roots)
    # Every header is parsed and bounds-checked before the first byte reaches the model, so a truncated
    # or corrupt shard is refused while the parameters are still intact.
    infos = digest.scan_directory(path)
    if options.roots:
        infos = loader_base.confine(infos, options.roots)
    pipeline = _pipeline(infos, skip, options)
    try:
        pipeline.start()
    except loader_mapped.MappingUnsupportedError:
        # Storage that cannot be mapped (some FUSE mounts) can still be read: nothing was fed yet.
        pipeline = _pipeline(infos, skip, dataclasses.replace(options, mode="read"))
        pipeline.start()
    return _feed(model, infos, skip, pipeline, required, start)


def commit_into(
    model: Any,
    staged: loader_staged.StagedCheckpoint,
    *,
    skip: Callable[[str], bool] = lambda _name: False,
    options: LoadOptions | None = None,
    required: Collection[str] | None = None,
) -> LoadOutcome:
    """Load a checkpoint already staged in host memory (``rolloutfleet_worker.staging``) into ``model``.

    The same rules and errors as ``stream_into`` (the same completeness checks; the digest covers every
    tensor, fed or skipped); the bytes come from the staging area instead of the files
    (``loader_staged``), copied to the GPU when ``options.pin`` (the model is on one), else handed over as
    private host copies. The caller compares the digest with the one computed while staging.
    """
    start = time.monotonic()
    options = options or LoadOptions()
    copies = loader_cuda.CudaCopies() if options.pin else loader_cuda.HostCopies()
    pipeline = loader_staged.StagedPipeline(staged, skip, options, copies)
    pipeline.start()
    return _feed(model, staged.infos, skip, pipeline, required, start)


def _feed(
    model: Any,
    infos: list[digest.TensorInfo],
    skip: Callable[[str], bool],
    pipeline: Pipeline,
    required: Collection[str] | None,
    start: float,
) -> LoadOutcome:
    """Drive a started ``pipeline`` into ``model.load_weights`` and check the load was complete.

    The part both entry points share: the model pulls every fed tensor, the pipeline hashes every tensor,
    and only a complete load (``_check_covered``) yields an outcome with a digest. The pipeline is closed
    whatever happens, so no thread reads host memory after this returns or raises.
    """
    to_feed = sum(1 for info in infos if not skip(info.name))
    fed = _Counter(pipeline.tensors())
    try:
        model_start = time.monotonic()
        try:
            loaded = model.load_weights(fed)
        except digest.CheckpointError:
            raise
        except Exception as exc:
            if pipeline.error is not None:
                raise pipeline.error from exc
            raise LoadWeightsError(f"{type(exc).__name__}: {exc}") from exc
        model_end = time.monotonic()
        if fed.count < to_feed:
            # Not drained: hashing the rest would only dress a partial load in the checkpoint's digest.
            raise IncompleteLoadError(
                f"load_weights returned after taking {fed.count} of {to_feed} tensors; "
                "the parameters it did not reach still hold their previous values"
            )
        pipeline.finish()
        _check_covered(infos, fed.names, pipeline, loaded, required)
    finally:
        # A loader that stopped early leaves the feed suspended on a tensor: end it so the tensor is
        # released before the pipeline gives its memory back.
        close = getattr(fed.inner, "close", None)
        if callable(close):
            close()
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


MAX_NAMED = 5  # names quoted in an error message; the count says how many more


def _named(names: Collection[str]) -> str:
    shown = sorted(names)[:MAX_NAMED]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more > 0 else "")


def _check_covered(
    infos: list[digest.TensorInfo],
    fed: list[str],
    pipeline: Pipeline,
    loaded: object,
    required: Collection[str] | None,
) -> None:
    """Raise IncompleteLoadError unless the load was complete (see the module docstring).

    The digest is built from what the pipeline hashed; requiring that to be exactly the fed plus the
    skipped tensors, and those to be the whole checkpoint, makes the digest cover what the model was given.
    """
    scanned = {info.name for info in infos}
    taken = set(fed) | set(pipeline.skipped)
    if taken != scanned or len(pipeline.builder) != len(scanned):
        raise IncompleteLoadError(
            f"{len(taken)} of {len(scanned)} tensors were fed or skipped and {len(pipeline.builder)} hashed; "
            f"never fed: {_named(scanned - taken)}"
        )
    if required is None or loaded is None:
        # A model whose loader returns nothing cannot say what it filled: the complete feed above is all
        # that can be checked. vLLM's models return the set (its own start-up load relies on it).
        return
    if not isinstance(loaded, Collection) or not all(isinstance(n, str) for n in loaded):
        raise IncompleteLoadError(f"load_weights returned {type(loaded).__name__}, not the set of loaded names")
    missing = set(required) - set(loaded)
    if missing:
        raise IncompleteLoadError(
            f"load_weights did not load {len(missing)} of {len(set(required))} parameters (checkpoint names "
            f"it does not map?), which still hold their previous values: {_named(missing)}"
        )


class _Counter:
    """Iterator wrapper counting what ``load_weights`` actually pulled, and how long it waited for it."""

    def __init__(self, inner: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.inner, self.count, self.waited = inner, 0, 0.0
        self.names: list[str] = []

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        started = time.monotonic()
        try:
            item = next(self.inner)
        finally:
            self.waited += time.monotonic() - started
        self.count += 1
        self.names.append(item[0])
        return item
