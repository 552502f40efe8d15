"""Status writes of the revision loop: WeightRevision statuses, final phases, and its RolloutFleet fields.

Called by ``reconcile.revision`` and ``reconcile.rollout_pass``. Owns the rule "write only what changed"
for revisions, and the revision loop's fields of the fleet status (``currentRevision``, ``targetRevision``,
``served``). Those fleet fields have this one writer; ``status.pods`` and the conditions belong to
``reconcile.fleet``, which this module asks to refresh from fresh reads (never from a body read minutes
ago). A revision deleted while it is being written is not an error: its 404 ends the write quietly.
"""

from __future__ import annotations

import logging
from typing import Any

from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.api import common
from rolloutfleet.api.revision import Phase, PodFailure, WeightRevisionStatus
from rolloutfleet.planning import revision_status, revisions
from rolloutfleet.reconcile.context import OperatorContext
from rolloutfleet.resources import labels

Manifest = dict[str, Any]
log = logging.getLogger(__name__)


def generation(body: Manifest) -> int:
    """``metadata.generation`` of an object (0 when unset)."""
    return int(body["metadata"].get("generation") or 0)


def wrev_ref(body: Manifest) -> Manifest:
    """What an Event about a WeightRevision needs of it."""
    return {"apiVersion": common.API_VERSION, "kind": "WeightRevision", "metadata": body["metadata"]}


async def write_revision(ctx: OperatorContext, rev: revisions.Revision, new: WeightRevisionStatus) -> bool:
    """Patch the fields of ``rev``'s status that differ from what is stored; False when nothing changed or
    the object is gone (deleted by a user or pruned by GitOps while the pass ran)."""
    # What this pass wrote last is what is stored (unless the status was replaced since: read back, reset).
    kept = rev.written_wire if rev.written_of is rev.status else None
    old_wire = kept if kept is not None else rev.status.to_wire()
    new_wire = new.to_wire()
    changed = {k: v for k, v in new_wire.items() if old_wire.get(k) != v}
    if not changed or rev.deleted:
        return False
    meta = rev.body["metadata"]
    try:
        await ctx.kube.patch_status(common.API_VERSION, "WeightRevision", meta["namespace"], meta["name"], changed)
    except KubeError as exc:
        if exc.status != 404:
            raise
        log.info("WeightRevision %s/%s was deleted; its status is not written", meta["namespace"], meta["name"])
        rev.deleted = True
        return False
    rev.status = new  # later writes of this pass compare against what is stored now
    rev.written_wire, rev.written_of = new_wire, new
    return True


async def still_exists(ctx: OperatorContext, rev: revisions.Revision) -> bool:
    """Whether ``rev``'s object is still there (the same object: a re-created one has another uid)."""
    if rev.deleted:
        return False
    meta = rev.body["metadata"]
    current = await ctx.kube.get(common.API_VERSION, "WeightRevision", meta["namespace"], meta["name"])
    if (
        current is None
        or current["metadata"].get("uid") != meta.get("uid")
        or current["metadata"].get("deletionTimestamp")
    ):
        rev.deleted = True
    return not rev.deleted


async def finalize(
    ctx: OperatorContext,
    rev: revisions.Revision,
    phase: Phase,
    reason: str,
    message: str,
    *,
    warn: bool = False,
    failures: list[PodFailure] | None = None,
    over: WeightRevisionStatus | None = None,
) -> None:
    """Give ``rev`` its final phase, with one event and one metric increment (once: repeated calls with the
    same phase and reason write nothing). ``failures``: per-pod entries to record with it; ``over``: the
    pass's last progress, written in the same request (else the stored status is the base)."""
    if rev.status.phase == phase and rev.status.reason == reason:
        return
    new = revision_status.finalized(over or rev.status, phase, reason, message, generation(rev.body))
    if failures is not None:
        new = new.model_copy(update={"failures": failures})
    if not await write_revision(ctx, rev, new):
        return
    meta = rev.body["metadata"]
    try:
        await ctx.kube.patch_labels(
            common.API_VERSION, "WeightRevision", meta["namespace"], meta["name"], {labels.SETTLED_LABEL: "true"}
        )
    except KubeError as exc:  # only an optimisation of the next passes' lists: the phase is what counts
        if exc.status != 404:
            log.warning("WeightRevision %s/%s: not labelled settled: %s", meta["namespace"], meta["name"], exc)
    await ctx.kube.event(wrev_ref(rev.body), "Warning" if warn else "Normal", reason, message)
    fleet = rev.spec.fleet_ref.name if rev.spec is not None else ""
    ctx.metrics.revisions.labels(rev.body["metadata"]["namespace"], fleet, phase.value).inc()


