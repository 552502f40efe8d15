"""Staged updates in the worker: the one stage a worker holds, and the RPCs' side of it (docs/staging.md).

Called by ``rolloutfleet_worker.extension``: ``rolloutfleet_stage`` (``stage``), ``rolloutfleet_unstage``
(``unstage``), ``rolloutfleet_state().staged`` (``report``) and the staged ``rolloutfleet_load``
(``committable`` finds what to commit, ``committed`` or ``discard`` after it); the commit itself is
``loader.commit_into`` over ``loader_staged``, and one stage's memory and threads are
``rolloutfleet_worker.staging_area``. Owns the contract's rules: argument checks, idempotence, replacing,
the budget, and release after the last commit. Runs on the RPC thread (vLLM runs RPCs one at a time).

The stage lives on the worker object (``_rolloutfleet_stage``, beside ``records``' ``_rolloutfleet_state``),
not in a module dict keyed by ``id(worker)``: an id is reused once its worker is collected, and a module
dict would keep gigabytes of page-locked memory alive after the worker is gone. It is not a field of
``records.Record`` because it owns threads and memory with a life of their own; the record stays plain data.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import rolloutfleet_digest as digest
from rolloutfleet_worker import loader_base, options, paths
from rolloutfleet_worker.loader_base import OutsideRootsError, memory
from rolloutfleet_worker.payloads import ErrorBody, ErrorCode, Failure, StageResult, StageState, Target, fail
from rolloutfleet_worker.staging_area import Checkpoint, Stage

# A child of vLLM's logger, so the lines land in the engine's log with its format and level.
log = logging.getLogger("vllm.rolloutfleet")

ATTRIBUTE = "_rolloutfleet_stage"

__all__ = [
    "Checkpoint",
    "Stage",
    "committable",
    "committed",
    "discard",
    "held",
    "report",
    "stage",
    "staged_bytes",
    "unstage",
]


def held(worker: Any) -> Stage | None:
    """The worker's stage, or None."""
    found = getattr(worker, ATTRIBUTE, None)
    return found if isinstance(found, Stage) else None


def _replace(worker: Any, new: Stage | None) -> int:
    """Stop and release the held stage (if any), hold ``new``; the bytes given back."""
    old = held(worker)
    released = old.stop() if old is not None else 0
    if old is not None and old.phase == "staging":
        log.info("rolloutfleet: staging of revision %s stopped (%.2f GB released)", old.revision, released / 1e9)
    setattr(worker, ATTRIBUTE, new)
    return released


