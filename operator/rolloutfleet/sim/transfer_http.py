"""vLLM's weight-transfer routes on a simulated engine (``vllm/entrypoints/serve/dev/rlhf/api_router.py`` in
0.26, ``vllm/entrypoints/rl/online/api_router.py`` in 0.33).

Registered by ``rolloutfleet.sim.server.SimulatedEngine`` on every engine (vLLM registers them under
``VLLM_SERVER_DEV_MODE=1`` whatever the transfer config; without ``--weight-transfer-config`` each call
fails in the worker). The state machine is ``rolloutfleet.sim.transfer``; this module parses requests and
writes vLLM's answers. Every call runs as an engine-core utility call (``EngineCore.utility``), is a
control route (the token, like every route but the open ones) and goes to the call log with its step
name; fault steps are the route names.

    POST /init_weight_transfer_engine  {"init_info": {...}}   → 200 {"message": "Weight transfer initialized"}
    POST /start_weight_update                                 → 200 {"message": "Weight update started"}
    POST /start_draft_weight_update                           → 200 {"message": "Draft weight update started"}
    POST /update_weights               {"update_info": {...}} → 200 {"message": "Weights updated"}
    POST /finish_weight_update         {"weight_version"?}    → 200 {"message": "Weight update finished"}

A body that is not JSON, or without ``init_info``/``update_info``, answers 400 (the route's own check). A
worker exception answers 500 ``{"error": {"message", "type": "InternalServerError", "param": null, "code":
500}}`` with vLLM's message: ``Call to collective_rpc method failed: <worker message>`` (one worker), or
with ``Worker failed with error '<worker message>', please check the stack trace above for the root
cause`` inside it (several workers). A failed load shows the worker's exception text: torch's message for a
wrong shape (measured on vLLM 0.26, 2026-12-01), empty for an exception without one.

The ``hang`` fault (``FaultKind.HANG``) on ``update_weights`` or ``init_weight_transfer_engine`` is a
collective with a dead peer: the call blocks inside the engine core (RPCs queue behind it; a client that
gives up frees nothing) until the engine restarts, or for ``delay`` seconds, then fails (an update then
destroys its target).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web

from rolloutfleet.sim import transfer
from rolloutfleet.sim.config import EngineSpec, FaultKind, Faults
from rolloutfleet.sim.engine import EngineCore

Action = Any  # server.Action: Callable[[Faults], Awaitable[tuple[web.Response, Any]]]


class Host(Protocol):
    """The engine the routes belong to (``SimulatedEngine``)."""

    spec: EngineSpec
    core: EngineCore

    async def run_step(
        self, keys: list[str], args: dict[str, Any], action: Action, *, log: bool = ...
    ) -> web.Response: ...


def add_routes(router: web.UrlDispatcher, host: Host) -> None:
    routes = _Routes(host)
    router.add_post("/init_weight_transfer_engine", routes.init)
    router.add_post("/start_weight_update", routes.start)
    router.add_post("/start_draft_weight_update", routes.start_draft)
    router.add_post("/update_weights", routes.update)
    router.add_post("/finish_weight_update", routes.finish)


def vllm_error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def worker_failure(spec: EngineSpec, exc: transfer.VllmError) -> web.Response:
    """vLLM's 500 for an exception raised in the worker (the message as its exception handler writes it)."""
    message = exc.message
    if isinstance(exc, transfer.UpdateFailedError) and not message:
        return vllm_error(500, "", "InternalServerError")
    if spec.tp_size > 1:  # MultiprocExecutor wraps the worker's message
        message = f"Worker failed with error '{message}', please check the stack trace above for the root cause"
    return vllm_error(500, f"Call to collective_rpc method failed: {message}", "InternalServerError")


async def _body(request: web.Request, key: str) -> tuple[Any, web.Response | None]:
    """The value of ``key`` in a JSON body, or vLLM's 400 (the route's own checks)."""
    try:
        text = await request.text()
        body = json.loads(text) if text else None
    except (ValueError, UnicodeDecodeError):
        return None, vllm_error(400, "Invalid JSON format", "Bad Request")
    value = body.get(key) if isinstance(body, dict) else None
    if value is None:
        return None, vllm_error(400, f"Missing '{key}' in request body", "Bad Request")
    return value, None


