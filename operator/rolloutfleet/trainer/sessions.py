"""The trainer's half of the push handshake, as data: what the revision's status asks, what to write back.

Called by ``rolloutfleet.trainer.push`` on every read of the WeightRevision. Pure functions over the
object (no I/O), so the rules are unit-tested on their own. docs/push.md ("Handshake", protocol 1) is the
contract, and ``rolloutfleet.api.revision`` holds its names (shared with the operator); in short:

- the operator publishes ``status.push = {protocol: 1, epoch, sessions: [{pod, address, target, epoch}]}``:
  every open session; ``epoch`` is the newest set of sessions it opened (one number per set, never reused,
  and a set is complete once its epoch is published);
- the trainer sends a target's tensors to every pod of each epoch newer than the last it served for that
  target, then writes ``push.rolloutfleet.io/<target>: "<epoch>"`` (the highest epoch served; the operator
  finishes every session up to it) — or, when a send failed, ``push.rolloutfleet.io/error: "<message>"``
  and no mark (the operator ends the unmarked sessions as failed).

The error message starts with ``"<target> epoch <N>: "``: a trainer that restarts reads it back, so it
never serves a failed epoch again. The operator applies the error to every unmarked session, so the
trainer removes it again once no session of that target up to epoch N is listed any more (the operator
has ended them all; ``error_retired``), and a later mark removes it too: an error about older sessions
must not end the operator's retry.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Final

from rolloutfleet.api import revision as revision_api
from rolloutfleet.trainer.errors import PushProtocolError, SendFailure

PROTOCOL: Final = revision_api.PUSH_PROTOCOL
TARGETS: Final = ("verifier", "draft")  # the order in which a step serves them
MARKS: Final = {target: revision_api.pushed_annotation(target) for target in TARGETS}
ERROR_ANNOTATION: Final = revision_api.PUSH_ERROR_ANNOTATION
RENDEZVOUS_ANNOTATION: Final = revision_api.RENDEZVOUS_ANNOTATION
SESSIONS_OPEN: Final = "SessionsOpen"
ERROR_MAX_CHARS: Final = 1024  # annotations are small; the full list stays in the trainer's exception
_ERROR_EPOCH = re.compile(r"^(verifier|draft) epoch (\d+):")


@dataclasses.dataclass(frozen=True, order=True)
class Session:
    """One engine's open session, as the operator lists it."""

    epoch: int
    target: str
    pod: str
    address: str  # host:port of the engine's HTTP server


@dataclasses.dataclass(frozen=True)
class Group:
    """NCCL: the transfer group the operator formed (``status.push.group``); the trainer is rank 0."""

    epoch: int
    world_size: int
    pods: tuple[str, ...]
    formed: bool = False  # every engine joined it (with some rank 0: this trainer, or an earlier one)


@dataclasses.dataclass(frozen=True)
class PushStatus:
    """``status.push`` of a WeightRevision, checked; ``open_reason`` is the SessionsOpen condition's reason."""

    epoch: int
    sessions: tuple[Session, ...]
    open_reason: str | None = None
    group: Group | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def push_status(obj: dict[str, Any]) -> PushStatus | None:
    """The revision's push status (None before the operator opened anything).

    PushProtocolError for another protocol version. Malformed session entries are skipped: they cannot be
    served, and the operator's deadline ends them.
    """
    status = obj.get("status") or {}
    raw = status.get("push")
    if not isinstance(raw, dict):
        return None
    protocol = raw.get("protocol", PROTOCOL)
    if protocol != PROTOCOL:
        raise PushProtocolError(
            f"WeightRevision {obj.get('metadata', {}).get('name')}: the operator speaks push protocol {protocol!r}, "
            f"this client speaks {PROTOCOL} (upgrade the trainer's rolloutfleet package)"
        )
    sessions = []
    for entry in raw.get("sessions") or []:
        if not isinstance(entry, dict):
            continue
        epoch, pod, address, target = (
            _int(entry.get("epoch")),
            entry.get("pod"),
            entry.get("address"),
            entry.get("target"),
        )
        if epoch is None or not isinstance(pod, str) or not isinstance(address, str) or target not in TARGETS:
            continue
        sessions.append(Session(epoch, str(target), pod, address))
    epoch = _int(raw.get("epoch"))
    if epoch is None:
        epoch = max((s.epoch for s in sessions), default=0)
    reason = next(
        (
            c.get("reason")
            for c in status.get("conditions") or []
            if isinstance(c, dict) and c.get("type") == SESSIONS_OPEN and c.get("status") == "True"
        ),
        None,
    )
    return PushStatus(epoch, tuple(sorted(sessions)), reason, _group(raw.get("group")))


