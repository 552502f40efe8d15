"""``RolloutFleetExtension``: the RPCs the operator calls on every vLLM worker.

vLLM appends this class to its Worker's bases (``--worker-extension-cls
rolloutfleet_worker.extension.RolloutFleetExtension``); the operator reaches the methods through
``POST /collective_rpc`` and gets one result per worker. This module owns the RPC boundary and the loads'
rules (verifier before draft, frozen drafts never overwritten, shared tensors never written by the draft),
shared by loads from files and commits from the staging area. The record of what is loaded is
``rolloutfleet_worker.records``; the wire payloads ``rolloutfleet_worker.payloads``; pushed weights (vLLM's
weight-transfer sessions) ``rolloutfleet_worker.push``; staged updates (docs/staging.md)
``rolloutfleet_worker.staging``; loading is ``rolloutfleet_worker.loader``; finding the modules is
``rolloutfleet_worker.models``; which paths may be read is ``rolloutfleet_worker.paths``; the environment
``rolloutfleet_worker.options``.

Rules vLLM imposes: only ADD attributes (a clash with a Worker attribute is an assertion error), so every
public name starts with ``rolloutfleet_`` and helpers are module functions; import torch/vLLM lazily so
this module imports without them; never raise across the RPC boundary (an exception becomes an opaque
HTTP 500), so every method returns ``{"ok": False, "error": {...}}`` instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import rolloutfleet_digest as digest
from rolloutfleet_worker import options, paths, push, records
from rolloutfleet_worker.options import (
    BOUNCE_SHARE_ENV,
    BOUNCE_THREADS_ENV,
    DRAFT_PATH_ENV,
    GPU_HASH_ENV,
    MODE_ENV,
    POLICY_ENV,
    READ_THREADS_ENV,
    READAHEAD_ENV,
    ROOTS_ENV,
    THREADS_ENV,
    UNLOCK_APART_ENV,
    draft_policy,
    load_options,
)
from rolloutfleet_worker.payloads import (
    DraftState,
    Failure,
    LoadResult,
    PreflightResult,
    PushBeginResult,
    PushEndResult,
    PushGroupResult,
    StageResult,
    StateResult,
    Target,
    UnstageResult,
    fail,
)

if TYPE_CHECKING:  # the loader imports torch: at run time only inside the functions that load
    from rolloutfleet_worker.loader import LoadOutcome

# The environment's names stay importable from here (the loader's tests and bench/ use them).
__all__ = [
    "BOUNCE_SHARE_ENV",
    "BOUNCE_THREADS_ENV",
    "DRAFT_PATH_ENV",
    "GPU_HASH_ENV",
    "MODE_ENV",
    "POLICY_ENV",
    "READAHEAD_ENV",
    "READ_THREADS_ENV",
    "ROOTS_ENV",
    "THREADS_ENV",
    "UNLOCK_APART_ENV",
    "RolloutFleetExtension",
    "check_path",
    "draft_policy",
    "load_options",
]

# A child of vLLM's logger, so the lines land in the engine's log with its format and level.
log = logging.getLogger("vllm.rolloutfleet")


def check_path(path: object) -> str | None:
    """Why ``path`` may not be loaded, or None when it may (``paths.resolve`` without the result)."""
    try:
        paths.resolve(path)
    except paths.PathRefusedError as exc:
        return str(exc)
    return None


@dataclass
class _Destination:
    """A load's target once every rule passed: the model, its record, and what the load must (not) fill."""

    target: Target
    model: Any
    slot: records.Slot
    exclude: list[str]  # the draft's parameters owned by the verifier: never written, never required
    skip: Callable[[str], bool]  # checkpoint tensors hashed but not fed (they land in ``exclude``)
    required: list[str] | None  # None for a quantized engine: the complete feed is what is checked


class _StagedMismatchError(Exception):
    """The bytes a commit handed to the model do not hash to the stage's digest."""


