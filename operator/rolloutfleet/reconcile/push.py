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

from rolloutfleet.api import common
from rolloutfleet.api.engine import EngineState, GroupMembership, Target
from rolloutfleet.api.fleet import RolloutFleetSpec, TransferBackend, engine_workers
from rolloutfleet.api.revision import (
    PUSH_ERROR_ANNOTATION,
    RENDEZVOUS_ANNOTATION,
    PushGroupRank,
    PushGroupStatus,
    PushSessionStatus,
    pushed_annotation,
)
from rolloutfleet.planning import revisions
from rolloutfleet.planning.transaction import Goal, PushMarks, Step

Manifest = dict[str, Any]
OPEN_STEPS = frozenset({Step.OPEN_VERIFIER_SESSION, Step.OPEN_DRAFT_SESSION})
ERROR_MAX = 512  # characters of the trainer's error kept in messages
# "<target> epoch <N>: ..." (rolloutfleet.trainer.sessions.error): the sessions the error is about.
_ERROR_SCOPE = re.compile(r"^(verifier|draft) epoch (\d+): ")
# "<group epoch>@<host>:<port>" (rolloutfleet.trainer): where the trainer, rank 0, waits for the group.
_RENDEZVOUS = re.compile(r"^(\d+|new)@(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def _epoch(value: object) -> int | None:
    try:
        number = int(str(value))
    except ValueError:
        return None
    return number if number >= 0 else None


def _annotations(rev: revisions.Revision | None) -> dict[str, Any]:
    return ((rev.body.get("metadata") or {}).get("annotations") or {}) if rev is not None else {}


def marks(spec: RolloutFleetSpec, rev: revisions.Revision | None, *, rolling_back: bool) -> PushMarks:
    """The trainer's marks on ``rev`` (its annotations) and whether sessions may be opened at all.

    Sessions are opened only for an active revision moving forward: a rollback or a catch-up of what the
    fleet serves has no trainer sending (the trainer's call ended with the revision it pushed).
    """
    deadline = float(spec.update_strategy.timeouts.push_seconds)
    if rev is None or rolling_back:
        return PushMarks(deadline_s=deadline, can_open=False)
    notes = _annotations(rev)
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


def goal_with_marks(
    goal: Goal,
    spec: RolloutFleetSpec,
    rev: revisions.Revision | None,
    *,
    rolling_back: bool,
    group: PushGroupStatus | None = None,
    rendezvous_expired: bool = False,
) -> Goal:
    """``goal`` with the push rules in force (unchanged for goals without pushed targets).

    ``group``: NCCL's transfer group every session needs (``transfer_group``); the trainer's rendezvous
    applies only when published for that group's epoch. ``rendezvous_expired``: pods have waited for it
    longer than ``pushSeconds``.
    """
    if not goal.pushed:
        return goal
    # A rollback's goal is the served record, never the active revision: its marks do not apply.
    found = marks(spec, rev, rolling_back=rolling_back)
    transfer = spec.weight_transfer
    if group is None and transfer is not None and transfer.backend == TransferBackend.NCCL:
        # No session before the group is known: one opened outside it would wait for a broadcast that
        # cannot reach it.
        return dataclasses.replace(goal, push=dataclasses.replace(found, can_open=False))
    if group is not None:
        found = dataclasses.replace(
            found,
            group_epoch=group.epoch,
            rendezvous=rendezvous_for(_annotations(rev).get(RENDEZVOUS_ANNOTATION), group.epoch),
            rendezvous_expired=rendezvous_expired,
        )
    return dataclasses.replace(goal, push=found)


def rendezvous_for(value: object, epoch: int) -> str | None:
    """The trainer's "host:port" for group ``epoch`` (None: absent, malformed, or for another group)."""
    found = _RENDEZVOUS.match(str(value or ""))
    if found is None or found[1] != str(epoch) or not 0 < int(found[3]) < 65536:
        return None
    return f"{found[2]}:{found[3]}"


def new_group_requested(rev: revisions.Revision | None) -> bool:
    """The trainer is not rank 0 of the group shown (a new trainer process): it asks for a new group."""
    return str(_annotations(rev).get(RENDEZVOUS_ANNOTATION) or "").startswith("new@")


def transfer_group(
    spec: RolloutFleetSpec,
    order: list[str],
    recorded: PushGroupStatus | None,
    states: Mapping[str, EngineState],
    *,
    new_requested: bool = False,
) -> PushGroupStatus | None:
    """The NCCL group for this pass's pods (None for IPC), derived from what the engines report.

    The trainer is rank 0; each engine in pod ordinal order gets the next ``engine_workers`` ranks. A group
    every engine reports (same epoch, its own ranks) is kept across revisions: vLLM's init is a collective
    that is neither needed nor safe to run again. Else this revision's ``recorded`` group while forming
    (nobody joined it yet, or everybody did). Else, and when the trainer asks (``new_requested``: it is
    not rank 0 of the formed group), a new group above every epoch seen: NCCL groups cannot take a member
    back, so once one engine process is new (it reports none), every engine joins a new group.
    """
    transfer = spec.weight_transfer
    if transfer is None or transfer.backend != TransferBackend.NCCL or not order:
        return None
    workers, ranks, offset = engine_workers(spec), [], 1
    for pod in order:
        ranks.append(PushGroupRank(pod=pod, rank_offset=offset, world_size=workers))
        offset += workers
    members = {p: states[p] for p in order if p in states and states[p].reachable}
    offsets = {r.pod: r.rank_offset for r in ranks}
    reported = {
        s.group.epoch
        for p, s in members.items()
        if s.group is not None and s.group.world_size == offset and s.group.rank_offset == offsets[p]
    }
    everyone = len(members) == len(order) and all(s.group is not None for s in members.values())
    formed = next(iter(reported)) if everyone and len(reported) == 1 else None
    # This revision's group, newer than the one the engines formed, is forming (a trainer asked for it).
    newer = recorded is not None and (formed is None or recorded.epoch > formed)
    if formed is not None and not new_requested and not newer:
        return PushGroupStatus(epoch=formed, world_size=offset, ranks=ranks, formed=True)
    if recorded is not None and recorded.ranks == ranks and recorded.world_size == offset and newer:
        joined = [s for s in members.values() if s.group is not None and s.group.epoch == recorded.epoch]
        if not joined or len(joined) == len(members):
            return with_formed(recorded, order, states)
    seen = [s.group.epoch for s in states.values() if s.group is not None]
    epoch = max([recorded.epoch if recorded is not None else 0, *seen]) + 1
    return PushGroupStatus(epoch=epoch, world_size=offset, ranks=ranks)


def with_formed(group: PushGroupStatus, order: list[str], states: Mapping[str, EngineState]) -> PushGroupStatus:
    """``group`` with ``formed``: every pod's engine reports it (the trainer then knows it has a rank 0)."""
    joined = all(
        (s := states.get(p)) is not None and s.group is not None and s.group.epoch == group.epoch for p in order
    )
    return group.model_copy(update={"formed": joined})


def membership(group: PushGroupStatus | None, pod: str) -> GroupMembership | None:
    """``pod``'s place in ``group`` (None: no group, IPC, or not a member)."""
    rank = next((r for r in group.ranks if r.pod == pod), None) if group is not None else None
    if group is None or rank is None:
        return None
    return GroupMembership(epoch=group.epoch, rank_offset=rank.rank_offset, world_size=group.world_size)


MARK_KEYS = frozenset({pushed_annotation("verifier"), pushed_annotation("draft"), PUSH_ERROR_ANNOTATION})


def marks_only(diff: Iterable[Any]) -> bool:
    """A watch event's diff (kopf's ``(op, field, old, new)`` items) changes only the trainer's marks
    (``MARK_KEYS``): a pass waiting on the trainer can take them without ending (``FleetMemory.kick_marks``).
    A rendezvous is not a mark: a new group is chosen at the start of a pass."""
    items = list(diff)
    if not items:
        return False
    for item in items:
        field, old, new = tuple(item[1]), item[2], item[3]
        if field[:2] != ("metadata", "annotations"):
            return False
        if len(field) >= 3:
            if field[2] not in MARK_KEYS:
                return False
            continue
        before, after = (v if isinstance(v, Mapping) else {} for v in (old, new))
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        if not changed <= MARK_KEYS:
            return False
    return True


def mark_annotations(annotations: Mapping[str, Any]) -> dict[str, str]:
    """The trainer's marks among a revision's annotations."""
    return {k: str(v) for k, v in annotations.items() if k in MARK_KEYS}


def with_marks(body: Manifest, marks: Mapping[str, str]) -> Manifest:
    """``body`` with its marks replaced by ``marks`` (the watch's newest), other annotations kept."""
    meta = dict(body.get("metadata") or {})
    kept = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in MARK_KEYS}
    meta["annotations"] = {**kept, **marks}
    return {**body, "metadata": meta}