def _valid_revision(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checkpoint(target: Target, path: object, roots: tuple[str, ...]) -> Checkpoint | Failure:
    """Check one checkpoint path as a load would (``invalid_path``); its headers are read later."""
    try:
        real = paths.resolve(path)
    except paths.PathRefusedError as exc:
        return fail("invalid_path", str(exc))
    assert isinstance(path, str)
    try:
        if roots:
            loader_base.check_files(real, roots)
        if not any(p.name.endswith(".safetensors") and p.is_file() for p in Path(real).iterdir()):
            return fail("invalid_path", f"no *.safetensors files in {path!r}")
    except OutsideRootsError as exc:
        return fail("invalid_path", str(exc))
    except (OSError, digest.CheckpointError) as exc:
        return fail("invalid_path", f"{path!r}: unreadable: {exc}")
    return Checkpoint(target=target, path=path, real=real, infos=[])


def stage(
    worker: Any,
    revision: object,
    verifier_path: object,
    draft_path: object = None,
    limit_bytes: object = None,
    threads: object = None,
    gbps: object = None,
    pin_chunk_bytes: object = None,
) -> StageResult | Failure:
    """Start staging (docs/staging.md ``rolloutfleet_stage``); returns at once, the threads fill it.

    Argument errors leave the held stage alone; anything else replaces it (its readers stop and its
    memory goes before the new stage allocates, so two revisions are never in host memory at once).
    ``threads``, ``gbps`` and ``pin_chunk_bytes`` override ``ROLLOUTFLEET_STAGE_THREADS``,
    ``ROLLOUTFLEET_STAGE_GBPS`` and ``ROLLOUTFLEET_STAGE_PIN_CHUNK_BYTES`` for this stage (benchmarks and
    per-engine tuning; the operator never sends them). A re-stage of the held revision answers the held
    stage whatever they say.
    """
    from rolloutfleet_worker import models

    if not _valid_revision(revision):
        return fail("invalid_revision", f"revision must be a non-negative integer, got {revision!r}")
    assert isinstance(revision, int)
    if limit_bytes is not None and not _valid_revision(limit_bytes):
        # No code of the contract fits a malformed budget (the operator never sends one): say it plainly.
        return fail("internal", f"limit_bytes must be a non-negative integer or null, got {limit_bytes!r}")
    assert limit_bytes is None or isinstance(limit_bytes, int)
    tuning = _tuning(threads, gbps, pin_chunk_bytes)
    if not isinstance(tuning, tuple):
        return tuning
    current = held(worker)
    key = (revision, verifier_path, draft_path)
    if current is not None and current.key == key and current.phase in ("staging", "staged"):
        return StageResult(ok=True, stage=current.report())  # idempotent: the operator re-sends after a restart
    roots = paths.weight_roots()
    verifier = _checkpoint("verifier", verifier_path, roots)
    if not isinstance(verifier, Checkpoint):
        return verifier
    draft: Checkpoint | None = None
    if draft_path is not None:
        try:
            has_draft = models.draft_model(worker) is not None
        except models.LookupFailedError as exc:
            return fail("internal", str(exc))
        if not has_draft:
            return fail("no_draft", "this engine (or this pipeline rank) has no draft model")
        found = _checkpoint("draft", draft_path, roots)
        if not isinstance(found, Checkpoint):
            return found
        draft = found
    new = Stage(
        revision,
        verifier,
        draft,
        limit_bytes,
        threads=tuning[0],
        gbps=tuning[1],
        device=_device(worker),
        roots=roots,
        pin_chunk_bytes=tuning[2],
    )
    corrupt: digest.CheckpointError | None = None
    try:
        for c in new.checkpoints:  # headers are small: read here, so the answer carries bytes_total
            infos = digest.scan_directory(c.real)
            c.infos = loader_base.confine(infos, roots) if roots else infos
    except OutsideRootsError as exc:
        return fail("invalid_path", str(exc))
    except digest.CheckpointError as exc:
        corrupt = exc
    _replace(worker, new)
    if corrupt is not None:
        new.end("failed", ErrorBody(code="io", message=str(corrupt)))
        log.warning("rolloutfleet: revision %s not staged: %s", revision, corrupt)
    elif limit_bytes is not None and new.bytes_total > limit_bytes:
        new.end("over_budget")
        log.info(
            "rolloutfleet: revision %s not staged: it needs %.2f GB, the limit is %.2f GB (loads read the files)",
            revision,
            new.bytes_total / 1e9,
            limit_bytes / 1e9,
        )
    else:
        new.start()
    return StageResult(ok=True, stage=new.report())


MAX_THREADS = 64


def _tuning(threads: object, gbps: object, pin_chunk_bytes: object) -> tuple[int, float, int | None] | Failure:
    """The stage's reader threads, bandwidth cap (GB/s, 0: none) and registration chunk (None: whole
    areas): each argument given, else its environment variable. A malformed one answers ``internal`` (no
    code of the contract fits; the operator never sends them)."""
    if threads is None:
        threads = options.stage_threads()
    elif not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        return fail("internal", f"threads must be an integer from 1 to {MAX_THREADS} or null, got {threads!r}")
    if gbps is None:
        gbps = options.stage_gbps()
    elif not isinstance(gbps, int | float) or isinstance(gbps, bool) or not 0 <= gbps < float("inf"):
        return fail("internal", f"gbps must be a finite number >= 0 (0: uncapped) or null, got {gbps!r}")
    if pin_chunk_bytes is None:
        pin_chunk_bytes = options.stage_pin_chunk_bytes()
    elif not isinstance(pin_chunk_bytes, int) or isinstance(pin_chunk_bytes, bool) or pin_chunk_bytes <= 0:
        return fail("internal", f"pin_chunk_bytes must be a positive integer or null, got {pin_chunk_bytes!r}")
    return threads, float(gbps), pin_chunk_bytes


def _device(worker: Any) -> int | None:
    """The CUDA device whose context page-locks the stage, or None on a CPU worker (nothing pinned)."""
    from rolloutfleet_worker import models

    try:
        verifier = models.verifier_model(worker)
    except Exception:  # no model to judge by: stage unpinned rather than refuse
        return None
    if verifier is None or not models.on_cuda(verifier):
        return None
    import torch

    return int(torch.cuda.current_device())


def unstage(worker: Any) -> int:
    """Stop any readers and release the staging area (``rolloutfleet_unstage``); the bytes given back."""
    return _replace(worker, None)


def report(worker: Any) -> StageState | None:
    """``rolloutfleet_state().staged``: the held stage's state, or None."""
    current = held(worker)
    return current.report() if current is not None else None


def committable(worker: Any, target: Target, path: str, revision: int) -> Checkpoint | str:
    """The staged checkpoint a staged load of ``target`` from ``path`` at ``revision`` commits, or why none
    (the ``not_staged`` message)."""
    current = held(worker)
    if current is None:
        return "nothing is staged"
    if current.phase != "staged":
        return f"the stage of revision {current.revision} is {current.phase}, not staged"
    if current.revision != revision:
        return f"the stage holds revision {current.revision}, not {revision}"
    checkpoint = current.verifier if target == "verifier" else current.draft
    if checkpoint is None:
        return f"the stage of revision {revision} has no draft"
    if os.path.normpath(checkpoint.path) != os.path.normpath(path):
        return f"the staged {target} of revision {revision} comes from {checkpoint.path!r}, not {path!r}"
    return checkpoint


def committed(worker: Any, target: Target) -> int:
    """Record a successful commit of ``target``; after the stage's last target (the draft, or the verifier
    of a stage without one) release the area. Returns the bytes given back."""
    current = held(worker)
    if current is None:
        return 0
    checkpoint = current.verifier if target == "verifier" else current.draft
    if checkpoint is not None:
        with current.lock:
            checkpoint.committed = True
    last = current.draft if current.draft is not None else current.verifier
    if not last.committed:
        return 0
    released = _replace(worker, None)
    log.info("rolloutfleet: stage of revision %s committed: %.2f GB released", current.revision, released / 1e9)
    return released


def discard(worker: Any, code: ErrorCode, message: str) -> None:
    """A commit found the staged bytes changed: they cannot be trusted again, so the stage fails and its
    memory goes; a re-stage of the same revision starts afresh."""
    current = held(worker)
    if current is None:
        return
    current.release()
    current.end("failed", ErrorBody(code=code, message=message))


def staged_bytes(worker: Any, target: Target, name: str) -> memoryview:
    """A writable view of one staged tensor's bytes (tests and diagnostics: the commit must notice a change)."""
    current = held(worker)
    if current is None:
        raise LookupError("nothing is staged")
    checkpoint = current.verifier if target == "verifier" else current.draft
    if checkpoint is None:
        raise LookupError(f"no staged {target}")
    info = next(i for i in checkpoint.infos if i.name == name)
    return memory(checkpoint.address(info), info.nbytes)
