"""Many simulated engines in one asyncio process, plus the admin API that drives them.

The embedding API for tests, the sandbox and the pod follower::

    async with SimulatedFleet(token="t", admin_port=0) as fleet:
        engine = await fleet.add("127.1.0.5", 8000)          # listens on 127.1.0.5:8000
        fleet.add_fault(FaultRule(step="sleep", kind=FaultKind.CRASH), key=engine.key)
        ...
        await fleet.remove("127.1.0.5", 8000)

Engines listen on loopback only (127.0.0.0/8: Linux accepts any address of it without configuration),
so the local control plane's pod IPs (127.1.x.y) can be served directly; ``::1`` too, for a pod of an IPv6
cluster. The admin server listens on 127.0.0.1 (``admin_port``) and needs the same bearer token as the
engines' control routes:

    GET    /admin/engines                         [{key, url, running, spec}]
    POST   /admin/engines                         {"ip", "port"?, "spec"?, "faults"?} → add one engine
    DELETE /admin/engines/{key}                   remove (stop listening, forget)
    GET    /admin/engines/{key}/state             the engine's internal state summary
    GET    /admin/engines/{key}/log?since=SEQ     the call log (see below)
    GET    /admin/logs?since=SEQ                  {key: log} for every engine
    GET    /admin/engines/{key}/faults            armed faults with fired counts
    POST   /admin/engines/{key}/faults            one FaultRule dict or a list → arm
    DELETE /admin/engines/{key}/faults            disarm all
    POST   /admin/faults                          arm on every engine ({"engine": key} narrows it)
    POST   /admin/engines/{key}/crash?restart_after=S  /  POST /admin/engines/{key}/restart

Call-log entries (ordered, ``seq`` increasing, ``t`` = ``time.monotonic()`` of this host, comparable
across processes on Linux): ``{seq, t, step, key, args, status, result, state}`` for every state-changing
call (reads are logged only when a fault fires), ``{seq, t, step, key, args, fault}`` when a fault fires,
``listen``/``crash``/``restart`` events, and for each served completion ``result`` =
``{tokens, finish_reason, t_start, runs: [{verifier, draft, resident, verifier_digest, draft_digest,
tokens}], weight_versions, mixed, garbage}`` — the pair(s) that generated its tokens. Extension RPCs log
``rpc_started``/``rpc_finished`` inside their entry (``key`` = ``METHOD:target`` for loads, pre-flights and
``rolloutfleet_push_begin``, ``rolloutfleet_load:staged`` for a commit; a load's entry also says
``staged``: a commit from the stage, or a load from the files); weight-transfer routes log under their
route name (``update_weights``: ``args`` ``{names}``, ``result`` ``{bytes}`` or ``{error}``); ``state``
carries ``session`` (the extension's open push session), ``vllm_session`` (the target of vLLM's open
session, or None) and ``stage`` (the staging area's ``{revision, phase}``, or None). Staged updates
(``rolloutfleet.sim.staging``) log ``stage_started``/``stage_finished`` (with ``phase``, ``digests``,
``error``), ``stage_committed``/``stage_mismatch`` per commit and ``stage_released`` (``reason``:
replaced, unstaged, committed, staged_mismatch), each with its ``t``: a test can tell that every pod's
stage finished before the first pod paused.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from aiohttp import web

from rolloutfleet.sim.config import EngineSpec, FaultRule, Latencies, WeightsConfig
from rolloutfleet.sim.server import SimulatedEngine


class SimulatedFleet:
    """Owns the simulated engines of one process and the optional admin server."""

    def __init__(
        self,
        *,
        token: str | None = None,
        spec: EngineSpec | None = None,
        weights: WeightsConfig | None = None,
        latencies: Latencies | None = None,
        admin_host: str = "127.0.0.1",
        admin_port: int | None = None,
        engine_class: type[SimulatedEngine] = SimulatedEngine,
    ) -> None:
        self.token = token
        self.engine_class = engine_class  # what ``add`` starts (the soak's engines rotate tokens in place)
        self.spec = spec or EngineSpec()
        self.weights = weights or WeightsConfig()
        self.latencies = latencies or Latencies()
        self.engines: dict[str, SimulatedEngine] = {}
        self._admin_host, self._admin_port = admin_host, admin_port
        self._admin: web.AppRunner | None = None

    def __repr__(self) -> str:
        return f"SimulatedFleet(engines={len(self.engines)}, admin={self.admin_url})"

    async def __aenter__(self) -> SimulatedFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def admin_url(self) -> str | None:
        if self._admin is None:
            return None
        return f"http://{self._admin_host}:{self._admin_port}"

    async def start(self) -> None:
        if self._admin_port is not None and self._admin is None:
            app = web.Application(middlewares=[self._auth])
            self._admin_routes(app)
            runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.05)
            await runner.setup()
            await web.TCPSite(runner, self._admin_host, self._admin_port, reuse_address=True).start()
            self._admin_port = int(runner.addresses[0][1])
            self._admin = runner

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.engines.values()))
        self.engines.clear()
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None

    # --- engines -----------------------------------------------------------------------------------

    async def add(
        self,
        ip: str,
        port: int = 8000,
        *,
        spec: EngineSpec | None = None,
        faults: list[FaultRule] | tuple[FaultRule, ...] = (),
    ) -> SimulatedEngine:
        """Start one engine on ``ip:port`` (``port=0`` picks a free port). Idempotent per key."""
        if not (ip.startswith("127.") or ip == "::1"):
            raise ValueError(f"simulated engines listen on loopback (127.0.0.0/8, or ::1) only, not {ip}")
        existing = self.engines.get(f"{ip}:{port}")
        if existing is not None:
            return existing
        engine = self.engine_class(
            ip, port, spec=spec or self.spec, weights=self.weights, latencies=self.latencies, token=self.token
        )
        for rule in faults:
            engine.add_fault(rule)
        await engine.start()
        self.engines[engine.key] = engine
        return engine

    async def add_many(self, addresses: list[tuple[str, int]], *, spec: EngineSpec | None = None) -> None:
        await asyncio.gather(*(self.add(ip, port, spec=spec) for ip, port in addresses))

    async def remove(self, ip: str, port: int = 8000) -> None:
        engine = self.engines.pop(f"{ip}:{port}", None)
        if engine is not None:
            await engine.stop()

    def engine(self, ip: str, port: int = 8000) -> SimulatedEngine:
        return self.engines[f"{ip}:{port}"]

    def add_fault(self, rule: FaultRule, *, key: str | None = None) -> None:
        """Arm ``rule`` on the engine ``key`` (``ip:port``), or on every engine when None."""
        targets = [self.engines[key]] if key is not None else list(self.engines.values())
        for engine in targets:
            engine.add_fault(rule)

    def logs(self, since: int = 0) -> dict[str, list[dict[str, Any]]]:
        return {key: e.log.since(since) for key, e in self.engines.items()}

    # --- admin HTTP --------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(presented.encode(), self.token.encode()):
                return web.json_response({"error": "Unauthorized"}, status=401, headers={"WWW-Authenticate": "Bearer"})
        resp: web.StreamResponse = await handler(request)
        return resp

    def _admin_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/admin/engines", self._list)
        r.add_post("/admin/engines", self._add)
        r.add_delete("/admin/engines/{key}", self._remove)
        r.add_get("/admin/engines/{key}/state", self._state)
        r.add_get("/admin/engines/{key}/log", self._log)
        r.add_get("/admin/logs", self._logs)
        r.add_get("/admin/engines/{key}/faults", self._faults)
        r.add_post("/admin/engines/{key}/faults", self._arm)
        r.add_delete("/admin/engines/{key}/faults", self._disarm)
        r.add_post("/admin/faults", self._arm_all)
        r.add_post("/admin/engines/{key}/crash", self._crash)
        r.add_post("/admin/engines/{key}/restart", self._restart)

    def _get(self, request: web.Request) -> SimulatedEngine:
        key = request.match_info["key"]
        engine = self.engines.get(key)
        if engine is None:
            raise web.HTTPNotFound(text=f"no simulated engine {key}")
        return engine

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response(
            [{"key": k, "url": e.url, "running": e.running, "spec": _spec(e.spec)} for k, e in self.engines.items()]
        )

    async def _add(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            spec = EngineSpec.from_dict({**_spec(self.spec), **(body.get("spec") or {})})
            faults = [FaultRule.from_dict(f) for f in body.get("faults") or []]
            engine = await self.add(str(body["ip"]), int(body.get("port", 8000)), spec=spec, faults=faults)
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except OSError as exc:
            return web.json_response({"error": f"cannot listen: {exc}"}, status=409)
        return web.json_response({"key": engine.key, "url": engine.url}, status=201)

    async def _remove(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        await self.remove(engine.ip, engine.port)
        return web.json_response({"removed": engine.key})

    async def _state(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        return web.json_response({"running": engine.running, **engine.core.summary()})

    async def _log(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        return web.json_response(engine.log.since(int(request.query.get("since", "0"))))

    async def _logs(self, request: web.Request) -> web.Response:
        return web.json_response(self.logs(int(request.query.get("since", "0"))))

    async def _faults(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        return web.json_response([{**f.rule.to_dict(), "fired": f.fired, "seen": f.seen} for f in engine.faults])

    async def _arm(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        try:
            rules = _rules(await request.json())
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        for rule in rules:
            engine.add_fault(rule)
        return web.json_response({"armed": len(rules)})

    async def _disarm(self, request: web.Request) -> web.Response:
        self._get(request).clear_faults()
        return web.json_response({"armed": 0})

    async def _arm_all(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            rules = _rules(body)
            items = body if isinstance(body, list) else [body]
            for rule, item in zip(rules, items, strict=True):
                self.add_fault(rule, key=item.get("engine"))
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"armed": len(rules)})

    async def _crash(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        after = request.query.get("restart_after")
        await engine.crash(float(after) if after else None)
        return web.json_response({"crashed": engine.key})

    async def _restart(self, request: web.Request) -> web.Response:
        engine = self._get(request)
        await engine.restart()
        return web.json_response({"restarted": engine.key})


def _rules(body: Any) -> list[FaultRule]:
    items = body if isinstance(body, list) else [body]
    return [FaultRule.from_dict(item) for item in items]


def _spec(spec: EngineSpec) -> dict[str, Any]:
    import dataclasses

    out = dataclasses.asdict(spec)
    out["shared_tensors"] = list(spec.shared_tensors)
    return out
