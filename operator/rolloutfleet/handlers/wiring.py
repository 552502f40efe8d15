"""Every kopf decorator of the operator, in one file; each handler is a few lines that delegate.

Loaded by ``rolloutfleet run`` (``handlers.commands``). Handlers are thin: they fetch the collaborators
from kopf's memo and call the level-triggered reconcilers, mapping exceptions to kopf's temporary errors
in one place (``_temporary``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from rolloutfleet.adapters.kube import Kube, KubeError
from rolloutfleet.api import common
from rolloutfleet.handlers import event_loop, gc_tuning
from rolloutfleet.handlers.diffbase import SpecDiffBaseStorage
from rolloutfleet.metrics import Metrics
from rolloutfleet.reconcile import fleet as fleet_reconcile
from rolloutfleet.reconcile import push as push_marks
from rolloutfleet.reconcile import revision as revision_reconcile
from rolloutfleet.reconcile import revision_loop as fleet_passes
from rolloutfleet.reconcile.context import OperatorContext

GROUP, VERSION = common.GROUP, common.VERSION
FLEETS = "rolloutfleets"
RESYNC_SECONDS = float(os.environ.get("ROLLOUTFLEET_RESYNC_SECONDS", "10"))
METRICS_PORT_ENV = "ROLLOUTFLEET_METRICS_PORT"
# Set by ``rolloutfleet run``: "1" when it watches every namespace.
CLUSTER_WIDE_ENV = "ROLLOUTFLEET_WATCH_CLUSTER_WIDE"


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    """Kopf settings (our annotation prefix, watch timeouts, posting level) and the process collaborators."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = SpecDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.queueing.worker_limit = 64
    settings.networking.request_timeout = 60
    # A stopped revision loop at rest exits within this; kopf then finishes a fleet's deletion at once
    # instead of re-checking after the daemon's whole cancellation backoff (the shutdown grace).
    settings.background.instant_exit_timeout = 5.0
    # Serving named namespaces, kopf needs no cluster scope: it takes the names as given and finds our
    # resources once through API discovery (the chart installs the CRDs before the operator starts), so a
    # namespaced install runs on Roles alone. Cluster-wide it keeps following CRDs as they change.
    settings.scanning.disabled = os.environ.get(CLUSTER_WIDE_ENV) != "1"
    metrics = Metrics()
    gc_clock = gc_tuning.CollectorClock()
    metrics.watch_gc(lambda: tuple(gc_clock.seconds))
    port = int(os.environ.get(METRICS_PORT_ENV, "0") or 0)
    if port:
        metrics.serve(port)
        logger.info("metrics on :%d/metrics", port)
    kube = Kube.from_environment(os.environ.get("KUBECONFIG"))
    kube.on_request = lambda verb: metrics.kube_request_counts(verb).inc()
    kube.on_connect = metrics.kube_connections.inc
    kube.on_throttle = metrics.kube_throttled.inc
    full_collections = gc_tuning.FullCollections(enabled=gc_tuning.tuned(os.environ))
    memo.ctx = OperatorContext(
        kube=kube,
        metrics=metrics,
        operator_namespace=os.environ.get("ROLLOUTFLEET_OPERATOR_NAMESPACE") or None,
        on_pass=lambda running: full_collections.enter() if running else full_collections.leave(),
    )
    # Last: a startup that fails above (the metrics port taken, no credentials) is retried by kopf, and a
    # collector clock or a lag watch started before the failure would run on, never removed, beside the retry's.
    gc_clock.install()
    memo.gc_clock = gc_clock
    memo.lag_watch = asyncio.create_task(event_loop.watch_lag(metrics.loop_lag.observe))


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    """Release the Kubernetes client's threads; stop the loop's lag samples."""
    lag_watch: asyncio.Task[None] | None = getattr(memo, "lag_watch", None)
    if lag_watch is not None:
        lag_watch.cancel()
        await asyncio.gather(lag_watch, return_exceptions=True)  # ended here, not pending when the loop closes
    gc_clock: gc_tuning.CollectorClock | None = getattr(memo, "gc_clock", None)
    if gc_clock is not None:
        gc_clock.remove()
    ctx: OperatorContext | None = getattr(memo, "ctx", None)
    if ctx is not None:
        await ctx.kube.aclose()


async def _fleet(memo: kopf.Memo, body: kopf.Body, *, resync: bool = False) -> None:
    ctx: OperatorContext = memo.ctx
    # The periodic resync leaves a status built less than half its period ago (a revision's pass refreshes it).
    fresh = RESYNC_SECONDS / 2 if resync else 0.0
    try:
        outcome = await fleet_reconcile.reconcile_fleet(ctx, _plain(body), fresh_within=fresh)
    except KubeError as exc:
        raise _temporary(exc) from exc
    ctx.metrics.fleets.set(len(getattr(memo, "seen_fleets", ())))
    del outcome


def _temporary(exc: KubeError) -> kopf.TemporaryError:
    # Conflicts and throttling clear up quickly; anything else gets a longer back-off.
    delay = 2 if exc.status in (409, 429) else 10
    return kopf.TemporaryError(str(exc), delay=delay)


