"""``ControlAuthMiddleware``: a bearer token on every vLLM control route.

Loaded by vLLM's API server (``--middleware rolloutfleet_worker.auth.ControlAuthMiddleware``, which calls
``app.add_middleware(cls)``). Stock vLLM's ``--api-key`` guards only ``/v1``; the dev-mode control routes
(pause, sleep, collective_rpc, weight transfer, ...) are open to anyone who can reach the pod. This pure
ASGI middleware owns that gate: generation and probe routes stay open, everything else needs
``Authorization: Bearer <token>`` with the token read from a mounted Secret file. Deny by default, so a
control route added by a future vLLM is protected before anyone lists it here.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Final

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TOKEN_FILE_ENV: Final = "ROLLOUTFLEET_CONTROL_TOKEN_FILE"  # noqa: S105 (a variable name, not a secret)
DEFAULT_TOKEN_FILE: Final = "/var/run/rolloutfleet/token/token"  # noqa: S105 (a path, not a secret)

# Routes anyone reaching the pod may call: probes, metrics, and generation (guarded by vLLM's own
# --api-key when set). Everything else, listed or not, needs the token.
OPEN_EXACT: Final = frozenset(
    {"/health", "/ping", "/metrics", "/version", "/load", "/tokenize", "/detokenize", "/invocations", "/v1"}
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


class ControlAuthMiddleware:
    """Pure ASGI middleware; one instance per app. Caches the token after the first successful read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._token: bytes | None = None

    def _read_token(self) -> bytes | None:
        # Cached once read: the operator rolls pods when the Secret changes (the token is in the pod spec
        # hash), so no re-reading per request. A missing file is not cached, so a late mount recovers.
        if self._token is None:
            path = Path(os.environ.get(TOKEN_FILE_ENV, DEFAULT_TOKEN_FILE))
            try:
                token = path.read_bytes().strip()
            except OSError:
                return None
            self._token = token or None
        return self._token

    def _authorized(self, scope: Scope, token: bytes) -> bool:
        for key, value in scope.get("headers", ()):
            if key.lower() == b"authorization":
                scheme, _, presented = bytes(value).strip().partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), token):
                    return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or is_open(str(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        token = self._read_token()
        if token is not None and self._authorized(scope, token):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
            return
        if token is None:
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
