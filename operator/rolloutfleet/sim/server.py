"""One simulated vLLM engine on its own ``IP:port``: vLLM's routes, our auth middleware, injected faults.

Created by ``rolloutfleet.sim.fleet.SimulatedFleet`` (many per process). The routes, status codes and
bodies follow vLLM's source (``vllm/entrypoints/serve/dev/...`` in 0.26 to 0.33):

- ``POST /pause`` → ``{"status": "paused"}``, 400 ``{"error": ...}`` for a bad mode; ``POST /resume`` →
  ``{"status": "resumed"}``; ``GET /is_paused`` → ``{"is_paused": bool}``.
- ``POST /sleep``, ``POST /wake_up`` → empty 200; ``GET /is_sleeping`` → ``{"is_sleeping": bool}``.
- ``POST /reset_prefix_cache?reset_running_requests=bool`` → ``{"success": bool}`` (0.26 and 0.33 alike,
  ``vllm/entrypoints/serve/dev/cache/api_router.py``); ``false`` while KV blocks are held unless running
  requests are preempted (see ``engine``). ``reset_external`` is accepted and ignored (no KV connector).
- ``POST /update_weight_version`` → ``{"success": true, "new_version": v}``; ``GET /weight_info`` →
  ``{"weight_version": v}``.
- ``POST /collective_rpc`` ``{"method", "args", "kwargs", "timeout"}`` → ``{"results": [...]}`` one per
  rank; an unknown method is a worker ``AttributeError``, i.e. a plain-text 500, and so is vLLM's RPC
  ``timeout`` expiring (multi-worker engines only; the work goes on, see ``engine``).
- ``GET /health`` → empty 200 whatever the sleep/pause state; ``GET /metrics``; ``/v1/completions``,
  ``/v1/models`` (a completion answers 500 while parameters are on the meta device: see ``engine``).
- vLLM's weight-transfer routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/start_draft_weight_update``, ``/update_weights``, ``/finish_weight_update``): ``transfer_http``. The
  extension's ``rolloutfleet_push_begin``/``_end`` go through ``/collective_rpc`` like every RPC.
- Staged updates (docs/staging.md): ``rolloutfleet_stage``/``rolloutfleet_unstage`` through
  ``/collective_rpc``; a staged load's fault and latency key is ``rolloutfleet_load:staged`` (after its
  target's), and its fixed latency is ``Latencies.commit_s`` instead of the load's. Faults:
  ``fail_stage`` on ``rolloutfleet_stage`` fails the stage's reading, ``corrupt_load`` on a staged load
  makes it answer ``staged_mismatch``.

Our image's middleware (``rolloutfleet_worker.auth``, mirrored here since the operator may not import
it): every route but ``/health``, ``/metrics``, ``/ping``, ``/version``, ``/v1`` and ``/v1/*`` (and a few
more open ones) needs ``Authorization: Bearer <token>``; otherwise 401
``{"error": {"message", "type": "Unauthorized", "code": 401}}`` with ``WWW-Authenticate: Bearer``.
Faults (``FaultRule``) act after authentication, per step.

The middleware's admission routes (``rolloutfleet_worker.admission``), same bodies and codes:
``GET /rolloutfleet/ready`` (open) → 200 ``{"admitted": true, "revision", "since"}`` or 503
``{"admitted": false}`` (every answer also names the process: ``instance``); ``POST /rolloutfleet/admit``
``{"revision": int|null, "instance"?}`` (token) → 200 as ready's, 409 for another instance, 400 for a
malformed body, 413 over 4 KiB; ``POST /rolloutfleet/withdraw`` (token) → 200 ``{"admitted": false}``;
``GET /rolloutfleet/observe`` (token) → 200 ``{"admission": ..., "routes": {"is_paused"|"is_sleeping"|
"weight_info"|"state": {"status", "body"}}}``, each route answered as on its own (its faults too);
``POST /rolloutfleet/sequence`` (token): a step's calls in one request, guarded (``sim.sequence``). A crash
or restart ends the process, and with it the admission. Fault steps: ``ready``, ``admit``, ``withdraw``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rolloutfleet.api import common, vllm_flags
from rolloutfleet.sim import sequence, transfer_http
from rolloutfleet.sim.config import (
    STAGED_LOAD_KEY,
    EngineSpec,
    FaultKind,
    FaultRule,
    Faults,
    Latencies,
    WeightsConfig,
)
from rolloutfleet.sim.engine import EngineCore, EngineLog, InternalError, RejectedError

# rolloutfleet_worker.auth: open exact paths and prefixes; everything else (deny by default) needs the token.
OPEN_EXACT = frozenset(
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
        "/rolloutfleet/ready",
    }
)
TARGETED_RPCS = ("rolloutfleet_load", "rolloutfleet_preflight", "rolloutfleet_push_begin")  # fault key: METHOD:target
MAX_ADMIT_BODY_BYTES = 4096  # rolloutfleet_worker.admission.MAX_BODY_BYTES
OPEN_PREFIXES = ("/v1/", "/metrics/")


def keep_alive_seconds() -> float:
    """How long vLLM's server keeps an idle connection: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` from the environment
    (uvicorn's timeout_keep_alive in vLLM's server), 5 s without it."""
    return float(vllm_flags.http_keep_alive_seconds(os.environ))


def is_open(path: str) -> bool:
    segments = path.split("/")[1:]
    if not path.startswith("/") or any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
        return False
    return path in OPEN_EXACT or path.startswith(OPEN_PREFIXES)


Action = Callable[[Faults], Awaitable[tuple[web.Response, Any]]]


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _internal() -> web.Response:
    return web.Response(status=500, text="Internal Server Error")


class _ArmedFault:
    def __init__(self, rule: FaultRule) -> None:
        self.rule = rule
        self.seen = 0
        self.fired = 0

    def matches(self, keys: list[str]) -> bool:
        if self.rule.step != "*" and self.rule.step not in keys:
            return False
        self.seen += 1
        if self.seen <= self.rule.skip:
            return False
        return self.rule.count is None or self.fired < self.rule.count


class SimulatedEngine:
    """A simulated engine: its HTTP listener, its state (``core``), its faults and its call log."""

    def __init__(
        self,
        ip: str,
        port: int,
        *,
        spec: EngineSpec,
        weights: WeightsConfig,
        latencies: Latencies,
        token: str | None,
    ) -> None:
        self.ip, self.port = ip, port
        self.spec, self.weights, self.latencies = spec, weights, latencies
        self._token = token
        self.log = EngineLog()
        self.core = EngineCore(spec, weights, latencies, self.log)
        self.faults: list[_ArmedFault] = []
        self.restarts = 0  # what a kubelet would count in the pod's restartCount (the pod follower reports it)
        self._runner: web.AppRunner | None = None
        self._handlers: dict[tuple[str, str], sequence.Handler] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"SimulatedEngine({self.key}, running={self.running})"

    @property
    def key(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{common.host_port(self.ip, self.port)}"

    @property
    def versioned(self) -> bool:
        """Whether this release has the weight-version routes (0.26 has none: 404, measured on the H200)."""
        return self.spec.vllm_version != "0.26"

    @property
    def running(self) -> bool:
        return self._runner is not None

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(middlewares=[self._auth])
        self._routes(app)
        # handler_cancellation: a client that gives up on a hung request frees the handler, as uvicorn does.
        # keepalive_timeout: vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds
        # (5 by default; aiohttp's own default is an hour), so clients here reconnect where they would there.
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=0.05,
            handler_cancellation=True,
            keepalive_timeout=keep_alive_seconds(),
        )
        await runner.setup()
        site = web.TCPSite(runner, self.ip, self.port, reuse_address=True, backlog=512)
        await site.start()
        if self.port == 0:
            self.port = int(runner.addresses[0][1])
        self._runner = runner
        self.log.add("listen", state=self.core.summary())

    async def stop(self) -> None:
        """Stop for good (fleet removal/shutdown): the listener and any pending restart."""
        for task in list(self._tasks):
            task.cancel()
        await self._close_listener()

    async def _close_listener(self) -> None:
        runner, self._runner = self._runner, None
        self.core.stop()
        self.core.withdraw()  # the API server process is gone, and its admission with it
        if runner is not None:
            await runner.cleanup()

    async def crash(self, restart_after: float | None = None) -> None:
        """The listener disappears, connections drop, state is lost; optionally listen again later."""
        self.log.add("crash", restart_after=restart_after)
        await self._close_listener()
        if restart_after is not None:
            self._spawn(self._restart_later(restart_after))

    async def restart(self) -> None:
        """A restarted container: fresh engine state (the initial weights), same call log."""
        await self._close_listener()
        self.core = EngineCore(self.spec, self.weights, self.latencies, self.log)
        self.restarts += 1
        self.log.add("restart")
        await self.start()

    async def _restart_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.restart()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def set_latencies(self, latencies: Latencies) -> None:
        """This engine's simulated durations from now on (a benchmark draws them per engine: disks, nodes and
        model start-up differ across a real fleet). Steps already running keep the durations they started with."""
        self.latencies = latencies
        self.core.lat = latencies
        self.core.staging.lat = latencies

    def add_fault(self, rule: FaultRule) -> None:
        self.faults.append(_ArmedFault(rule))

    def clear_faults(self) -> None:
        self.faults.clear()

    # --- HTTP --------------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._token and not is_open(request.path):
            scheme, _, presented = request.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token.encode()):
                self.log.add(request.path.strip("/"), status=401, result="unauthorized")
                message = "a valid bearer token is required for control routes"
                return web.json_response(
                    {"error": {"message": message, "type": "Unauthorized", "code": 401}},
                    status=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        resp: web.StreamResponse = await handler(request)
        return resp

    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/rolloutfleet/ready", self._ready)
        r.add_post("/rolloutfleet/admit", self._admit)
        r.add_post("/rolloutfleet/withdraw", self._withdraw)
        r.add_get("/rolloutfleet/observe", self._observe)
        r.add_post(sequence.SEQUENCE_PATH, self._sequence)
        r.add_get("/metrics", self._metrics)
        r.add_get("/is_paused", self._is_paused)
        r.add_post("/pause", self._pause)
        r.add_post("/resume", self._resume)
        r.add_post("/sleep", self._sleep)
        r.add_post("/wake_up", self._wake_up)
        r.add_get("/is_sleeping", self._is_sleeping)
        r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        if self.versioned:
            r.add_post("/update_weight_version", self._update_weight_version)
            r.add_get("/weight_info", self._weight_info)
        r.add_post("/collective_rpc", self._collective_rpc)
        transfer_http.add_routes(r, self)
        r.add_post("/v1/completions", self._completions)
        r.add_get("/v1/models", self._models)
        self._handlers = {
            (route.method, route.resource.canonical): route.handler
            for route in r.routes()
            if route.resource is not None
        }

    def handler(self, method: str, path: str) -> sequence.Handler | None:
        """The handler of one route (``sim.sequence`` runs a sequence's calls through them)."""
        return self._handlers.get((method, path))

    def admission_report(self) -> dict[str, Any]:
        return self.core.admission()

    @property
    def instance(self) -> str:
        return self.core.instance

    async def _sequence(self, request: web.Request) -> web.Response:
        """``rolloutfleet_worker.sequence``: a step's calls in one request (``sim.sequence``). A fault on
        ``sequence`` acts on the whole (a 404 plays an image without the route); each call is logged as
        its own route logs it."""

        async def act(_: Faults) -> tuple[web.Response, Any]:
            return await sequence.serve(self, request), None

        return await self.run_step(["sequence"], {}, act, log=False)

    async def run_step(
        self,
        keys: list[str],
        args: dict[str, Any],
        action: Action,
        *,
        log: bool = True,
        note: dict[str, Any] | None = None,
    ) -> web.Response:
        """Run one step: injected faults and latency first, then the action, then the call log entry
        (with ``note``'s fields, e.g. whether a load was a commit from the stage)."""
        fault = next((f for f in self.faults if f.matches(keys)), None)
        flags: Faults = {}
        started = time.monotonic()  # logged as t0: tests measure how many engines were in a step at once
        step = keys[1] if keys[0] == "collective_rpc" else keys[0]  # log RPCs by their method name
        if fault is not None:
            fault.fired += 1
            rule = fault.rule
            self.log.add(step, key=keys[-1], args=args, fault=rule.to_dict())
            if rule.kind is FaultKind.SLOW:
                await asyncio.sleep(rule.delay)
            elif rule.kind is FaultKind.TIMEOUT:
                await asyncio.sleep(rule.delay or 3600.0)  # until the client gives up (or the delay ends)
                return _error(504, "simulated timeout elapsed", "TimeoutError")
            elif rule.kind is FaultKind.CRASH:
                self._spawn(self.crash(rule.restart_after))
                await asyncio.sleep(3600.0)  # cancelled by the crash: the client sees the connection drop
            elif rule.kind is FaultKind.HTTP_ERROR and rule.phase == "before":
                return web.json_response(rule.body, status=rule.status)
            flags[rule.kind] = rule
        fixed = self.latencies.fixed(keys)
        if fixed > 0:
            await asyncio.sleep(fixed)
        resp, result = await action(flags)
        if fault is not None and fault.rule.kind is FaultKind.HTTP_ERROR:  # phase "after": acted, answer lost
            resp = web.json_response(fault.rule.body, status=fault.rule.status)
        if log:
            self.log.add(
                step,
                key=keys[-1],
                args=args,
                status=resp.status,
                result=result,
                state=self.core.summary(),
                t0=started,
                **(note or {}),
            )
        return resp

    @staticmethod
    def _body(result: Any, status: int = 200) -> tuple[web.Response, Any]:
        if result is None:
            return web.Response(status=status), None
        return web.json_response(result, status=status), result

    async def _health(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            return self._body(None)

        return await self.run_step(["health"], {}, act, log=False)

    @property
    def admitted(self) -> bool:
        """Whether the operator admitted this engine process (``/rolloutfleet/ready`` answers 200)."""
        return self.core.admitted

    async def _ready(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            return self._admission(200 if self.core.admitted else 503)

        return await self.run_step(["ready"], {}, act, log=False)

    async def _admit(self, request: web.Request) -> web.Response:
        raw = await request.content.read(MAX_ADMIT_BODY_BYTES + 1)
        too_large = len(raw) > MAX_ADMIT_BODY_BYTES
        revision, instance, problem = (None, None, "too large") if too_large else _admit_body(raw)

        async def act(_: Faults) -> tuple[web.Response, Any]:
            if too_large:
                message = f"the body is over {MAX_ADMIT_BODY_BYTES} bytes"
                return _error(413, message, "PayloadTooLarge"), {"error": problem}
            if problem is not None:
                return _error(400, problem), {"error": problem}
            if instance is not None and instance != self.core.instance:
                message = f"this is engine process {self.core.instance}, not {instance}: observe it again"
                return _error(409, message, "Conflict"), {"error": "instance mismatch"}
            self.core.admit(revision)
            return self._admission(200)

        return await self.run_step(["admit"], {"revision": revision}, act)

    async def _withdraw(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            self.core.withdraw()
            return self._admission(200)

        return await self.run_step(["withdraw"], {}, act)

    async def _observe(self, request: web.Request) -> web.Response:
        """``rolloutfleet_worker.observation``: the admission (read first), then vLLM's four reads, each as
        its own route would have answered it (its faults and latency included), in one body. A fault on
        ``observe`` itself acts on the whole (a 404 plays an image without the route)."""

        async def act(_: Faults) -> tuple[web.Response, Any]:
            report = self.core.admission()
            answers = await asyncio.gather(
                self._is_paused(request),
                self._is_sleeping(request),
                self._weight_info(request) if self.versioned else _not_found(),
                self._rpc_call({"method": "rolloutfleet_state", "args": [], "kwargs": {}}),
            )
            keys = ("is_paused", "is_sleeping", "weight_info", "state")
            routes = {key: sequence.part(resp) for key, resp in zip(keys, answers, strict=True)}
            return self._body({"admission": report, "routes": routes})

        return await self.run_step(["observe"], {}, act, log=False)

    def _admission(self, status: int) -> tuple[web.Response, Any]:
        body = self.core.admission()
        return web.json_response(body, status=status, headers={"Cache-Control": "no-store"}), body

    async def _metrics(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            text = self.core.metrics_text()
            return web.Response(text=text, content_type="text/plain", charset="utf-8"), None

        return await self.run_step(["metrics"], {}, act, log=False)

    async def _is_paused(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            return self._body({"is_paused": self.core.paused})

        return await self.run_step(["is_paused"], {}, act, log=False)

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        clear = request.query.get("clear_cache", "true").lower() in ("1", "true", "yes")
        args = {"mode": mode, "clear_cache": clear}

        async def act(_: Faults) -> tuple[web.Response, Any]:
            if mode not in ("keep", "wait", "abort"):
                return _error(400, f"invalid pause mode {mode!r}"), {"error": "bad mode"}
            await self.core.pause(mode, clear)
            return self._body({"status": "paused"})

        return await self.run_step(["pause", f"pause:{mode}"], args, act)

    async def _resume(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            await self.core.resume()
            return self._body({"status": "resumed"})

        return await self.run_step(["resume"], {}, act)

    async def _sleep(self, request: web.Request) -> web.Response:
        level_text, mode = request.query.get("level", "1"), request.query.get("mode", "abort")
        args = {"level": level_text, "mode": mode}

        async def act(_: Faults) -> tuple[web.Response, Any]:
            try:
                await self.core.sleep(int(level_text), mode)
            except (InternalError, ValueError):
                return _internal(), {"error": "internal"}
            return self._body(None)

        return await self.run_step(["sleep", f"sleep:{level_text}"], args, act)

    async def _wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", [])
        keys = ["wake_up", *(f"wake_up:{t}" for t in tags)]

        async def act(_: Faults) -> tuple[web.Response, Any]:
            try:
                await self.core.wake_up(list(tags) or None)
            except InternalError:
                return _internal(), {"error": "internal"}
            return self._body(None)

        return await self.run_step(keys, {"tags": list(tags)}, act)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            return self._body({"is_sleeping": self.core.is_sleeping})

        return await self.run_step(["is_sleeping"], {}, act, log=False)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        running = request.query.get("reset_running_requests", "false").lower() in ("1", "true")

        async def act(_: Faults) -> tuple[web.Response, Any]:
            return self._body({"success": self.core.reset_prefix_cache(running)})

        return await self.run_step(["reset_prefix_cache"], {"reset_running_requests": running}, act)

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json(request)
        version = body.get("new_version") if isinstance(body, dict) else None

        async def act(_: Faults) -> tuple[web.Response, Any]:
            if not isinstance(version, str):
                return _error(400, "Field required: new_version"), {"error": "missing new_version"}
            self.core.weight_version = version
            return self._body({"success": True, "new_version": version})

        return await self.run_step(["update_weight_version"], {"new_version": version}, act)

    async def _weight_info(self, request: web.Request) -> web.Response:
        async def act(_: Faults) -> tuple[web.Response, Any]:
            return self._body({"weight_version": self.core.weight_version})

        return await self.run_step(["weight_info"], {}, act, log=False)

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        return await self._rpc_call(await _json(request))

    async def _rpc_call(self, body: Any) -> web.Response:
        """``/collective_rpc`` with its decoded JSON body (None: not JSON)."""
        if not isinstance(body, dict):
            return _error(400, "JSON decode error")
        method = body.get("method")
        if method is None:
            return _error(400, "Missing 'method' in request body")
        kwargs = body.get("kwargs") or {}
        timeout = body.get("timeout")
        keys = ["collective_rpc", str(method)]
        if method in TARGETED_RPCS and isinstance(kwargs, dict):
            keys.append(f"{method}:{kwargs.get('target')}")
        if method == "rolloutfleet_load" and isinstance(kwargs, dict) and kwargs.get("staged") is True:
            keys.append(STAGED_LOAD_KEY)  # a commit: its own fault key, and its own latency (Latencies.fixed)
        args = {"method": method, "args": body.get("args") or [], "kwargs": kwargs, "timeout": timeout}

        async def act(flags: Faults) -> tuple[web.Response, Any]:
            try:
                results = await self.core.rpc(
                    str(method),
                    kwargs if isinstance(kwargs, dict) else {},
                    corrupt=FaultKind.CORRUPT_LOAD in flags,
                    split=FaultKind.SPLIT_RANKS in flags,
                    rpc_timeout=float(timeout) if isinstance(timeout, int | float) else None,
                    fail_stage=FaultKind.FAIL_STAGE in flags,
                )
            except InternalError:
                return _internal(), {"error": "internal"}
            return self._body({"results": results})

        # State reads and pre-flights change nothing: keep them out of the log unless a fault fired.
        log = method not in ("rolloutfleet_state", "rolloutfleet_preflight")
        staged = isinstance(kwargs, dict) and kwargs.get("staged") is True
        note = {"staged": staged} if method == "rolloutfleet_load" else None  # a commit, or a load from files
        return await self.run_step(keys, args, act, log=log, note=note)

    async def _completions(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if not isinstance(body, dict):
            return _error(400, "JSON decode error")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = [b % self.spec.vocab_size for b in prompt.encode()]
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            return _error(400, "prompt must be a string or a list of token ids", "BadRequestError")
        max_tokens = int(body.get("max_tokens") or 16)
        args = {"prompt_len": len(prompt_ids), "max_tokens": max_tokens}

        async def act(_: Faults) -> tuple[web.Response, Any]:
            try:
                out = await self.core.complete(prompt_ids, max_tokens)
            except RejectedError as exc:
                return _error(503, str(exc), "ServiceUnavailableError"), {"error": "paused"}
            except InternalError as exc:
                return _error(500, str(exc), "InternalServerError"), {"error": str(exc)}
            choice: dict[str, Any] = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": out["finish_reason"],
                "stop_reason": None,
            }
            if body.get("return_token_ids"):
                choice["token_ids"] = out["tokens"]
            if body.get("logprobs") is not None:
                # vLLM's completion logprobs shape; tokens as ids (return_tokens_as_token_ids, no tokenizer).
                choice["logprobs"] = {
                    "text_offset": [0] * len(out["tokens"]),
                    "token_logprobs": out["logprobs"],
                    "tokens": [f"token_id:{t}" for t in out["tokens"]],
                    "top_logprobs": None,
                }
            if body.get("return_weight_versions"):
                choice["weight_versions"] = out["spans"]
            n = len(out["tokens"])
            payload = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.spec.served_model_name,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": n,
                    "total_tokens": n + len(prompt_ids),
                },
            }
            served = {
                "tokens": n,
                "finish_reason": out["finish_reason"],
                "t_start": out["t_start"],
                "runs": out["runs"],
                "weight_versions": out["spans"],
                "mixed": any(run["mixed"] for run in out["runs"]),
                "garbage": any(run["verifier_content"] in (None, "partial") for run in out["runs"]),
            }
            return web.json_response(payload), served

        return await self.run_step(["completions"], args, act)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.spec.served_model_name, "object": "model", "owned_by": "vllm"}]}
        )


def _admit_body(raw: bytes) -> tuple[int | None, str | None, str | None]:
    """``rolloutfleet_worker.admission.parse_admit``: (revision, instance, None) or (.., why it is refused)."""
    try:
        body = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError):
        return None, None, "the body is not JSON"
    if not isinstance(body, dict) or "revision" not in body:
        return None, None, 'the body must be a JSON object {"revision": <int or null>}'
    revision, instance = body["revision"], body.get("instance")
    if instance is not None and (not isinstance(instance, str) or not instance or len(instance) > 64):
        return None, None, "instance must be a non-empty string of at most 64 characters"
    if revision is None:
        return None, instance, None
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        return None, None, "revision must be a non-negative integer or null"
    return revision, instance, None


async def _not_found() -> web.Response:
    """What vLLM (FastAPI) answers for a route it does not have."""
    return web.json_response({"detail": "Not Found"}, status=404)


async def _json(request: web.Request) -> Any:
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        text = await request.text()
        return json.loads(text) if text else {}
    return None