@kopf.on.create(GROUP, VERSION, FLEETS)
@kopf.on.update(GROUP, VERSION, FLEETS)
@kopf.on.resume(GROUP, VERSION, FLEETS)
async def fleet_changed(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """A fleet appeared or its spec changed: reconcile now."""
    memo.setdefault("seen_fleets", set()).add((body["metadata"]["namespace"], body["metadata"]["name"]))
    await _fleet(memo, body)


@kopf.timer(GROUP, VERSION, FLEETS, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS / 2)
async def fleet_resync(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Periodic level-triggered pass: pods came and went, someone edited a child, the operator restarted."""
    await _fleet(memo, body, resync=True)


@kopf.on.delete(GROUP, VERSION, FLEETS, optional=True)
async def fleet_deleted(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Children go with their owner references; only forget the fleet's metrics."""
    memo.setdefault("seen_fleets", set()).discard((body["metadata"]["namespace"], body["metadata"]["name"]))


REVISIONS = "weightrevisions"
IDLE_SECONDS = float(os.environ.get("ROLLOUTFLEET_IDLE_SECONDS", "5"))
# On stop, how long the revision loop may take to let its running engine steps finish (none is started
# after the stop): kopf signals the daemon, waits this long, then cancels it (charts: shutdownGraceSeconds).
SHUTDOWN_GRACE_SECONDS = float(os.environ.get("ROLLOUTFLEET_SHUTDOWN_GRACE_SECONDS", "300"))


def _plain(obj: Any) -> Any:
    """A deep plain-dict copy of a kopf view (our reconcilers may mutate what they are given)."""
    if isinstance(obj, dict) or hasattr(obj, "keys"):
        return {k: _plain(obj[k]) for k in obj}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


@kopf.daemon(GROUP, VERSION, FLEETS, cancellation_backoff=SHUTDOWN_GRACE_SECONDS, cancellation_timeout=10)
async def revision_loop(
    memo: kopf.Memo,
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """The fleet's weight-update loop: passes of ``reconcile_revisions`` until the fleet goes away.

    A pass runs again at once when it asks to, when a WeightRevision changes (a kick), or after
    ``IDLE_SECONDS`` (pods may have come back, an operator before us may have left work half done).
    On shutdown the running steps finish (up to ``SHUTDOWN_GRACE_SECONDS``); on the fleet's deletion the
    loop ends at once (``reconcile.revision_loop``).
    """
    ctx: OperatorContext = memo.ctx
    assert namespace is not None  # RolloutFleet is namespaced
    memory = ctx.memory(namespace, name)
    memory.marks_delivered = True  # revision_changed hands the trainer's marks to the running pass
    try:
        await fleet_passes.run(ctx, namespace, name, memory, _KopfStop(stopped), logger, idle_seconds=IDLE_SECONDS)
    finally:  # also on cancellation: close the engines' connection pool
        if memory.pool is not None:
            await memory.pool.close()
        ctx.fleets.pop((namespace, name), None)


class _KopfStop:
    """kopf's daemon stop flag as the revision loop's ``StopSignal``."""

    def __init__(self, stopped: kopf.DaemonStopped) -> None:
        self._stopped = stopped

    def stopping(self) -> bool:
        return bool(self._stopped)

    def deleted(self) -> bool:
        reason = self._stopped.reason
        return reason is not None and bool(reason & kopf.DaemonStoppingReason.RESOURCE_DELETED)

    async def wait(self) -> None:
        await self._stopped.wait()


def _kick(
    memo: kopf.Memo,
    namespace: str | None,
    spec: Any,
    *,
    marks_of: Any = None,
    diff: Any = None,
    created: tuple[str, int] | None = None,
) -> None:
    """Wake the fleet's loop; a change of the trainer's marks alone (``marks_of``: the revision's body)
    is handed to the running pass instead of ending it. ``created``: the revision (name, generation) whose
    creation this is, which a pass already carrying it out knows (``FleetMemory.stale_kick``)."""
    fleet = (spec or {}).get("fleetRef", {}).get("name")
    ctx: OperatorContext | None = getattr(memo, "ctx", None)
    if ctx is None or not fleet or not namespace:
        return
    memory = ctx.memory(namespace, fleet)
    if marks_of is not None and diff is not None and push_marks.marks_only(diff):
        meta = marks_of.get("metadata") or {}
        memory.kick_marks(str(meta.get("name")), push_marks.mark_annotations(meta.get("annotations") or {}))
    else:
        memory.kick_all(created)


# No timer or daemon on WeightRevisions: kopf puts a finalizer on every object a timer or daemon runs for,
# and a revision with a finalizer could not be deleted (or pruned by Argo CD/Flux) while no operator runs.
@kopf.on.create(GROUP, VERSION, REVISIONS)
@kopf.on.update(GROUP, VERSION, REVISIONS)
@kopf.on.resume(GROUP, VERSION, REVISIONS)
async def revision_changed(
    memo: kopf.Memo,
    namespace: str | None,
    spec: kopf.Spec,
    body: kopf.Body,
    diff: kopf.Diff,
    reason: str,
    **_: Any,
) -> None:
    """A revision appeared or changed: wake its fleet's loop (which validates and rolls it), or report
    Pending/FleetNotFound when the fleet does not exist (yet)."""
    meta = body.get("metadata") or {}
    created = (str(meta.get("name")), int(meta.get("generation") or 0)) if reason == kopf.Reason.CREATE else None
    _kick(memo, namespace, _plain(spec), marks_of=_plain(body), diff=diff, created=created)
    ctx: OperatorContext = memo.ctx
    try:
        await revision_reconcile.report_orphan(ctx, _plain(body))
    except KubeError as exc:
        raise _temporary(exc) from exc


@kopf.on.delete(GROUP, VERSION, REVISIONS, optional=True)
async def revision_deleted(memo: kopf.Memo, namespace: str | None, spec: kopf.Spec, **_: Any) -> None:
    """A revision went away (a prune, a cleanup): its fleet's loop cancels it if it had not completed."""
    _kick(memo, namespace, _plain(spec))
