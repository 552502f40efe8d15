"""``reconcile_fleet``: one level-triggered pass over a RolloutFleet.

Called by the fleet handlers (create, update, resume, timer). Observe the fleet, its StatefulSet and pods
→ validate (pure) → build the children (pure) → server-side apply them → build the status (pure) → patch
it only when it differs from what is stored. Invalid specs never touch the children: the fleet keeps
serving what it served, and the problem is reported once as ``Degraded/ValidationFailed`` plus a Warning
event.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.api import common, validation
from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from rolloutfleet.planning import fleet_status
from rolloutfleet.reconcile.context import FleetMemory, OperatorContext, StatusMemo
from rolloutfleet.resources import children, labels

Manifest = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class FleetOutcome:
    """What a pass did (for logs, tests and metrics)."""

    valid: bool
    applied: int
    status_written: bool
    errors: tuple[str, ...] = ()


async def reconcile_fleet(ctx: OperatorContext, body: Manifest, *, fresh_within: float = 0.0) -> FleetOutcome:
    """Converge one fleet's children and status to its spec.

    ``fresh_within`` (the periodic resync): leave a valid fleet's status as it is when it was built from fresh
    reads less than this many seconds ago. A revision's pass rebuilds it every 1-2 s at 1,024 pods; the resync
    rebuilding it again as well was 4.8 % of the operator's samples during a 25 s Rolling revision (issue 18).
    """
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    generation = int(meta.get("generation") or 0)
    spec, errors = validation.parse_fleet_spec(body.get("spec") or {})
    if spec is not None:
        errors = validation.validate_fleet(spec, name=name)
    ctx.metrics.replicas_desired.labels(namespace, name).set(int((body.get("spec") or {}).get("replicas") or 0))
    if spec is None or errors:
        ctx.metrics.validation_failures.labels("RolloutFleet").inc()
        message = validation.summary(errors)
        # Parsed here only: a valid fleet's status is parsed where it is rebuilt (``_observe_and_write``), and
        # not at all by a resync that leaves a fresh one (at 1,024 pods each parse builds 1,024 entries).
        old_status = _parse_status(body.get("status"))
        new_status = fleet_status.invalid(old_status, message, generation)
        written, _ = await _write_status(ctx, body, old_status.to_wire(), new_status.to_wire())
        if written and fleet_status.newly_invalid(old_status, message):
            await ctx.kube.event(body, "Warning", "ValidationFailed", message)
        ctx.metrics.reconciles.labels("RolloutFleet", "invalid").inc()
        return FleetOutcome(valid=False, applied=0, status_written=written, errors=tuple(str(e) for e in errors))

    owner = children.Owner(name=name, namespace=namespace, uid=meta["uid"])
    await _ensure_token(ctx, owner)
    desired = children.build_children(owner, spec, ctx.operator_namespace)
    for manifest in desired:
        await ctx.kube.apply(manifest)
    memory = ctx.fleets.get((namespace, name))
    if fresh_within > 0 and memory is not None and time.monotonic() - memory.status_observed_at < fresh_within:
        ctx.metrics.reconciles.labels("RolloutFleet", "ok").inc()
        return FleetOutcome(valid=True, applied=len(desired), status_written=False)
    try:
        written = await _observe_and_write(ctx, body, spec)
    except KubeError as exc:
        if exc.status != 409:
            raise
        # The copy kopf handed us is older than the stored fleet (the revision loop wrote meanwhile):
        # build the status again from a fresh read rather than retrying the whole handler later.
        written = await refresh_status(ctx, namespace, name)
    ctx.metrics.reconciles.labels("RolloutFleet", "ok").inc()
    return FleetOutcome(valid=True, applied=len(desired), status_written=written)


async def _observe_and_write(
    ctx: OperatorContext, body: Manifest, spec: RolloutFleetSpec, memo: StatusMemo | None = None
) -> bool:
    """Build the status from the StatefulSet, the pods and the revision loop's view; write what changed.

    The write is conditional on ``body``'s resourceVersion: a status computed from an old copy of the fleet
    is refused (409) instead of overwriting newer fields, and the caller retries from a fresh read. ``memo``:
    the status as this process last wrote it, ``body`` the fleet then (``refresh_status``), instead of the
    status ``body`` carries.
    """
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    old_status = memo.status if memo is not None else _parse_status(body.get("status"))
    sts = await ctx.kube.get("apps/v1", "StatefulSet", namespace, labels.statefulset_name(name))
    pods = await ctx.kube.list("v1", "Pod", namespace, labels.selector_string(name))
    generation = int(meta.get("generation") or 0)
    memory = ctx.fleets.get((namespace, name))
    facts = memory.status_facts if memory is not None else fleet_status.PodFactsMemo()
    new_status = fleet_status.observed(
        old_status, spec, name, generation, sts, pods, _engines(memory, facts, pods), facts
    )
    ctx.metrics.replicas_ready.labels(namespace, name).set(new_status.ready_replicas)
    old_wire = memo.wire if memo is not None else old_status.to_wire()
    new_wire = new_status.to_wire()
    written, version = await _write_status(ctx, body, old_wire, new_wire)
    memory = ctx.fleets.get((namespace, name))  # (not created here: a deleted fleet's memory is gone for good)
    if memory is not None:
        memory.status_observed_at = time.monotonic()
        # Kept with the version the fleet has now: the write's, or with nothing written the one read. A write
        # whose answer named none leaves nothing to write on from: the next refresh reads the fleet. A version
        # that is not the latest (kopf's copy of the fleet can be older) only costs that refresh a 409 and a read.
        current = version if written else meta.get("resourceVersion")
        memory.status_memo = (
            StatusMemo(
                # What later refreshes take from the fleet: its spec, and for Events its apiVersion and kind.
                body={
                    "apiVersion": body.get("apiVersion") or common.API_VERSION,
                    "kind": body.get("kind") or "RolloutFleet",
                    "metadata": {**meta, "resourceVersion": current},
                    "spec": body.get("spec"),
                },
                spec=spec,
                status=new_status,
                wire=new_wire,
            )
            if current
            else None
        )
    if written:
        await _events_for_flips(ctx, body, old_status, new_status)
    return written


async def refresh_status(ctx: OperatorContext, namespace: str, name: str, attempts: int = 3) -> bool:
    """Rewrite a fleet's status from fresh reads (the revision loop calls it after each pass, so per-pod
    revisions show at once rather than at the fleet's next resync). Retries on a write conflict.

    The fleet itself is read only when this process's last status write is not the fleet's latest change
    (``StatusMemo``): during a pass, at 1,024 pods every two seconds, that read (the fleet with a row per pod)
    and parsing its status again were a quarter of each refresh (issue 18).
    """
    memory = ctx.fleets.get((namespace, name))
    if memory is not None and memory.status_memo is not None:
        memo = memory.status_memo
        try:
            return await _observe_and_write(ctx, memo.body, memo.spec, memo)
        except KubeError as exc:
            if exc.status not in (404, 409):
                raise
            # 409: the fleet changed since (its spec, the revision loop's fields, another writer): read it.
            # 404: it is gone (the read below says so).
            memory.status_memo = None
    for _ in range(attempts):
        body = await ctx.kube.get(common.API_VERSION, "RolloutFleet", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return False
        spec = spec_or_none(body)
        if spec is None:
            return False
        try:
            return await _observe_and_write(ctx, body, spec)
        except KubeError as exc:
            if exc.status != 409:
                raise
    return False


def _engines(
    memory: FleetMemory | None, facts: fleet_status.PodFactsMemo, pods: list[Manifest]
) -> dict[str, fleet_status.EngineSummary]:
    if memory is None:
        return {}
    summaries: dict[str, fleet_status.EngineSummary] = {}
    # Each summary is kept with what it was made from: the observation and step (observations are immutable,
    # replaced on change), the pod object (the watch replaces it on every change) and the incarnation the
    # observation was read through. Making every pod's again took 1.9-2.7 ms of each of a pass's status writes at
    # 1,024 pods, more than building the status from the pods' facts (0.7-0.8 ms kept; issue 18). A pod whose four
    # are its summary's is not read at all (its facts and incarnation were asked at every write before: in place,
    # during a long-tail Rolling revision at 1,024 pods, this walk took 3.5-4.2 ms a write then and 2.0-2.9 now,
    # the reads of changed pods aside; bench/results/rollout_overhead.md, "What the status builds cost in place").
    # The one change made to a listed pod in place, its gate (``reconcile.gates``), does not touch its incarnation
    # (uid, restart counts).
    made, kept = memory.summaries, {}
    view, steps, read_through = memory.engine_view, memory.steps, memory.engine_view_incarnations
    for pod in pods:
        name = pod["metadata"]["name"]
        state = view.get(name)
        if state is None:
            # No observation, so none read through another incarnation (``remember`` keeps both per pod).
            continue
        step, through = steps.get(name), read_through.get(name)
        last = made.get(name)
        earlier = None  # the summary of this observation and step, made through another object of the pod
        if last is not None and last[0] is state and last[1] == step:
            if last[2] is pod and last[3] == through:
                kept[name] = last
                summaries[name] = last[4]
                continue
            earlier = last[4]
        if memory.replaced(name, facts.facts(pod).incarnation):
            # A pod recreated under the same name, or whose container restarted, is a new engine process on
            # the initial checkpoint: what its predecessor served (in memory and in the status) says nothing
            # of it until it is read.
            summary = _NOTHING_KNOWN
        elif earlier is not None and earlier is not _NOTHING_KNOWN:
            summary = earlier  # the same engine seen through a newer object of the same pod
        else:
            # An engine that does not answer holds nothing the status may claim: its revisions read unknown (a
            # crashed engine comes back on the initial checkpoint), its step says why.
            summary = (
                fleet_status.EngineSummary(
                    revision=state.verifier.revision,
                    draft_revision=state.draft.revision if state.draft is not None else None,
                    step=step,
                    weight_version=state.weight_version,
                )
                if state.reachable
                else fleet_status.EngineSummary(None, None, step or "Unreachable", None)
            )
        kept[name] = (state, step, pod, through, summary)
        summaries[name] = summary
    memory.summaries = kept
    return summaries


_NOTHING_KNOWN = fleet_status.EngineSummary(None, None, None, None)


def _parse_status(raw: object) -> RolloutFleetStatus:
    try:
        return RolloutFleetStatus.model_validate(raw or {})
    except ValueError:
        # A status we cannot read (an older operator's shape) is rebuilt from observations.
        return RolloutFleetStatus()


async def _ensure_token(ctx: OperatorContext, owner: children.Owner) -> None:
    """Create the control-token Secret once; an existing token is never read into logs or rotated here."""
    existing = await ctx.kube.get("v1", "Secret", owner.namespace, labels.token_secret_name(owner.name))
    if existing is None:
        await ctx.kube.create(children.build_token_secret(owner, secrets.token_urlsafe(32)))


async def _write_status(
    ctx: OperatorContext, body: Manifest, old_wire: Manifest, new_wire: Manifest
) -> tuple[bool, str | None]:
    """Patch the status subresource only with fields that changed: (written, the fleet's resourceVersion
    after the write, None when nothing was written or the answer named none). A field the new status no longer
    has (``podsCommon`` once the fleet is small again) is removed: a merge patch's null."""
    changed: Manifest = {k: v for k, v in new_wire.items() if old_wire.get(k) != v}
    changed.update(dict.fromkeys(old_wire.keys() - new_wire.keys()))
    if not changed:
        return False, None
    meta = body["metadata"]
    version = await ctx.kube.patch_status(
        common.API_VERSION,
        "RolloutFleet",
        meta["namespace"],
        meta["name"],
        changed,
        resource_version=meta.get("resourceVersion"),
    )
    return True, version


async def _events_for_flips(
    ctx: OperatorContext, body: Manifest, old: RolloutFleetStatus, new: RolloutFleetStatus
) -> None:
    for cond in fleet_status.flipped_conditions(old, new):
        warning = (cond.type == "Degraded" and cond.status == common.ConditionStatus.TRUE) or (
            cond.type in ("Available", fleet_status.PUSH_WITHIN_LIMIT) and cond.status == common.ConditionStatus.FALSE
        )
        await ctx.kube.event(
            body, "Warning" if warning else "Normal", cond.reason, f"{cond.type}={cond.status.value}: {cond.message}"
        )


def spec_or_none(body: Manifest) -> RolloutFleetSpec | None:
    """The fleet's spec when it parses and validates, else None (used by the revision loop)."""
    spec, errors = validation.parse_fleet_spec(body.get("spec") or {})
    if spec is None or errors or validation.validate_fleet(spec, name=body["metadata"]["name"]):
        return None
    return spec
