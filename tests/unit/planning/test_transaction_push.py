"""Table tests of the per-pod transaction for pushed targets (docs/push.md, DESIGN §4b).

The order and the fail-closed rules the issue asks for, each derived from the engine's state alone:
verifier session → trainer sends → end (verify) → draft session → end → stamp → resume; never a draft
session before the verifier verified; never resume with a session open or a target destroyed; a session
that cannot be fed any more is abandoned; a destroyed target restarts the pod.
"""

from __future__ import annotations

import dataclasses

import pytest

from rolloutfleet.api.engine import DraftPolicy, EngineState, GroupMembership, PushSession, Target, TargetState
from rolloutfleet.planning.transaction import Goal, PushMarks, Step, next_step

D = "blake3:" + "a" * 64
DV = "blake3:" + "b" * 64
DD = "blake3:" + "c" * 64
PUSH = Goal(
    revision=2,
    verifier_path=None,
    verifier_pushed=True,
    verifier_digest=DV,
    draft_pushed=True,
    draft_digest=DD,
    sleep_mode=False,
    draft_method="draft_model",
    push=PushMarks(deadline_s=60.0),
)
SLEEP_PUSH = dataclasses.replace(PUSH, sleep_mode=True)


def engine(
    *,
    paused: bool = True,
    v: int | None = 1,
    vd: str | None = D,
    d: int | None = 1,
    dd: str | None = D,
    session: PushSession | None = None,
    destroyed: Target | None = None,
    version: str | None = "1",
    resident: bool = True,
) -> EngineState:
    return EngineState(
        reachable=True,
        paused=paused,
        sleeping=paused,
        resident=resident,
        verifier=TargetState(revision=v, digest=vd, verified=vd is not None, destroyed=destroyed == Target.VERIFIER),
        draft=TargetState(
            revision=d,
            digest=dd,
            verified=dd is not None,
            policy=DraftPolicy.CO_UPDATE,
            destroyed=destroyed == Target.DRAFT,
        ),
        weight_version=version,
        draft_method="draft_model",
        session=session,
    )


def session(target: Target = Target.VERIFIER, epoch: int = 3, **kw: object) -> PushSession:
    return PushSession(target=target, revision=2, epoch=epoch, **kw)  # type: ignore[arg-type]


def marked(goal: Goal, **kw: object) -> Goal:
    return dataclasses.replace(goal, push=dataclasses.replace(goal.push, **kw))  # type: ignore[arg-type]


CASES = [
    ("serving the old pair: pause first", PUSH, engine(paused=False), Step.PAUSE),
    ("paused on old weights: open the verifier session", PUSH, engine(), Step.OPEN_VERIFIER_SESSION),
    ("sleep mode frees the old weights before the session", SLEEP_PUSH, engine(), Step.SLEEP),
    (
        "asleep: map the weights before the session",
        SLEEP_PUSH,
        dataclasses.replace(engine(v=None, vd=None, d=None, dd=None, resident=False), mapped=False),
        Step.WAKE_WEIGHTS,
    ),
    ("a session waits for the trainer", PUSH, engine(v=None, vd=None, session=session()), Step.AWAIT_PUSH),
    (
        "the trainer marked the session's epoch: end it",
        marked(PUSH, verifier_epoch=3),
        engine(v=None, vd=None, session=session()),
        Step.END_SESSION,
    ),
    (
        "a mark of an older epoch does not end a newer session",
        marked(PUSH, verifier_epoch=2),
        engine(v=None, vd=None, session=session(epoch=3)),
        Step.AWAIT_PUSH,
    ),
    (
        "the draft mark does not end a verifier session",
        marked(PUSH, draft_epoch=9),
        engine(v=None, vd=None, session=session()),
        Step.AWAIT_PUSH,
    ),
    (
        "past the deadline without a mark: abandon",
        PUSH,
        engine(v=None, vd=None, session=session(age_s=61.0)),
        Step.ABANDON_SESSION,
    ),
    (
        "the trainer reported it cannot send: abandon",
        marked(PUSH, error="CUDA out of memory"),
        engine(v=None, vd=None, session=session()),
        Step.ABANDON_SESSION,
    ),
    (
        "the trainer's error about this target and epoch: abandon",
        marked(PUSH, error="verifier epoch 3: policy-0: refused", error_target=Target.VERIFIER, error_epoch=3),
        engine(v=None, vd=None, session=session(epoch=3)),
        Step.ABANDON_SESSION,
    ),
    (
        "an error about an earlier epoch leaves a retry's session alone",
        marked(PUSH, error="verifier epoch 3: policy-0: refused", error_target=Target.VERIFIER, error_epoch=3),
        engine(v=None, vd=None, session=session(epoch=4)),
        Step.AWAIT_PUSH,
    ),
    (
        "an error about the verifier leaves a draft session alone",
        marked(PUSH, error="verifier epoch 3: x", error_target=Target.VERIFIER, error_epoch=9),
        engine(v=2, vd=DV, d=None, dd=None, session=session(Target.DRAFT, epoch=5)),
        Step.AWAIT_PUSH,
    ),
    (
        "an update into the session failed: end it (the extension reports the failure)",
        PUSH,
        engine(v=None, vd=None, session=session(error="shape mismatch")),
        Step.END_SESSION,
    ),
    (
        "a session of another revision (an earlier operator's): abandon",
        PUSH,
        engine(v=None, vd=None, session=dataclasses.replace(session(), revision=1)),
        Step.ABANDON_SESSION,
    ),
    ("verifier verified: open the draft session", PUSH, engine(v=2, vd=DV), Step.OPEN_DRAFT_SESSION),
    (
        "verifier verified with a wrong digest: a verdict, never the draft session",
        PUSH,
        engine(v=2, vd=D),
        Step.VERIFY_FAILED,
    ),
    ("both verified: stamp the version", PUSH, engine(v=2, vd=DV, d=2, dd=DD), Step.RESUME),
    ("both verified, stamped: resume", PUSH, engine(v=2, vd=DV, d=2, dd=DD, version="2"), Step.RESUME),
    (
        "a destroyed target restarts the pod",
        PUSH,
        engine(v=None, vd=None, destroyed=Target.VERIFIER),
        Step.RESTART_POD,
    ),
    (
        "a destroyed draft behind a verified verifier is never resumed",
        PUSH,
        engine(v=2, vd=DV, d=None, dd=None, destroyed=Target.DRAFT, version="2"),
        Step.RESTART_POD,
    ),
    (
        "a served pushed revision cannot be fetched again: wait for the next revision",
        marked(PUSH, can_open=False),
        engine(),
        Step.AWAIT_PUSH,
    ),
]


