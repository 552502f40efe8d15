"""``reconcile_revisions``: one pass of a fleet's weight-update loop.

Called by the per-fleet daemon in ``handlers.wiring`` (and by the unit-test and benchmark harnesses).
A pass: read the fleet afresh and its WeightRevisions → select the goal (``planning.revisions``, from the
fleet's record of what it serves, never from old revision objects) → settle what needs no engine (refused,
superseded, already served) → list the pods → run a ``rollout_pass.RolloutPass`` toward the goal. On its
initial weights with nothing to roll, a fleet only needs its pods' readiness gates opened
(``_initial_gates``). Nothing here is a cursor: the next pass, in this process or a restarted one, derives
everything again from the engines.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from rolloutfleet.adapters.engine import EngineClient, EnginePool
from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.api import common, validation, vllm_flags
from rolloutfleet.api.engine import EngineState
from rolloutfleet.api.fleet import RolloutFleetSpec
from rolloutfleet.api.revision import Phase, WeightRevisionStatus
from rolloutfleet.planning import pod_view, revision_status, revisions
from rolloutfleet.planning.pod_view import PodView
from rolloutfleet.reconcile import fanout, gates
from rolloutfleet.reconcile import fleet as fleet_reconcile
from rolloutfleet.reconcile import status_writes as writes
from rolloutfleet.reconcile.context import FleetMemory, OperatorContext, RestMark
from rolloutfleet.reconcile.rollout_pass import READ_CONCURRENCY, PassOutcome, RolloutPass
from rolloutfleet.resources import labels

Manifest = dict[str, Any]
log = logging.getLogger(__name__)
ENGINE_CONNECTIONS = 4096  # per fleet; `rolloutfleet run` raises the open-files limit to fit
# A fleet at rest is read whole again at least this often even when none of its pods changed: the safety net
# under the rest signature (``planning.pod_view.PodViewMemo.signature``) for what a pod's status cannot show
# (docs/rollouts.md, "A fleet at rest").
REST_READ_SECONDS = float(os.environ.get("ROLLOUTFLEET_REST_READ_SECONDS", "60"))

__all__ = ["PassOutcome", "reconcile_revisions", "report_orphan"]


def _parse(body: Manifest) -> revisions.Revision:
    parsed, errors = validation.parse_revision_spec(body.get("spec") or {})
    try:
        status = WeightRevisionStatus.model_validate(body.get("status") or {})
    except ValueError:
        status = WeightRevisionStatus()
    return revisions.Revision(
        name=body["metadata"]["name"],
        created=str(body["metadata"].get("creationTimestamp") or ""),
        spec=parsed,
        status=status,
        parse_errors=tuple(errors),
        body=body,
    )


async def _token(ctx: OperatorContext, namespace: str, fleet: str) -> str | None:
    # Read every pass, so a replaced Secret reaches the engine clients within one pass (the engines accept
    # the previous token for a grace period while kubelet swaps their copy: worker_image/README.md).
    secret = await ctx.kube.get("v1", "Secret", namespace, labels.token_secret_name(fleet))
    data = (secret or {}).get("data") or {}
    raw = data.get(labels.TOKEN_KEY)
    return base64.b64decode(raw).decode() if raw else None


def engine_idle_seconds(spec: RolloutFleetSpec) -> float:
    """How long the operator may leave a connection to one of the fleet's engines idle and use it again: a
    second under the engines' keep-alive (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` in spec.env, vLLM's 5 s without
    it), so that a call never meets the engine's close in flight. Raising it keeps the connections through a
    Rolling fleet's waits and an AllAtOnce fleet's barrier (docs/install.md, "Engine connections")."""
    keep_alive = vllm_flags.http_keep_alive_seconds({e.name: e.value for e in spec.env})
    return keep_alive - 1.0 if keep_alive >= 2 else keep_alive / 2


async def _pool(ctx: OperatorContext, memory: FleetMemory, token: str, spec: RolloutFleetSpec) -> EnginePool:
    idle = engine_idle_seconds(spec)
    if memory.pool is not None:
        # One pool for the fleet's life: it remembers loads of unknown outcome per engine, and a rotated
        # token keeps the previous one as a fallback while kubelets refresh the engines' copies.
        memory.pool.credentials.rotate(token)
        memory.pool.idle_s = idle  # (follows the fleet's env: a new keep-alive restarts its pods with it)
        return memory.pool
    metrics = ctx.metrics

    def on_latency(step: str, seconds: float, outcome: str) -> None:
        metrics.engine_requests(step.split(":", 1)[0], outcome).observe(seconds)

    # Room for every pod's concurrent reads on kept-alive connections: with fewer, a 1,024-pod fleet
    # churned connections (bench/results/rollout_overhead.md).
    memory.pool = EnginePool(
        token=token,
        limit=ENGINE_CONNECTIONS,
        on_latency=on_latency,
        idle_s=idle,
        on_connect=metrics.engine_connections.inc,
    )
    await memory.pool.start()
    return memory.pool


def _pod_view(pods: list[Manifest], memo: pod_view.PodViewMemo | None = None) -> PodView:
    """Which pods the pass moves: Running with an IP and the engine up (its readiness probe passed).

    A pod still starting (a large model takes minutes) is not moved and not failed: it only counts as
    unavailable; once its engine is up it is caught up at once, outside the rollout budget (not routed).
    ``memo``: the fleet's reads of its pods from earlier passes (``planning.pod_view``), else read anew.
    """
    return (memo if memo is not None else pod_view.PodViewMemo()).view(pods)


async def reconcile_revisions(
    ctx: OperatorContext, namespace: str, fleet_name: str, memory: FleetMemory, interrupted: Callable[[], bool]
) -> PassOutcome:
    """One pass over a fleet's revisions and engines.

    The fleet is read afresh from the API server: a watch-fed copy may still show the previous record of
    what it serves right after this loop advanced it, and acting on that would roll pods backwards.
    """
    fleet_body = await ctx.kube.get(common.API_VERSION, "RolloutFleet", namespace, fleet_name)
    if fleet_body is None or fleet_body["metadata"].get("deletionTimestamp"):
        return PassOutcome()
    spec = fleet_reconcile.spec_or_none(fleet_body)
    if spec is None:
        return PassOutcome()
    status = fleet_body.get("status") or {}
    # Finished revisions are labelled settled and never needed again, so only the others are listed (a
    # namespace may hold one revision per training step, thousands). A status from before ``served``
    # existed needs the finished ones once, to find what it serves.
    needs_history = "served" not in status and status.get("currentRevision") is not None
    selector = "" if needs_history else labels.UNSETTLED_SELECTOR
    bodies = await ctx.kube.list(common.API_VERSION, "WeightRevision", namespace, selector)
    revs = [_parse(b) for b in bodies if ((b.get("spec") or {}).get("fleetRef") or {}).get("name") == fleet_name]
    served = writes.served_of(status, revs)
    sel = revisions.select(spec, served, revs)
    await _settle(ctx, sel)
    fields: dict[str, Any] = {}
    if sel.active is not None:
        fields["targetRevision"] = sel.active.number
    # Without an active revision the pass itself says whether pods are moving to what is served, once it read
    # them: a target cleared before that (a first revision deleted after its pods were routed on it) said the
    # fleet moved nowhere while they still served it (the smoke soak's check c).
    if served is not None and "served" not in status:
        fields["served"] = writes.served_wire(served, revision_status.timestamp())  # recorded once (upgrade)
    # Written beside the token's read, the pod list and a revision's pre-flight (which only read), and waited
    # for before any engine moves (``RolloutPass.run``): one round trip less between a revision's creation
    # and its first pause (0.06 s of the 0.10 s pick-up at 1,024 pods on 16 cores, issue 18).
    announcing = asyncio.ensure_future(writes.patch_fleet(ctx, fleet_body, fields))
    try:
        outcome = await _pass(ctx, namespace, fleet_name, memory, interrupted, fleet_body, spec, sel, announcing)
    except BaseException:
        announcing.cancel()
        await asyncio.gather(announcing, return_exceptions=True)
        raise
    await announcing  # (usually done: a pass waits for it before its first step); its error is the pass's
    return outcome


async def _pass(
    ctx: OperatorContext,
    namespace: str,
    fleet_name: str,
    memory: FleetMemory,
    interrupted: Callable[[], bool],
    fleet_body: Manifest,
    spec: RolloutFleetSpec,
    sel: revisions.Selection,
    announcing: asyncio.Future[None],
) -> PassOutcome:
    """The pass once its revisions are settled: the pods, and the rollout toward ``sel``'s goal. The fleet's
    record of the target (``announcing``) is waited for before any engine or gate is touched."""
    token = await _token(ctx, namespace, fleet_name)
    if token is None:
        return PassOutcome()  # the fleet reconcile has not made the Secret yet
    pool = await _pool(ctx, memory, token, spec)
    view = _pod_view(await ctx.kube.list("v1", "Pod", namespace, labels.selector_string(fleet_name)), memory.pod_views)
    # A fleet at rest on what it serves (a revision, or its initial weights), whose pods show nothing new since
    # every engine was read serving it: nothing to read, nothing to write (the fleet's own reconcile keeps the
    # pods' status). Any other pass (a revision's, one after an operator start) forgets that.
    resting = sel.active is None
    rest_goal = sel.goal if sel.goal is not None else revisions.initial_goal(spec)
    signature = memory.pod_views.signature() if resting else ()
    mark, memory.rest = memory.rest, None  # only a pass that finds the fleet at rest sets it again
    at_rest = (
        resting
        and mark is not None
        and mark.goal == rest_goal
        and mark.pods == signature
        and time.monotonic() - mark.read_at < REST_READ_SECONDS
    )
    if at_rest and (
        sel.goal is not None
        # On its initial weights: also every pod routed (none to read and open) and the target already cleared.
        or (view.not_routed.isdisjoint(view.order) and (fleet_body.get("status") or {}).get("targetRevision") is None)
    ):
        memory.rest = mark
        return PassOutcome()
    clients = {name: pool.for_address(view.bodies[name]["status"]["podIP"], spec.port) for name in view.order}
    started = time.monotonic()
    try:
        if sel.goal is None:
            await announcing
            behind = await _initial_gates(ctx, spec, view, clients, everyone=not at_rest)
            if not behind:
                await writes.patch_fleet(ctx, fleet_body, {"targetRevision": None})
                memory.rest = mark if at_rest else RestMark(rest_goal, signature, started)
                return PassOutcome()
            # Pods that hold something else than the initial weights (a revision deleted before it ever
            # completed): back to the initial weights, and only them (the others have nothing to reload).
            sel = dataclasses.replace(sel, goal=rest_goal)
            view = dataclasses.replace(view, order=behind)
        rollout = RolloutPass(ctx, spec, fleet_body, memory, sel, view, clients, interrupted, announcing)
        outcome = await rollout.run()
        if resting and rollout.found_at_rest:
            memory.rest = RestMark(sel.goal, signature, started)
    finally:
        try:
            await fleet_reconcile.refresh_status(ctx, namespace, fleet_name)
        except KubeError as exc:  # the fleet's own resync writes it soon; never fail a pass for it
            log.info("fleet status not refreshed: %s", exc)
    return outcome


async def _settle(ctx: OperatorContext, sel: revisions.Selection) -> None:
    """Revisions decided without touching an engine: refused, superseded, or exactly what is served."""
    for refusal in sel.refused:
        await writes.finalize(ctx, refusal.revision, Phase.FAILED, refusal.reason, refusal.message, warn=True)
    for old in sel.superseded:
        newer = sel.active.name if sel.active else "a newer one"
        await writes.finalize(ctx, old, Phase.SUPERSEDED, "Superseded", f"superseded by {newer}")
    for rev in sel.already_served:
        await writes.finalize(
            ctx, rev, Phase.SUCCEEDED, "AlreadyServed", f"the fleet serves revision {rev.number} from these sources"
        )


async def _initial_gates(
    ctx: OperatorContext, spec: RolloutFleetSpec, view: PodView, clients: dict[str, EngineClient], *, everyone: bool
) -> list[str]:
    """A fleet on its initial weights: open the gate of each pod whose engine serves what it started with.

    ``everyone``: read every pod (the fleet is not known to be at rest: the operator started, or a revision
    was deleted before it completed, whose pods may be routed on its weights). Otherwise only pods not routed
    yet are read: a gate never opened, or an engine process not admitted (a restarted container). Returns the
    pods whose engine holds other weights (it loaded a revision that never completed), to be moved back.
    """
    goal = revisions.initial_goal(spec)
    unopened = [name for name in view.order if everyone or name in view.not_routed]
    states = await fanout.bounded((clients[name].observe() for name in unopened), READ_CONCURRENCY)

    async def one(name: str, state: EngineState) -> bool:
        """Open or close one pod's gate; True when its engine holds weights to move back from."""
        body, client = view.bodies[name], clients[name]
        if gates.serves_initial(state, goal):
            await gates.open_for(ctx, body, client, state, "Serving", "serves the fleet's initial weights")
            return False
        reason = state.error or f"holds revision {state.verifier.revision}"
        await gates.close_for(ctx, body, client, state, "NotServingFleetWeights", reason)
        return (state.reachable and state.verifier.revision not in (None, 0)) or state.paused

    # Every pod at once (the Kubernetes session bounds the writes in flight): one after the other, a
    # 1,024-pod fleet took 21 s to open its gates (bench/results/rollout_overhead.md).
    moved = await asyncio.gather(*(one(name, state) for name, state in zip(unopened, states, strict=True)))
    return [name for name, back in zip(unopened, moved, strict=True) if back]


async def report_orphan(ctx: OperatorContext, body: Manifest) -> None:
    """Mark a revision whose fleet is missing as Pending/FleetNotFound (nothing is touched; it waits)."""
    rev = _parse(body)
    if rev.final or rev.spec is None:
        return
    meta = body["metadata"]
    fleet = await ctx.kube.get(common.API_VERSION, "RolloutFleet", meta["namespace"], rev.spec.fleet_ref.name)
    if fleet is not None:
        return
    message = f"spec.fleetRef.name: RolloutFleet {rev.spec.fleet_ref.name!r} not found in this namespace"
    new = revision_status.waiting_for_fleet(rev.status, message, writes.generation(body))
    if await writes.write_revision(ctx, rev, new):
        await ctx.kube.event(writes.wrev_ref(body), "Warning", "FleetNotFound", message)
