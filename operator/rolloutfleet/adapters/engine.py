"""Async HTTP client for one vLLM engine (DESIGN.md §4), and a pool sharing one connection pool.

Called by ``rolloutfleet.reconcile`` (the per-pod transaction of issue 6), the sandbox and the benchmarks.
It owns the engine's wire contract: vLLM's dev routes (``VLLM_SERVER_DEV_MODE=1``) plus our worker
extension's RPCs through ``POST /collective_rpc``. Every control route carries the bearer token that the
image's auth middleware requires; ``/health``, ``/metrics`` and ``/v1/*`` are open and get no token.

Deadlines: every call takes ``deadline`` (seconds) from its caller, and that is exactly how long it may
take, retries included; ``reconcile.executor`` passes the fleet's ``updateStrategy.timeouts`` for each
step. Without one a call falls back to ``EngineTimeouts`` (the sandbox, the benchmarks). Only the TCP
connect has a bound of its own (``EngineTimeouts.connect``): a pod IP that never answers a SYN is not a
load that is still running. Loads also send vLLM's own RPC ``timeout``, a little below the HTTP deadline,
so the engine gives up and answers before the client does.

Retries: only idempotent calls (GETs, the ``rolloutfleet_state`` RPC, the pre-flight, the parity probe,
and staging's ``rolloutfleet_stage``/``rolloutfleet_unstage``, which an engine answers alike when re-sent)
are retried, with exponential backoff and full jitter, on unreachable/502/503/504 while their deadline lasts. A
state-changing call (pause, sleep, load...) is sent once: after a lost answer only a fresh ``observe()``
can tell whether it happened, which is what the level-based planner does anyway. A load whose outcome is
unknown (its HTTP call timed out, was cancelled, lost its connection or got a 5xx) blocks the next load to
the same engine (``LoadOutcomeUnknown``) until a state read started after it succeeded: vLLM runs RPCs one
at a time, so a second load would queue behind the first. ``reset_prefix_cache`` is re-sent while vLLM
answers ``{"success": false}`` (blocks still held), which is safe because the reset is idempotent.

``observe()`` reports an engine it cannot observe as ``EngineState.failed(fault, error)``, with the fault
told apart (``engine_wire.fault_of``); only programming errors propagate.

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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol, TypeVar, cast

import msgspec

from rolloutfleet.adapters import engine_wire as wire
from rolloutfleet.adapters import http11
from rolloutfleet.adapters.engine_policy import (
    RPC_TIMEOUT_MARGIN_SECONDS,
    EngineTimeouts,
    LoadLedger,
    ResetPolicy,
    RetryPolicy,
    rpc_timeout_below,
)
from rolloutfleet.adapters.engine_wire import (
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnreachable,
    LoadOutcomeUnknown,
    fault_of,
    state_from_wire,
)
from rolloutfleet.api import common
from rolloutfleet.api import engine as api

__all__ = [
    "EngineClient",
    "EnginePool",
    "EngineTimeouts",
    "LatencyHook",
    "LoadLedger",
    "ResetPolicy",
    "RetryPolicy",
    "rpc_timeout_below",
]

# Routes the image's auth middleware leaves open: they never get the token (least exposure).
OPEN_EXACT = frozenset({"/health", "/ping", "/metrics", "/version", "/v1", "/rolloutfleet/ready"})
READY_PATH, ADMIT_PATH, WITHDRAW_PATH = "/rolloutfleet/ready", "/rolloutfleet/admit", "/rolloutfleet/withdraw"
OBSERVE_PATH = "/rolloutfleet/observe"  # the whole observation in one request (rolloutfleet_worker.observation)
SEQUENCE_PATH = "/rolloutfleet/sequence"  # a step's calls in one request (rolloutfleet_worker.sequence)
OPEN_PREFIXES = ("/v1/", "/metrics/")
RETRYABLE_STATUS = frozenset({502, 503, 504})
T = TypeVar("T")


class LatencyHook(Protocol):
    """Called once per HTTP attempt. ``outcome``: ok | http_error | timeout | unreachable."""

    def __call__(self, step: str, seconds: float, outcome: str) -> None: ...


class EngineClient:
    """One engine at ``base_url`` (``http://10.1.2.3:8000``), over the pool's connections (``http11``)."""

    def __init__(
        self,
        base_url: str,
        *,
        http: http11.HTTP11,
        token: str | None = None,
        timeouts: EngineTimeouts | None = None,
        retry: RetryPolicy | None = None,
        reset: ResetPolicy | None = None,
        on_latency: LatencyHook | None = None,
        rng: random.Random | None = None,
        unversioned: dict[str, float] | None = None,
        apart: dict[str, float] | None = None,
        no_sequence: dict[str, float] | None = None,
        read_apart: dict[str, float] | None = None,
        resume_apart: dict[str, float] | None = None,
        loads: LoadLedger | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Shared by the pool's clients: engines whose /weight_info answered 404, and when (monotonic).
        self._unversioned = unversioned if unversioned is not None else {}
        # Shared likewise: engines whose image has no /rolloutfleet/observe (read with five requests).
        self._apart = apart if apart is not None else {}
        # Shared likewise: engines whose image has no /rolloutfleet/sequence (a step's calls go apart).
        self._no_sequence = no_sequence if no_sequence is not None else {}
        # Shared likewise: engines whose sequences refuse an observation among their calls (an image from before
        # it was allowed: 400), read in a request of its own.
        self._read_apart = read_apart if read_apart is not None else {}
        # Shared likewise: engines whose sequences compare an RPC call's expectation with its whole body (an image
        # from before a state check could precede a resume in the loads' request): resumed in a request of its own.
        self._resume_apart = resume_apart if resume_apart is not None else {}
        # Shared by the pool's clients (each reconcile pass makes new ones): loads of unknown outcome.
        self._loads = loads if loads is not None else LoadLedger()
        self._http = http
        self._origin = http.origin(self.base_url)
        self._credentials = credentials if credentials is not None else Credentials(token)
        self.timeouts = timeouts or EngineTimeouts()
        self.retry = retry or RetryPolicy()
        self.reset = reset or ResetPolicy()
        self._on_latency = on_latency
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r}, token={'<redacted>' if self._credentials.token else None})"

    # --- vLLM dev routes -------------------------------------------------------------------------

    async def pause(
        self, mode: wire.PauseMode = "keep", clear_cache: bool = False, *, deadline: float | None = None
    ) -> None:
        """``POST /pause``. ``keep`` freezes in-flight requests until resume; ``clear_cache=False`` keeps KV.

        vLLM's own default is ``clear_cache=true``, which in keep mode preempts the frozen requests.
        """
        await self._call(
            "POST",
            "/pause",
            step="pause",
            params=[("mode", mode), ("clear_cache", _bool(clear_cache))],
            deadline=_or(deadline, self.timeouts.pause),
        )

    async def resume(self, *, deadline: float | None = None) -> None:
        await self._call("POST", "/resume", step="resume", deadline=deadline)

    async def is_paused(self, *, deadline: float | None = None) -> bool:
        body = await self._call("GET", "/is_paused", step="is_paused", idempotent=True, deadline=deadline)
        return bool(_field(body, "is_paused", bool, self.base_url, "is_paused"))

    async def sleep(self, level: int, mode: wire.PauseMode | None = None, *, deadline: float | None = None) -> None:
        """``POST /sleep?level=N``. vLLM 0.26 and 0.33 both answer an empty 200. ``mode`` is passed through
        (vLLM defaults to ``abort`` for the requests it finds in flight)."""
        params: list[tuple[str, str]] = [("level", str(level))]
        if mode is not None:
            params.append(("mode", mode))
        await self._call("POST", "/sleep", step="sleep", params=params, deadline=_or(deadline, self.timeouts.sleep))

    async def wake_up(self, tags: Sequence[wire.WakeTag] | None = None, *, deadline: float | None = None) -> None:
        """``POST /wake_up?tags=...``; no tags wakes everything."""
        params = [("tags", t) for t in tags] if tags else None
        step = "wake_up:" + ",".join(tags) if tags else "wake_up"
        await self._call("POST", "/wake_up", step=step, params=params, deadline=_or(deadline, self.timeouts.wake_up))

    async def is_sleeping(self, *, deadline: float | None = None) -> bool:
        body = await self._call("GET", "/is_sleeping", step="is_sleeping", idempotent=True, deadline=deadline)
        return bool(_field(body, "is_sleeping", bool, self.base_url, "is_sleeping"))

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False, deadline: float | None = None) -> bool:
        """``POST /reset_prefix_cache``: True once vLLM answered ``{"success": true}``.

        vLLM 0.26 and 0.33 refuse a plain reset (``success: false``) while any KV block is held, e.g. by
        requests frozen by ``pause(keep)``; it is re-sent per ``ResetPolicy`` within ``deadline`` and False
        is returned if it never went through. ``reset_running_requests=True`` first preempts the running
        requests (vLLM frees their blocks and recomputes them when they are scheduled again), so only a
        failure of the reset itself remains (vLLM answers 500). Any other body cannot confirm a reset:
        ``EngineProtocolError``.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + _or(deadline, self.timeouts.reset_prefix_cache)
        params = [("reset_running_requests", "true")] if reset_running_requests else None
        for attempt in range(max(1, self.reset.attempts)):
            body = await self._call(
                "POST",
                "/reset_prefix_cache",
                step="reset_prefix_cache",
                params=params,
                deadline=max(0.0, end - loop.time()),
            )
            if not isinstance(body, dict) or not isinstance(body.get("success"), bool):
                raise EngineProtocolError(
                    f"unexpected /reset_prefix_cache body: {str(body)[:200]}", url=self.base_url, step="reset"
                )
            if body["success"]:
                return True
            pause = min(self.reset.max_delay, self.reset.base_delay * (2**attempt))
            if attempt + 1 >= self.reset.attempts or loop.time() + pause >= end:
                break
            await asyncio.sleep(pause)
        return False

    async def update_weight_version(self, version: str, *, deadline: float | None = None) -> None:
        await self._call(
            "POST",
            "/update_weight_version",
            step="update_weight_version",
            json={"new_version": version},
            deadline=deadline,
        )

    async def weight_info(self, *, deadline: float | None = None) -> str | None:
        body = await self._call("GET", "/weight_info", step="weight_info", idempotent=True, deadline=deadline)
        return _weight_version(body, self.base_url)

    async def greedy_logprobs(
        self, prompt_token_ids: Sequence[int], max_tokens: int, *, deadline: float | None = None
    ) -> list[float]:
        """Processed logprobs of the greedy continuation of ``prompt_token_ids`` (the parity probe).

        A generation request (``/v1/completions``, open route): temperature 0, one logprob per token, tokens
        as ids so no tokenizer is needed. ``deadline`` covers the generation and its retries (the operator
        passes the fleet's ``verifySeconds``).
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
            deadline=deadline,
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

    async def health(self, *, deadline: float | None = None) -> None:
        """``GET /health``: returns when 200, raises otherwise. It does not reflect sleep or pause."""
        await self._call("GET", "/health", step="health", idempotent=True, deadline=deadline)

    async def metrics(self, *, deadline: float | None = None) -> str:
        """The Prometheus text of ``GET /metrics`` (``vllm:`` metrics, spec-decode counters included)."""
        body = await self._call("GET", "/metrics", step="metrics", idempotent=True, deadline=deadline)
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
        """``POST /collective_rpc``: one result per worker. ``timeout`` is vLLM's own RPC timeout (vLLM stops
        waiting for its workers then, which keep running); ``http_timeout`` is this call's deadline."""
        payload = rpc_call(method, kwargs or {}, step=method, timeout=timeout, args=args).json
        body = await self._call(
            "POST",
            "/collective_rpc",
            step=method,
            json=payload,
            idempotent=idempotent,
            deadline=http_timeout or (timeout + RPC_TIMEOUT_MARGIN_SECONDS if timeout else None),
        )
        return _rpc_results(body, self.base_url, method)

    # --- our worker extension -------------------------------------------------------------------

    async def load(
        self,
        target: api.Target | str,
        path: str,
        revision: int,
        *,
        staged: bool = False,
        deadline: float | None = None,
    ) -> api.LoadResult:
        """Load ``target`` in place from the safetensors directory ``path``; the draft only after the verifier.

        ``staged=True`` commits the engine's stage instead of reading the files (docs/staging.md): refused
        with ``not_staged`` (nothing changed) unless the stage is ``staged`` for ``revision`` with ``path``
        for ``target``, and ``staged_mismatch`` when what reached the GPU does not hash to the staged digest.
        The argument is sent only when true, so an image without staging still takes every plain load.
        Raises ``LoadOutcomeUnknown`` without sending anything while an earlier load's outcome is unknown
        (a commit changes the weights like any load, so it is guarded alike).
        """
        step = f"rolloutfleet_load:{target}"
        kwargs: dict[str, Any] = {"target": str(target), "path": path, "revision": revision}
        if staged:
            kwargs["staged"] = True
        results = await self._load_rpc("rolloutfleet_load", kwargs, step, deadline)
        return wire.load_result_from_wire(results, url=self.base_url, step=step)

    async def stage(
        self,
        revision: int,
        verifier_path: str,
        draft_path: str | None = None,
        limit_bytes: int | None = None,
        *,
        deadline: float | None = None,
    ) -> api.StageState:
        """Start staging ``revision``'s checkpoints into the engine's pinned host memory (docs/staging.md).

        Answers at once with the stage's state, usually ``staging``: the engine reads and hashes in the
        background while it serves, and ``observe().staged`` reports the progress. ``failed`` (a corrupt
        header, code ``io``) and ``over_budget`` (more than ``limit_bytes``: nothing held, loads read the
        files) can come back at once. Argument errors raise ``EngineRPCError`` with the load's codes
        (``invalid_revision``, ``invalid_path``, ``no_draft``). The same revision and paths as the stage
        held answer that stage unchanged, so this is idempotent and retried like a state read; anything
        else replaces the stage. Every rank must hold the same stage (``EngineInconsistent`` otherwise).
        """
        step = "rolloutfleet_stage"
        kwargs = {
            "revision": revision,
            "verifier_path": verifier_path,
            "draft_path": draft_path,
            "limit_bytes": limit_bytes,
        }
        results = await self.collective_rpc(step, kwargs=kwargs, idempotent=True, http_timeout=deadline)
        return wire.stage_result_from_wire(results, url=self.base_url, step=step)

    async def unstage(self, *, deadline: float | None = None) -> int:
        """Stop the engine's stage readers and release its staging area; the bytes released (all ranks).

        Idempotent (a second call releases nothing) and retried like a state read. For a fleet that turned
        staging off, and for a stage of a revision that is no longer the goal.
        """
        step = "rolloutfleet_unstage"
        results = await self.collective_rpc(step, idempotent=True, http_timeout=deadline)
        return wire.released_bytes_from_wire(results, url=self.base_url, step=step)

    async def restore_draft(self, path: str, *, deadline: float | None = None) -> api.LoadResult:
        """Restore a ``frozen`` draft after a level-2 sleep (its revision stays None). Guarded like ``load``."""
        step = "rolloutfleet_restore_draft"
        results = await self._load_rpc(step, {"path": path}, step, deadline)
        return wire.load_result_from_wire(results, url=self.base_url, step=step)

    # --- pushed weights: vLLM's weight-transfer sessions, bracketed by our extension (docs/push.md) -----

    async def init_weight_transfer(self, init_info: dict[str, Any], *, deadline: float | None = None) -> None:
        """``POST /init_weight_transfer_engine``: join the transfer group (NCCL) or set up IPC (``{}``)."""
        await self._call(
            "POST",
            "/init_weight_transfer_engine",
            step="init_weight_transfer_engine",
            json={"init_info": init_info},
            deadline=_or(deadline, self.timeouts.load),
        )

    async def push_begin(
        self, target: api.Target | str, revision: int, epoch: int, *, deadline: float | None = None
    ) -> None:
        """The extension opens its side of a session: from now on it hashes and counts what ``target``
        receives, and the target's revision is unknown until ``push_end`` verifies it."""
        step = f"rolloutfleet_push_begin:{target}"
        results = await self.collective_rpc(
            "rolloutfleet_push_begin",
            kwargs={"target": str(target), "revision": revision, "epoch": epoch},
            http_timeout=_or(deadline, self.timeouts.default),
        )
        wire.agreeing(results, url=self.base_url, step=step, key=lambda r: (r.get("target"), r.get("epoch")))

    async def start_weight_update(self, target: api.Target | str, *, deadline: float | None = None) -> None:
        """vLLM's ``/start_weight_update`` (verifier) or ``/start_draft_weight_update`` (draft)."""
        route = "/start_draft_weight_update" if str(target) == api.Target.DRAFT else "/start_weight_update"
        await self._call("POST", route, step=route.lstrip("/"), json={}, deadline=_or(deadline, self.timeouts.default))

    async def finish_weight_update(self, *, deadline: float | None = None) -> None:
        """vLLM's ``/finish_weight_update``: the session's received weights are committed."""
        await self._call(
            "POST",
            "/finish_weight_update",
            step="finish_weight_update",
            json={},
            deadline=_or(deadline, self.timeouts.load),
        )

    async def push_group(self, epoch: int, rank_offset: int, world_size: int, *, deadline: float | None = None) -> None:
        """The extension records the NCCL group this process just joined (``/init_weight_transfer_engine``
        returned): its state reports it from now on, and a restarted process reports none."""
        step = "rolloutfleet_push_group"
        results = await self.collective_rpc(
            step,
            kwargs={"epoch": epoch, "rank_offset": rank_offset, "world_size": world_size},
            http_timeout=_or(deadline, self.timeouts.default),
        )
        wire.agreeing(results, url=self.base_url, step=step, key=lambda r: r.get("epoch"))

    async def push_end(self, *, abandon: bool = False, deadline: float | None = None) -> api.LoadResult:
        """The extension closes its side: the digest of exactly what was received, every parameter
        present, or ``EngineRPCError`` (``failed``, ``incomplete``, ``abandoned``, ``no_session``) with the
        target left destroyed."""
        step = "rolloutfleet_push_end"
        results = await self.collective_rpc(
            "rolloutfleet_push_end", kwargs={"abandon": abandon}, http_timeout=_or(deadline, self.timeouts.default)
        )
        return wire.load_result_from_wire(results, url=self.base_url, step=step)

    async def preflight(
        self, target: api.Target | str, path: str, *, deadline: float | None = None
    ) -> api.PreflightResult:
        """Whether a load of ``target`` from ``path`` can succeed, judged from safetensors headers and sizes.

        The extension reads no tensor bytes and touches no parameter, so this changes nothing: it is
        idempotent (retried like a state read), not guarded by ``LoadOutcomeUnknown``, and safe while the
        engine serves or sleeps (it queues behind a running load, as every RPC does). Every rank must answer
        ok with the same target, path, tensor count and bytes (``EngineInconsistent`` otherwise); an
        ``ok: false`` raises ``EngineRPCError`` with the load's codes (``invalid_target``, ``invalid_path``,
        ``io``, ``no_draft``, ``incomplete``, ``load_failed``/``internal``). Passing does not guarantee the
        load: which parameter a checkpoint name fills is decided by vLLM's ``load_weights`` only.
        """
        results = await self.collective_rpc(
            "rolloutfleet_preflight",
            kwargs={"target": str(target), "path": path},
            idempotent=True,
            http_timeout=deadline,
        )
        return self._preflight_result(results, f"rolloutfleet_preflight:{target}")

    async def preflights(
        self, targets: Sequence[tuple[api.Target, str]], *, deadline: float | None = None
    ) -> list[api.PreflightResult | wire.EngineError]:
        """``preflight`` of each (target, path), in one request where the image takes sequences (every one
        runs whatever the others answer); each a result or the error its own request would have raised."""
        calls = preflight_calls(targets)
        answer: wire.SequenceAnswer | None = None
        if len(calls) > 1:
            try:
                answer = await self.sequence(calls, stop=False, deadline=deadline)
            except wire.EngineError as exc:
                return [exc] * len(calls)
        if answer is None:  # a request each, at once (as they went before sequences)
            apart = await asyncio.gather(
                *(self.preflight(t, p, deadline=deadline) for t, p in targets), return_exceptions=True
            )
            for failure in apart:
                if isinstance(failure, BaseException) and not isinstance(failure, wire.EngineError):
                    raise failure  # a bug, not an engine's answer
            return cast(list[api.PreflightResult | wire.EngineError], apart)
        return self._preflight_parts(answer, calls)

    def _preflight_parts(
        self, answer: wire.SequenceAnswer, calls: list[wire.Call]
    ) -> list[api.PreflightResult | wire.EngineError]:
        """The pre-flights ``calls`` (the first calls of ``answer``'s sequence): each a result or its error."""
        out: list[api.PreflightResult | wire.EngineError] = []
        for index, call in enumerate(calls):
            try:
                if index >= len(answer.parts):
                    raise EngineProtocolError("the sequence ended early", url=self.base_url, step=call.step)
                out.append(self._preflight_result(self.rpc_part(answer, index, call), call.step))
            except wire.EngineError as exc:
                out.append(exc)
        return out

    async def preflights_then_observe(
        self, targets: Sequence[tuple[api.Target, str]], *, deadline: float | None = None
    ) -> tuple[list[api.PreflightResult | wire.EngineError], api.EngineState]:
        """``preflights`` and then ``observe``, in one request where the image takes an observation among a
        sequence's calls (the observation runs after the pre-flights: it reads what they leave, which is
        what they found, as they change nothing). Before a revision's first pause every engine is checked and
        then read; one request each instead of two is time before the first pause at 1,024 pods and the
        operator's CPU (issue 18). An image without sequences, or from before the observation was allowed in
        one (it refuses the sequence with 400 before running anything; remembered for
        ``ENVELOPE_RECHECK_SECONDS``), gets the two as before; so does an engine whose sequence failed as a
        whole (its pre-flights then report that error, and the read says what it can)."""
        if not targets or _believed(self._read_apart, self.base_url, ENVELOPE_RECHECK_SECONDS):
            return await self.preflights(targets, deadline=deadline), await self.observe()
        calls = preflight_calls(targets)
        ticket = self._loads.ticket()
        try:
            answer = await self.sequence([*calls, OBSERVE_CALL], stop=False, deadline=deadline)
        except EngineHTTPError as exc:
            if exc.status != 400:
                return [exc] * len(calls), await self.observe()
            self._read_apart[self.base_url] = time.monotonic()
            answer = None
        except wire.EngineError as exc:
            return [exc] * len(calls), await self.observe()
        if answer is None:  # no sequences here, or none that take an observation
            return await self.preflights(targets, deadline=deadline), await self.observe()
        self._read_apart.pop(self.base_url, None)
        results = self._preflight_parts(answer, calls)
        read = answer.parts[len(calls)] if len(answer.parts) > len(calls) else None
        if read is None or read.get("status") != 200:  # e.g. a fault on the route: read it on its own
            return results, await self.observe()
        return results, self._state_of(self._reads_of_envelope(read.get("body"), ticket))

    def _preflight_result(self, results: list[Any], step: str) -> api.PreflightResult:
        checked = wire.agreeing(
            results,
            url=self.base_url,
            step=step,
            key=lambda r: (r.get("target"), r.get("path"), r.get("tensors"), r.get("bytes")),
        )
        first = checked[0]
        try:
            tensors, size = first["tensors"], first["bytes"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (tensors, size)):
                raise TypeError("tensors and bytes must be non-negative integers")
            return api.PreflightResult(
                target=api.Target(first["target"]), path=str(first["path"]), tensors=tensors, bytes=size
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineProtocolError(f"malformed preflight result: {first!r}", url=self.base_url, step=step) from exc

    async def extension_state(self, *, deadline: float | None = None) -> list[wire.StateResult]:
        """Every rank's ``rolloutfleet_state()``, checked ok and agreeing. Idempotent: retried.

        An answer also proves that any load sent before this call ended (vLLM runs RPCs one at a time).
        """
        ticket = self._loads.ticket()
        results = await self.collective_rpc("rolloutfleet_state", idempotent=True, http_timeout=deadline)
        self._loads.settle(self.base_url, ticket)
        return wire.states_from_wire(results, url=self.base_url)

    async def observe(self, *, deadline: float | None = None) -> api.EngineState:
        """One snapshot: the admission, ``/is_paused``, ``/is_sleeping``, ``/weight_info`` and the extension state.

        An engine that cannot be observed yields ``EngineState.failed(fault, error)``: unreachable (no
        connection, no answer in time, 502/503/504 after retries), unauthorized (401/403), protocol (an
        answer outside the contract), extension (``ok: false``, with its code) or inconsistent (ranks
        disagree). Anything that is not an engine error (a bug) propagates. ``deadline`` bounds each read.

        One request (``GET /rolloutfleet/observe``: the image's middleware answers the five reads in one
        body, ``rolloutfleet_worker.observation``); an image without that route (404) is read with five
        requests, and remembered for a while so that it costs one request fewer next time. Either way the
        admission (with the process's ``instance``) is read first: the instance then names a process at least
        as old as the weights read after it, so an admit that names it can never admit a newer process that
        came up on other weights at the same address (it refuses: 409).
        """
        return await self._observed(deadline)

    async def _observed(self, deadline: float | None) -> api.EngineState:
        """``observe``'s work (``recheck`` calls it too: an observation counted as what it replaced)."""
        reads = await self._reads_in_one(deadline)
        if reads is None:
            reads = await self._reads_apart(deadline)
        return self._state_of(reads)

    def _state_of(self, reads: list[Any]) -> api.EngineState:
        """The state the five reads (``_reads_apart``'s shape) describe, or the failure that hides it."""
        failures = [r for r in reads if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, wire.EngineError):
                raise failure
        if failures:
            error = wire.most_telling(cast(list[wire.EngineError], failures))
            fault = fault_of(error)
            if fault == api.EngineFault.UNREACHABLE:
                self._unversioned.pop(self.base_url, None)  # it may come back as another vLLM release
                self._apart.pop(self.base_url, None)  # or as another image
            return api.EngineState.failed(fault, str(error))
        paused, sleeping, version, states, answer = reads
        admitted, instance = cast(tuple[bool | None, str | None], answer)
        versioned = version is not _NO_VERSIONS
        state = state_from_wire(
            paused=cast(bool, paused),
            sleeping=cast(bool, sleeping),
            weight_version=cast(str | None, version) if versioned else None,
            states=cast(list[wire.StateResult], states),
        )
        return state.evolve(versioned=versioned, admitted=admitted, instance=instance)

    async def _reads_apart(self, deadline: float | None) -> list[Any]:
        """The five reads of ``observe`` as five requests: (paused, sleeping, version, states, admission),
        each a value or the ``EngineError`` it raised."""
        admission: Any
        try:
            admission = await self.admission(deadline=deadline)
        except wire.EngineError as exc:
            admission = exc
        return [
            *await asyncio.gather(
                self.is_paused(deadline=deadline),
                self.is_sleeping(deadline=deadline),
                self._weight_info_or_absent(deadline),
                self.extension_state(deadline=deadline),
                return_exceptions=True,
            ),
            admission,
        ]

    async def _reads_in_one(self, deadline: float | None) -> list[Any] | None:
        """The five reads of ``observe`` from one ``GET /rolloutfleet/observe``, shaped as ``_reads_apart``'s;
        None when the image has no such route (then, and for ``ENVELOPE_RECHECK_SECONDS``, five requests)."""
        if _believed(self._apart, self.base_url, ENVELOPE_RECHECK_SECONDS):
            return None
        ticket = self._loads.ticket()
        try:
            body = await self._call("GET", OBSERVE_PATH, step="observe", idempotent=True, deadline=deadline)
        except EngineHTTPError as exc:
            if exc.status == 404:
                self._apart[self.base_url] = time.monotonic()
                return None
            return [exc] * 5
        except wire.EngineError as exc:
            return [exc] * 5
        self._apart.pop(self.base_url, None)
        return self._reads_of_envelope(body, ticket)

    def _reads_of_envelope(self, body: Any, ticket: int) -> list[Any]:
        """The five reads an observation's body holds (its own request's, or a sequence's part), shaped as
        ``_reads_apart``'s; ``ticket``: the load ledger's, taken before the request was sent."""
        try:
            routes, answer = body["routes"], body["admission"]
            parts = [routes[key] for key in ("is_paused", "is_sleeping", "weight_info", "state")]
            if not all(isinstance(p, dict) and isinstance(p.get("status"), int) for p in parts):
                raise TypeError("each route needs a status")
        except (KeyError, TypeError):
            error = EngineProtocolError(f"malformed observation: {str(body)[:200]}", url=self.base_url, step="observe")
            return [error] * 5
        paused, sleeping, version, state = parts
        url = self.base_url
        reads: list[Any] = [
            self._part(paused, "is_paused", lambda b: bool(_field(b, "is_paused", bool, url, "is_paused"))),
            self._part(sleeping, "is_sleeping", lambda b: bool(_field(b, "is_sleeping", bool, url, "is_sleeping"))),
            self._version_part(version),
            self._part(state, "rolloutfleet_state", lambda b: wire.states_from_wire(_rpc_results(b, url), url=url)),
            _parsed(lambda: (bool(_field(answer, "admitted", bool, url, "ready")), _instance(answer))),
        ]
        if not isinstance(reads[3], BaseException):
            self._loads.settle(self.base_url, ticket)  # an answered state read: earlier loads have ended
        return reads

    def _part(self, part: dict[str, Any], step: str, parse: Callable[[Any], Any]) -> Any:
        """One route's answer inside an observation: its value, or the error the route alone would raise."""
        status, body = part["status"], part.get("body")
        if not 200 <= status < 300:
            return EngineHTTPError(status, body, url=self.base_url, step=step)
        return _parsed(lambda: parse(body))

    def _version_part(self, part: dict[str, Any]) -> Any:
        """``/weight_info`` inside an observation: 404 is a release without weight versions (vLLM 0.26)."""
        if part.get("status") == 404:
            self._unversioned[self.base_url] = time.monotonic()
            return _NO_VERSIONS
        value = self._part(part, "weight_info", lambda b: _weight_version(b, self.base_url))
        if not isinstance(value, BaseException):
            self._unversioned.pop(self.base_url, None)
        return value

    async def recheck(self, known: api.EngineState, *, deadline: float | None = None) -> api.EngineState:
        """What the engine holds now, in as few requests as its image allows: a full ``observe`` where that is
        one request; otherwise two (its admission, i.e. the process's ``instance``, and the extension state)
        over ``known`` for the rest.

        For a read right before a resume, of an engine whose pause, sleep and weight version this client
        just set and saw acknowledged: what can have changed since is what the extension reports (its
        weights, digests, residency, stage) or the process itself. A process other than ``known``'s (it
        restarted), or an engine that cannot be read, gets a full ``observe``.

        The two reads go out together (``observe`` reads the admission first so that an admit can never name
        a newer process than the weights it saw): here the instance must equal ``known``'s, and instances are
        never reused, so a state answered by a newer process is either refused by that comparison (the
        admission came from the newer one) or is that process's initial weights, which no resume accepts.
        """
        if not _believed(self._apart, self.base_url, ENVELOPE_RECHECK_SECONDS):
            return await self._observed(deadline)
        admission, states = await asyncio.gather(
            self.admission(deadline=deadline), self.extension_state(deadline=deadline), return_exceptions=True
        )
        for answer in (admission, states):
            if isinstance(answer, BaseException) and not isinstance(answer, wire.EngineError):
                raise answer
        if isinstance(admission, BaseException) or isinstance(states, BaseException):
            return await self.observe(deadline=deadline)
        admitted, instance = admission
        if known.instance is None or instance != known.instance:
            return await self.observe(deadline=deadline)
        state = state_from_wire(
            paused=known.paused, sleeping=known.sleeping, weight_version=known.weight_version, states=states
        )
        return state.evolve(versioned=known.versioned, admitted=admitted, instance=instance)

    # --- several calls of one step in one request (rolloutfleet_worker.sequence) ------------------------

    async def sequence(
        self,
        calls: Sequence[wire.Call],
        *,
        known: api.EngineState | None = None,
        loads: bool = False,
        stop: bool = True,
        deadline: float | None = None,
    ) -> wire.SequenceAnswer | None:
        """``POST /rolloutfleet/sequence``: ``calls`` run one after the other inside the engine's process,
        stopping after the first that failed; None for an image without the route (404, then remembered for
        ``ENVELOPE_RECHECK_SECONDS``: the caller sends the calls apart).

        ``known``: run the calls only if the engine is still that process and its extension still reports
        the weights ``known`` holds (``guard_of``); otherwise nothing runs (``held``). ``loads``: the calls
        change weights, guarded like ``load`` (not sent while an earlier load's outcome is unknown; their
        outcome is unknown after a 5xx or a lost answer). ``stop=False``: every call runs whatever the others
        answered (for calls that change nothing). Not retried: a step's calls are not idempotent.
        """
        if _believed(self._no_sequence, self.base_url, ENVELOPE_RECHECK_SECONDS):
            return None
        step = "sequence:" + "+".join(c.step for c in calls)
        body: dict[str, Any] = {"calls": [c.to_wire() for c in calls]}
        if not stop:
            body["stop"] = False
        if known is not None and known.instance is not None:
            body["instance"] = known.instance
            body["expect"] = guard_of(known)

        def send() -> Awaitable[Any]:
            return self._call("POST", SEQUENCE_PATH, step=step, json=body, deadline=deadline)

        try:
            answer = await (self._guarded_load(step, send) if loads else send())
        except EngineHTTPError as exc:
            if exc.status == 404:
                self._no_sequence[self.base_url] = time.monotonic()
                return None
            raise
        self._no_sequence.pop(self.base_url, None)
        return wire.sequence_from_wire(answer, len(calls), url=self.base_url)

    @property
    def chains_resume(self) -> bool:
        """Whether a resume may follow the loads in their request, behind ``state_check_call``: not for an image
        seen to compare the check with the RPC's whole body (``note_resume_apart``), for a while
        (``ENVELOPE_RECHECK_SECONDS``)."""
        return not _believed(self._resume_apart, self.base_url, ENVELOPE_RECHECK_SECONDS)

    def note_resume_apart(self) -> None:
        """This engine's image stopped a sequence at a state check that every rank held (it compares an RPC
        call's expectation with the whole body): its resumes go in requests of their own for a while."""
        self._resume_apart[self.base_url] = time.monotonic()

    def state_check_call(self, expected: api.EngineState, *, deadline: float) -> wire.Call:
        """``rolloutfleet_state`` as a call of a sequence that every rank's result must hold ``guard_of(expected)``
        for, or the sequence ends there: what a resume chained after loads runs behind."""
        call = rpc_call("rolloutfleet_state", {}, step="rolloutfleet_state", timeout=rpc_timeout_below(deadline))
        return dataclasses.replace(call, expect=guard_of(expected))

    def state_check_held(self, answer: wire.SequenceAnswer, index: int, call: wire.Call) -> bool:
        """Whether the state check ``call`` at ``index`` of ``answer`` held: answered 200, and every rank's
        result ok and holding the call's expectation."""
        part = answer.parts[index]
        if part.get("status") != 200:
            return False
        try:
            results = _rpc_results(part.get("body"), self.base_url)
        except EngineProtocolError:
            return False
        return bool(results) and all(
            isinstance(r, dict) and r.get("ok") is True and wire.holds(r, call.expect) for r in results
        )

    def commit_call(self, target: api.Target, path: str, revision: int, *, deadline: float) -> wire.Call:
        """A staged load of ``target`` (``load(..., staged=True)``) as a call of a sequence."""
        return self.load_call(target, path, revision, staged=True, deadline=deadline)

    def load_call(
        self, target: api.Target, path: str, revision: int, *, staged: bool = False, deadline: float
    ) -> wire.Call:
        """``load(target, path, revision, staged=...)`` as a call of a sequence (``load_part`` reads its answer)."""
        kwargs: dict[str, Any] = {"target": str(target), "path": path, "revision": revision}
        if staged:
            kwargs["staged"] = True
        return rpc_call(
            "rolloutfleet_load", kwargs, step=f"rolloutfleet_load:{target}", timeout=rpc_timeout_below(deadline)
        )

    def load_part(self, answer: wire.SequenceAnswer, index: int, call: wire.Call) -> api.LoadResult:
        """The result of a load (or commit) call of ``answer``, or its error. A 5xx part leaves the load's outcome
        unknown (vLLM's RPC timeout stops the waiting, not the workers), exactly as ``load`` on its own does:
        no later load is sent to this engine before it was observed again."""
        try:
            results = self.rpc_part(answer, index, call)
        except EngineHTTPError as exc:
            if exc.status >= 500:
                self._loads.mark(self.base_url)
            raise
        return wire.load_result_from_wire(results, url=self.base_url, step=call.step)

    def part(self, answer: wire.SequenceAnswer, index: int, call: wire.Call) -> Any:
        """The body call ``index`` of ``answer`` answered, or the error it would have raised on its own
        (``EngineHTTPError`` for a status outside 2xx). A call that did not run is a bug of the caller."""
        part = answer.parts[index]
        if not 200 <= part["status"] < 300:
            raise EngineHTTPError(part["status"], part.get("body"), url=self.base_url, step=call.step)
        return part.get("body")

    def rpc_part(self, answer: wire.SequenceAnswer, index: int, call: wire.Call) -> list[Any]:
        """``part`` of a ``/collective_rpc`` call: its per-rank results."""
        return _rpc_results(self.part(answer, index, call), self.base_url, call.step)

    # --- admission: the readiness probe's answer (worker_image/README.md, "Admission") ----------------

    async def admitted(self, *, deadline: float | None = None) -> bool | None:
        """Whether this engine process was admitted (its readiness probe passes); None: an image without
        the admission routes (404), whose readiness is ``/health`` alone."""
        return (await self.admission(deadline=deadline))[0]

    async def admission(self, *, deadline: float | None = None) -> tuple[bool | None, str | None]:
        """(admitted, instance): ``admitted()`` and the engine process's ``instance`` (None when the image
        does not name its processes)."""
        try:
            body = await self._call("GET", READY_PATH, step="ready", deadline=deadline)
        except EngineHTTPError as exc:
            if exc.status == 404:
                return None, None
            if exc.status == 503 and isinstance(exc.body, dict) and exc.body.get("admitted") is False:
                return False, _instance(exc.body)  # a real answer (not admitted), not an overloaded engine
            raise
        return bool(_field(body, "admitted", bool, self.base_url, "ready")), _instance(body)

    async def admit(self, revision: int | None, *, instance: str | None = None, deadline: float | None = None) -> None:
        """Let the readiness probe pass: the operator verified that this process serves ``revision``.

        ``instance`` (from the observation the decision came from) makes another process refuse (409)."""
        body: dict[str, Any] = {"revision": revision}
        if instance is not None:
            body["instance"] = instance
        await self._call("POST", ADMIT_PATH, step="admit", json=body, deadline=deadline)

    async def withdraw(self, *, deadline: float | None = None) -> None:
        """Fail the readiness probe from now on (before the engine leaves the fleet's weights)."""
        await self._call("POST", WITHDRAW_PATH, step="withdraw", deadline=deadline)

    async def _weight_info_or_absent(self, deadline: float | None) -> Any:
        # vLLM 0.26 has no weight-version routes (404, measured on the H200): feature-detect, do not fail,
        # and remember it for a while so each observation of such an engine costs one read fewer (and its
        # log one 404 line fewer). An engine that goes unreachable is asked again when it is back.
        if _believed(self._unversioned, self.base_url, VERSION_ROUTES_RECHECK_SECONDS):
            return _NO_VERSIONS
        try:
            info = await self.weight_info(deadline=deadline)
        except EngineHTTPError as exc:
            if exc.status == 404:
                self._unversioned[self.base_url] = time.monotonic()
                return _NO_VERSIONS
            raise
        self._unversioned.pop(self.base_url, None)
        return info

    # --- plumbing --------------------------------------------------------------------------------

    async def _load_rpc(self, method: str, kwargs: dict[str, Any], step: str, deadline: float | None) -> list[Any]:
        """Send one load RPC unless an earlier one's outcome is unknown; mark it unknown when this one's is."""
        http = _or(deadline, self.timeouts.load)
        return await self._guarded_load(
            step,
            lambda: self.collective_rpc(method, kwargs=kwargs, timeout=rpc_timeout_below(http), http_timeout=http),
        )

    async def _guarded_load(self, step: str, send: Callable[[], Awaitable[T]]) -> T:
        """``send`` a request that changes weights, unless an earlier one's outcome is unknown (raises
        ``LoadOutcomeUnknown`` without sending); when this one's outcome becomes unknown, mark it so."""
        since = self._loads.since(self.base_url)
        if since is not None:
            raise LoadOutcomeUnknown(
                f"not sent: an earlier load's outcome became unknown {self._loads.age(self.base_url):.0f}s ago "
                "(it may still be running); observe the engine first",
                since=since,
                url=self.base_url,
                step=step,
            )
        try:
            return await send()
        except EngineHTTPError as exc:
            if exc.status >= 500:  # e.g. vLLM's RPC timeout: it stopped waiting, its workers did not
                self._loads.mark(self.base_url)
            raise
        except EngineUnreachable as exc:
            if exc.sent:
                self._loads.mark(self.base_url)
            raise
        except EngineProtocolError:
            raise  # a 2xx answer: the request ran to its end
        except BaseException:  # a timeout, a cancelled call: the engine may be loading still
            self._loads.mark(self.base_url)
            raise

    async def _call(
        self,
        method: str,
        path: str,
        *,
        step: str,
        params: Sequence[tuple[str, str]] | None = None,
        json: Any = None,
        deadline: float | None = None,
        idempotent: bool = False,
    ) -> Any:
        """One call within ``deadline`` seconds in all (retries of an idempotent call included)."""
        total = _or(deadline, self.timeouts.default)
        loop = asyncio.get_running_loop()
        end = loop.time() + total
        attempts = max(1, self.retry.attempts) if idempotent else 1
        last: Exception | None = None
        for attempt in range(attempts):
            remaining = end - loop.time()
            if remaining <= 0:
                break
            try:
                return await self._once(
                    method, path, step=step, params=params, json_body=json, budget=remaining, total=total
                )
            except EngineTimeout:
                raise  # it used what was left of the deadline
            except EngineUnreachable as exc:
                last = exc
            except EngineHTTPError as exc:
                if exc.status not in RETRYABLE_STATUS:
                    raise
                last = exc
            delay = self.retry.delay(attempt, self._rng)
            if attempt + 1 < attempts and loop.time() + delay < end:
                await asyncio.sleep(delay)
            else:
                break
        if last is None:
            raise EngineTimeout(f"{step} timed out after {total:g}s", url=self.base_url + path, step=step)
        raise last

    async def _once(
        self,
        method: str,
        path: str,
        *,
        step: str,
        params: Sequence[tuple[str, str]] | None,
        json_body: Any,
        budget: float,
        total: float,
    ) -> Any:
        guarded = not (path in OPEN_EXACT or path.startswith(OPEN_PREFIXES))
        try:
            return await self._sent(
                method,
                path,
                self._credentials.token if guarded else None,
                step=step,
                params=params,
                json_body=json_body,
                budget=budget,
                total=total,
            )
        except EngineHTTPError as exc:
            fallback = self._credentials.fallback() if guarded else None
            if exc.status != 401 or fallback is None:
                raise
            # The engine may not have the rotated token yet (its kubelet refreshes the mounted Secret later).
            # A 401 is answered before anything is done, so the retry cannot do a step twice.
            return await self._sent(
                method, path, fallback, step=step, params=params, json_body=json_body, budget=budget, total=total
            )

    async def _sent(
        self,
        method: str,
        path: str,
        token: str | None,
        *,
        step: str,
        params: Sequence[tuple[str, str]] | None,
        json_body: Any,
        budget: float,
        total: float,
    ) -> Any:
        headers = {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if json_body is not None:
            # msgspec, not aiohttp's json.dumps: the same JSON, and encoding was 4 % of the operator's CPU at
            # 1,024 pods (issue 18).
            data = msgspec.json.encode(json_body)
            headers["Content-Type"] = "application/json"
        url = self.base_url + path
        target = path + "?" + wire.query_string(tuple(params)) if params else path
        outcome = "ok"
        started = time.perf_counter()
        try:
            resp = await self._http.request(
                method,
                self._origin,
                target,
                headers=headers,
                body=data,
                total=budget,
                connect=min(budget, self.timeouts.connect),
            )
            body = _decode(resp.text(), resp.content_type)
            if not 200 <= resp.status < 300:
                outcome = "http_error"
                raise EngineHTTPError(resp.status, body, url=self.base_url, step=step)
            return body
        except TimeoutError as exc:
            outcome = "timeout"
            raise EngineTimeout(f"{step} timed out after {total:g}s", url=url, step=step) from exc
        except http11.NotSent as exc:  # no connection: the engine cannot have received it
            outcome = "unreachable"
            raise EngineUnreachable(f"{step}: {exc}", url=url, step=step, sent=False) from exc
        except http11.Lost as exc:
            outcome = "unreachable"
            raise EngineUnreachable(f"{step}: {exc}", url=url, step=step) from exc
        finally:
            if self._on_latency is not None:
                self._on_latency(step, time.perf_counter() - started, outcome)


class Credentials:
    """The control token, and the one it replaced while engines may still hold it.

    A replaced Secret reaches the operator at once (it reads it every pass) but each engine only when its
    kubelet refreshes the mounted copy (up to a minute or more), so for ``grace`` seconds after a change a
    401 is retried once with the previous token: a rotation during a rollout costs no failed step. Shared by
    a pool's clients; never logged (``repr`` redacts).
    """

    def __init__(self, token: str | None, *, grace: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.token = token
        self.previous: str | None = None
        self._previous_until = 0.0
        self._grace = grace
        self._clock = clock

    def __repr__(self) -> str:
        return f"Credentials(token={'<redacted>' if self.token else None})"

    def rotate(self, token: str | None) -> None:
        """Use ``token`` from now on; the one it replaces stays a fallback for the grace period."""
        if token == self.token:
            return
        self.previous, self.token = self.token, token
        self._previous_until = self._clock() + self._grace

    def fallback(self) -> str | None:
        """The previous token while it may still be what an engine holds, else None."""
        return self.previous if self.previous and self._clock() < self._previous_until else None


_NO_VERSIONS = object()  # sentinel: the engine has no weight-version routes
# The observation as a call of a sequence (``preflights_then_observe``); answered as its own request is.
OBSERVE_CALL: Final = wire.Call(OBSERVE_PATH, "observe", method="GET")
ENVELOPE_RECHECK_SECONDS = 300.0  # how long a 404 on /rolloutfleet/observe is believed without asking again
VERSION_ROUTES_RECHECK_SECONDS = 300.0  # how long a 404 on /weight_info is believed without asking again


class EnginePool:
    """Clients for many engines over one ``http11.HTTP11`` (kept-alive connections, bounded).

    ``limit`` bounds open connections across all engines (1,000 pods x 1 connection each is fine on
    Linux; the default leaves headroom for the operator's other sockets); ``limit_per_host`` keeps one
    engine from hogging the pool when the planner fans out reads. Use as ``async with EnginePool(...)``.
    The pool outlives the reconcile passes (clients are made per pass), so what must be remembered per
    engine lives here: the 0.26 feature detection and the ``LoadLedger`` of loads of unknown outcome.
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
        idle_s: float = http11.IDLE_S,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self.credentials = Credentials(token)
        self._limit = limit
        self._limit_per_host = limit_per_host
        self._idle_s = idle_s
        self._on_connect = on_connect
        self.timeouts = timeouts or EngineTimeouts()
        self.retry = retry or RetryPolicy()
        self.reset = reset or ResetPolicy()
        self._on_latency = on_latency
        self._http: http11.HTTP11 | None = None
        self._rng = random.Random()  # noqa: S311 - jitter only
        self._unversioned: dict[str, float] = {}
        self._apart: dict[str, float] = {}
        self._no_sequence: dict[str, float] = {}
        self._read_apart: dict[str, float] = {}
        self._resume_apart: dict[str, float] = {}
        self.loads = LoadLedger()

    def __repr__(self) -> str:
        return f"EnginePool(limit={self._limit}, token={'<redacted>' if self.credentials.token else None})"

    async def __aenter__(self) -> EnginePool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._http is None:
            # No proxies: engines are dialled directly on their pod IPs.
            self._http = http11.HTTP11(
                limit=self._limit, limit_per_host=self._limit_per_host, idle_s=self._idle_s, on_connect=self._on_connect
            )

    @property
    def idle_s(self) -> float:
        """How long a connection to an engine may stay idle and still be used again: below the engines' own
        keep-alive (``http11.IDLE_S`` for vLLM's default of 5 s)."""
        return self._idle_s

    @idle_s.setter
    def idle_s(self, seconds: float) -> None:
        self._idle_s = seconds
        if self._http is not None:
            self._http.idle_s = seconds

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def client(self, base_url: str) -> EngineClient:
        if self._http is None:
            raise RuntimeError("EnginePool is not started: use `async with EnginePool(...)`")
        return EngineClient(
            base_url,
            http=self._http,
            timeouts=self.timeouts,
            retry=self.retry,
            reset=self.reset,
            on_latency=self._on_latency,
            rng=self._rng,
            unversioned=self._unversioned,
            apart=self._apart,
            no_sequence=self._no_sequence,
            read_apart=self._read_apart,
            resume_apart=self._resume_apart,
            loads=self.loads,
            credentials=self.credentials,
        )

    def for_address(self, ip: str, port: int = 8000) -> EngineClient:
        """The engine of a pod at ``ip`` (its status.podIP: IPv4, or IPv6 on an IPv6 cluster)."""
        return self.client(f"http://{common.host_port(ip, port)}")


def preflight_calls(targets: Sequence[tuple[api.Target, str]]) -> list[wire.Call]:
    """``preflight`` of each (target, path) as calls of a sequence."""
    return [
        rpc_call("rolloutfleet_preflight", {"target": str(t), "path": p}, step=f"rolloutfleet_preflight:{t}")
        for t, p in targets
    ]


def rpc_call(
    method: str, kwargs: dict[str, Any], *, step: str, timeout: float | None = None, args: Sequence[Any] = ()
) -> wire.Call:
    """``POST /collective_rpc`` of ``method`` as a call (of a sequence; ``collective_rpc`` sends its body)."""
    body: wire.CollectiveRPCRequest = {"method": method, "args": list(args), "kwargs": kwargs}
    if timeout is not None:
        body["timeout"] = timeout
    return wire.Call("/collective_rpc", step, json=body)


def guard_of(known: api.EngineState) -> dict[str, Any]:
    """What a sequence's guard expects every rank's ``rolloutfleet_state`` to hold: the weights ``known``
    reports (revisions and digests, residency), and no open session. What else a decision reads (paused,
    sleeping, the weight version) is what this client set and saw acknowledged; what the extension reports
    can change behind it (another writer, a failed session), and a new process changes the instance."""
    v = known.verifier
    guard: dict[str, Any] = {
        "resident": known.resident,
        "verifier": {"revision": v.revision, "digest": v.digest},
        "session": None,
    }
    d = known.draft
    guard["draft"] = None if d is None else {"revision": d.revision, "digest": d.digest}
    return guard


def _instance(body: Any) -> str | None:
    value = body.get("instance") if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


def _believed(noted: dict[str, float], url: str, seconds: float) -> bool:
    """A missing route noted for ``url`` (when, monotonic) is still believed: noted less than ``seconds`` ago."""
    when = noted.get(url)
    return when is not None and time.monotonic() - when < seconds


def _weight_version(body: Any, url: str) -> str | None:
    """``/weight_info``'s answer: the version, None when none was set."""
    if not isinstance(body, dict) or "weight_version" not in body:
        raise EngineProtocolError(f"unexpected /weight_info body: {body!r}", url=url, step="weight_info")
    value = body["weight_version"]
    return None if value is None else str(value)


def _rpc_results(body: Any, url: str, method: str = "rolloutfleet_state") -> list[Any]:
    """``/collective_rpc``'s answer: one result per worker (an empty body: none)."""
    if body is None or body == "":
        return []
    if not isinstance(body, dict) or not isinstance(body.get("results"), list):
        raise EngineProtocolError(f"unexpected /collective_rpc body: {body!r}", url=url, step=method)
    return cast(list[Any], body["results"])


def _parsed(parse: Callable[[], T]) -> T | wire.EngineError:
    """``parse()``, or the engine error it raised (a read inside an observation fails on its own)."""
    try:
        return parse()
    except wire.EngineError as exc:
        return exc


def _or(deadline: float | None, fallback: float) -> float:
    return fallback if deadline is None else deadline


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _decode(text: str, content_type: str) -> Any:
    if not text:
        return None
    if content_type == "application/json" or text[:1] in "{[":
        try:
            return msgspec.json.decode(text)  # the json module's answer, several times faster (issue 18)
        except msgspec.DecodeError:
            pass
        try:
            return json.loads(text)  # what msgspec refuses and Python writes: NaN, Infinity
        except ValueError:
            return text
    return text


def _field(body: Any, name: str, kind: type, url: str, step: str) -> Any:
    if not isinstance(body, dict) or not isinstance(body.get(name), kind):
        raise EngineProtocolError(f"unexpected body: {body!r}", url=url, step=step)
    return body[name]
