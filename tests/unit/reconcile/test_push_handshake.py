"""``reconcile.push``: the operator's half of the handshake, pure parts (docs/push.md, "Handshake")."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutfleet.api import fleet as fleet_api
from rolloutfleet.api import validation
from rolloutfleet.api.engine import EngineState, GroupMembership, PushSession, Target
from rolloutfleet.api.revision import WeightRevisionStatus
from rolloutfleet.planning import revisions
from rolloutfleet.reconcile import push
from rolloutfleet.trainer.senders import split_address

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


def test_a_session_on_an_ipv6_pod_is_published_with_its_address_in_brackets() -> None:
    # docs/push.md gives an address as host:port, [v6]:port too, and the trainer splits it at its last colon:
    # "fd00::7:8000" written bare was read there as host "fd00::7", but it is no address an HTTP URL or another
    # reader of the status can take (is 7:8000 part of the host?).
    published = push.published_sessions({"a": _state(4)}, {}, {"a": _pod("fd00::7")}, 8000)
    assert [s.address for s in published] == ["[fd00::7]:8000"]
    assert split_address(published[0].address) == ("fd00::7", 8000)


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


# --- NCCL transfer groups ------------------------------------------------------------------------------


def _nccl_spec(**extra: Any) -> Any:
    body = {
        "image": "vllm:x",
        "verifier": {"path": "/w/v"},
        "weights": {"claimName": "c", "mountPath": "/w", "allowedRoots": ["/w"]},
        "weightTransfer": {"backend": "nccl"},
        **extra,
    }
    spec, errors = validation.parse_fleet_spec(body)
    assert spec is not None, errors
    return spec


def _joined(epoch: int | None, offset: int = 1, world: int = 3) -> EngineState:
    group = None if epoch is None else GroupMembership(epoch=epoch, rank_offset=offset, world_size=world)
    return EngineState(reachable=True, group=group)


def test_group_ranks_follow_pod_order_and_each_engines_workers() -> None:
    # vLLM: worker rank = rank_offset + its rank within the engine (tensor x pipeline parallel); the
    # trainer is rank 0, so engine i starts after every worker of the engines before it.
    spec = _nccl_spec(tensorParallelSize=2, gpusPerPod=4, extraArgs=["--pipeline-parallel-size", "2"])
    assert fleet_api.engine_workers(spec) == 4
    group = push.transfer_group(spec, ["p-0", "p-1"], None, {})
    assert group is not None and group.epoch == 1 and group.world_size == 9
    assert [(r.pod, r.rank_offset, r.world_size) for r in group.ranks] == [("p-0", 1, 4), ("p-1", 5, 4)]
    assert push.transfer_group(_nccl_spec(weightTransfer={"backend": "ipc"}), ["p-0"], None, {}) is None


def test_a_group_is_kept_while_nobody_left_it_and_replaced_once_someone_did() -> None:
    spec = _nccl_spec()  # tensor parallel 1: pods a, b are ranks 1 and 2 of 3
    recorded = push.transfer_group(spec, ["a", "b"], None, {})
    assert recorded is not None and not recorded.formed
    # While forming (nobody joined yet): this revision's group, whose rendezvous the trainer may have set.
    assert push.transfer_group(spec, ["a", "b"], recorded, {"a": _joined(None), "b": _joined(None)}) == recorded
    # Every engine reports it with its own ranks: formed, and kept for later revisions (no record needed).
    both = {"a": _joined(1, 1), "b": _joined(1, 2)}
    kept = push.transfer_group(spec, ["a", "b"], None, both)
    assert kept is not None and (kept.epoch, kept.formed) == (1, True)
    # One process is new (it joined nothing): NCCL cannot take it back into the old group.
    after = push.transfer_group(spec, ["a", "b"], recorded, {"a": _joined(1, 1), "b": _joined(None)})
    assert after is not None and after.epoch == 2 and not after.formed
    # A trainer that is not rank 0 of the formed group (a new process) asks for a new one.
    fresh = push.transfer_group(spec, ["a", "b"], None, both, new_requested=True)
    assert fresh is not None and fresh.epoch == 2 and not fresh.formed
    # ... and keeps it while it forms, though the old one is still what the engines report.
    assert push.transfer_group(spec, ["a", "b"], fresh, both, new_requested=True) == fresh
    # ... and once the trainer joined it (its rendezvous replaced the request), until the engines did too.
    assert push.transfer_group(spec, ["a", "b"], fresh, both) == fresh
    # Other pods: other ranks, a new group above every epoch seen.
    scaled = push.transfer_group(spec, ["a", "b", "c"], recorded, {"a": _joined(6, 1)})
    assert scaled is not None and scaled.epoch == 7 and scaled.world_size == 4


def test_the_rendezvous_applies_to_its_own_group_only() -> None:
    assert push.rendezvous_for("3@trainer-0.rl.svc:29600", 3) == "trainer-0.rl.svc:29600"
    assert push.rendezvous_for("3@[fd00::1]:29600", 3) == "[fd00::1]:29600"
    assert push.rendezvous_for("2@trainer:29600", 3) is None  # the previous group's
    assert push.rendezvous_for("3@trainer:99999", 3) is None
    assert push.rendezvous_for("trainer:29600", 3) is None
    assert push.rendezvous_for(None, 3) is None
    assert push.rendezvous_for("new@trainer:29600", 3) is None  # a request for a new group, not a rendezvous


def test_init_info_names_the_rendezvous_the_group_size_and_the_pods_first_rank() -> None:
    spec = _nccl_spec(tensorParallelSize=2, gpusPerPod=2)
    group = push.transfer_group(spec, ["a", "b"], None, {})
    assert push.init_info(spec, push.membership(group, "b"), "trainer:29600") == {
        "master_address": "trainer",
        "master_port": 29600,
        "rank_offset": 3,
        "world_size": 5,
    }
    assert push.init_info(spec, push.membership(group, "b"), None) is None  # no rendezvous yet: nothing to join
    assert push.init_info(spec, push.membership(group, "z"), "trainer:29600") is None  # not a member
    packed = _nccl_spec(weightTransfer={"backend": "nccl", "nccl": {"packed": True}})
    assert push.init_info(
        packed, push.membership(push.transfer_group(packed, ["a"], None, {}), "a"), "[fd00::1]:1"
    ) == {
        "master_address": "fd00::1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
    }


def test_only_the_trainers_marks_are_handed_to_a_running_pass() -> None:
    # kopf's diff items: (op, field, old, new). A mark, an error or their removal: marks only. Anything
    # else (a spec edit, a label, the rendezvous, which chooses a group at a pass's start) ends the pass.
    verifier, error = "push.rolloutfleet.io/verifier", "push.rolloutfleet.io/error"
    assert push.marks_only([("add", ("metadata", "annotations", verifier), None, "3")])
    assert push.marks_only([("remove", ("metadata", "annotations", error), "x", None)])
    assert push.marks_only([("add", ("metadata", "annotations"), None, {verifier: "3"})])
    assert not push.marks_only([])
    assert not push.marks_only([("change", ("spec", "revision"), 1, 2)])
    assert not push.marks_only([("add", ("metadata", "labels", "x"), None, "y")])
    assert not push.marks_only([("add", ("metadata", "annotations", "push.rolloutfleet.io/rendezvous"), None, "1@h:1")])
    assert not push.marks_only([("add", ("metadata", "annotations"), None, {verifier: "3", "other": "y"})])
    body = {"metadata": {"name": "r", "annotations": {verifier: "1", "note": "kept"}}}
    assert push.with_marks(body, {"push.rolloutfleet.io/draft": "2"})["metadata"]["annotations"] == {
        "note": "kept",
        "push.rolloutfleet.io/draft": "2",
    }
