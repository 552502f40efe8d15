"""Final phases of a revision's status say the same thing in every field (issue 15 defect 12)."""

from __future__ import annotations

import pytest

from rolloutfleet.api.revision import Phase, WeightRevisionStatus
from rolloutfleet.planning import revision_status

pytestmark = pytest.mark.unit


def test_superseded_keeps_the_pods_that_did_serve_it_in_both_counts() -> None:
    """A revision superseded after 3 of 8 pods moved to it: `updated` printed 0/8 next to podsUpdated 3,
    so `kubectl get wrev` and the status disagreed. Both say 3/8: those pods did serve it."""
    old = WeightRevisionStatus(phase=Phase.PROGRESSING, pods_updated=3, pods_total=8, updated="3/8")
    new = revision_status.finalized(old, Phase.SUPERSEDED, "Superseded", "superseded by step-9", 2)
    assert (new.pods_updated, new.updated) == (3, "3/8")


@pytest.mark.parametrize(
    ("phase", "updated"), [(Phase.SUCCEEDED, "8/8"), (Phase.FAILED, "0/8"), (Phase.ROLLED_BACK, "0/8")]
)
def test_other_final_phases(phase: Phase, updated: str) -> None:
    old = WeightRevisionStatus(phase=Phase.PROGRESSING, pods_updated=3, pods_total=8, updated="3/8")
    new = revision_status.finalized(old, phase, "Reason", "message", 2)
    assert new.updated == updated and new.updated == f"{new.pods_updated}/8"
