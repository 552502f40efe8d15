"""A revision's status: final phases say the same thing in every field (issue 15 defect 12); step timings; the
progress of a large fleet."""

from __future__ import annotations

import pytest

from rolloutfleet.api.engine import EngineState, TargetState
from rolloutfleet.api.revision import Phase, WeightRevisionStatus
from rolloutfleet.planning import revision_status
from rolloutfleet.planning.transaction import Decision, Goal, Step

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


def test_progress_of_a_large_fleet_lists_the_first_pods_not_done_and_counts_every_pod() -> None:
    """Mid-revision at 600 pods: the status lists, in the fleet's order, the first ``MAX_POD_ENTRIES`` pods that
    are not done or carry a message (a pod done with a message among them), each with its attempts (the pass
    passes only the pods that failed); ``updated`` counts the pods done, ``Verified`` the pods done or about to
    resume on verified weights. A walk that stopped early, or counted from the listed pods, would miss these."""
    goal = Goal(revision=7, verifier_path="/w/7/v", sleep_mode=True, draft_path="/w/7/d")
    order = [f"policy-{i}" for i in range(600)]
    state = EngineState(reachable=True, verifier=TargetState(7, "d"), draft=TargetState(7, "d"))
    # 0-99 done, 100-149 about to resume, 150-449 loading, 450-599 not decided yet; 40 done with a message
    decisions = {p: Decision(Step.DONE) for p in order[:100]}
    decisions.update({p: Decision(Step.RESUME) for p in order[100:150]})
    decisions.update({p: Decision(Step.LOAD_VERIFIER) for p in order[150:450]})
    messages = {"policy-40": "LoadVerifier: retried"}
    status = revision_status.progressing(
        WeightRevisionStatus(),
        goal=goal,
        order=order,
        states=dict.fromkeys(order, state),
        decisions=decisions,
        attempts={"policy-40": 1, "policy-200": 2},
        messages=messages,
        durations={},
        total=600,
        rolling_back=False,
        generation=1,
    )
    listed = [p.name for p in status.pods]
    assert len(listed) == revision_status.MAX_POD_ENTRIES
    assert listed == ["policy-40", *order[100 : 100 + revision_status.MAX_POD_ENTRIES - 1]]
    assert {p.name: p.attempts for p in status.pods if p.attempts} == {"policy-40": 1, "policy-200": 2}
    assert (status.pods_updated, status.updated) == (100, "100/600")
    verified = next(c for c in status.conditions if c.type == revision_status.VERIFIED)
    assert verified.message == "150/600 pods report the expected digests" and verified.status == "False"
    assert status.pods[-1].step == Step.LOAD_VERIFIER.value
