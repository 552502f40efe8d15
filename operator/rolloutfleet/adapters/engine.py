"""Async HTTP client for one vLLM engine (DESIGN.md §4), and a pool sharing one connection pool.

Called by ``rolloutfleet.reconcile`` (the per-pod transaction of issue 6), the sandbox and the benchmarks.
It owns the engine's wire contract: vLLM's dev routes (``VLLM_SERVER_DEV_MODE=1``) plus our worker
extension's RPCs through ``POST /collective_rpc``. Every control route carries the bearer token that the
image's auth middleware requires; ``/health``, ``/metrics`` and ``/v1/*`` are open and get no token.

Retries: only idempotent calls (GETs and the ``rolloutfleet_state`` RPC) are retried, with exponential
backoff and full jitter, on unreachable/timeout/502/503/504. A state-changing call (pause, sleep, load...)
is sent once: after a lost answer only a fresh ``observe()`` can tell whether it happened, which is what
the level-based planner does anyway. ``reset_prefix_cache`` is re-sent while vLLM answers
``{"success": false}`` (blocks still held), which is safe because the reset is idempotent by nature.

A ``LatencyHook`` receives (step, seconds, outcome) per HTTP attempt so the operator can export
Prometheus histograms without this module importing prometheus. The token is never logged or put in
an error message; ``repr`` redacts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

import aiohttp

from rolloutfleet.adapters import engine_wire as wire
from rolloutfleet.adapters.engine_wire import (
    EngineHTTPError,
    EngineInconsistent,
    EngineProtocolError,
    EngineRPCError,
    EngineTimeout,
    EngineUnreachable,
    state_from_wire,
)
from rolloutfleet.api import engine as api

# Routes the image's auth middleware leaves open: they never get the token (least exposure).
OPEN_EXACT = frozenset({"/health", "/ping", "/metrics", "/version", "/v1"})
OPEN_PREFIXES = ("/v1/", "/metrics/")
RETRYABLE_STATUS = frozenset({502, 503, 504})


class LatencyHook(Protocol):
    """Called once per HTTP attempt. ``outcome``: ok | http_error | timeout | unreachable."""

    def __call__(self, step: str, seconds: float, outcome: str) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter for idempotent calls; ``attempts`` counts the first try."""

    attempts: int = 3
    base_delay: float = 0.1
    max_delay: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2**attempt)))


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTimeouts:
    """Per-call HTTP timeouts in seconds. A load moves a whole checkpoint, so it gets its own budget."""

    default: float = 10.0
    pause: float = 120.0  # mode=wait drains in-flight requests
    sleep: float = 120.0
    wake_up: float = 120.0
    load: float = 900.0
    reset_prefix_cache: float = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class ResetPolicy:
    """How long to keep re-sending ``/reset_prefix_cache`` while it answers ``success: false``."""

    attempts: int = 20
    base_delay: float = 0.05
    max_delay: float = 1.0