def _arguments(target: object, path: object, revision: object) -> str | Failure:
    """The resolved directory of a load's ``path``, or why the arguments are refused (nothing changes)."""
    if target not in ("verifier", "draft"):
        return fail("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
    if revision is not None and (not isinstance(revision, int) or isinstance(revision, bool) or revision < 0):
        return fail("invalid_revision", f"revision must be a non-negative integer, got {revision!r}")
    try:
        return paths.resolve(path)
    except paths.PathRefusedError as exc:
        return fail("invalid_path", str(exc))


def _destination(worker: Any, target: Target, revision: int | None, restore: bool) -> _Destination | Failure:
    """The rules every load obeys, from files or from the stage: no load during a session or into a
    destroyed target, the verifier first, frozen drafts never overwritten, weights mapped."""
    from rolloutfleet_worker import models

    state = records.record_of(worker)
    try:
        verifier, draft, shared = records.models_of(worker, state)
    except models.LookupFailedError as exc:
        return fail("internal", str(exc))
    refused = records.refused(worker, state, target, verifier, draft)
    if refused is not None:
        return refused
    records.take_baseline(state, verifier, draft, shared)
    if target == "verifier":
        model, slot, exclude = verifier, state.verifier, []
        if model is None:
            return fail("load_failed", "the worker has no verifier model")
    else:
        model, slot, exclude = draft, state.draft, shared
        if model is None:
            return fail("no_draft", "this engine (or this pipeline rank) has no draft model")
        policy = options.draft_policy()
        if restore and policy != "frozen":
            return fail("invalid_target", "restore_draft is only for a frozen draft; use rolloutfleet_load")
        if not restore and policy == "frozen":
            return fail("frozen", "the draft policy is frozen: its weights are never overwritten")
        if not restore:
            records.observe(state.verifier, verifier, [])
            v = state.verifier
            if v.lost or not v.verified or v.revision != revision:
                held = None if v.lost or not v.verified else v.revision
                return fail("order", f"load the verifier at revision {revision} first (it holds {held})")
    if not models.weights_mapped(model):
        return fail("order", f"the {target} weights are not mapped (asleep): wake_up(tags=weights) first")
    skip = (lambda name: models.matches_shared(name, shared)) if target == "draft" and shared else None
    # vLLM checks the loaded names only for unquantized models (quantization methods may create
    # parameters no checkpoint carries); for a quantized one the complete feed is what is checked.
    quantized = models.quantization(worker, target) is not None
    return _Destination(
        target=target,
        model=model,
        slot=slot,
        exclude=exclude,
        skip=skip or (lambda _name: False),
        required=None if quantized else models.required_parameters(model, exclude),
    )


def _apply(
    dest: _Destination, path: str, revision: int | None, run: Callable[[_Destination], LoadOutcome], *, staged: bool
) -> LoadResult | Failure:
    """Run a load (``run`` returns the loader's ``LoadOutcome``) into ``dest``: the target is unknown
    from the first byte on, and holds ``revision`` only when the load succeeded."""
    from rolloutfleet_worker import loader, loader_base, models

    slot = dest.slot
    slot.unknown()  # fail closed from here on: a crash mid-load must not leave an old claim behind
    slot.lost = False
    try:
        outcome = run(dest)
    except loader_base.OutsideRootsError as exc:
        return fail("invalid_path", str(exc))
    except digest.CheckpointError as exc:
        return fail("io", str(exc))
    except loader.LoadWeightsError as exc:
        return fail("load_failed", str(exc))
    except loader.IncompleteLoadError as exc:
        return fail("incomplete", str(exc))
    except _StagedMismatchError as exc:
        return fail("staged_mismatch", str(exc))
    except Exception as exc:
        return fail("load_failed", f"{type(exc).__name__}: {exc}")
    gb, seconds = outcome.bytes / 1e9, outcome.seconds
    log.info(
        "rolloutfleet: %s %s revision %s from %s: %.2f GB in %.3f s (%.1f GB/s, %s path%s%s%s; "
        "load_weights %.3f s, waiting for tensors %.3f s, finishing %.3f s)",
        "committed" if staged else "loaded",
        dest.target,
        revision,
        f"the stage of {path}" if staged else path,
        gb,
        seconds,
        gb / max(seconds, 1e-9),
        outcome.path,
        f", {outcome.unpinned_bytes / 1e9:.2f} GB not page-locked" if outcome.unpinned_bytes else "",
        f", {outcome.device_hashed_bytes / 1e9:.2f} GB hashed on the GPU" if outcome.device_hashed_bytes else "",
        f", {outcome.bounced_bytes / 1e9:.2f} GB through bounce buffers" if outcome.bounced_bytes else "",
        outcome.model_seconds,
        outcome.waiting_seconds,
        outcome.finish_seconds,
    )
    slot.revision, slot.digest, slot.path, slot.verified = revision, outcome.digest, path, True
    slot.fingerprint = models.fingerprint(dest.model, dest.exclude)
    return LoadResult(
        ok=True,
        target=dest.target,
        revision=revision,
        path=path,
        digest=outcome.digest,
        bytes=outcome.bytes,
        seconds=outcome.seconds,
        tensors=outcome.tensors,
        skipped=outcome.skipped,
        staged=staged,
    )


def _load(worker: Any, target: object, path: object, revision: int | None, restore: bool) -> LoadResult | Failure:
    """A load from the checkpoint files (``loader.stream_into``)."""
    from rolloutfleet_worker import loader, models

    real = _arguments(target, path, revision)
    if not isinstance(real, str):
        return real
    assert isinstance(path, str)
    dest = _destination(worker, "draft" if target == "draft" else "verifier", revision, restore)
    if not isinstance(dest, _Destination):
        return dest

    def run(d: _Destination) -> LoadOutcome:
        opts = options.load_options(
            pin=models.on_cuda(d.model), world_size=models.world_size(), sample=paths.first_file(real)
        )
        return loader.stream_into(d.model, real, skip=d.skip, options=opts, required=d.required)

    return _apply(dest, path, revision, run, staged=False)


def _commit(worker: Any, target: object, path: object, revision: object) -> LoadResult | Failure:
    """A staged load (docs/staging.md): the stage's bytes for ``target`` copied into the model and
    hashed again on the way; ``not_staged`` (nothing changed) unless the finished stage holds exactly this
    revision and path; ``staged_mismatch`` (target unknown, stage dropped) when the bytes changed."""
    import dataclasses

    from rolloutfleet_worker import loader, models, staging

    real = _arguments(target, path, revision)
    if not isinstance(real, str):
        return real
    assert isinstance(path, str) and isinstance(revision, int)
    name: Target = "draft" if target == "draft" else "verifier"
    checkpoint = staging.committable(worker, name, path, revision)
    if isinstance(checkpoint, str):
        return fail("not_staged", checkpoint)
    dest = _destination(worker, name, revision, restore=False)
    if not isinstance(dest, _Destination):
        return dest
    expected = checkpoint.digest

    def run(d: _Destination) -> LoadOutcome:
        pin = models.on_cuda(d.model)
        # No page-locking probe (the bytes are already in host memory); hashing on the GPU needs one.
        opts = options.load_options(pin=pin, world_size=models.world_size(), probe=False)
        opts = dataclasses.replace(opts, gpu_hash=opts.gpu_hash and pin)
        outcome = loader.commit_into(d.model, checkpoint, skip=d.skip, options=opts, required=d.required)
        if outcome.digest != expected:
            raise _StagedMismatchError(
                f"the {d.target} handed to the model hashes to {outcome.digest}, the stage to {expected}: "
                "the staged bytes changed in host memory"
            )
        return outcome

    result = _apply(dest, path, revision, run, staged=True)
    if result["ok"]:
        staging.committed(worker, name)
    elif result["error"]["code"] == "staged_mismatch":
        staging.discard(worker, "staged_mismatch", result["error"]["message"])
        log.warning("rolloutfleet: commit of %s revision %s refused: %s", name, revision, result["error"]["message"])
    return result


def _preflight(worker: Any, target: object, path: object) -> PreflightResult | Failure:
    """Whether a load of ``target`` from ``path`` can succeed, judged from headers and sizes alone.

    Checks: the target and path as a load checks them; the target model exists (and for a draft, which
    of its tensors the verifier owns); every ``*.safetensors`` file directly in the directory resolves and
    opens under the allowed roots and is readable; every header parses, every tensor lies inside its file
    with as many bytes as its dtype and shape say, no name appears twice, and every dtype is one torch can
    load; and, for an unquantized engine, the tensors a load would feed hold at least as many elements as
    the target's parameters on this rank (shared and vocabulary-padding ones left out).

    Cannot check, because vLLM's per-model ``load_weights`` decides it: which parameter each checkpoint
    name fills (q/k/v are stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, prefixes are
    renamed, tensor-parallel ranks take slices), so neither a name nor a shape is compared one to one, and
    a checkpoint with enough elements under names the model ignores still passes (the load itself then
    fails with ``incomplete``); nor anything about the values. For a quantized engine the element count is
    not compared either (quantization methods create parameters no checkpoint carries). Reads no tensor
    bytes and touches no parameter, so it is safe while the engine serves or sleeps.
    """
    from rolloutfleet_worker import loader_base, models

    if target not in ("verifier", "draft"):
        return fail("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
    try:
        real = paths.resolve(path)
    except paths.PathRefusedError as exc:
        return fail("invalid_path", str(exc))
    assert isinstance(path, str)
    try:
        verifier, draft, shared = records.models_of(worker)
    except models.LookupFailedError as exc:
        return fail("internal", str(exc))
    model, exclude = (verifier, []) if target == "verifier" else (draft, shared)
    if model is None:
        if target == "verifier":
            return fail("load_failed", "the worker has no verifier model")
        return fail("no_draft", "this engine (or this pipeline rank) has no draft model")
    roots = paths.weight_roots()
    try:
        if roots:
            loader_base.check_files(real, roots)
        infos = digest.scan_directory(real)
        if roots:
            infos = loader_base.confine(infos, roots)
        for file in dict.fromkeys(info.file for info in infos):
            os.close(loader_base.open_file(file, roots))
        for info in infos:
            loader_base.torch_dtype(info.dtype, info.file)
    except loader_base.OutsideRootsError as exc:
        return fail("invalid_path", str(exc))
    except digest.CheckpointError as exc:
        return fail("io", str(exc))
    fed = [info for info in infos if not (exclude and models.matches_shared(info.name, exclude))]
    if models.quantization(worker, target) is None:
        have = sum(_elements(info.shape) for info in fed)
        need = models.parameter_elements(model, exclude)
        if have < need:
            return fail(
                "incomplete",
                f"the checkpoint's {len(fed)} tensors hold {have} elements; the {target}'s parameters on this "
                f"rank need {need}: it cannot fill the model",
            )
    return PreflightResult(
        ok=True,
        target="draft" if target == "draft" else "verifier",
        path=path,
        tensors=len(infos),
        bytes=sum(info.nbytes for info in infos),
    )


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _report(worker: Any) -> StateResult:
    from rolloutfleet_worker import models, staging

    state = records.record_of(worker)
    verifier, draft, shared = records.models_of(worker, state)
    records.settle(state, verifier, draft, vllm_open=records.vllm_session_open(worker))
    records.take_baseline(state, verifier, draft, shared)
    read = state.session is None  # during a session the target's parameters are on the meta device
    v_mapped = records.observe(state.verifier, verifier, [], read=read)
    d_mapped = records.observe(state.draft, draft, shared, read=read)
    resident = (
        v_mapped
        and d_mapped
        and state.session is None
        and not (state.verifier.lost or state.verifier.destroyed)
        and (draft is None or not (state.draft.lost or state.draft.destroyed))
    )
    draft_report: DraftState | None = None
    if draft is not None:
        d = state.draft.report(d_mapped)
        draft_report = DraftState(
            revision=d["revision"],
            digest=d["digest"],
            path=d["path"],
            verified=d["verified"],
            destroyed=d["destroyed"],
            policy=options.draft_policy(),
        )
    return StateResult(
        ok=True,
        resident=resident,
        mapped=v_mapped and d_mapped,
        verifier=state.verifier.report(v_mapped),
        draft=draft_report,
        draft_method=models.draft_method(worker),
        shared_tensors=shared,
        rank=models.rank(),
        session=push.session_report(state.session),
        group=state.group,
        staged=staging.report(worker),
    )


class RolloutFleetExtension:
    """Mixin for vLLM's Worker. Every method returns a dict and never raises."""

    def rolloutfleet_load(self, target: str, path: str, revision: int, staged: bool = False) -> LoadResult | Failure:
        """Load ``target`` ("verifier" | "draft") in place from checkpoint directory ``path``; ``staged``:
        commit it from the staging area instead (``rolloutfleet_stage`` of the same revision and path)."""
        try:
            if revision is None:
                return fail("invalid_revision", "revision is required")
            if staged is True:
                return _commit(self, target, path, revision)
            return _load(self, target, path, revision, restore=False)
        except Exception as exc:  # the RPC boundary: report, never raise
            return fail("load_failed", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_stage(
        self,
        revision: int,
        verifier_path: str,
        draft_path: str | None = None,
        limit_bytes: int | None = None,
        threads: int | None = None,
        gbps: float | None = None,
        pin_chunk_bytes: int | None = None,
    ) -> StageResult | Failure:
        """Start reading ``revision``'s checkpoints into host memory while the engine serves; returns at once.
        ``threads`` / ``gbps`` / ``pin_chunk_bytes``: this stage's tuning instead of the environment's
        (benchmarks; the operator never sends them)."""
        try:
            from rolloutfleet_worker import staging

            return staging.stage(
                self,
                revision,
                verifier_path,
                draft_path,
                limit_bytes,
                threads=threads,
                gbps=gbps,
                pin_chunk_bytes=pin_chunk_bytes,
            )
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_unstage(self) -> UnstageResult | Failure:
        """Stop any staging and release the staging area."""
        try:
            from rolloutfleet_worker import staging

            return UnstageResult(ok=True, released_bytes=staging.unstage(self))
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_restore_draft(self, path: str) -> LoadResult | Failure:
        """Reload a frozen draft from ``path`` (after a level-2 sleep); revision stays None."""
        try:
            pinned = os.environ.get(options.DRAFT_PATH_ENV)
            if pinned and isinstance(path, str) and os.path.normpath(path) != os.path.normpath(pinned):
                return fail("invalid_path", f"the frozen draft comes from {pinned!r}, not {path!r}")
            return _load(self, "draft", path, None, restore=True)
        except Exception as exc:
            return fail("load_failed", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_preflight(self, target: str, path: str) -> PreflightResult | Failure:
        """Check, from headers and sizes only, that ``target`` could load from ``path`` (``_preflight``)."""
        try:
            return _preflight(self, target, path)
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_state(self) -> StateResult | Failure:
        """What this worker holds: revisions, digests, residency, draft method, shared tensors, rank."""
        try:
            return _report(self)
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_push_begin(self, target: str, revision: int, epoch: int) -> PushBeginResult | Failure:
        """Open the extension's side of a weight-transfer session into ``target`` (before vLLM's start)."""
        try:
            return push.begin(self, target, revision, epoch)
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_push_group(self, epoch: int, rank_offset: int, world_size: int) -> PushGroupResult | Failure:
        """Record the NCCL transfer group this process joined (after vLLM's init returned)."""
        try:
            return push.record_group(self, epoch, rank_offset, world_size)
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_push_end(self, abandon: bool = False) -> PushEndResult | Failure:
        """Close the open session (after vLLM's finish): verified, or the target destroyed."""
        try:
            return push.end(self, abandon)
        except Exception as exc:
            return fail("internal", f"{type(exc).__name__}: {exc}")
