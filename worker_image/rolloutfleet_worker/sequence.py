"""``POST /rolloutfleet/sequence``: several control calls of one transaction step, in one request.

Served by ``rolloutfleet_worker.auth.ControlAuthMiddleware`` (token required) inside vLLM's API server
process. A step of the operator's transaction is often a few calls in a row (a resume is: stamp the weight
version, wake the KV cache, reset the prefix cache, resume; a staged commit is the verifier's, then the
draft's), each of which used to be one HTTP request, and the resume was preceded by a read of what the
engine holds. Inside the pause every such request round costs the whole fleet time out of service (issue
17), and each request costs the operator CPU per pod (issue 18). This route runs the calls one after the
other *in this process*, through the app below this middleware (``observation.call``), and answers what
each call answered, so the operator parses exactly what it parsed before.

The body::

    {"instance": "<hex>",           # optional: this process must be the one named (else nothing runs)
     "expect": {...},               # optional: what every rank's ``rolloutfleet_state`` must hold
     "calls": [{"method": "POST", "path": "/resume", "query": "a=b", "json": {...}}, ...]}

A call may carry ``"expect": {...}``: its JSON body must hold it (a ``/collective_rpc`` call: every rank's
result), or the sequence ends there (a prefix-cache reset that answers ``{"success": false}`` must never be
followed by the resume; nor a resume chained after loads whose ``rolloutfleet_state`` does not hold the digests
the operator expects). The guard makes a resume safe
in one request: the operator names the engine process and the weights it saw
acknowledged, and the calls run only if both still hold (``expect`` is a subset of each rank's report:
objects compared key by key, anything else by equality, a missing key reads as null). The answer (200)::

    {"admission": {...}, "held": null | "instance" | "state",
     "state": {"status": 200, "body": {"results": [...]}},   # the guard's read, when ``expect`` was given
     "results": [{"status": 200, "body": ..., "seconds": 0.012}, ...]}  # the calls that ran, in order

``held`` names the guard that stopped everything (then ``results`` is empty). Unless the body says
``"stop": false`` (calls that change nothing, e.g. the pre-flights of both targets), the calls stop after the
first one that failed: a status outside 2xx, or a ``/collective_rpc`` with a result that is not ``ok`` (an
extension error: e.g. a verifier commit whose bytes changed never lets the draft's commit run). The admission
routes (``/rolloutfleet/admit``, ``/rolloutfleet/withdraw``) may be calls too, and ``GET /rolloutfleet/observe``
(``observation``: answered as on its own, read when its turn comes, so after the calls before it): the
operator's pre-flight reads the engine in the pre-flight's own request, one request per engine fewer before a
revision's first pause (issue 18). The other ``/rolloutfleet/`` routes may not (400); an image from before
the observation was allowed answers that 400 too, and the operator then sends the read apart.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from rolloutfleet_worker import admission, observation

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SEQUENCE_PATH: Final = "/rolloutfleet/sequence"
MAX_BODY_BYTES: Final = 64 * 1024  # a few calls with small JSON bodies (a commit's path, a version string)
MAX_CALLS: Final = 16
METHODS: Final = frozenset({"GET", "POST"})

log = logging.getLogger("vllm.rolloutfleet")


class BodyError(ValueError):
    """A sequence the route refuses (400), before anything runs."""


def parse(raw: bytes) -> tuple[str | None, Any, list[dict[str, Any]], bool]:
    """(``instance``, ``expect``, ``calls``, ``stop``) of a sequence body, each call with method, path, query,
    json and expect; ``stop`` false runs every call whatever the others answered (reads, e.g. pre-flights)."""
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
    parsed = [_call(i, c) for i, c in enumerate(calls)]
    return instance, expect, parsed, stop


def _call(index: int, call: Any) -> dict[str, Any]:
    where = f"calls[{index}]"
    if not isinstance(call, dict):
        raise BodyError(f"{where} must be an object")
    method, path, query = call.get("method", "POST"), call.get("path"), call.get("query", "")
    if method not in METHODS:
        raise BodyError(f"{where}.method must be one of {sorted(METHODS)}")
    if not isinstance(path, str) or not path.startswith("/") or "?" in path:
        raise BodyError(f"{where}.path must be an absolute path without a query")
    if path == observation.OBSERVE_PATH and method != "GET":
        raise BodyError(f"{where}: {path} is read with GET")
    if path.startswith("/rolloutfleet/") and path not in admission.CONTROL_PATHS | {observation.OBSERVE_PATH}:
        raise BodyError(f"{where}.path: {path} cannot be part of a sequence")
    if not isinstance(query, str):
        raise BodyError(f"{where}.query must be a string")
    expect = call.get("expect")
    if expect is not None and not isinstance(expect, dict):
        raise BodyError(f"{where}.expect must be a JSON object")
    return {"method": method, "path": path, "query": query, "json": call.get("json"), "expect": expect}


def holds(actual: Any, expected: Any) -> bool:
    """Whether ``actual`` holds ``expected``: objects key by key (a missing key reads as null), else equal."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(holds(actual.get(k), v) for k, v in expected.items())
    return bool(actual == expected)


