"""Prometheus metrics of the operator, served on its metrics port by ``rolloutfleet run``.

Imported by reconcile (fleet and revision) to record what happened. One registry per process, created by
``Metrics()`` and kept in kopf's memo (no module-level mutable state), so tests can make their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_M = TypeVar("_M", prom.Counter, prom.Gauge, prom.Histogram)
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# How late the event loop runs what is due (``handlers.event_loop.watch_lag``): a few ms is an idle loop, tens of
# ms a busy one, a second or more a loop that holds back every engine call and watch event behind it.
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Every metric the operator exports."""

    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, open fds: what the operator costs its node.
        prom.ProcessCollector(registry=r)
        self.fleets = prom.Gauge("rolloutfleet_fleets", "RolloutFleets reconciled by this operator.", registry=r)
        self.replicas_desired = prom.Gauge(
            "rolloutfleet_fleet_replicas_desired", "spec.replicas of a fleet.", ["namespace", "fleet"], registry=r
        )
        self.replicas_ready = prom.Gauge(
            "rolloutfleet_fleet_replicas_ready", "Ready engine pods of a fleet.", ["namespace", "fleet"], registry=r
        )
        self.reconciles = prom.Counter(
            "rolloutfleet_reconcile_total", "Reconciles by kind and outcome.", ["kind", "outcome"], registry=r
        )
        self.validation_failures = prom.Counter(
            "rolloutfleet_validation_failures_total", "Objects refused by semantic validation.", ["kind"], registry=r
        )
        self.step_duration = prom.Histogram(
            "rolloutfleet_update_step_duration_seconds",
            "Duration of one step of the per-pod weight-update transaction.",
            ["namespace", "fleet", "step", "mode"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.rollout_duration = prom.Histogram(
            "rolloutfleet_revision_rollout_duration_seconds",
            "Time from a WeightRevision's start to its end, by outcome phase.",
            ["namespace", "fleet", "phase"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.pods_at_revision = prom.Gauge(
            "rolloutfleet_pods_at_revision",
            "Engine pods serving each revision.",
            ["namespace", "fleet", "revision"],
            registry=r,
        )
        self.update_failures = prom.Counter(
            "rolloutfleet_update_failures_total",
            "Failed steps of the transaction.",
            ["namespace", "fleet", "step", "reason"],
            registry=r,
        )
        self.rollbacks = prom.Counter(
            "rolloutfleet_rollbacks_total",
            "Pods rolled back to the previous revision.",
            ["namespace", "fleet"],
            registry=r,
        )
        self.push_sessions_open = prom.Gauge(
            "rolloutfleet_push_sessions_open",
            "Weight-transfer sessions open and waiting for the trainer (pushed revisions).",
            ["namespace", "fleet", "target"],
            registry=r,
        )
        self.push_sessions = prom.Counter(
            "rolloutfleet_push_sessions_total",
            "Weight-transfer sessions that ended, by outcome (verified, failed, abandoned).",
            ["namespace", "fleet", "target", "outcome"],
            registry=r,
        )
        self.pods_restarted = prom.Counter(
            "rolloutfleet_pods_restarted_total",
            "Engine pods deleted by the operator to repair a target a failed session destroyed.",
            ["namespace", "fleet"],
            registry=r,
        )
        self.revisions = prom.Counter(
            "rolloutfleet_revisions_total",
            "WeightRevisions that reached a final phase.",
            ["namespace", "fleet", "phase"],
            registry=r,
        )
        self.engine_request_seconds = prom.Histogram(
            "rolloutfleet_engine_request_duration_seconds",
            "Latency of HTTP requests from the operator to engines.",
            ["route", "outcome"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.engine_connections = prom.Counter(
            "rolloutfleet_engine_connections_opened_total",
            "TCP connections the operator opened to engines (each request reuses one kept alive when it can).",
            registry=r,
        )
        self.kube_connections = prom.Counter(
            "rolloutfleet_kube_connections_opened_total",
            "TLS connections the operator opened to the Kubernetes API for its requests (watches aside).",
            registry=r,
        )
        self.kube_throttled = prom.Counter(
            "rolloutfleet_kube_throttled_total",
            "Answers of 429 Too Many Requests from the Kubernetes API that the operator waited out and sent again.",
            registry=r,
        )
        self.loop_lag = prom.Histogram(
            "rolloutfleet_event_loop_lag_seconds",
            "How late the operator's event loop ran a timer that was due (sampled every half second): the time "
            "every engine call, Kubernetes request and watch event waits behind the work queued before it.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.kube_requests = prom.Counter(
            "rolloutfleet_kube_api_requests_total",
            "Requests from the reconcilers to the Kubernetes API.",
            ["verb"],
            registry=r,
        )
        # What the rollout's hot paths record per request and per step (at 1,024 pods ~10 per pod per
        # revision): each child looked up once (``Children``).
        self.step_durations = Children(self.step_duration)
        self.engine_requests = Children(self.engine_request_seconds)
        self.kube_request_counts = Children(self.kube_requests)

    def watch_gc(self, seconds: Callable[[], Sequence[float]]) -> None:
        """Export ``seconds()`` (the cycle collector's CPU seconds per generation, read at each scrape)."""
        self.registry.register(_GCSeconds(seconds))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from inside the cluster
        """Start the /metrics HTTP server (a daemon thread; prometheus_client's own)."""
        prom.start_http_server(port, addr=addr, registry=self.registry)


class Children(Generic[_M]):
    """A metric's children by label values, each made once: ``children(*values)`` is ``metric.labels(*values)``.

    ``labels`` checks and converts the values and takes the metric's lock on every call (~2.5 µs of the
    operator's event loop, against ~1 µs for the observation itself); a rollout records a step's duration or
    a request's count about ten times per pod. Only for metrics whose children are never removed: a cached
    child would outlive its removal.
    """

    def __init__(self, metric: _M) -> None:
        self._metric: _M = metric
        self._children: dict[tuple[str, ...], _M] = {}

    def __call__(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class _GCSeconds(Collector):
    """``rolloutfleet_gc_seconds_total``: read at scrape time, so the collector's callback takes no lock."""

    def __init__(self, seconds: Callable[[], Sequence[float]]) -> None:
        self._seconds = seconds

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "rolloutfleet_gc_seconds",
            "CPU seconds of the operator process's cycle garbage collector, by generation.",
            labels=["generation"],
        )
        for generation, value in enumerate(self._seconds()):
            family.add_metric([str(generation)], value)
        yield family
