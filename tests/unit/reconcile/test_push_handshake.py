"""``reconcile.push``: the operator's half of the handshake, pure parts (docs/push.md, "Handshake")."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutfleet.api import validation
from rolloutfleet.api.engine import EngineState, PushSession, Target
from rolloutfleet.api.revision import WeightRevisionStatus
from rolloutfleet.planning import revisions
from rolloutfleet.reconcile import push

pytestmark = pytest.mark.unit


def _state(epoch: int | None, *, error: str | None = None) -> EngineState:
    session = None if epoch is None else PushSession(Target.VERIFIER, revision=2, epoch=epoch, error=error)
    return EngineState(reachable=True, session=session)


def _pod(ip: str) -> dict[str, Any]:
    return {"status": {"podIP": ip}}


def test_an_epoch_is_published_only_once_every_session_of_it_is_open() -> None:
    # A trainer that saw part of an epoch would mark it, and the operator would then end the sessions opened
    # after that mark with nothing received (destroying their targets): never show a partial epoch.
    states = {"a": _state(4), "b": _state(5), "c": _state(5, error="shape"), "d": _state(None)}
    bodies = {p: _pod(f"127.1.0.{i}") for i, p in enumerate("abcd")}
    published = push.published_sessions(states, {5: {"e"}}, bodies, 8000)
    assert [(s.pod, s.epoch, s.address) for s in published] == [("a", 4, "127.1.0.0:8000")]
    complete = push.published_sessions(states, {}, bodies, 8000)
    assert [s.pod for s in complete] == ["a", "b"]  # a failed session is not one to send into


def test_epochs_only_grow_above_what_any_engine_reports() -> None:
    # A restarted operator's status may be behind the engines (it died before writing): never reuse one.
    assert push.next_epoch(3, [_state(7), _state(None)]) == 8
    assert push.next_epoch(9, [_state(7)]) == 10


def _revision(annotations: dict[str, str]) -> revisions.Revision:
    spec, errors = validation.parse_revision_spec(
        {"fleetRef": {"name": "p"}, "revision": 2, "verifier": {"push": {}, "digest": "blake3:" + "1" * 64}}
    )
    assert spec is not None, errors
    body = {"metadata": {"name": "step-2", "annotations": annotations}, "spec": {}}
    return revisions.Revision("step-2", "", spec, WeightRevisionStatus(), (), body)


def _fleet() -> Any:
    spec, errors = validation.parse_fleet_spec(
        {
            "image": "i",
            "verifier": {"path": "/w/p/0"},
            "weights": {"claimName": "c", "allowedRoots": ["/w/p"]},
            "weightTransfer": {"backend": "ipc"},
            "updateStrategy": {"timeouts": {"pushSeconds": 45}},
        }
    )
    assert spec is not None, errors
    return spec


def test_marks_come_from_the_revisions_annotations_and_bad_values_mark_nothing() -> None:
    rev = _revision({"push.rolloutfleet.io/verifier": "7", "push.rolloutfleet.io/draft": "x"})
    marks = push.marks(_fleet(), rev, rolling_back=False)
    assert (marks.verifier_epoch, marks.draft_epoch, marks.deadline_s, marks.can_open) == (7, None, 45.0, True)
    assert marks.sent(Target.VERIFIER, 7) and marks.sent(Target.VERIFIER, 6) and not marks.sent(Target.VERIFIER, 8)
    error = push.marks(_fleet(), _revision({"push.rolloutfleet.io/error": "x" * 2000}), rolling_back=False)
    assert error.error is not None and len(error.error) == push.ERROR_MAX
    assert error.error_target is None  # unscoped: it ends every open session
    scoped = push.marks(
        _fleet(), _revision({"push.rolloutfleet.io/error": "draft epoch 12: pod-1: refused"}), rolling_back=False
    )
    assert (scoped.error_target, scoped.error_epoch) == (Target.DRAFT, 12)


def test_no_session_is_opened_for_a_rollback_or_a_catch_up() -> None:
    # Only an active revision has a trainer sending; a rollback's or a served revision's goal has none.
    assert not push.marks(_fleet(), _revision({}), rolling_back=True).can_open
    assert not push.marks(_fleet(), None, rolling_back=False).can_open