def failed(path: str, answer: dict[str, Any], expect: Any = None) -> bool:
    """Whether a call's answer ends the sequence: not 2xx, a body that does not hold the call's ``expect``
    (vLLM answers some refusals with 200, e.g. ``{"success": false}`` from a prefix-cache reset), or an RPC
    whose result on some rank is not ok. An RPC's ``expect`` is held by every rank's result, as the guard's is:
    a ``rolloutfleet_state`` call after the loads ends the sequence before the resume unless every rank holds
    the weights the operator expects (a Rolling pod's whole update in one request)."""
    if not 200 <= int(answer["status"]) < 300:
        return True
    if path != "/collective_rpc":
        return expect is not None and not holds(answer["body"], expect)
    results = answer["body"].get("results") if isinstance(answer["body"], dict) else None
    if not isinstance(results, list) or any(isinstance(r, dict) and r.get("ok") is False for r in results):
        return True
    return expect is not None and not (results and all(isinstance(r, dict) and holds(r, expect) for r in results))


async def serve(app: ASGIApp, admitted: admission.Admission, scope: Scope, receive: Receive, send: Send) -> None:
    """Run one sequence (the caller has checked the token)."""
    if scope.get("method") != "POST":
        await admission.reply(send, 405, admission.error_body(405, "MethodNotAllowed", "use POST"), allow="POST")
        return
    raw = await admission.read_body(receive, MAX_BODY_BYTES)
    if raw is None:  # the client went away before its body arrived: run nothing
        return
    if len(raw) > MAX_BODY_BYTES:
        await admission.reply(
            send, 413, admission.error_body(413, "PayloadTooLarge", f"the body is over {MAX_BODY_BYTES} bytes")
        )
        return
    try:
        instance, expect, calls, stop = parse(raw)
    except BodyError as exc:
        await admission.reply(send, 400, admission.error_body(400, "BadRequestError", str(exc)))
        return
    answer: dict[str, Any] = {"admission": admitted.report(), "held": None, "results": []}
    if instance is not None and instance != admitted.instance:
        answer["held"] = "instance"
        await admission.reply(send, 200, answer)
        return
    if expect is not None:
        state = await observation.call(app, scope, "POST", "/collective_rpc", observation.STATE_RPC)
        answer["state"] = state
        if not _state_holds(state, expect):
            answer["held"] = "state"
            log.info("rolloutfleet: sequence held: the engine no longer holds what the operator expects")
            await admission.reply(send, 200, answer)
            return
    for call in calls:
        started = time.perf_counter()
        result = await _run(app, admitted, scope, call)
        # Each call's own time: the operator times the steps of a chain sent in one request (their metrics).
        result["seconds"] = round(time.perf_counter() - started, 6)
        answer["results"].append(result)
        if stop and failed(call["path"], result, call["expect"]):
            break
    ran = ", ".join(f"{c['path']} {r['status']}" for c, r in zip(calls, answer["results"], strict=False))
    log.info("rolloutfleet: sequence of %d calls ran %d: %s", len(calls), len(answer["results"]), ran)
    await admission.reply(send, 200, answer)


def _state_holds(state: dict[str, Any], expect: Any) -> bool:
    results = state["body"].get("results") if state["status"] == 200 and isinstance(state["body"], dict) else None
    if not isinstance(results, list) or not results:
        return False
    return all(isinstance(r, dict) and r.get("ok") is True and holds(r, expect) for r in results)


async def _run(app: ASGIApp, admitted: admission.Admission, scope: Scope, call: dict[str, Any]) -> dict[str, Any]:
    """One call, in process: vLLM's routes through the app below the middleware, the admission routes (ours,
    not vLLM's) through the admission itself, the observation through ``observation.serve``; all captured the
    same way (``observation.call``)."""

    async def control(inner: Scope, receive: Receive, send: Send) -> None:
        await admission.serve_control(admitted, inner, receive, send)

    async def observe(inner: Scope, _receive: Receive, send: Send) -> None:
        await observation.serve(app, admitted, inner, send)

    target: ASGIApp = app
    if call["path"] in admission.CONTROL_PATHS:
        target = control
    elif call["path"] == observation.OBSERVE_PATH:
        target = observe
    return await observation.call(target, scope, call["method"], call["path"], call["json"], call["query"])
