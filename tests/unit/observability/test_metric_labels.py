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