def _group(raw: Any) -> Group | None:
    if not isinstance(raw, dict):
        return None
    epoch, world = _int(raw.get("epoch")), _int(raw.get("worldSize"))
    ranks = raw.get("ranks")
    entries: list[Any] = ranks if isinstance(ranks, list) else []
    pods = tuple(str(r["pod"]) for r in entries if isinstance(r, dict) and isinstance(r.get("pod"), str))
    if epoch is None or world is None or not pods:
        return None
    return Group(epoch, world, pods, raw.get("formed") is True)


def rendezvous_epoch(obj: dict[str, Any]) -> int | None:
    """The group epoch of the rendezvous a trainer published (None: none yet)."""
    text = str(((obj.get("metadata") or {}).get("annotations") or {}).get(RENDEZVOUS_ANNOTATION) or "")
    head = text.split("@", 1)[0]
    return int(head) if "@" in text and head.isdigit() else None


def rendezvous(epoch: int | None, address: str) -> dict[str, str | None]:
    """The annotation that tells the operator where rank 0 waits for group ``epoch`` (None: this trainer is
    not rank 0 of the formed group shown, it asks for a new one)."""
    return {RENDEZVOUS_ANNOTATION: f"{'new' if epoch is None else epoch}@{address}"}


def whole_group(status: PushStatus | None, sessions: list[Session]) -> bool:
    """NCCL: one broadcast feeds the whole group, so a target is served only once every member's session
    is listed (always true without a group)."""
    if status is None or status.group is None:
        return True
    return set(status.group.pods) <= {s.pod for s in sessions}


def served_epochs(obj: dict[str, Any]) -> dict[str, int]:
    """The highest epoch already handled per target, from the annotations (a restarted trainer resumes here).

    A mark is an epoch served; the error annotation's epoch was handled too (it failed, and is never sent
    again: the operator ends those sessions and opens new ones).
    """
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    served = dict.fromkeys(TARGETS, 0)
    for target, key in MARKS.items():
        value = str(annotations.get(key) or "")
        if value.isdigit():
            served[target] = int(value)
    failed = error_of(obj)
    if failed is not None:
        served[failed[0]] = max(served[failed[0]], failed[1])
    return served


def error_of(obj: dict[str, Any]) -> tuple[str, int, str] | None:
    """``(target, epoch, text)`` of an error annotation a trainer wrote (None: none, or not in our format)."""
    text = str(((obj.get("metadata") or {}).get("annotations") or {}).get(ERROR_ANNOTATION) or "")
    m = _ERROR_EPOCH.match(text)
    return (m[1], int(m[2]), text) if m else None


def pending(status: PushStatus | None, served: dict[str, int]) -> dict[str, list[Session]]:
    """Per target, the sessions to serve now: epochs newer than the last served, and already published.

    A pod listed under two such epochs (a stale listing) gets the newer one only: an engine holds one
    session at a time, and sending twice would load twice.
    """
    out: dict[str, list[Session]] = {t: [] for t in TARGETS}
    if status is None:
        return out
    for target in TARGETS:
        newest: dict[str, Session] = {}
        for s in status.sessions:
            fresh = s.target == target and served[target] < s.epoch <= status.epoch
            if fresh and (s.pod not in newest or newest[s.pod].epoch < s.epoch):
                newest[s.pod] = s
        out[target] = sorted(newest.values())
    return out


def error_retired(status: PushStatus | None, target: str, epoch: int) -> bool:
    """Whether the operator has ended every session an error about ``target`` up to ``epoch`` was about."""
    return status is None or not any(s.target == target and s.epoch <= epoch for s in status.sessions)


def mark(target: str, epoch: int) -> dict[str, str | None]:
    """The annotations that record ``epoch`` served for ``target`` (and retire an older error)."""
    return {MARKS[target]: str(epoch), ERROR_ANNOTATION: None}


def error(target: str, epoch: int, failures: Sequence[SendFailure]) -> dict[str, str | None]:
    """The annotation that reports failed sends of ``target``'s sessions of ``epoch``."""
    text = f"{target} epoch {epoch}: " + "; ".join(f"{f.pod}: {' '.join(f.message.split())}" for f in failures)
    if len(text) > ERROR_MAX_CHARS:
        text = text[: ERROR_MAX_CHARS - 3].rstrip() + "..."
    return {ERROR_ANNOTATION: text}
