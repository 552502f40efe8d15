"""The extension's weight-transfer session RPCs: the rules around vLLM's sessions (docs/push.md).

Called by ``rolloutfleet_worker.extension`` for ``rolloutfleet_push_begin`` / ``rolloutfleet_push_end`` and
the ``session`` of ``rolloutfleet_state``. The operator calls begin before vLLM's ``/start_weight_update``
(or ``/start_draft_weight_update``) and end after its ``/finish_weight_update`` (or without it, when the
update failed or the session is abandoned). Owns the rules: one session at a time, a draft only after the
verifier verified at the same revision, never into a frozen draft or a destroyed target; and the outcome:
the target holds the revision, verified, with the digest of exactly what was received, or it is
destroyed. What happens inside a session (wrapping, hashing, the completeness verdict) is
``rolloutfleet_worker.transfer``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rolloutfleet_worker import options, records
from rolloutfleet_worker.payloads import (
    ErrorCode,
    Failure,
    GroupState,
    PushBeginResult,
    PushEndResult,
    PushGroupResult,
    SessionState,
    Target,
    fail,
)

if TYPE_CHECKING:
    from rolloutfleet_worker.transfer import Session

log = logging.getLogger("vllm.rolloutfleet")


def session_report(session: Session | None) -> SessionState | None:
    """The open session as ``rolloutfleet_state`` reports it (None when there is none)."""
    if session is None:
        return None
    return SessionState(
        target="draft" if session.target == "draft" else "verifier",
        revision=session.revision,
        epoch=session.epoch,
        age_s=round(session.age, 3),
        tensors=session.tensors,
        bytes=session.bytes,
        error=session.error,
    )


def _count(value: object) -> bool:
    """A non-negative int that is not a bool (revisions and epochs)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def record_group(worker: Any, epoch: object, rank_offset: object, world_size: object) -> PushGroupResult | Failure:
    """Remember the NCCL group this process joined: the operator calls it once vLLM's
    ``/init_weight_transfer_engine`` returned (every rank joined). Only memory: a restarted process joined
    nothing, which is how the operator sees that the group lost a member and must be formed again."""
    if not (_count(epoch) and _count(rank_offset) and _count(world_size)):
        return fail(
            "invalid_group",
            f"epoch, rank_offset, world_size must be integers >= 0: {epoch!r}, {rank_offset!r}, {world_size!r}",
        )
    assert isinstance(epoch, int) and isinstance(rank_offset, int) and isinstance(world_size, int)
    if rank_offset < 1 or world_size <= rank_offset:
        return fail("invalid_group", f"rank_offset {rank_offset} is not a rank of a group of {world_size}")
    state = records.record_of(worker)
    state.group = GroupState(epoch=epoch, rank_offset=rank_offset, world_size=world_size)
    log.info("rolloutfleet: joined transfer group %d (ranks from %d of %d)", epoch, rank_offset, world_size)
    return PushGroupResult(ok=True, epoch=epoch)


