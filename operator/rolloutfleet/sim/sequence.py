"""The simulated engine's ``POST /rolloutfleet/sequence`` (``rolloutfleet_worker.sequence``, mirrored).

Called by ``rolloutfleet.sim.server.SimulatedEngine`` for that route. Same body, guard, answer and stop rule
as the worker's middleware; each call is run by the route's own handler (its faults, latency and call-log
entry included, exactly as if it had come as its own request), so the engines' logs read the same whether
the operator sent a step's calls apart or together. The operator may not import the worker package, so the
body's parsing is mirrored here and the shared contract suite (tests/contract) holds both to one behaviour.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol, cast

from aiohttp import web
from multidict import CIMultiDictProxy, MultiDict, MultiDictProxy

SEQUENCE_PATH: Final = "/rolloutfleet/sequence"
MAX_BODY_BYTES: Final = 64 * 1024
MAX_CALLS: Final = 16
ADMISSION_PATHS: Final = frozenset({"/rolloutfleet/admit", "/rolloutfleet/withdraw"})
OBSERVE_PATH: Final = "/rolloutfleet/observe"  # a call too (GET): the pre-flight's request reads the engine
STATE_RPC: Final = {"method": "rolloutfleet_state", "args": [], "kwargs": {}}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Host(Protocol):
    """What the route needs of the simulated engine."""

    def handler(self, method: str, path: str) -> Handler | None: ...

    def admission_report(self) -> dict[str, Any]: ...

    @property
    def instance(self) -> str: ...


class InnerRequest:
    """Just enough of ``web.Request`` for the simulator's handlers: query, headers, path and body."""

    def __init__(self, method: str, path: str, query: str, raw: bytes, headers: Mapping[str, str]) -> None:
        self.method, self.path, self._raw = method, path, raw
        self.query = MultiDictProxy(MultiDict(urllib.parse.parse_qsl(query, keep_blank_values=True)))
        self.headers = headers
        self.content = self

    async def read(self, n: int = -1) -> bytes:
        return self._raw if n < 0 else self._raw[:n]

    async def text(self) -> str:
        return self._raw.decode()


class BodyError(ValueError):
    """A sequence refused before anything runs (400)."""


def parse(raw: bytes) -> tuple[str | None, Any, list[dict[str, Any]], bool]:
    """``rolloutfleet_worker.sequence.parse``: (instance, expect, calls, stop)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BodyError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BodyError('the body must be a JSON object {"calls": [...]}')
    instance, expect, calls = body.get("instance"), body.get("expect"), body.get("calls")
    if instance is not None and (not isinstance(instance, str) or not instance or len(instance) > 64):
        raise BodyError("instance must be a non-empty string of at most 64 characters")
    if expect is not None and not isinstance(expect, dict):
        raise BodyError("expect must be a JSON object")
    if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_CALLS:
        raise BodyError(f"calls must be a list of 1 to {MAX_CALLS} calls")
    stop = body.get("stop", True)
    if not isinstance(stop, bool):
        raise BodyError("stop must be true or false")
    out = []
    for index, call in enumerate(calls):
        where = f"calls[{index}]"
        if not isinstance(call, dict):
            raise BodyError(f"{where} must be an object")
        method, path, query = call.get("method", "POST"), call.get("path"), call.get("query", "")
        if method not in ("GET", "POST"):
            raise BodyError(f"{where}.method must be one of ['GET', 'POST']")
        if not isinstance(path, str) or not path.startswith("/") or "?" in path:
            raise BodyError(f"{where}.path must be an absolute path without a query")
        if path == OBSERVE_PATH and method != "GET":
            raise BodyError(f"{where}: {path} is read with GET")
        if path.startswith("/rolloutfleet/") and path not in ADMISSION_PATHS | {OBSERVE_PATH}:
            raise BodyError(f"{where}.path: {path} cannot be part of a sequence")
        if not isinstance(query, str):
            raise BodyError(f"{where}.query must be a string")
        wants = call.get("expect")  # the call's own expectation (``expect`` above is the guard's)
        if wants is not None and not isinstance(wants, dict):
            raise BodyError(f"{where}.expect must be a JSON object")
        out.append({"method": method, "path": path, "query": query, "json": call.get("json"), "expect": wants})
    return instance, expect, out, stop


def holds(actual: Any, expected: Any) -> bool:
    """Objects key by key (a missing key reads as null), anything else by equality."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(holds(actual.get(k), v) for k, v in expected.items())
    return bool(actual == expected)


def failed(path: str, part: dict[str, Any], expect: Any = None) -> bool:
    """Not 2xx, a body that does not hold the call's ``expect`` (an RPC: every rank's result must), or an RPC
    with a rank whose result is not ok."""
    if not 200 <= int(part["status"]) < 300:
        return True
    if path != "/collective_rpc":
        return expect is not None and not holds(part["body"], expect)
    results = part["body"].get("results") if isinstance(part["body"], dict) else None
    if not isinstance(results, list) or any(isinstance(r, dict) and r.get("ok") is False for r in results):
        return True
    return expect is not None and not (results and all(isinstance(r, dict) and holds(r, expect) for r in results))


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


async def serve(host: Host, request: web.Request) -> web.Response:
    """Run one sequence (the auth middleware has checked the token)."""
    raw = await request.content.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        return _error(413, "PayloadTooLarge", f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        instance, expect, calls, stop = parse(raw)
    except BodyError as exc:
        return _error(400, "BadRequestError", str(exc))
    answer: dict[str, Any] = {"admission": host.admission_report(), "held": None, "results": []}
    if instance is not None and instance != host.instance:
        answer["held"] = "instance"
        return web.json_response(answer)
    headers = request.headers
    if expect is not None:
        state = await _call(host, "POST", "/collective_rpc", "", STATE_RPC, headers)
        answer["state"] = state
        results = state["body"].get("results") if state["status"] == 200 and isinstance(state["body"], dict) else None
        if (
            not isinstance(results, list)
            or not results
            or not all(isinstance(r, dict) and r.get("ok") is True and holds(r, expect) for r in results)
        ):
            answer["held"] = "state"
            return web.json_response(answer)
    for call in calls:
        started = time.perf_counter()
        part = await _call(host, call["method"], call["path"], call["query"], call["json"], headers)
        part["seconds"] = round(time.perf_counter() - started, 6)
        answer["results"].append(part)
        if stop and failed(call["path"], part, call["expect"]):
            break
    return web.json_response(answer)


async def _call(
    host: Host, method: str, path: str, query: str, body: Any, headers: CIMultiDictProxy[str]
) -> dict[str, Any]:
    handler = host.handler(method, path)
    if handler is None:  # what vLLM (FastAPI) answers for a route it does not have
        return {"status": 404, "body": {"detail": "Not Found"}}
    raw = b"" if body is None else json.dumps(body).encode()
    inner = InnerRequest(method, path, query, raw, headers)
    resp = await handler(cast(web.Request, inner))
    assert isinstance(resp, web.Response)
    return part(resp)


def part(resp: web.Response) -> dict[str, Any]:
    """One route's answer as an envelope carries it (a sequence's results, ``/rolloutfleet/observe``'s routes):
    its status and its (decoded) body."""
    text = resp.text if resp.body is not None else ""
    body: Any = text or ""
    if resp.content_type == "application/json" and text:
        body = json.loads(text)
    return {"status": resp.status, "body": body}