def recorded_epoch(rev: revisions.Revision | None) -> int:
    """The newest epoch the status records (0: none)."""
    if rev is None or rev.status.push is None:
        return 0
    return rev.status.push.epoch


def next_epoch(current: int, states: Iterable[EngineState]) -> int:
    """An epoch above every one used: the pass's, and any an engine reports (an earlier operator's)."""
    seen = [s.session.epoch for s in states if s.session is not None]
    return max([current, *seen]) + 1


def init_info(spec: RolloutFleetSpec, member: GroupMembership | None, rendezvous: str | None) -> dict[str, Any] | None:
    """What ``/init_weight_transfer_engine`` needs for a pod in ``member`` (a JoinGroup step), or None when
    nothing does.

    IPC: nothing (vLLM's IPC init is a no-op). NCCL: the trainer's rendezvous, the group's size and this
    engine's first rank; ``packed`` only when the fleet asks for it (vLLM >= 0.28 takes packing at init;
    0.26 refuses the keys and takes packing per update from the trainer).
    """
    transfer = spec.weight_transfer
    if transfer is None or transfer.backend != TransferBackend.NCCL or member is None or rendezvous is None:
        return None
    host, _, port = rendezvous.rpartition(":")
    info: dict[str, Any] = {
        "master_address": host.strip("[]"),
        "master_port": int(port),
        "rank_offset": member.rank_offset,
        "world_size": member.world_size,
    }
    if transfer.nccl is not None and transfer.nccl.packed:
        info["packed"] = True
    return info


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
        address = common.host_port(ip, port)
        out.append(PushSessionStatus(pod=pod, address=address, target=session.target.value, epoch=session.epoch))
    return out