def begin(worker: Any, target: object, revision: object, epoch: object) -> PushBeginResult | Failure:
    """Open the extension's side of a weight-transfer session into ``target`` (docs/push.md).

    Called before vLLM's ``/start_weight_update`` (or ``/start_draft_weight_update``): everything that
    must read the target's parameters (which to require, which are shared) is read now, while they are
    still on the device. The target's slot becomes unknown: its content is about to change.
    """
    from rolloutfleet_worker import loader_cuda, models, transfer

    if target not in ("verifier", "draft"):
        return fail("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
    if not _count(revision):
        return fail("invalid_revision", f"revision must be a non-negative integer, got {revision!r}")
    if not _count(epoch):
        return fail("invalid_epoch", f"epoch must be a non-negative integer, got {epoch!r}")
    assert isinstance(revision, int) and isinstance(epoch, int)
    state = records.record_of(worker)
    if getattr(worker, "weight_transfer_engine", False) is None:  # vLLM's Worker has it, None when off
        return fail("no_transfer", "vLLM runs without --weight-transfer-config: no session can be opened")
    try:
        verifier, draft, shared = records.models_of(worker, state)
    except models.LookupFailedError as exc:
        return fail("internal", str(exc))
    if state.session is None and records.vllm_session_open(worker):
        return fail("busy", "vLLM has a weight update open that no push_begin bracketed: its target is not trusted")
    refused = records.refused(worker, state, str(target), verifier, draft)
    if refused is not None:
        return refused
    records.take_baseline(state, verifier, draft, shared)
    model, exclude = (verifier, []) if target == "verifier" else (draft, shared)
    if model is None:
        if target == "verifier":
            return fail("internal", "the worker has no verifier model")
        return fail("no_draft", "this engine (or this pipeline rank) has no draft model")
    if target == "draft":
        if options.draft_policy() == "frozen":
            return fail("frozen", "the draft policy is frozen: its weights are never overwritten")
        records.observe(state.verifier, verifier, [])
        v = state.verifier
        if v.lost or v.destroyed or not v.verified or v.revision != revision:
            held = None if v.lost or v.destroyed or not v.verified else v.revision
            return fail("order", f"the verifier must hold revision {revision}, verified, first (it holds {held})")
    if not models.weights_mapped(model):
        return fail("order", f"the {target} weights are not mapped (asleep): wake_up(tags=weights) first")
    quantized = models.quantization(worker, str(target)) is not None
    gpu_hash = options.flag_env(options.GPU_HASH_ENV, True)

    def device_hash(device: Any) -> bool:
        return gpu_hash and device.type == "cuda" and loader_cuda.device_hash_ready(device.index or 0)

    session = transfer.Session(
        target=str(target),
        revision=revision,
        epoch=epoch,
        model=model,
        required=None if quantized else models.required_parameters(model, exclude),
        need_elements=None if quantized else models.parameter_elements(model, exclude),
        skip=(lambda name: models.matches_shared(name, exclude)) if exclude else (lambda _name: False),
        device_hash=device_hash,
    )
    if gpu_hash and models.on_cuda(model):
        import torch

        loader_cuda.device_hash_ready(torch.cuda.current_device())  # start the self-test now if nobody has
    try:
        session.install(getattr(worker, "weight_transfer_engine", None))
    except Exception:
        session.uninstall()
        raise
    slot = state.slot(str(target))
    slot.unknown()  # fail closed from here on
    slot.lost = False
    state.shared = shared
    state.session = session
    log.info("rolloutfleet: %s weight-transfer session open for revision %d (epoch %d)", target, revision, epoch)
    return PushBeginResult(ok=True, target=_target_of(session), revision=revision, epoch=epoch)


def _target_of(session: Session) -> Target:
    return "draft" if session.target == "draft" else "verifier"


def end(worker: Any, abandon: bool) -> PushEndResult | Failure:
    """Close the open session (after vLLM's ``/finish_weight_update``, or without it when the update
    failed or the session is abandoned): the target holds the revision, verified, or it is destroyed."""
    from rolloutfleet_worker import models

    state = records.record_of(worker)
    session = state.session
    if session is None:
        return fail("no_session", "no weight-transfer session is open")
    slot = state.slot(session.target)
    verdict: tuple[ErrorCode, str] | None
    try:
        replaced = session.uninstall()
        if replaced:
            log.warning("rolloutfleet: left in place, replaced during the session: %s", ", ".join(replaced))
        verdict = session.verdict(abandon=abandon is not False, vllm_open=records.vllm_session_open(worker))
        if verdict is None:
            exclude = (state.shared or []) if session.target == "draft" else []
            slot.fingerprint = models.fingerprint(session.model, exclude)
    except Exception as exc:
        verdict = "failed", f"checking the session failed: {type(exc).__name__}: {exc}"
    finally:
        session.uninstall()
        state.session = None
    seconds = round(session.age, 6)
    if verdict is not None:
        code, message = verdict
        slot.unknown()
        slot.destroyed = True
        log.warning("rolloutfleet: %s destroyed: %s (%s)", session.target, message, code)
        try:
            verifier, draft, _shared_names = records.models_of(worker, state)
            records.settle(state, verifier, draft, vllm_open=records.vllm_session_open(worker))  # the other target
        except Exception as exc:  # the state report settles it later; the verdict stands
            log.warning("rolloutfleet: could not check the other target: %s: %s", type(exc).__name__, exc)
        return fail(code, message)
    slot.revision, slot.digest, slot.path, slot.verified = session.revision, session.builder.hexdigest(), None, True
    slot.lost = False
    log.info(
        "rolloutfleet: received %s revision %d (epoch %d): %d tensors, %.2f GB in %d calls, %.2f GB hashed on the "
        "GPU, session open %.3f s",
        session.target,
        session.revision,
        session.epoch,
        session.tensors,
        session.bytes / 1e9,
        session.calls,
        session.device_hashed_bytes / 1e9,
        seconds,
    )
    return PushEndResult(
        ok=True,
        target=_target_of(session),
        revision=session.revision,
        epoch=session.epoch,
        path=None,
        digest=slot.digest,
        bytes=session.bytes,
        seconds=seconds,
        tensors=session.tensors,
        skipped=sorted(session.skipped),
    )
