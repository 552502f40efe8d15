"""Revision metrics are labelled by fleet, with exactly the label names the reconcilers pass."""

from __future__ import annotations

import pytest

from rolloutfleet.metrics import Metrics

FLEET_LABELLED = {
    "step_duration": ("namespace", "fleet", "step", "mode"),
    "rollout_duration": ("namespace", "fleet", "phase"),
    "update_failures": ("namespace", "fleet", "step", "reason"),
    "rollbacks": ("namespace", "fleet"),
    "revisions": ("namespace", "fleet", "phase"),
    "pods_at_revision": ("namespace", "fleet", "revision"),
}


@pytest.mark.parametrize(("attribute", "labels"), sorted(FLEET_LABELLED.items()))
def test_revision_metrics_are_labelled_by_fleet(attribute: str, labels: tuple[str, ...]) -> None:
    metric = getattr(Metrics(), attribute)
    assert metric._labelnames == labels  # the reconcilers call .labels(*fleet_labels, ...) in this order
    metric.labels(*(f"v{i}" for i in range(len(labels))))  # and the arity works


def test_cached_children_record_into_the_exported_series() -> None:
    """The hot paths record through ``Children`` (a child looked up once): what they record must be what a
    scrape shows under the same labels, and a second lookup must not start a new series."""
    metrics = Metrics()
    first = metrics.step_durations("ns", "fleet", "pause", "sleep")
    first.observe(0.3)
    metrics.step_durations("ns", "fleet", "pause", "sleep").observe(0.6)
    metrics.kube_request_counts("patch").inc()
    metrics.engine_requests("resume", "ok").observe(0.01)
    assert metrics.step_durations("ns", "fleet", "pause", "sleep") is first
    assert first is metrics.step_duration.labels("ns", "fleet", "pause", "sleep")
    sample = metrics.registry.get_sample_value
    labels = {"namespace": "ns", "fleet": "fleet", "step": "pause", "mode": "sleep"}
    assert sample("rolloutfleet_update_step_duration_seconds_count", labels) == 2
    assert sample("rolloutfleet_update_step_duration_seconds_sum", labels) == pytest.approx(0.9)
    assert sample("rolloutfleet_kube_api_requests_total", {"verb": "patch"}) == 1
    assert sample("rolloutfleet_engine_request_duration_seconds_count", {"route": "resume", "outcome": "ok"}) == 1
