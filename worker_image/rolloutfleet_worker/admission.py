"""Admission: whether the operator has checked THIS engine process and lets its pod take traffic.

Served by ``rolloutfleet_worker.auth.ControlAuthMiddleware`` (the only ASGI piece vLLM loads from us), never
by vLLM. The pod's readiness probe asks ``GET /rolloutfleet/ready`` (open: kubelet carries no token); the
operator answers it with ``POST /rolloutfleet/admit`` once it verified the weights this process serves,
and ``POST /rolloutfleet/withdraw`` before it pauses the engine for an update (both need the token).

Why: a crashed engine container restarts on its initial checkpoint while the pod's readiness gate (set by
the operator earlier) is still True, so a probe on ``/health`` alone would route traffic to stale weights
until the operator notices. Admission lives in this process's memory only, so a restarted container starts
un-admitted and stays out of the Service until the operator has looked at it again.

Every answer names this process (``instance``, random per process). The operator reads it *before* it
reads the weights, and an admit that names another instance is refused (409): an operator that looked at
one process never admits the next one, which came up on its initial checkpoint at the same address (a
container restart, or a pod recreated under the same name and IP) between the look and the admit.

One ``Admission`` per middleware instance, i.e. per API server process; one event loop uses it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

READY_PATH: Final = "/rolloutfleet/ready"
ADMIT_PATH: Final = "/rolloutfleet/admit"
WITHDRAW_PATH: Final = "/rolloutfleet/withdraw"
# Served by the middleware itself once the token was accepted (vLLM has no such routes: it would 404).
CONTROL_PATHS: Final = frozenset({ADMIT_PATH, WITHDRAW_PATH})
MAX_BODY_BYTES: Final = 4096  # {"revision": <int>} fits many times over

log = logging.getLogger("vllm.rolloutfleet")


class BodyError(ValueError):
    """A request body the admit route refuses (400)."""


class Admission:
    """The admission of this process. ``clock`` is wall-clock seconds (``since`` is a Unix time)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.instance = secrets.token_hex(8)
        self.admitted = False
        self.revision: int | None = None
        self.since: float | None = None

    def admit(self, revision: int | None) -> None:
        """Admit for ``revision``; a retry for the same revision keeps ``since``, another one restarts it."""
        if not self.admitted or revision != self.revision:
            self.since = round(self.clock(), 3)
            log.info("rolloutfleet: engine admitted for traffic (revision %s)", revision)
        self.admitted, self.revision = True, revision

    def withdraw(self) -> None:
        if self.admitted:
            log.info("rolloutfleet: engine admission withdrawn")
        self.admitted, self.revision, self.since = False, None, None

    def report(self) -> dict[str, Any]:
        """The body of every admission answer: ``{"admitted": false}`` or ``{"admitted": true, ...}``."""
        if not self.admitted:
            return {"admitted": False, "instance": self.instance}
        return {"admitted": True, "revision": self.revision, "since": self.since, "instance": self.instance}


def parse_revision(raw: bytes) -> int | None:
    """The ``revision`` of an admit body: a JSON object whose ``revision`` is a non-negative int or null."""
    return parse_admit(raw)[0]


def parse_admit(raw: bytes) -> tuple[int | None, str | None]:
    """(``revision``, ``instance``) of an admit body; ``instance`` (optional) names the process meant."""
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError):
        raise BodyError("the body is not JSON") from None
    if not isinstance(body, dict) or "revision" not in body:
        raise BodyError('the body must be a JSON object {"revision": <int or null>}')
    revision, instance = body["revision"], body.get("instance")
    if instance is not None and (not isinstance(instance, str) or not instance or len(instance) > 64):
        raise BodyError("instance must be a non-empty string of at most 64 characters")
    if revision is None:
        return None, instance
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise BodyError("revision must be a non-negative integer or null")
    return revision, instance


async def serve_ready(admission: Admission, scope: Scope, send: Send) -> None:
    """``GET /rolloutfleet/ready``: 200 when admitted, 503 before. No engine call, no token, no secrets."""
    if scope.get("method", "GET") not in ("GET", "HEAD"):
        await reply(send, 405, error_body(405, "MethodNotAllowed", "use GET"), allow="GET, HEAD")
        return
    body = admission.report()
    await reply(send, 200 if admission.admitted else 503, body, head=scope.get("method") == "HEAD")


async def serve_control(admission: Admission, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /rolloutfleet/admit`` and ``/rolloutfleet/withdraw``; the caller checked the token."""
    if scope.get("method") != "POST":
        await reply(send, 405, error_body(405, "MethodNotAllowed", "use POST"), allow="POST")
        return
    raw = await read_body(receive)
    if raw is None:  # the client went away before its body arrived: act on nothing
        return
    if len(raw) > MAX_BODY_BYTES:
        await reply(send, 413, error_body(413, "PayloadTooLarge", f"the body is over {MAX_BODY_BYTES} bytes"))
        return
    if scope.get("path") == WITHDRAW_PATH:
        admission.withdraw()  # any body is ignored: withdrawing never needs a reason
    else:
        try:
            revision, instance = parse_admit(raw)
        except BodyError as exc:
            await reply(send, 400, error_body(400, "BadRequestError", str(exc)))
            return
        if instance is not None and instance != admission.instance:
            message = f"this is engine process {admission.instance}, not {instance}: observe it again"
            await reply(send, 409, error_body(409, "Conflict", message))
            return
        admission.admit(revision)
    await reply(send, 200, admission.report())


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request body (cut just past ``limit``: enough to refuse it), None on a disconnect. Also read by
    ``rolloutfleet_worker.sequence`` (with its own limit)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return None  # http.disconnect
        if size <= limit:
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def error_body(status: int, kind: str, message: str) -> dict[str, Any]:
    """vLLM's error body shape (also answered by ``rolloutfleet_worker.sequence``)."""
    return {"error": {"message": message, "type": kind, "code": status}}


async def reply(
    send: Send, status: int, payload: dict[str, Any], *, allow: str | None = None, head: bool = False
) -> None:
    """One JSON answer, never cached (a probe must see the current admission)."""
    body = json.dumps(payload).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if allow is not None:
        headers.append((b"allow", allow.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})
