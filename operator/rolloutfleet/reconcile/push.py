"""The operator's side of the push handshake (docs/push.md): marks in, epochs and published sessions out.

Called by ``reconcile.rollout_pass`` for goals with pushed targets. Reads the trainer's marks (annotations
on the WeightRevision) into the goal's ``PushMarks``, allocates session epochs (one per set of sessions
opened together; never reused: above the status's record and every epoch an engine reports), and lists
the open sessions the trainer may send into — only complete epochs, so that a trainer never marks an
epoch before every session of it was opened.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from rolloutfleet.api.engine import EngineState, Target
from rolloutfleet.api.fleet import RolloutFleetSpec, TransferBackend
from rolloutfleet.api.revision import PUSH_ERROR_ANNOTATION, PushSessionStatus, pushed_annotation
from rolloutfleet.planning import revisions
from rolloutfleet.planning.transaction import Goal, PushMarks, Step

Manifest = dict[str, Any]
OPEN_STEPS = frozenset({Step.OPEN_VERIFIER_SESSION, Step.OPEN_DRAFT_SESSION})
ERROR_MAX = 512  # characters of the trainer's error kept in messages
# "<target> epoch <N>: ..." (rolloutfleet.trainer.sessions.error): the sessions the error is about.
_ERROR_SCOPE = re.compile(r"^(verifier|draft) epoch (\d+): ")


def _epoch(value: object) -> int | None:
    try:
        number = int(str(value))
    except ValueError:
        return None
    return number if number >= 0 else None


def marks(spec: RolloutFleetSpec, rev: revisions.Revision | None, *, rolling_back: bool) -> PushMarks:
    """The trainer's marks on ``rev`` (its annotations) and whether sessions may be opened at all.

    Sessions are opened only for an active revision moving forward: a rollback or a catch-up of what the
    fleet serves has no trainer sending (the trainer's call ended with the revision it pushed).
    """
    deadline = float(spec.update_strategy.timeouts.push_seconds)
    if rev is None or rolling_back:
        return PushMarks(deadline_s=deadline, can_open=False)
    notes = (rev.body.get("metadata") or {}).get("annotations") or {}
    error = str(notes.get(PUSH_ERROR_ANNOTATION) or "")
    scope = _ERROR_SCOPE.match(error)
    return PushMarks(
        verifier_epoch=_epoch(notes.get(pushed_annotation("verifier"))),
        draft_epoch=_epoch(notes.get(pushed_annotation("draft"))),
        error=error[:ERROR_MAX] or None,
        error_target=Target(scope[1]) if scope else None,
        error_epoch=int(scope[2]) if scope else None,
        deadline_s=deadline,
        can_open=True,
    )


def goal_with_marks(goal: Goal, spec: RolloutFleetSpec, rev: revisions.Revision | None, *, rolling_back: bool) -> Goal:
    """``goal`` with the push rules in force (unchanged for goals without pushed targets)."""
    if not goal.pushed:
        return goal
    # A rollback's goal is the served record, never the active revision: its marks do not apply.
    return dataclasses.replace(goal, push=marks(spec, rev, rolling_back=rolling_back))


def recorded_epoch(rev: revisions.Revision | None) -> int:
    """The newest epoch the status records (0: none)."""
    if rev is None or rev.status.push is None:
        return 0
    return rev.status.push.epoch


def next_epoch(current: int, states: Iterable[EngineState]) -> int:
    """An epoch above every one used: the pass's, and any an engine reports (an earlier operator's)."""
    seen = [s.session.epoch for s in states if s.session is not None]
    return max([current, *seen]) + 1


def init_info(spec: RolloutFleetSpec) -> dict[str, Any] | None:
    """What ``/init_weight_transfer_engine`` needs before a session, or None when nothing does.

    IPC: nothing (vLLM 0.26's IPC init is a no-op: its init info is empty). NCCL is refused by validation
    until this operator forms transfer groups (docs/push.md, "Transfer group").
    """
    transfer = spec.weight_transfer
    assert transfer is None or transfer.backend == TransferBackend.IPC, "validation refuses pushes over NCCL"
    return None


def published_sessions(
    states: Mapping[str, EngineState], opening: Mapping[int, set[str]], bodies: Mapping[str, Manifest], port: int
) -> list[PushSessionStatus]:
    """Open, healthy sessions of complete epochs, with the address the trainer sends to."""
    out = []
    for pod, state in states.items():
        session = state.session
        if session is None or session.error is not None or session.epoch in opening:
            continue
        ip = ((bodies.get(pod) or {}).get("status") or {}).get("podIP")
        if not ip:
            continue
        out.append(PushSessionStatus(pod=pod, address=f"{ip}:{port}", target=session.target.value, epoch=session.epoch))
    return out
