"""Failure summaries and status size (issue 15 defect 21): a failure on many pods reads once, and a
revision's status stays far below the API server's object size limit at 4,096 pods, listing the pods not done."""

from __future__ import annotations

import json

import pytest

from rolloutfleet.api.engine import EngineState, TargetState
from rolloutfleet.api.revision import PodFailure, WeightRevisionStatus
from rolloutfleet.planning import failures, revision_status
from rolloutfleet.planning.transaction import Decision, Goal, Step

pytestmark = pytest.mark.unit
MESSAGE = "ExtensionIo: no such directory: '/weights/p/step-9/verifier'"


def failure(i: int, message: str = MESSAGE, step: str = "LoadVerifier") -> PodFailure:
    return PodFailure(name=f"p-{i}", step=step, reason="ExtensionIo", message=message, attempts=3)


def _progress(
    order: list[str],
    decisions: dict[str, Decision],
    messages: dict[str, str],
    attempts: dict[str, int],
    durations: dict[str, list[float]],
) -> WeightRevisionStatus:
    """A pass's progress status of revision 7, every pod's engine holding its pair."""
    digest = "blake3:" + "a" * 64
    state = EngineState(reachable=True, verifier=TargetState(7, digest), draft=TargetState(7, digest))
    return revision_status.progressing(
        WeightRevisionStatus(),
        goal=Goal(revision=7, verifier_path="/w/7/v", sleep_mode=True, draft_path="/w/7/d"),
        order=order,
        states=dict.fromkeys(order, state),
        decisions=decisions,
        attempts=attempts,
        messages=messages,
        durations=durations,
        total=len(order),
        rolling_back=False,
        generation=1,
    )


def test_identical_failures_are_said_once_with_a_count_and_which_pods() -> None:
    """Eight pods missing the same checkpoint is one problem: said once, with 8, an example and the pods."""
    summary = failures.summarize([failure(i) for i in range(8)], total=8)
    assert summary.count(MESSAGE) == 1
    assert summary.startswith("8/8 pods failed at LoadVerifier (ExtensionIo) on p-0, p-1, p-2, p-3, p-4 and 3 more")


def test_messages_differing_only_by_the_pod_are_one_kind() -> None:
    """Engines name themselves in errors (their address, their pod); that does not make two problems."""
    summary = failures.summarize(
        [failure(i, f"EngineUnreachable: 127.1.0.{i}:8000 refused (p-{i})") for i in range(4)], total=4
    )
    assert summary.startswith("4/4 pods failed") and summary.count("refused") == 1


def test_different_kinds_are_each_said_and_the_rest_counted() -> None:
    mixed = [failure(0), failure(1), failure(2, "x", "Sleep"), failure(3, "y", "Pause"), failure(4, "z", "Resume")]
    summary = failures.summarize(mixed, total=5)
    assert "2/5 pods failed at LoadVerifier" in summary and "1 more pods failed in 1 other ways" in summary


def test_status_failures_are_bounded() -> None:
    kept = failures.bounded([failure(i) for i in range(4096)])
    assert len(kept) == failures.MAX_FAILURE_ENTRIES


def test_a_4096_pod_revision_status_stays_small() -> None:
    """Every pod listed with two digests would be ~1.2 MB at 4,096 pods, near etcd's 1.5 MiB object limit;
    the status lists every pod only up to 256 and otherwise the pods that are not done."""
    order = [f"policy-{i}" for i in range(4096)]
    decisions = {p: Decision(Step.DONE) for p in order}
    decisions["policy-17"] = Decision(Step.LOAD_DRAFT)
    status = _progress(order, decisions, {"policy-17": MESSAGE}, {}, {"LoadVerifier": [0.5] * 4096})
    size = len(json.dumps(status.to_wire()))
    assert size < 64 * 1024, size
    assert [p.name for p in status.pods] == ["policy-17"] and status.pods_updated == 4095


def test_each_pod_is_kept_once() -> None:
    """status.failures is a list-map keyed by pod name: a pod named twice made the API server refuse the whole
    status write (422), so the revision never ended (found by the sandbox demo: a pre-flight refused both
    the verifier and the draft of every pod)."""
    twice = [failure(0), failure(0, "another", "LoadDraft"), failure(1)]
    assert [f.name for f in failures.bounded(twice)] == ["p-0", "p-1"]


def test_progress_of_a_large_fleet_lists_the_first_pods_not_done_and_counts_every_pod() -> None:
    """Mid-revision at 600 pods: the status lists, in the fleet's order, the first ``MAX_POD_ENTRIES`` pods that
    are not done or carry a message (a pod done with a message among them), each with its attempts (the pass
    passes only the pods that failed); ``updated`` counts the pods done, ``Verified`` the pods done or about to
    resume on verified weights. A walk that stopped early, or counted from the listed pods, would miss these."""
    order = [f"policy-{i}" for i in range(600)]
    # 0-99 done, 100-149 about to resume, 150-449 loading, 450-599 not decided yet; 40 done with a message
    decisions = {p: Decision(Step.DONE) for p in order[:100]}
    decisions.update({p: Decision(Step.RESUME) for p in order[100:150]})
    decisions.update({p: Decision(Step.LOAD_VERIFIER) for p in order[150:450]})
    messages = {"policy-40": "LoadVerifier: retried"}
    status = _progress(order, decisions, messages, {"policy-40": 1, "policy-200": 2}, {})
    listed = [p.name for p in status.pods]
    assert len(listed) == revision_status.MAX_POD_ENTRIES
    assert listed == ["policy-40", *order[100 : 100 + revision_status.MAX_POD_ENTRIES - 1]]
    assert {p.name: p.attempts for p in status.pods if p.attempts} == {"policy-40": 1, "policy-200": 2}
    assert (status.pods_updated, status.updated) == (100, "100/600")
    verified = next(c for c in status.conditions if c.type == revision_status.VERIFIED)
    assert verified.message == "150/600 pods report the expected digests" and verified.status == "False"
    assert status.pods[-1].step == Step.LOAD_VERIFIER.value
