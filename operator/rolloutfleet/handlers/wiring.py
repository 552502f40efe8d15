"""Every kopf decorator of the operator, in one file; each handler is a few lines that delegate.

Loaded by ``rolloutfleet run`` (``handlers.commands``). Handlers are thin: they fetch the collaborators
from kopf's memo and call the level-triggered reconcilers, mapping exceptions to kopf's temporary errors
in one place (``_temporary``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from rolloutfleet.adapters.kube import Kube, KubeError
from rolloutfleet.api import common
from rolloutfleet.metrics import Metrics
from rolloutfleet.reconcile import fleet as fleet_reconcile
from rolloutfleet.reconcile.context import OperatorContext

GROUP, VERSION = common.GROUP, common.VERSION
FLEETS = "rolloutfleets"
RESYNC_SECONDS = float(os.environ.get("ROLLOUTFLEET_RESYNC_SECONDS", "10"))
METRICS_PORT_ENV = "ROLLOUTFLEET_METRICS_PORT"


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any
) -> None:
    """Kopf settings (our annotation prefix, watch timeouts, posting level) and the process collaborators."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.batching.worker_limit = 64
    settings.networking.request_timeout = 60
    metrics = Metrics()
    port = int(os.environ.get(METRICS_PORT_ENV, "0") or 0)
    if port:
        metrics.serve(port)
        logger.info("metrics on :%d/metrics", port)
    memo.ctx = OperatorContext(
        kube=Kube.from_environment(os.environ.get("KUBECONFIG")),
        metrics=metrics,
        operator_namespace=os.environ.get("ROLLOUTFLEET_OPERATOR_NAMESPACE") or None,
    )


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    """Release the Kubernetes client's threads."""
    ctx: OperatorContext | None = getattr(memo, "ctx", None)
    if ctx is not None:
        ctx.kube.close()


async def _fleet(memo: kopf.Memo, body: kopf.Body) -> None:
    ctx: OperatorContext = memo.ctx
    try:
        outcome = await fleet_reconcile.reconcile_fleet(ctx, dict(body))
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
    await _fleet(memo, body)


@kopf.on.delete(GROUP, VERSION, FLEETS, optional=True)
async def fleet_deleted(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Children go with their owner references; only forget the fleet's metrics."""
    memo.setdefault("seen_fleets", set()).discard((body["metadata"]["namespace"], body["metadata"]["name"]))