async def _hang(faults: Faults) -> bool:
    """Block as a dead collective does; True when it ended by its delay (the call then fails)."""
    rule = faults.get(FaultKind.HANG)
    if rule is None:
        return False
    if rule.delay > 0:
        await asyncio.sleep(rule.delay)
    else:
        await asyncio.Event().wait()  # until the engine crashes or restarts (EngineCore.stop)
    return True


class _Routes:
    def __init__(self, host: Host) -> None:
        self.host = host

    def _ok(self, message: str) -> tuple[web.Response, Any]:
        return web.json_response({"message": message}), {"message": message}

    def _failed(self, exc: transfer.VllmError) -> tuple[web.Response, Any]:
        reason = exc.reason if isinstance(exc, transfer.UpdateFailedError) else exc.message
        return worker_failure(self.host.spec, exc), {"error": reason}

    async def init(self, request: web.Request) -> web.Response:
        init_info, bad = await _body(request, "init_info")
        args = {"init_info": init_info}

        async def act(faults: Faults) -> tuple[web.Response, Any]:
            if bad is not None:
                return bad, {"error": "bad request"}
            core = self.host.core

            async def work() -> None:
                if await _hang(faults):
                    raise transfer.VllmError("TCPStore timed out waiting for the other ranks (simulated hang)")
                if not isinstance(init_info, dict):
                    raise transfer.VllmError(f"init_info must be an object, got {type(init_info).__name__}")
                core.transfer.init(init_info)

            try:
                await core.utility(work)
            except transfer.VllmError as exc:
                return self._failed(exc)
            return self._ok("Weight transfer initialized")

        return await self.host.run_step(["init_weight_transfer_engine"], args, act)

    async def _start(self, target: str, route: str, message: str) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            core = self.host.core

            async def work() -> None:
                core.transfer.start(target)
                await core.notify()

            try:
                await core.utility(work)
            except transfer.VllmError as exc:
                return self._failed(exc)
            return self._ok(message)

        return await self.host.run_step([route], {}, act)

    async def start(self, request: web.Request) -> web.Response:
        return await self._start("verifier", "start_weight_update", "Weight update started")

    async def start_draft(self, request: web.Request) -> web.Response:
        return await self._start("draft", "start_draft_weight_update", "Draft weight update started")

    async def update(self, request: web.Request) -> web.Response:
        info, bad = await _body(request, "update_info")
        names = info.get("names") if isinstance(info, dict) else None
        args = {"names": names if isinstance(names, list) else None}

        async def act(faults: Faults) -> tuple[web.Response, Any]:
            if bad is not None:
                return bad, {"error": "bad request"}
            core = self.host.core

            async def work() -> int:
                try:
                    if await _hang(faults):
                        fault = transfer.UpdateFailedError("the collective was aborted (simulated hang)", shown=False)
                        core.transfer.fail_update(fault)
                        raise fault
                    received = core.transfer.update(info)
                finally:
                    await core.notify()
                if core.lat.load_bytes_per_s > 0:
                    await asyncio.sleep(received / core.lat.load_bytes_per_s)
                return received

            try:
                received = await core.utility(work)
            except transfer.VllmError as exc:
                return self._failed(exc)
            response, _ = self._ok("Weights updated")
            return response, {"bytes": received}

        return await self.host.run_step(["update_weights"], args, act)

    async def finish(self, request: web.Request) -> web.Response:
        try:
            text = await request.text()
            body = json.loads(text) if text else {}
        except (ValueError, UnicodeDecodeError):
            body = {}
        version = body.get("weight_version") if isinstance(body, dict) else None
        version = version if isinstance(version, str) else None

        async def act(_: Faults) -> tuple[web.Response, Any]:
            core = self.host.core

            async def work() -> None:
                core.transfer.finish(version)
                await core.notify()

            try:
                await core.utility(work)
            except transfer.VllmError as exc:
                return self._failed(exc)
            return self._ok("Weight update finished")

        return await self.host.run_step(["finish_weight_update"], {"weight_version": version}, act)