async def patch_fleet(ctx: OperatorContext, fleet_body: Manifest, fields: dict[str, Any]) -> None:
    """Merge-patch the revision loop's own fields of the fleet status (only those that changed).

    These fields have no other writer, so a merge patch of just them cannot overwrite anyone's newer data.
    """
    if not isinstance(fleet_body.get("status"), dict):
        fleet_body["status"] = {}  # a fleet not yet reconciled: keep what this pass writes comparable
    status = fleet_body["status"]
    changed = {k: v for k, v in fields.items() if status.get(k) != v}
    if changed:
        meta = fleet_body["metadata"]
        await ctx.kube.patch_status(common.API_VERSION, "RolloutFleet", meta["namespace"], meta["name"], changed)
        status.update(changed)


def served_wire(served: revisions.Served, since: str) -> dict[str, Any]:
    """``status.served`` as written (camelCase, unset fields omitted)."""
    wire: dict[str, Any] = {
        "revision": served.revision,
        "name": served.name,
        "verifierPath": served.verifier_path,
        "verifierPushed": served.verifier_pushed or None,
        "verifierDigest": served.verifier_digest,
        "draftPath": served.draft_path,
        "draftPushed": served.draft_pushed or None,
        "draftDigest": served.draft_digest,
        "since": since,
    }
    return {k: v for k, v in wire.items() if v is not None}


def served_from_status(status: Manifest) -> revisions.Served | None:
    """The record a fleet status holds of what it serves (None: its initial weights, or no record)."""
    raw = status.get("served")
    if not isinstance(raw, dict) or not isinstance(raw.get("revision"), int):
        return None
    pushed = raw.get("verifierPushed") is True
    if not raw.get("verifierPath") and not pushed:
        return None
    return revisions.Served(
        revision=raw["revision"],
        verifier_path=None if pushed else str(raw["verifierPath"]),
        verifier_digest=raw.get("verifierDigest"),
        draft_path=raw.get("draftPath"),
        draft_digest=raw.get("draftDigest"),
        name=raw.get("name"),
        verifier_pushed=pushed,
        draft_pushed=raw.get("draftPushed") is True,
    )


def served_of(status: Manifest, revs: list[revisions.Revision]) -> revisions.Served | None:
    """What the fleet serves: its ``status.served`` record, or (a status written before that record
    existed) the Succeeded revision numbered ``currentRevision`` while its object is still there."""
    served = served_from_status(status)
    if served is not None:
        return served
    current = status.get("currentRevision")
    if not isinstance(current, int):
        return None
    rev = next((r for r in revs if r.status.phase == Phase.SUCCEEDED and r.number == current), None)
    if rev is None or rev.spec is None:
        log.warning("fleet status names revision %s but records no sources and its object is gone", current)
        return None
    spec = rev.spec
    return revisions.Served(
        revision=spec.revision,
        verifier_path=spec.verifier.path,
        verifier_digest=spec.verifier.digest,
        draft_path=spec.draft.path if spec.draft is not None else None,
        draft_digest=spec.draft.digest if spec.draft is not None else None,
        name=rev.name,
        verifier_pushed=spec.verifier.pushed,
        draft_pushed=spec.draft is not None and spec.draft.pushed,
    )
