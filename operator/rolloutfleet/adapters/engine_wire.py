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

The parsers (``agreeing``, ``states_from_wire``, ``load_result_from_wire``, ``state_from_wire``) turn RPC
results into ``api.engine`` values or raise the errors above; ``fault_of`` says which ``EngineFault`` an
error means for an observation. No I/O here.
"""

from __future__ import annotations

import json
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
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineProtocolError(f"rank {rank}: malformed session or group: {exc}", url=url, step=step) from exc
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
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise EngineProtocolError(f"malformed load result: {first!r}", url=url, step=step) from exc


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
