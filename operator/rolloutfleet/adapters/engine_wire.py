"""Wire payloads and the error vocabulary of the engine client (``rolloutfleet.adapters.engine``).

The TypedDicts describe what vLLM's dev routes and our worker extension (``rolloutfleet_worker``) send;
the simulator (``rolloutfleet.sim``) produces the same shapes. Errors are small and typed so the
reconciler can map them to kopf's temporary/permanent errors in one place:

- :class:`EngineUnreachable` — no TCP connection / connection dropped (pod gone, crashed, not started).
- :class:`EngineTimeout` — the engine did not answer within the call's timeout.
- :class:`EngineHTTPError` — a non-2xx answer; carries the status and vLLM's error body.
- :class:`EngineRPCError` — our extension answered ``{"ok": false, "error": {code, message}}``.
- :class:`EngineInconsistent` — tensor-parallel ranks disagreed (revision/digest differ per rank).
- :class:`EngineProtocolError` — a 2xx answer whose body does not follow the contract.
- :class:`LoadOutcomeUnknown` — refused locally: an earlier load to this engine may still be running.

The parsers (``agreeing``, ``states_from_wire``, ``load_result_from_wire``, ``state_from_wire``,
``stage_from_wire``/``stage_of_ranks``, ``stage_result_from_wire``, ``released_bytes_from_wire``) turn RPC
results into ``api.engine`` values or raise the errors above; ``fault_of`` says which ``EngineFault`` an
error means for an observation. No I/O here.

Fields added after the first images (``mapped``, ``destroyed``, ``session``, ``group``, ``staged`` in a
state, ``staged`` in a load result) may be absent: an older image does not have them, and their absence
reads as "not known" or "none", never as a protocol error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import urllib.parse
from collections.abc import Callable
from typing import Any, Literal, NotRequired, TypedDict, cast

from rolloutfleet.api import engine as api

PauseMode = Literal["keep", "wait", "abort"]
WakeTag = Literal["weights", "kv_cache"]


class ExtensionError(TypedDict):
    code: str
    message: str


class TargetWire(TypedDict):
    revision: int | None
    digest: str | None
    path: str | None
    verified: NotRequired[bool]
    destroyed: NotRequired[bool]  # absent from extensions without push sessions: false


class SessionWire(TypedDict):
    """An open weight-transfer session, as ``rolloutfleet_state`` reports it (docs/push.md)."""

    target: str
    revision: int
    epoch: int
    age_s: float
    tensors: int
    bytes: int
    error: str | None


class DraftWire(TargetWire):
    policy: str | None


class GroupWire(TypedDict):
    """The NCCL transfer group a rank joined (``rolloutfleet_push_group``)."""

    epoch: int
    rank_offset: int
    world_size: int


class StagedTargetWire(TypedDict):
    """One checkpoint of a stage (docs/staging.md)."""

    path: str
    digest: str | None  # None until every byte is staged and hashed
    bytes: int
    tensors: int
    committed: bool


class StageWire(TypedDict):
    """The staging area (``rolloutfleet_state().staged``, ``rolloutfleet_stage``'s ``stage``)."""

    revision: int
    phase: str  # staging | staged | failed | over_budget
    verifier: StagedTargetWire
    draft: StagedTargetWire | None
    bytes_total: int
    bytes_done: int
    limit_bytes: int | None
    seconds: float
    error: ExtensionError | None


class StateResult(TypedDict):
    """``rolloutfleet_state()`` on one rank."""

    ok: bool
    resident: bool
    mapped: NotRequired[bool]  # absent from extensions older than the field: unknown
    verifier: TargetWire
    draft: DraftWire | None
    draft_method: str | None
    shared_tensors: list[str]
    rank: int
    session: NotRequired[SessionWire | None]
    group: NotRequired[GroupWire | None]  # absent from extensions without NCCL groups: none
    staged: NotRequired[StageWire | None]  # absent from extensions without staging: nothing staged
    error: NotRequired[ExtensionError]


class LoadResultWire(TypedDict):
    """``rolloutfleet_load(...)`` / ``rolloutfleet_restore_draft(...)`` on one rank."""

    ok: bool
    target: str
    revision: int | None
    path: str | None
    digest: str
    bytes: int
    seconds: float
    tensors: int
    skipped: list[str]
    staged: NotRequired[bool]  # absent from extensions without staging: read from the files
    error: NotRequired[ExtensionError]


class CollectiveRPCRequest(TypedDict):
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    timeout: NotRequired[float | None]


class EngineError(Exception):
    """Base of every engine-client error. ``url`` is the engine's base URL (never a token)."""

    def __init__(self, message: str, *, url: str = "", step: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.step = step


class EngineUnreachable(EngineError):  # noqa: N818 - the names the operator's error map uses
    """Could not connect, or the connection dropped before an answer.

    ``sent`` is False when no connection was made, so the engine cannot have received the request.
    """

    def __init__(self, message: str, *, url: str = "", step: str = "", sent: bool = True) -> None:
        super().__init__(message, url=url, step=step)
        self.sent = sent


class EngineTimeout(EngineError):  # noqa: N818 - the names the operator's error map uses
    """No answer within the call's timeout."""


class EngineHTTPError(EngineError):
    """A non-2xx answer. ``body`` is vLLM's error body (JSON decoded when it is JSON, else text)."""

    def __init__(self, status: int, body: Any, *, url: str = "", step: str = "") -> None:
        super().__init__(f"{step or 'request'} answered HTTP {status}: {_short(body)}", url=url, step=step)
        self.status = status
        self.body = body


class EngineRPCError(EngineError):
    """The extension reported a failure: ``code`` is one of the extension's codes (``io``, ``order``...)."""

    def __init__(self, code: str, message: str, *, rank: int | None = None, url: str = "", step: str = "") -> None:
        super().__init__(f"{step or 'rpc'} failed with {code}: {message}", url=url, step=step)
        self.code = code
        self.message = message
        self.rank = rank


class EngineInconsistent(EngineError):  # noqa: N818 - the names the operator's error map uses
    """Tensor-parallel ranks disagree about what they hold: the engine must not serve."""

    def __init__(self, message: str, *, results: list[Any], url: str = "", step: str = "") -> None:
        super().__init__(message, url=url, step=step)
        self.results = results


class EngineProtocolError(EngineError):
    """The engine answered 2xx with a body we cannot understand (wrong version, missing extension)."""


class LoadOutcomeUnknown(EngineError):  # noqa: N818 - the names the operator's error map uses
    """A load was not sent: an earlier load to the same engine ended without a known outcome.

    vLLM runs ``collective_rpc`` calls one after another and keeps running one whose HTTP client gave up,
    so a second load would queue behind the first (and run after it, whatever the operator decided in
    between). Only a successful ``rolloutfleet_state`` read started after the failure (it queues behind
    the running load, so its answer proves the load ended) lifts the refusal. ``since`` is the monotonic
    time at which the outcome became unknown.
    """

    def __init__(self, message: str, *, since: float, url: str = "", step: str = "") -> None:
        super().__init__(message, url=url, step=step)
        self.since = since


def agreeing(results: list[Any], *, url: str, step: str, key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """Every rank's result, checked: a dict, ``ok``, and the same ``key`` on every rank."""
    if not results:
        raise EngineProtocolError("no worker answered", url=url, step=step)
    for rank, result in enumerate(results):
        if not isinstance(result, dict):
            raise EngineProtocolError(f"rank {rank} answered {result!r}", url=url, step=step)
        if result.get("ok") is not True:
            err = result.get("error") or {}
            code, message = str(err.get("code", "unknown")), str(err.get("message", ""))
            raise EngineRPCError(code, message, rank=rank, url=url, step=step)
    if len(results) == 1:  # one rank agrees with itself (most engines: one GPU each); no key to encode
        return cast(list[dict[str, Any]], results)
    keys = {json.dumps(key(r), sort_keys=True, default=str) for r in results}
    if len(keys) > 1:
        raise EngineInconsistent(f"{len(results)} ranks disagree: {sorted(keys)}", results=results, url=url, step=step)
    return cast(list[dict[str, Any]], results)


def states_from_wire(results: list[Any], *, url: str) -> list[StateResult]:
    """``rolloutfleet_state`` results, checked ok, agreeing, and shaped like a state report."""
    step = "rolloutfleet_state"
    checked = agreeing(
        results,
        url=url,
        step=step,
        key=lambda r: (
            r.get("resident"),
            _pick(r.get("verifier"), "revision", "digest"),
            _pick(r.get("draft"), "revision", "digest"),
            _pick(r.get("session"), "target", "revision", "epoch", "error"),
            _pick(r.get("group"), "epoch", "rank_offset", "world_size"),
        ),
    )
    for rank, result in enumerate(checked):
        if not isinstance(result.get("resident"), bool) or not isinstance(result.get("verifier"), dict):
            raise EngineProtocolError(f"rank {rank}: not a state report: {_short(result, 200)}", url=url, step=step)
        try:
            _session(result.get("session"))
            _group(result.get("group"))
            stage_from_wire(result.get("staged"))
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineProtocolError(
                f"rank {rank}: malformed session, group or stage: {exc}", url=url, step=step
            ) from exc
    stage_of_ranks([r.get("staged") for r in checked], url=url, step=step)  # the ranks' stages agree
    return cast(list[StateResult], checked)


def load_result_from_wire(results: list[Any], *, url: str, step: str) -> api.LoadResult:
    """A load's (or restore's) results, checked ok and agreeing, as one ``LoadResult``."""
    checked = agreeing(results, url=url, step=step, key=lambda r: (r.get("target"), r.get("revision"), r.get("digest")))
    first = cast(LoadResultWire, checked[0])
    try:
        return api.LoadResult(
            target=api.Target(first["target"]),
            revision=first["revision"],
            path=None if first.get("path") is None else str(first["path"]),
            digest=str(first["digest"]),
            bytes=int(first["bytes"]),
            seconds=float(first["seconds"]),
            tensors=int(first["tensors"]),
            skipped=tuple(first.get("skipped") or ()),
            staged=_flag(first.get("staged", False)),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineProtocolError(f"malformed load result: {first!r}", url=url, step=step) from exc


def stage_from_wire(raw: Any) -> api.StageState | None:
    """One rank's stage (None: nothing staged); a malformed one raises ValueError, TypeError or KeyError.

    Strict where the operator acts on a field: the revision and sizes are non-negative integers, the phase
    one of the contract's, and a ``staged`` stage names the digest of every checkpoint (the operator
    compares them before any pod pauses; a staged stage without them could never be checked).
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError(f"stage is not an object: {_short(raw, 200)}")
    phase = api.StagePhase(raw["phase"])
    verifier = _staged_target(raw["verifier"])
    draft = None if raw.get("draft") is None else _staged_target(raw["draft"])
    if phase == api.StagePhase.STAGED and (verifier.digest is None or (draft is not None and draft.digest is None)):
        raise ValueError("a staged stage without the digest of every checkpoint")
    limit, error = raw.get("limit_bytes"), raw.get("error")
    if error is not None and not isinstance(error, dict):
        raise TypeError(f"stage error is not an object: {error!r}")
    seconds = raw.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise TypeError(f"seconds must be a non-negative number, got {seconds!r}")
    return api.StageState(
        revision=_count(raw["revision"]),
        phase=phase,
        verifier=verifier,
        draft=draft,
        bytes_total=_count(raw["bytes_total"]),
        bytes_done=_count(raw["bytes_done"]),
        limit_bytes=None if limit is None else _count(limit),
        seconds=float(seconds),
        error_code=None if error is None else str(error.get("code", "unknown")),
        error_message=None if error is None else str(error.get("message", "")),
    )


# How the ranks' phases combine: the engine's stage is no further than its slowest rank.
_PHASE_ORDER = (api.StagePhase.FAILED, api.StagePhase.OVER_BUDGET, api.StagePhase.STAGING, api.StagePhase.STAGED)


def stage_of_ranks(raws: list[Any], *, url: str, step: str) -> api.StageState | None:
    """The engine's stage from every rank's (each checked by ``stage_from_wire``; malformed:
    ``EngineProtocolError``), or ``EngineInconsistent`` when the ranks hold different stages.

    Ranks must agree on what is staged: all or none have a stage, of the same revision, paths and limit,
    with the same commits, and every digest known on two ranks equal. They may differ in progress: each
    rank's readers run at their own pace, so one rank still ``staging`` while another is ``staged`` is no
    disagreement (failing the observation then would stop a healthy rollout). The engine's phase is the
    least advanced rank's (``failed`` before ``over_budget`` before ``staging`` before ``staged``), with
    that rank's error; a digest is the engine's only once every rank has it; bytes done are the slowest
    rank's, seconds the slowest's.
    """
    try:
        stages = [stage_from_wire(raw) for raw in raws]
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineProtocolError(f"malformed stage: {exc}", url=url, step=step) from exc
    present = [s for s in stages if s is not None]
    if not present:
        return None

    def disagree(what: str) -> EngineInconsistent:
        return EngineInconsistent(
            f"{len(raws)} ranks disagree about the stage: {what}", results=raws, url=url, step=step
        )

    if len(present) != len(stages):
        missing = [rank for rank, s in enumerate(stages) if s is None]
        raise disagree(f"ranks {missing} have none")
    identity = {(s.revision, s.limit_bytes, *_stage_targets(s, lambda t: (t.path, t.committed))) for s in present}
    if len(identity) > 1:
        raise disagree(f"{sorted(identity, key=str)}")
    for which in ("verifier", "draft"):
        digests = {d for s in present if (d := _staged_digest(s, which)) is not None}
        if len(digests) > 1:
            raise disagree(f"{which} digests {sorted(digests)}")
    slowest = min(present, key=lambda s: _PHASE_ORDER.index(s.phase))

    def combined(which: str) -> api.StagedTarget | None:
        target = slowest.verifier if which == "verifier" else slowest.draft
        if target is None:
            return None
        digests = [_staged_digest(s, which) for s in present]
        return dataclasses.replace(target, digest=None if None in digests else digests[0])

    verifier = combined("verifier")
    assert verifier is not None
    return dataclasses.replace(
        slowest,
        verifier=verifier,
        draft=combined("draft"),
        bytes_done=min(s.bytes_done for s in present),
        seconds=max(s.seconds for s in present),
    )


def stage_result_from_wire(results: list[Any], *, url: str, step: str) -> api.StageState:
    """``rolloutfleet_stage``'s results: every rank ok (else ``EngineRPCError`` with the extension's code),
    each with a stage, the ranks agreeing (``stage_of_ranks``)."""
    checked = agreeing(results, url=url, step=step, key=lambda r: None)
    stage = stage_of_ranks([r.get("stage") for r in checked], url=url, step=step)
    if stage is None:
        raise EngineProtocolError(f"a stage answer without a stage: {_short(checked[0], 200)}", url=url, step=step)
    return stage


def released_bytes_from_wire(results: list[Any], *, url: str, step: str) -> int:
    """``rolloutfleet_unstage``'s results: the pinned host memory every rank released, together."""
    checked = agreeing(results, url=url, step=step, key=lambda r: None)
    try:
        return sum(_count(r["released_bytes"]) for r in checked)
    except (KeyError, TypeError) as exc:
        raise EngineProtocolError(f"malformed unstage result: {_short(checked[0], 200)}", url=url, step=step) from exc


def fault_of(exc: EngineError) -> api.EngineFault:
    """Why an engine could not be observed, from the error one of its reads raised.

    No connection, no answer in time, or a gateway status that outlived the retries (502/503/504) is
    ``unreachable``; 401/403 is ``unauthorized`` (the token was refused); an extension ``ok: false`` is
    ``extension``; disagreeing ranks are ``inconsistent``; any other status or a body outside the
    contract (e.g. a plain 500 because the image has no extension) is ``protocol``.
    """
    if isinstance(exc, EngineUnreachable | EngineTimeout):
        return api.EngineFault.UNREACHABLE
    if isinstance(exc, EngineHTTPError):
        if exc.status in (401, 403):
            return api.EngineFault.UNAUTHORIZED
        if exc.status in (502, 503, 504):
            return api.EngineFault.UNREACHABLE
        return api.EngineFault.PROTOCOL
    if isinstance(exc, EngineRPCError):
        return api.EngineFault.EXTENSION
    if isinstance(exc, EngineInconsistent):
        return api.EngineFault.INCONSISTENT
    return api.EngineFault.PROTOCOL


# When several reads of one observation fail, the most telling fault is reported: a refused token explains
# every other failure, and any answer at all proves the engine reachable.
_TELLING = (
    api.EngineFault.UNAUTHORIZED,
    api.EngineFault.INCONSISTENT,
    api.EngineFault.EXTENSION,
    api.EngineFault.PROTOCOL,
    api.EngineFault.UNREACHABLE,
)


def most_telling(errors: list[EngineError]) -> EngineError:
    """The error whose fault says most about the engine (the first such, for ties)."""
    return min(errors, key=lambda e: _TELLING.index(fault_of(e)))


def state_from_wire(
    *, paused: bool, sleeping: bool, weight_version: str | None, states: list[StateResult]
) -> api.EngineState:
    """Compose an ``EngineState`` from the four reads (exposed for tests and the pod follower)."""
    first = states[0]
    resident = bool(first.get("resident"))
    draft_wire = first.get("draft")
    draft = None
    if draft_wire is not None:
        policy = draft_wire.get("policy")
        draft = api.TargetState(
            revision=draft_wire.get("revision"),
            digest=draft_wire.get("digest"),
            path=draft_wire.get("path"),
            verified=bool(draft_wire.get("verified")),
            policy=api.DraftPolicy(policy) if policy else None,
            destroyed=draft_wire.get("destroyed") is True,
        )
    verifier = first.get("verifier") or {}
    return api.EngineState(
        reachable=True,
        paused=paused,
        sleeping=sleeping,
        sleep_level=api.derive_sleep_level(is_sleeping=sleeping),
        resident=resident,
        verifier=api.TargetState(
            revision=verifier.get("revision"),
            digest=verifier.get("digest"),
            path=verifier.get("path"),
            verified=bool(verifier.get("verified")),
            destroyed=verifier.get("destroyed") is True,
        ),
        draft=draft,
        session=_session(first.get("session")),
        group=_group(first.get("group")),
        weight_version=weight_version,
        mapped=first.get("mapped"),
        draft_method=first.get("draft_method"),
        shared_tensors=tuple(first.get("shared_tensors") or ()),
        ranks=len(states),
        staged=stage_of_ranks([s.get("staged") for s in states], url="", step="rolloutfleet_state"),
    )


def _session(raw: Any) -> api.PushSession | None:
    """The open session of a state report (None when there is none); malformed raises ValueError."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"session is not an object: {raw!r}")
    error = raw.get("error")
    return api.PushSession(
        target=api.Target(raw["target"]),
        revision=int(raw["revision"]),
        epoch=int(raw["epoch"]),
        age_s=float(raw.get("age_s") or 0.0),
        tensors=int(raw.get("tensors") or 0),
        bytes=int(raw.get("bytes") or 0),
        error=None if error is None else str(error),
    )


def _staged_target(raw: Any) -> api.StagedTarget:
    if not isinstance(raw, dict):
        raise TypeError(f"staged checkpoint is not an object: {_short(raw, 200)}")
    path, digest = raw["path"], raw.get("digest")
    if not isinstance(path, str) or not path:
        raise TypeError(f"staged path must be a non-empty string, got {path!r}")
    if digest is not None and not isinstance(digest, str):
        raise TypeError(f"staged digest must be a string or null, got {digest!r}")
    return api.StagedTarget(
        path=path,
        digest=digest,
        bytes=_count(raw["bytes"]),
        tensors=_count(raw["tensors"]),
        committed=_flag(raw.get("committed", False)),
    )


def _stage_targets(stage: api.StageState, part: Callable[[api.StagedTarget], Any]) -> tuple[Any, Any]:
    return part(stage.verifier), None if stage.draft is None else part(stage.draft)


def _staged_digest(stage: api.StageState, which: str) -> str | None:
    target = stage.verifier if which == "verifier" else stage.draft
    return None if target is None else target.digest


def _count(value: Any) -> int:
    """A non-negative integer of the wire (a bool is no count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {value!r}")
    return value


def _group(raw: Any) -> api.GroupMembership | None:
    """The transfer group of a state report (None when the process joined none); malformed raises."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"group is not an object: {raw!r}")
    return api.GroupMembership(
        epoch=int(raw["epoch"]), rank_offset=int(raw["rank_offset"]), world_size=int(raw["world_size"])
    )


def _short(body: Any, limit: int = 300) -> str:
    text = str(body)
    return text if len(text) <= limit else text[:limit] + "..."


def _pick(obj: Any, *names: str) -> Any:
    return None if not isinstance(obj, dict) else [obj.get(n) for n in names]


# --- POST /rolloutfleet/sequence (rolloutfleet_worker.sequence) ---------------------------------------


@functools.lru_cache(maxsize=256)
def query_string(query: tuple[tuple[str, str], ...]) -> str:
    # Cached: every pod's sequence carries the same few queries, and urlencode (pure Python) was 1.6 % of the
    # operator's CPU at 1,024 pods (issue 18).
    return urllib.parse.urlencode(query)


def holds(actual: Any, expected: Any) -> bool:
    """A sequence's expectation as the engine applies it (``rolloutfleet_worker.sequence.holds``): objects key
    by key (a missing key reads as null), anything else by equality."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(holds(actual.get(k), v) for k, v in expected.items())
    return bool(actual == expected)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a sequence: a control route with its query and JSON body; ``step`` names it in errors."""

    path: str
    step: str
    query: tuple[tuple[str, str], ...] = ()
    json: Any = None
    method: str = "POST"
    expect: Any = None  # what the call's JSON body must hold, or the sequence ends there

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "path": self.path}
        if self.query:
            out["query"] = query_string(self.query)
        if self.json is not None:
            out["json"] = self.json
        if self.expect is not None:
            out["expect"] = self.expect
        return out


@dataclasses.dataclass(frozen=True)
class SequenceAnswer:
    """What a sequence did: ``held`` names the guard that stopped it (``instance``, ``state``) before any
    call ran; ``parts`` holds the ``{"status", "body"}`` of each call that ran, in order (the calls stop
    after the first failed one); ``admitted`` and ``instance``: the engine process's admission."""

    held: str | None
    admitted: bool | None
    instance: str | None
    parts: tuple[dict[str, Any], ...]


def sequence_from_wire(body: Any, calls: int, *, url: str) -> SequenceAnswer:
    """The answer of ``POST /rolloutfleet/sequence``, its shape checked (``EngineProtocolError`` if not)."""
    step = "sequence"
    try:
        held, parts, admission = body["held"], body["results"], body["admission"]
        if held not in (None, "instance", "state") or not isinstance(parts, list) or len(parts) > calls:
            raise TypeError("held or results")
        if not all(isinstance(p, dict) and isinstance(p.get("status"), int) for p in parts):
            raise TypeError("each result needs a status")
        admitted = admission.get("admitted")
        instance = admission.get("instance")
        if not isinstance(admitted, bool) or not (instance is None or isinstance(instance, str)):
            raise TypeError("admission")
    except (KeyError, TypeError, AttributeError) as exc:
        message = f"malformed sequence answer ({exc}): {_short(body, 200)}"
        raise EngineProtocolError(message, url=url, step=step) from exc
    return SequenceAnswer(held, admitted, instance, tuple(parts))
