"""A revision's status: final phases say the same thing in every field (issue 15 defect 12); step timings."""

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


def test_step_timings_follow_their_lists_through_the_memo() -> None:
    """A pass writes its progress every second at 1,024 pods; the step timings' medians are kept between writes
    while a step's list of durations is the same object with the same length (the pass only appends). A longer
    list, and another list of the same length (another pass's, another revision's), are timed again."""
    memo: revision_status.TimingsMemo = {}
    loads = [2.0, 1.0, 4.0]
    durations = {"rolloutfleet_load:verifier": loads, "pause": [0.1]}
    first = revision_status.timings(durations, memo)
    assert [(t.step, t.count, t.median_seconds, t.max_seconds) for t in first] == [
        ("pause", 1, 0.1, 0.1),
        ("rolloutfleet_load:verifier", 3, 2.0, 4.0),
    ]
    assert revision_status.timings(durations, memo)[1] is first[1]  # unchanged: the same entry
    loads.append(9.0)
    assert [(t.count, t.median_seconds, t.max_seconds) for t in revision_status.timings(durations, memo)][1] == (
        4,
        3.0,
        9.0,
    )
    durations["rolloutfleet_load:verifier"] = [5.0, 6.0, 7.0, 8.0]  # same length, another list
    assert revision_status.timings(durations, memo)[1].median_seconds == 6.5
    assert revision_status.timings(durations, memo) == revision_status.timings(durations, {})
