"""``GET /rolloutfleet/observe``: everything the operator reads about an engine, in one request.

Served by ``rolloutfleet_worker.auth.ControlAuthMiddleware`` (token required) inside vLLM's API server
process. The operator's observation used to be five requests per engine (the admission, ``/is_paused``,
``/is_sleeping``, ``/weight_info`` and the ``rolloutfleet_state`` RPC through ``/collective_rpc``): at
1,024 pods that was 5,120 requests per read of the fleet, most of the operator's CPU. This route answers
the same five in one body, so the operator parses exactly what it parsed before.

How: the admission is read here first (it names this process, and is read before the weights, as
``admission`` requires); then the four vLLM routes are called *in this process*, through the rest of the
app's ASGI stack below this middleware, as if the same authenticated request had asked for them. Nothing
here knows vLLM's internals: the routes, their status codes and their bodies are vLLM's own (a release
without ``/weight_info`` answers its 404 inside the envelope, exactly as it would over HTTP).

The answer (200)::

    {"admission": {"admitted": bool, "instance": str, ...},
     "routes": {"is_paused": {"status": 200, "body": {...}}, "is_sleeping": {...},
                "weight_info": {...}, "state": {"status": 200, "body": {"results": [...]}}}}

``body`` is the route's JSON, or its text when it is not JSON. A route that raised (vLLM's server-error
middleware sits above ours, so it would have answered a plain-text 500) reads ``{"status": 500, "body":
"Internal Server Error"}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from rolloutfleet_worker import admission

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OBSERVE_PATH: Final = "/rolloutfleet/observe"
STATE_RPC: Final = {"method": "rolloutfleet_state", "args": [], "kwargs": {}}
# (envelope key, method, path, JSON body): the reads of one observation, in the operator's terms.
READS: Final = (
    ("is_paused", "GET", "/is_paused", None),
    ("is_sleeping", "GET", "/is_sleeping", None),
    ("weight_info", "GET", "/weight_info", None),
    ("state", "POST", "/collective_rpc", STATE_RPC),
)
# Headers of the outer request that the inner reads keep: the token (vLLM's own --api-key check, if any,
# sees what the operator sent) and nothing that describes the outer body.
KEPT_HEADERS: Final = frozenset({b"authorization", b"host", b"user-agent"})

log = logging.getLogger("vllm.rolloutfleet")


async def serve(app: ASGIApp, admitted: admission.Admission, scope: Scope, send: Send) -> None:
    """Answer one observation (the caller has checked the token)."""
    if scope.get("method") != "GET":
        await _json(send, 405, {"error": {"message": "GET only", "type": "MethodNotAllowed", "code": 405}})
        return
    report = admitted.report()  # first: the instance named is at least as old as the weights read next
    answers = await asyncio.gather(*(call(app, scope, method, path, body) for _, method, path, body in READS))
    routes = {key: answer for (key, _, _, _), answer in zip(READS, answers, strict=True)}
    await _json(send, 200, {"admission": report, "routes": routes})


async def call(app: ASGIApp, outer: Scope, method: str, path: str, body: Any, query: str = "") -> dict[str, Any]:
    """One route of this app, called in process as the authenticated ``outer`` request would have called it;
    its status and decoded body (``rolloutfleet_worker.sequence`` calls it too, with a query string)."""
    raw = b"" if body is None else json.dumps(body).encode()
    headers = [(k, v) for k, v in outer.get("headers", ()) if bytes(k).lower() in KEPT_HEADERS]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    scope: Scope = {
        **outer,
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": headers,
        # Per request: a route may write request.state, and the inner reads run concurrently.
        "state": dict(outer.get("state") or {}),
    }
    sent = False
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()  # no disconnect: the outer request is still open (cancellable, like a real wait)
        return {"type": "http.disconnect"}

    status = 500
    content_type = b""
    chunks: list[bytes] = []

    async def collect(message: Message) -> None:
        nonlocal status, content_type
        if message["type"] == "http.response.start":
            status = int(message["status"])
            for key, value in message.get("headers", ()):
                if bytes(key).lower() == b"content-type":
                    content_type = bytes(value)
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    try:
        await app(scope, receive, collect)
    except Exception as exc:  # what vLLM's server-error middleware (above ours) would have answered
        log.warning("rolloutfleet: in-process call %s failed: %s: %s", path, type(exc).__name__, exc)
        return {"status": 500, "body": "Internal Server Error"}
    text = b"".join(chunks).decode("utf-8", "replace")
    decoded: Any = text
    if b"json" in content_type and text:
        try:
            decoded = json.loads(text)
        except ValueError:
            decoded = text
    return {"status": status, "body": decoded}


async def _json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
