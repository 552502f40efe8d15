"""Wire payloads and the error vocabulary of the engine client (``rolloutfleet.adapters.engine``).

The TypedDicts describe what vLLM's dev routes and our worker extension (``rolloutfleet_worker``) send;
the simulator (``rolloutfleet.sim``) produces the same shapes. Errors are small and typed so the
reconciler can map them to kopf's temporary/permanent errors in one place:

- :class:`EngineUnreachable` — no TCP connection / connection dropped (pod gone, crashed, not started).
- :class:`EngineTimeout` — the engine did not answer within the call's timeout.
- :class:`EngineHTTPError` — a non-2xx answer; carries the status and vLLM's error body.
- :class:`EngineRPCError` — our extension answered ``{"ok": false, "error": {code, message}}``.
- :class:`EngineInconsistent` — tensor-parallel ranks disagreed (revision/digest differ per rank).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

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


class DraftWire(TargetWire):
    policy: str | None


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
    error: NotRequired[ExtensionError]


class LoadResultWire(TypedDict):
    """``rolloutfleet_load(...)`` / ``rolloutfleet_restore_draft(...)`` on one rank."""

    ok: bool
    target: str
    revision: int | None
    path: str
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
    """Could not connect, or the connection dropped before an answer."""


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
        ),
        draft=draft,
        weight_version=weight_version,
        mapped=first.get("mapped"),
        draft_method=first.get("draft_method"),
        shared_tensors=tuple(first.get("shared_tensors") or ()),
        ranks=len(states),
    )


def _short(body: Any, limit: int = 300) -> str:
    text = str(body)
    return text if len(text) <= limit else text[:limit] + "..."