class EngineClient:
    """One engine at ``base_url`` (``http://10.1.2.3:8000``), sharing the pool's ``aiohttp`` session."""

    def __init__(
        self,
        base_url: str,
        *,
        session: aiohttp.ClientSession,
        token: str | None = None,
        timeouts: EngineTimeouts | None = None,
        retry: RetryPolicy | None = None,
        reset: ResetPolicy | None = None,
        on_latency: LatencyHook | None = None,
        rng: random.Random | None = None,
        unversioned: dict[str, float] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Shared by the pool's clients: engines whose /weight_info answered 404, and when (monotonic).
        self._unversioned = unversioned if unversioned is not None else {}
        self._session = session
        self._token = token
        self.timeouts = timeouts or EngineTimeouts()
        self.retry = retry or RetryPolicy()
        self.reset = reset or ResetPolicy()
        self._on_latency = on_latency
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r}, token={'<redacted>' if self._token else None})"

    # --- vLLM dev routes -------------------------------------------------------------------------

    async def pause(self, mode: wire.PauseMode = "keep", clear_cache: bool = False) -> None:
        """``POST /pause``. ``keep`` freezes in-flight requests until resume; ``clear_cache=False`` keeps KV."""
        await self._call(
            "POST",
            "/pause",
            step="pause",
            params=[("mode", mode), ("clear_cache", _bool(clear_cache))],
            budget=self.timeouts.pause,
        )

    async def resume(self) -> None:
        await self._call("POST", "/resume", step="resume")

    async def is_paused(self) -> bool:
        body = await self._call("GET", "/is_paused", step="is_paused", idempotent=True)
        return bool(_field(body, "is_paused", bool, self.base_url, "is_paused"))

    async def sleep(self, level: int, mode: wire.PauseMode | None = None) -> None:
        """``POST /sleep?level=N``. vLLM 0.26 and 0.33 both answer an empty 200. ``mode`` is passed through
        (vLLM defaults to ``abort`` for the requests it finds in flight)."""
        params: list[tuple[str, str]] = [("level", str(level))]
        if mode is not None:
            params.append(("mode", mode))
        await self._call("POST", "/sleep", step="sleep", params=params, budget=self.timeouts.sleep)

    async def wake_up(self, tags: Sequence[wire.WakeTag] | None = None) -> None:
        """``POST /wake_up?tags=...``; no tags wakes everything."""
        params = [("tags", t) for t in tags] if tags else None
        step = "wake_up:" + ",".join(tags) if tags else "wake_up"
        await self._call("POST", "/wake_up", step=step, params=params, budget=self.timeouts.wake_up)

    async def is_sleeping(self) -> bool:
        body = await self._call("GET", "/is_sleeping", step="is_sleeping", idempotent=True)
        return bool(_field(body, "is_sleeping", bool, self.base_url, "is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache, re-sending while vLLM answers ``success: false`` (blocks held).

        Returns True once reset (0.26's empty 200 counts as success), False when still refused after
        ``ResetPolicy.attempts`` tries: the caller decides whether that fails the step.
        """
        for attempt in range(self.reset.attempts):
            body = await self._call(
                "POST", "/reset_prefix_cache", step="reset_prefix_cache", budget=self.timeouts.reset_prefix_cache
            )
            if not isinstance(body, dict) or body.get("success", True) is not False:
                return True
            if attempt + 1 < self.reset.attempts:
                await asyncio.sleep(min(self.reset.max_delay, self.reset.base_delay * (2**attempt)))
        return False

    async def update_weight_version(self, version: str) -> None:
        await self._call("POST", "/update_weight_version", step="update_weight_version", json={"new_version": version})

    async def weight_info(self) -> str | None:
        body = await self._call("GET", "/weight_info", step="weight_info", idempotent=True)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineProtocolError(f"unexpected /weight_info body: {body!r}", url=self.base_url, step="weight_info")
        value = body["weight_version"]
        return None if value is None else str(value)

    async def greedy_logprobs(self, prompt_token_ids: Sequence[int], max_tokens: int) -> list[float]:
        """Processed logprobs of the greedy continuation of ``prompt_token_ids`` (the parity probe).

        A generation request (``/v1/completions``, open route): temperature 0, one logprob per token, tokens
        as ids so no tokenizer is needed.
        """
        body = await self._call(
            "POST",
            "/v1/completions",
            step="parity_probe",
            json={
                "prompt": list(prompt_token_ids),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
            idempotent=True,
        )
        try:
            values = body["choices"][0]["logprobs"]["token_logprobs"]
            return [float(v) for v in values]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineProtocolError(
                f"unexpected completion body for the parity probe: {str(body)[:200]}",
                url=self.base_url,
                step="parity_probe",
            ) from exc

    async def health(self) -> None:
        """``GET /health``: returns when 200, raises otherwise. It does not reflect sleep or pause."""
        await self._call("GET", "/health", step="health", idempotent=True)

    async def metrics(self) -> str:
        """The Prometheus text of ``GET /metrics`` (``vllm:`` metrics, spec-decode counters included)."""
        body = await self._call("GET", "/metrics", step="metrics", idempotent=True)
        return body if isinstance(body, str) else json.dumps(body)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's RPC field, not an asyncio deadline
        *,
        idempotent: bool = False,
        http_timeout: float | None = None,
    ) -> list[Any]:
        """``POST /collective_rpc``: one result per worker. ``timeout`` is vLLM's own RPC timeout."""
        payload: wire.CollectiveRPCRequest = {"method": method, "args": list(args), "kwargs": kwargs or {}}
        if timeout is not None:
            payload["timeout"] = timeout
        body = await self._call(
            "POST",
            "/collective_rpc",
            step=method,
            json=payload,
            idempotent=idempotent,
            budget=http_timeout or (timeout + 5.0 if timeout else self.timeouts.default),
        )
        if body is None or body == "":
            return []
        if not isinstance(body, dict) or not isinstance(body.get("results"), list):
            raise EngineProtocolError(f"unexpected /collective_rpc body: {body!r}", url=self.base_url, step=method)
        return cast(list[Any], body["results"])

    # --- our worker extension -------------------------------------------------------------------

    async def load(self, target: api.Target | str, path: str, revision: int) -> api.LoadResult:
        """Load ``target`` in place from the safetensors directory ``path``; the draft only after the verifier."""
        step = f"rolloutfleet_load:{target}"
        results = await self.collective_rpc(
            "rolloutfleet_load",
            kwargs={"target": str(target), "path": path, "revision": revision},
            http_timeout=self.timeouts.load,
        )
        return self._load_result(results, step)

    async def restore_draft(self, path: str) -> api.LoadResult:
        """Restore a ``frozen`` draft after a level-2 sleep (its revision stays None)."""
        results = await self.collective_rpc(
            "rolloutfleet_restore_draft", kwargs={"path": path}, http_timeout=self.timeouts.load
        )
        return self._load_result(results, "rolloutfleet_restore_draft")

    async def extension_state(self) -> list[wire.StateResult]:
        """Every rank's ``rolloutfleet_state()``, checked ok and agreeing. Idempotent: retried."""
        results = await self.collective_rpc("rolloutfleet_state", idempotent=True)
        checked = self._agreeing(
            results,
            "rolloutfleet_state",
            lambda r: (
                r.get("resident"),
                _pick(r.get("verifier"), "revision", "digest"),
                _pick(r.get("draft"), "revision", "digest"),
            ),
        )
        return cast(list[wire.StateResult], checked)

    async def observe(self) -> api.EngineState:
        """One snapshot: ``/is_paused``, ``/is_sleeping``, ``/weight_info`` and the extension state, at once.

        An engine that cannot be reached (or times out) yields ``EngineState.unreachable``; HTTP errors,
        extension errors and disagreeing ranks raise, since they need a human or a different action.
        """
        try:
            paused, sleeping, version, states = await asyncio.gather(
                self.is_paused(), self.is_sleeping(), self._weight_info_or_absent(), self.extension_state()
            )
        except (EngineUnreachable, EngineTimeout) as exc:
            self._unversioned.pop(self.base_url, None)  # it may come back as another vLLM release
            return api.EngineState.unreachable(str(exc))
        versioned = version is not _NO_VERSIONS
        state = state_from_wire(
            paused=paused, sleeping=sleeping, weight_version=version if versioned else None, states=states
        )
        return dataclasses.replace(state, versioned=versioned)

    async def _weight_info_or_absent(self) -> Any:
        # vLLM 0.26 has no weight-version routes (404, measured on the H200): feature-detect, do not fail,
        # and remember it for a while so each observation of such an engine costs one read fewer (and its
        # log one 404 line fewer). An engine that goes unreachable is asked again when it is back.
        noted = self._unversioned.get(self.base_url)
        if noted is not None and time.monotonic() - noted < VERSION_ROUTES_RECHECK_SECONDS:
            return _NO_VERSIONS
        try:
            info = await self.weight_info()
        except EngineHTTPError as exc:
            if exc.status == 404:
                self._unversioned[self.base_url] = time.monotonic()
                return _NO_VERSIONS
            raise
        self._unversioned.pop(self.base_url, None)
        return info

    # --- plumbing --------------------------------------------------------------------------------

    def _load_result(self, results: list[Any], step: str) -> api.LoadResult:
        checked = self._agreeing(results, step, lambda r: (r.get("target"), r.get("revision"), r.get("digest")))
        first = cast(wire.LoadResultWire, checked[0])
        try:
            return api.LoadResult(
                target=api.Target(first["target"]),
                revision=first["revision"],
                path=str(first["path"]),
                digest=str(first["digest"]),
                bytes=int(first["bytes"]),
                seconds=float(first["seconds"]),
                tensors=int(first["tensors"]),
                skipped=tuple(first.get("skipped") or ()),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineProtocolError(f"malformed load result: {first!r}", url=self.base_url, step=step) from exc

    def _agreeing(self, results: list[Any], step: str, key: Any) -> list[dict[str, Any]]:
        if not results:
            raise EngineProtocolError("no worker answered", url=self.base_url, step=step)
        for rank, result in enumerate(results):
            if not isinstance(result, dict):
                raise EngineProtocolError(f"rank {rank} answered {result!r}", url=self.base_url, step=step)
            if result.get("ok") is not True:
                err = result.get("error") or {}
                raise EngineRPCError(
                    str(err.get("code", "unknown")),
                    str(err.get("message", "")),
                    rank=rank,
                    url=self.base_url,
                    step=step,
                )
        keys = {json.dumps(key(r), sort_keys=True, default=str) for r in results}
        if len(keys) > 1:
            raise EngineInconsistent(
                f"{len(results)} ranks disagree: {sorted(keys)}", results=results, url=self.base_url, step=step
            )
        return cast(list[dict[str, Any]], results)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        step: str,
        params: Sequence[tuple[str, str]] | None = None,
        json: Any = None,
        budget: float | None = None,
        idempotent: bool = False,
    ) -> Any:
        attempts = max(1, self.retry.attempts) if idempotent else 1
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                return await self._once(method, path, step=step, params=params, json_body=json, budget=budget)
            except (EngineUnreachable, EngineTimeout) as exc:
                last = exc
            except EngineHTTPError as exc:
                if exc.status not in RETRYABLE_STATUS:
                    raise
                last = exc
            if attempt + 1 < attempts:
                await asyncio.sleep(self.retry.delay(attempt, self._rng))
        assert last is not None
        raise last

    async def _once(
        self,
        method: str,
        path: str,
        *,
        step: str,
        params: Sequence[tuple[str, str]] | None,
        json_body: Any,
        budget: float | None,
    ) -> Any:
        headers = {}
        if self._token and not (path in OPEN_EXACT or path.startswith(OPEN_PREFIXES)):
            headers["Authorization"] = f"Bearer {self._token}"
        url = self.base_url + path
        outcome = "ok"
        started = time.perf_counter()
        try:
            async with self._session.request(
                method,
                url,
                params=list(params) if params else None,
                json=json_body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=budget or self.timeouts.default),
            ) as resp:
                text = await resp.text()
                body = _decode(text, resp.content_type)
                if not 200 <= resp.status < 300:
                    outcome = "http_error"
                    raise EngineHTTPError(resp.status, body, url=self.base_url, step=step)
                return body
        except TimeoutError as exc:  # before ClientConnectionError: ServerTimeoutError is both
            outcome = "timeout"
            raise EngineTimeout(
                f"{step} timed out after {budget or self.timeouts.default}s", url=url, step=step
            ) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            outcome = "unreachable"
            raise EngineUnreachable(f"{step}: {type(exc).__name__}: {exc}", url=url, step=step) from exc
        finally:
            if self._on_latency is not None:
                self._on_latency(step, time.perf_counter() - started, outcome)


_NO_VERSIONS = object()  # sentinel: the engine has no weight-version routes
VERSION_ROUTES_RECHECK_SECONDS = 300.0  # how long a 404 on /weight_info is believed without asking again


class EnginePool:
    """Clients for many engines over one ``aiohttp.ClientSession`` (one TCP connector, bounded).

    ``limit`` bounds open connections across all engines (1,000 pods x 1 connection each is fine on
    Linux; the default leaves headroom for the operator's other sockets); ``limit_per_host`` keeps one
    engine from hogging the pool when the planner fans out reads. Use as ``async with EnginePool(...)``.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        limit: int = 512,
        limit_per_host: int = 4,
        timeouts: EngineTimeouts | None = None,
        retry: RetryPolicy | None = None,
        reset: ResetPolicy | None = None,
        on_latency: LatencyHook | None = None,
    ) -> None:
        self._token = token
        self._limit = limit
        self._limit_per_host = limit_per_host
        self.timeouts = timeouts or EngineTimeouts()
        self.retry = retry or RetryPolicy()
        self.reset = reset or ResetPolicy()
        self._on_latency = on_latency
        self._session: aiohttp.ClientSession | None = None
        self._rng = random.Random()  # noqa: S311 - jitter only
        self._unversioned: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"EnginePool(limit={self._limit}, token={'<redacted>' if self._token else None})"

    async def __aenter__(self) -> EnginePool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=self._limit_per_host)
            # No proxies from the environment: engines are dialled directly on their pod IPs.
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def client(self, base_url: str) -> EngineClient:
        if self._session is None:
            raise RuntimeError("EnginePool is not started: use `async with EnginePool(...)`")
        return EngineClient(
            base_url,
            session=self._session,
            token=self._token,
            timeouts=self.timeouts,
            retry=self.retry,
            reset=self.reset,
            on_latency=self._on_latency,
            rng=self._rng,
            unversioned=self._unversioned,
        )

    def for_address(self, ip: str, port: int = 8000) -> EngineClient:
        return self.client(f"http://{ip}:{port}")


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _decode(text: str, content_type: str) -> Any:
    if not text:
        return None
    if content_type == "application/json" or text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _field(body: Any, name: str, kind: type, url: str, step: str) -> Any:
    if not isinstance(body, dict) or not isinstance(body.get(name), kind):
        raise EngineProtocolError(f"unexpected body: {body!r}", url=url, step=step)
    return body[name]


def _pick(obj: Any, *names: str) -> Any:
    return None if not isinstance(obj, dict) else [obj.get(n) for n in names]
