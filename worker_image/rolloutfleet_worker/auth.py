"""``ControlAuthMiddleware``: a bearer token on every vLLM control route.

Loaded by vLLM's API server (``--middleware rolloutfleet_worker.auth.ControlAuthMiddleware``, which calls
``app.add_middleware(cls)``). Stock vLLM's ``--api-key`` guards only ``/v1``; the dev-mode control routes
(pause, sleep, collective_rpc, weight transfer, ...) are open to anyone who can reach the pod. This pure
ASGI middleware owns that gate: generation and probe routes stay open, everything else needs
``Authorization: Bearer <token>`` with the token read from a mounted Secret file. Deny by default, so a
control route added by a future vLLM is protected before anyone lists it here.

It also serves the admission routes itself (``rolloutfleet_worker.admission``; vLLM has none of them):
``GET /rolloutfleet/ready`` is open (the pod's readiness probe, no token), ``POST /rolloutfleet/admit`` and
``POST /rolloutfleet/withdraw`` need the token like every control route and never reach vLLM. So does
``GET /rolloutfleet/observe`` (``rolloutfleet_worker.observation``): the operator's whole read of the engine
in one request, answered by calling vLLM's own routes in process, and ``POST /rolloutfleet/sequence``
(``rolloutfleet_worker.sequence``): the calls of one transaction step, guarded, in one request.

The Secret can be replaced while engines run (kubelet swaps the mounted files in place): the file is
checked again every ``CHECK_INTERVAL_SECONDS`` and before any refusal, and after a change the previous
token stays valid for a grace period (``ROLLOUTFLEET_CONTROL_TOKEN_GRACE_SECONDS``) so an operator that
still holds it is not locked out. A file that cannot be read fails closed: no token is accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Final

from rolloutfleet_worker import admission, observation, sequence

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TOKEN_FILE_ENV: Final = "ROLLOUTFLEET_CONTROL_TOKEN_FILE"  # noqa: S105 (a variable name, not a secret)
DEFAULT_TOKEN_FILE: Final = "/var/run/rolloutfleet/token/token"  # noqa: S105 (a path, not a secret)
GRACE_ENV: Final = "ROLLOUTFLEET_CONTROL_TOKEN_GRACE_SECONDS"
DEFAULT_GRACE_SECONDS: Final = 300.0
# How often a request may stat the file. kubelet refreshes mounted Secrets within about a minute, so a few
# seconds adds little; a refused request re-reads at once anyway.
CHECK_INTERVAL_SECONDS: Final = 5.0

# A child of vLLM's logger, so the lines land in the engine's log. Never log a token or a presented value.
log = logging.getLogger("vllm.rolloutfleet")

# Routes anyone reaching the pod may call: probes, metrics, and generation (guarded by vLLM's own
# --api-key when set). Everything else, listed or not, needs the token.
OPEN_EXACT: Final = frozenset(
    {
        "/health",
        "/ping",
        "/metrics",
        "/version",
        "/load",
        "/tokenize",
        "/detokenize",
        "/invocations",
        "/v1",
        admission.READY_PATH,  # answered here, never by vLLM
    }
)
OPEN_PREFIXES: Final = ("/v1/", "/metrics/")

# Documented for readers and tests; enforcement does not depend on this list (deny by default).
CONTROL_ROUTES: Final = (
    "/pause",
    "/resume",
    "/is_paused",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/update_weight_version",
    "/weight_info",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/weight_checker",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/server_info",
    "/reload_weights",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/start_profile",
    "/stop_profile",
)


def is_open(path: str) -> bool:
    """Whether ``path`` is served without the token.

    Paths with empty, ``.`` or ``..`` segments are never open: a proxy or router that normalises them
    could otherwise turn ``/v1/../pause`` into a control route after this check.
    """
    segments = path.split("/")[1:]
    if not path.startswith("/") or any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
        return False
    return path in OPEN_EXACT or path.startswith(OPEN_PREFIXES)


def _grace_seconds() -> float:
    """The grace period from the environment; unset or malformed means the default, negative means 0."""
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, "").strip()))
    except ValueError:
        return DEFAULT_GRACE_SECONDS


def _fingerprint(token: bytes) -> bytes:
    # Compared as fixed-length hashes, so the comparison's time says nothing about a token's length.
    return hashlib.sha256(token).digest()


class TokenFile:
    """The accepted tokens: the file's current one, and the previous one until its grace ends.

    ``clock`` is monotonic seconds (injected by the tests). Not thread-safe: one event loop calls it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.path = Path(os.environ.get(TOKEN_FILE_ENV, DEFAULT_TOKEN_FILE))
        self.grace = _grace_seconds()
        self.current: bytes | None = None  # fingerprint of the file's token; None: fail closed
        self.previous: bytes | None = None
        self.previous_until = 0.0
        self.signature: tuple[int, ...] | None = None  # what the file looked like when last read
        self.checked_at: float | None = None

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the file when it changed (or ``force``), at most once per interval unless forced."""
        now = self.clock()
        if not force and self.checked_at is not None and now - self.checked_at < CHECK_INTERVAL_SECONDS:
            return
        self.checked_at = now
        try:
            # stat follows kubelet's links (token -> ..data/token -> ..<timestamp>/token): a swap changes it.
            st = self.path.stat()
            signature = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            if not force and signature == self.signature:
                return
            token = self.path.read_bytes().strip()
        except OSError as exc:
            self._set(None, now, f"unreadable ({exc.strerror or type(exc).__name__})")
            self.signature = None
            return
        self.signature = signature
        self._set(_fingerprint(token) if token else None, now, "empty" if not token else "")

    def _set(self, fingerprint: bytes | None, now: float, problem: str) -> None:
        if fingerprint is None:
            if self.current is not None or self.previous is not None:
                log.warning("rolloutfleet: control token file %s %s: control routes refused", self.path, problem)
            self.current = self.previous = None  # fail closed: a token must not outlive its Secret
            return
        if fingerprint == self.current:
            return
        if self.current is not None and self.grace > 0:
            self.previous, self.previous_until = self.current, now + self.grace
            log.info("rolloutfleet: control token rotated; the previous one is accepted for %.0f s", self.grace)
        elif self.current is not None:
            self.previous = None
            log.info("rolloutfleet: control token rotated; the previous one is no longer accepted")
        self.current = fingerprint

    def accepts(self, presented: bytes) -> bool:
        """Whether ``presented`` is the current token, or the previous one within its grace."""
        offered = _fingerprint(presented)
        # Both comparisons always run, so timing does not say which token matched.
        current = self.current is not None and hmac.compare_digest(offered, self.current)
        in_grace = self.previous is not None and self.clock() < self.previous_until
        previous = self.previous is not None and hmac.compare_digest(offered, self.previous)
        return current or (in_grace and previous)

    @property
    def configured(self) -> bool:
        return self.current is not None


class ControlAuthMiddleware:
    """Pure ASGI middleware; one instance per app. ``clock`` is for the tests (monotonic seconds)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        self.tokens = TokenFile(clock)
        # This API server process's admission: a restarted container starts without it.
        self.admission = admission.Admission(wall_clock)

    def _authorized(self, scope: Scope) -> bool:
        for key, value in scope.get("headers", ()):
            if key.lower() == b"authorization":
                scheme, _, presented = bytes(value).strip().partition(b" ")
                if scheme.lower() == b"bearer" and self.tokens.accepts(presented.strip()):
                    return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        path = str(scope.get("path", ""))
        if kind == "http" and path == admission.READY_PATH:
            await admission.serve_ready(self.admission, scope, send)
            return
        if kind not in ("http", "websocket") or is_open(path):
            await self.app(scope, receive, send)
            return
        self.tokens.refresh()
        authorized = self._authorized(scope)
        if not authorized:
            # The Secret may have just been replaced (the caller holds the new token): look before refusing.
            self.tokens.refresh(force=True)
            authorized = self._authorized(scope)
        if authorized and kind == "http" and path in admission.CONTROL_PATHS:
            await admission.serve_control(self.admission, scope, receive, send)
            return
        if authorized and kind == "http" and path == observation.OBSERVE_PATH:
            await observation.serve(self.app, self.admission, scope, send)
            return
        if authorized and kind == "http" and path == sequence.SEQUENCE_PATH:
            await sequence.serve(self.app, self.admission, scope, receive, send)
            return
        if authorized:
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
            return
        if not self.tokens.configured:
            await _reply(send, 503, "ServiceUnavailable", "control token not configured on this engine")
        else:
            await _reply(send, 401, "Unauthorized", "a valid bearer token is required for control routes")


async def _reply(send: Send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