@pytest.mark.parametrize(("why", "goal", "observed", "expected"), CASES, ids=[c[0] for c in CASES])
def test_next_step_for_pushed_targets(why: str, goal: Goal, observed: EngineState, expected: Step) -> None:
    assert next_step(goal, observed).step == expected, why


def test_never_resume_with_a_session_open_even_when_the_pair_reads_right() -> None:
    # An engine reporting the goal's pair with a session still open (an operator died between the trainer's
    # send and the end) is not at the goal: the session's content is unverified until it ends.
    at_pair = engine(v=2, vd=DV, d=2, dd=DD, version="2", session=session(Target.DRAFT))
    assert next_step(PUSH, at_pair).step == Step.AWAIT_PUSH
    assert next_step(PUSH, dataclasses.replace(at_pair, paused=False, sleeping=False)).step == Step.PAUSE


def test_path_verifier_with_pushed_draft_mixes_sources() -> None:
    mixed = dataclasses.replace(PUSH, verifier_path="/w/2/v", verifier_pushed=False)
    assert next_step(mixed, engine()).step == Step.LOAD_VERIFIER
    assert next_step(mixed, engine(v=2, vd=DV)).step == Step.OPEN_DRAFT_SESSION


# --- NCCL: the transfer group comes before any session (docs/push.md, "Transfer group") ----------------

NCCL = dataclasses.replace(PUSH, push=PushMarks(deadline_s=60.0, group_epoch=4))


def in_group(state: EngineState, epoch: int) -> EngineState:
    return dataclasses.replace(state, group=GroupMembership(epoch=epoch, rank_offset=1, world_size=3))


def test_nccl_waits_for_the_trainers_rendezvous_before_joining() -> None:
    # A session outside the group would wait for a broadcast that cannot reach it: join first, and join
    # only where the trainer (rank 0) said it waits.
    assert next_step(NCCL, engine()).step == Step.AWAIT_PUSH
    with_rendezvous = dataclasses.replace(NCCL, push=dataclasses.replace(NCCL.push, rendezvous="10.0.0.5:29600"))
    assert next_step(with_rendezvous, engine()).step == Step.JOIN_GROUP
    # An engine in an older group (a process of a group that lost a member) joins the new one too.
    assert next_step(with_rendezvous, in_group(engine(), 3)).step == Step.JOIN_GROUP
    assert next_step(with_rendezvous, in_group(engine(), 4)).step == Step.OPEN_VERIFIER_SESSION
    # In the group already, but the trainer has not said it is its rank 0 (it may be a new process that
    # will ask for a new group): no session yet, or it would wait for a broadcast that never comes.
    assert next_step(NCCL, in_group(engine(), 4)).step == Step.AWAIT_PUSH


def test_nccl_a_rendezvous_that_never_comes_is_a_failed_attempt() -> None:
    expired = dataclasses.replace(NCCL, push=dataclasses.replace(NCCL.push, rendezvous_expired=True))
    assert next_step(expired, engine()).step == Step.NO_RENDEZVOUS
    assert next_step(expired, in_group(engine(), 4)).step == Step.NO_RENDEZVOUS


def test_nccl_the_draft_session_also_needs_the_group() -> None:
    verified = engine(v=2, vd=DV)
    ready = dataclasses.replace(NCCL, push=dataclasses.replace(NCCL.push, rendezvous="10.0.0.5:29600"))
    assert next_step(ready, in_group(verified, 4)).step == Step.OPEN_DRAFT_SESSION
    assert next_step(ready, verified).step == Step.JOIN_GROUP
