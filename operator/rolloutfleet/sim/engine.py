"""The simulated engine's state machine: pause/sleep/wake, weights, weight version, completions, metrics.

Called by ``rolloutfleet.sim.server`` (one HTTP app per simulated engine) — this module knows no HTTP.
It mirrors what DESIGN.md §4 and shared/gpu/README.md record about real vLLM with our extension:

- ``pause(keep)`` freezes in-flight requests (they finish after ``resume``); ``abort`` ends them at once;
  ``wait`` drains them first. While paused in ``abort``/``wait`` new requests are refused (503, as DESIGN
  §4 states; ``EngineSpec.reject_while_paused=False`` holds them instead, like the ``keep`` mode).
  ``clear_cache=true`` (vLLM's default) then resets the caches the way vLLM 0.26/0.33 do
  (``EngineCore._reset_caches``): running requests are preempted, so they hold no blocks any more.
- KV blocks and the prefix-cache reset (``vllm/v1/core/sched/scheduler.py`` ``reset_prefix_cache`` and
  ``vllm/v1/core/block_pool.py`` in 0.26 and 0.33): a request holds blocks from its first scheduled step
  until it ends, also while frozen by ``pause(keep)``. A plain reset is refused (``success: false``)
  while any block is held; ``reset_running_requests=true`` first preempts the running requests (their
  blocks are freed; vLLM recomputes them once scheduled again, so they still complete after resume),
  then the reset succeeds. A level>=1 sleep frees every block the same way.
- ``sleep(level)`` pauses the scheduler (abort unless ``mode`` says otherwise) and releases memory: level
  1 offloads weights (kept), level 2 discards verifier *and* draft (revision/digest become None, resident
  False). ``wake_up(weights)`` maps weight memory back (zeros after level 2), ``wake_up(kv_cache)`` the KV
  cache; once both are awake the scheduler resumes by itself — unless it was paused before the sleep.
- ``/is_sleeping`` is true while asleep *or* paused; ``/health`` ignores both.
- Admission (``admit``/``withdraw``, our middleware's ``/rolloutfleet/*`` routes) is plain state of this
  core: a restarted engine gets a fresh core, so it starts un-admitted like a new API server process.
- RPCs (``collective_rpc``) run one at a time, as vLLM's engine core runs utility calls, and run to their
  end even when the HTTP client gave up (vLLM does not cancel them), so a second RPC queues behind a
  running load. vLLM's RPC ``timeout`` is honoured only with several workers (``tp_size > 1``: the
  multiprocessing executor stops waiting and the route answers 500 while the workers go on); a single
  worker ignores it, as vLLM's uni-process executor does. ``load_gate`` (tests only) holds a load open
  until it is set. Each RPC but the state read and the pre-flight (reads that change nothing) logs
  ``rpc_started``/``rpc_finished``.
- Loads: validation codes as the extension; the draft only after the verifier holds the same revision;
  a frozen draft is never loaded, only restored; a load into sleeping weights fails with ``load_failed``
  (our choice: real vLLM would write into unmapped memory and die — the extension must refuse first).
- Completions: token ids are a deterministic function of the verifier digest, token 0 forever when the
  weights are not resident (as measured after wake without reload); spec-decode acceptance is ~0.99 when
  the draft holds the verifier's revision, 0 when it does not, and 1.0 when nothing is resident.
- Weight-transfer sessions (``rolloutfleet.sim.transfer``, DESIGN.md §4b, docs/push.md): vLLM's session
  calls run as engine-core utility calls (``utility``: one at a time with the RPCs, to their end); the
  extension's ``rolloutfleet_push_begin``/``_end`` are RPCs. While parameters are on the ``meta`` device
  (a session open, or a failed update) a completion fails (500; real vLLM would raise in the forward pass)
  and a level-2 sleep fails (500, measured: vLLM saves the model's buffers to the host first). A destroyed
  target refuses loads (``destroyed``, as the extension) and a load while a session is open is refused
  (``busy``); ``wake_up(tags=weights)`` takes a failed update's parameters off ``meta`` (measured: fresh
  sessions work again), while the extension's verdict stays until a restart.
- Staged updates (``rolloutfleet.sim.staging``, docs/staging.md): ``rolloutfleet_stage`` answers at once
  and its background reader holds no RPC lock, so serving and other RPCs go on while it reads; a staged
  load (``rolloutfleet_load(..., staged=True)``, the commit) checks its path as a load does, then the
  stage (``not_staged``), then obeys every order rule of a load, copies the staged bytes (not the files)
  in ``Latencies.commit_s`` + bytes / ``commit_bytes_per_s``, and answers ``staged_mismatch`` (target left
  unknown, stage failed) under the ``corrupt_load`` fault. Load results carry ``staged``, the state
  carries the stage. ``EngineSpec.staging=False`` plays an older image.

Every state change goes to the engine's call log with a monotonic timestamp (``EngineLog``), including
which (verifier revision, draft revision, resident) pair generated every served token. ``until`` lets a
test wait for a state (e.g. ``blocks_held``) instead of sleeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import secrets
import time
import unicodedata
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import blake3

from rolloutfleet.sim import staging, transfer, weights
from rolloutfleet.sim.config import EngineSpec, Latencies, WeightsConfig


def reference_logprob(verifier_path: str, revision: int | None, prompt: list[int], i: int) -> float:
    """The simulated processed logprob of greedy token ``i`` with these weights.

    What a trainer's reference forward pass gives in the parity probe: tests compute expected logprobs
    with it, and an engine holding other weights answers something else.
    """
    h = blake3.blake3(f"logprob|{verifier_path}|{revision}|{prompt}|{i}".encode()).digest(4)
    return -round(int.from_bytes(h, "little") % 5000 / 1000.0, 3)


T = TypeVar("T")


class EngineLog:
    """The ordered call log of one simulated engine (kept across crashes/restarts)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._seq = itertools.count()

    def add(self, step: str, **fields: Any) -> dict[str, Any]:
        entry = {"seq": next(self._seq), "t": time.monotonic(), "step": step, **fields}
        self.entries.append(entry)
        return entry

    def since(self, seq: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["seq"] >= seq]


class RejectedError(Exception):
    """A request vLLM refuses (503 while paused/aborting)."""


class InternalError(Exception):
    """What FastAPI would turn into a plain ``500 Internal Server Error``."""


@dataclasses.dataclass
class _Request:
    rid: int
    holds_blocks: bool = False  # KV blocks are allocated when the scheduler first runs the request
    aborted: bool = False
    done: bool = False


class EngineCore:
    """The state of one simulated engine; a crash replaces it with a fresh one (a restarted container)."""

    def __init__(self, spec: EngineSpec, cfg: WeightsConfig, latencies: Latencies, log: EngineLog) -> None:
        self.spec, self.cfg, self.lat, self.log = spec, cfg, latencies, log
        self.paused = False
        self.pause_mode: str | None = None
        self.paused_by_sleep = False
        self.draining = False
        self.weights_awake = True
        self.kv_awake = True
        self.sleep_level = 0
        self.weight_version: str | None = None
        # What ``vllm serve`` loaded at start-up: real content, but the extension claims nothing about it.
        self.verifier = weights.Slot(content=("initial", spec.verifier_path, None))
        self.draft = None if spec.draft_path is None else weights.Slot(content=("initial", spec.draft_path, None))
        self.counters = dict.fromkeys(
            ("draft_tokens", "accepted", "drafts", "generation_tokens", "prompt_tokens", "success"), 0
        )
        self._changed = asyncio.Condition()
        self._rpc_lock = asyncio.Lock()
        self._rpc_tasks: set[asyncio.Task[Any]] = set()
        self.load_gate: asyncio.Event | None = None  # tests: a load waits for it before it completes
        # Our middleware's admission (``/rolloutfleet/admit``): in the API server's memory, so a new
        # process (a fresh core) starts un-admitted.
        self.admitted = False
        self.instance = secrets.token_hex(8)  # names this process in every admission answer
        self.admitted_revision: int | None = None
        self.admitted_since: float | None = None
        self._active: dict[int, _Request] = {}
        self._rid = itertools.count()
        self._parameters: dict[str, dict[str, transfer.Parameter] | None] = {}  # the models' parameters
        self.transfer = transfer.Transfer(self)
        self.staging = staging.Staging(spec, cfg, latencies, log, self._notify)

    # --- read-only views ---------------------------------------------------------------------------

    @property
    def resident(self) -> bool:
        """As the extension reports it: weights mapped and not lost (contents may still be unclaimed)."""
        draft_lost = self.draft is not None and (self.draft.lost or self.draft.unusable)
        return self.weights_awake and not (self.verifier.lost or self.verifier.unusable) and not draft_lost

    @property
    def is_sleeping(self) -> bool:
        return self.paused or self.sleep_level > 0 or not (self.weights_awake and self.kv_awake)

    @property
    def runnable(self) -> bool:
        return not self.paused and self.weights_awake and self.kv_awake

    @property
    def blocks_held(self) -> bool:
        """Some request holds KV blocks (a plain prefix-cache reset is refused)."""
        return any(r.holds_blocks for r in self._active.values())

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds (checked at every state change): order, not time."""
        async with self._changed:
            await self._changed.wait_for(predicate)

    def pair(self) -> dict[str, Any]:
        """What memory really holds now (not what is claimed): the pair a served token comes from."""
        return {
            "verifier": self.verifier.content_revision,
            "draft": None if self.draft is None else self.draft.content_revision,
            "resident": self.verifier.content is not None,
            "verifier_content": None if self.verifier.content is None else self.verifier.content[0],
            "draft_content": None if self.draft is None or self.draft.content is None else self.draft.content[0],
            "mixed": self.mixed,
        }

    @property
    def mixed(self) -> bool:
        """A co-updated draft that does not hold the verifier's checkpoint generation."""
        if self.draft is None or self.spec.draft_policy == "frozen" or self.verifier.content is None:
            return False
        return not weights.same_checkpoint_generation(self.verifier, self.draft)

    def admit(self, revision: int | None) -> None:
        """As ``rolloutfleet_worker.admission``: a retry for the same revision keeps ``since``."""
        if not self.admitted or revision != self.admitted_revision:
            self.admitted_since = round(time.time(), 3)
        self.admitted, self.admitted_revision = True, revision

    def withdraw(self) -> None:
        self.admitted, self.admitted_revision, self.admitted_since = False, None, None

    def admission(self) -> dict[str, Any]:
        """The body of ``/rolloutfleet/ready``, ``/admit`` and ``/withdraw``."""
        if not self.admitted:
            return {"admitted": False, "instance": self.instance}
        return {
            "admitted": True,
            "revision": self.admitted_revision,
            "since": self.admitted_since,
            "instance": self.instance,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "admitted": self.admitted,
            "admitted_revision": self.admitted_revision,
            "paused": self.paused,
            "pause_mode": self.pause_mode,
            "sleep_level": self.sleep_level,
            "weights_awake": self.weights_awake,
            "kv_awake": self.kv_awake,
            "weight_version": self.weight_version,
            "active_requests": len(self._active),
            "resident_reported": self.resident,
            "claimed_verifier": self.verifier.report(True),
            "claimed_draft": None if self.draft is None else self.draft.report(True),
            **self.transfer.summary(),
            **self.staging.summary(),
            **self.pair(),
        }

    def state_results(self) -> list[dict[str, Any]]:
        mapped = self.weights_awake
        draft = None
        if self.draft is not None:
            draft = {**self.draft.report(mapped), "policy": self.spec.draft_policy}
        base = {
            "ok": True,
            "resident": self.resident,
            "mapped": mapped,
            "verifier": self.verifier.report(mapped),
            "draft": draft,
            "draft_method": self.spec.draft_method if self.draft is not None else None,
            "shared_tensors": list(self.spec.shared_tensors),
            "session": None if self.transfer.push is None else self.transfer.push.report(),
            "group": self.transfer.group,
        }
        if self.spec.staging:  # an older image's state has no such key
            base["staged"] = self.staging.report()
        return [{**base, "rank": r} for r in range(self.spec.tp_size)]

    # --- scheduler ---------------------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def notify(self) -> None:
        """Wake whatever waits on a state change (``until``, held requests): for changes made from outside."""
        await self._notify()

    async def pause(self, mode: str, clear_cache: bool) -> None:
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"invalid pause mode {mode!r}")
        if mode == "wait":
            self.draining = True
            async with self._changed:
                await self._changed.wait_for(lambda: not self._active)
            self.draining = False
        if mode == "abort":
            self._abort_all()
        self.paused, self.pause_mode, self.paused_by_sleep = True, mode, False
        if clear_cache:  # vLLM: _reset_caches() with reset_running_requests=True, in every mode
            self.reset_prefix_cache(reset_running=True)
        await self._notify()

    async def resume(self) -> None:
        self.paused, self.pause_mode, self.paused_by_sleep = False, None, False
        await self._notify()

    def _abort_all(self) -> None:
        for req in self._active.values():
            req.aborted = True

    async def sleep(self, level: int, mode: str) -> None:
        if not self.spec.sleep_mode:
            raise InternalError("sleep mode is not enabled (--enable-sleep-mode)")
        if level not in (0, 1, 2):
            raise InternalError(f"invalid sleep level {level}")
        if level == 2 and self.transfer.forward_blocked:
            # vLLM copies the model's buffers to the host before discarding: a meta tensor has no data.
            raise InternalError("NotImplementedError: Cannot copy out of meta tensor; no data!")
        if not self.paused:
            self.paused, self.pause_mode, self.paused_by_sleep = True, mode, True
        if mode == "abort":
            self._abort_all()
        if level >= 1:
            self.kv_awake = False
            for req in self._active.values():
                req.holds_blocks = False  # the KV cache is gone: held requests will recompute
            self.weights_awake = False
        if level == 2:
            self.verifier.discard()
            if self.draft is not None:
                self.draft.discard()
        self.sleep_level = max(self.sleep_level, level)
        await self._notify()

    async def wake_up(self, tags: list[str] | None) -> None:
        if not self.spec.sleep_mode:
            raise InternalError("sleep mode is not enabled (--enable-sleep-mode)")
        wanted = tags or ["weights", "kv_cache"]
        for tag in wanted:
            if tag not in ("weights", "kv_cache"):
                raise InternalError(f"unknown wake_up tag {tag!r}")
        if not tags and self.weights_awake and not self.kv_awake:
            # vLLM 0.26 re-maps every allocation on a tag-less wake, including weights already mapped:
            # "CUDA Error: invalid argument" in cumem_allocator.cpp and HTTP 500 (measured on the H200).
            raise InternalError("CUDA Error: invalid argument at csrc/cumem_allocator.cpp:169")
        if "weights" in wanted and self.transfer.repair():
            await self._notify()
        asleep = [t for t in wanted if not (self.weights_awake if t == "weights" else self.kv_awake)]
        if not asleep and self.paused:
            # Waking what is already awake resumes a paused scheduler (measured on vLLM 0.26, H200): a
            # careless wake between the verifier and the draft loads would serve a mixed pair.
            self.paused, self.pause_mode, self.paused_by_sleep = False, None, False
            await self._notify()
            return
        if "weights" in wanted and not self.weights_awake:
            size = self.cfg.verifier_bytes + (self.cfg.draft_bytes if self.draft is not None else 0)
            if self.lat.wake_bytes_per_s > 0:
                await asyncio.sleep(size / self.lat.wake_bytes_per_s)
            self.weights_awake = True
        if "kv_cache" in wanted:
            self.kv_awake = True
        if self.weights_awake and self.kv_awake:
            self.sleep_level = 0
            if self.paused_by_sleep:  # vLLM resumes the scheduler it paused for the sleep, nothing else
                self.paused, self.pause_mode, self.paused_by_sleep = False, None, False
        await self._notify()

    def reset_prefix_cache(self, reset_running: bool) -> bool:
        """vLLM's scheduler: refused while blocks are held, unless running requests are preempted first."""
        held = [r for r in self._active.values() if r.holds_blocks]
        if held and not reset_running:
            return False
        for r in held:
            r.holds_blocks = False  # preempted: its KV is recomputed when it is scheduled again
        return True

    # --- extension RPCs ----------------------------------------------------------------------------

    async def rpc(
        self,
        method: str,
        kwargs: dict[str, Any],
        *,
        corrupt: bool,
        split: bool,
        rpc_timeout: float | None = None,
        fail_stage: bool = False,
    ) -> list[dict[str, Any]]:
        # The work runs in a task of its own: neither a client that gives up nor vLLM's RPC timeout stops it.
        task = asyncio.ensure_future(self._rpc_serialized(method, kwargs, corrupt=corrupt, fail_stage=fail_stage))
        self._rpc_tasks.add(task)
        task.add_done_callback(self._rpc_done)
        if rpc_timeout is not None and self.spec.tp_size > 1:
            try:
                results = await asyncio.wait_for(asyncio.shield(task), rpc_timeout)
            except TimeoutError:
                raise InternalError(f"TimeoutError: RPC call to {method} timed out.") from None
        else:
            results = await asyncio.shield(task)
        if split and len(results) > 1 and results[1].get("ok"):
            other = weights.synthetic_digest("split-rank")
            if "verifier" in results[1]:
                results[1] = {**results[1], "verifier": {**results[1]["verifier"], "digest": other}}
            elif isinstance(results[1].get("stage"), dict):  # a stage: rank 1 holds another revision's
                stage = results[1]["stage"]
                results[1] = {**results[1], "stage": {**stage, "revision": stage["revision"] + 1}}
            elif "digest" in results[1]:
                results[1] = {**results[1], "digest": other}
            else:  # a pre-flight: the ranks disagree about what the checkpoint holds
                results[1] = {**results[1], "bytes": int(results[1].get("bytes", 0)) + 1}
        return results

    def stop(self) -> None:
        """The engine process ends (crash, restart, removal): work still running ends with it."""
        for task in list(self._rpc_tasks):
            task.cancel()
        self.staging.stop()

    async def utility(self, work: Callable[[], Awaitable[T]]) -> T:
        """One engine-core utility call (vLLM's weight-transfer routes): serialized with the RPCs, in a task
        of its own that a client giving up does not stop; a crash or restart ends it (``stop``)."""

        async def serialized() -> T:
            async with self._rpc_lock:
                return await work()

        task = asyncio.ensure_future(serialized())
        self._rpc_tasks.add(task)
        task.add_done_callback(self._rpc_done)
        return await asyncio.shield(task)

    def _rpc_done(self, task: asyncio.Task[Any]) -> None:
        self._rpc_tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late failure nobody waits for is not an "unhandled" error

    async def _rpc_serialized(
        self, method: str, kwargs: dict[str, Any], *, corrupt: bool, fail_stage: bool = False
    ) -> list[dict[str, Any]]:
        async with self._rpc_lock:  # vLLM's engine core runs one utility call at a time
            if method == "rolloutfleet_state":
                return self.state_results()
            if method == "rolloutfleet_preflight":  # reads headers only: no state change, not logged
                return await self._preflight(kwargs)
            self.log.add("rpc_started", method=method)
            try:
                if method == "rolloutfleet_load":
                    return await self._load(kwargs, corrupt=corrupt)
                if method == "rolloutfleet_restore_draft":
                    return await self._load({**kwargs, "target": "draft", "restore": True}, corrupt=corrupt)
                if method in ("rolloutfleet_push_begin", "rolloutfleet_push_end", "rolloutfleet_push_group"):
                    return await self._push(method, kwargs)
                if method in ("rolloutfleet_stage", "rolloutfleet_unstage") and self.spec.staging:
                    return await self._stage(method, kwargs, fail=fail_stage)
                raise InternalError(f"AttributeError: 'Worker' object has no attribute {method!r}")
            finally:
                self.log.add("rpc_finished", method=method)

    async def _push(self, method: str, kw: dict[str, Any]) -> list[dict[str, Any]]:
        """The extension's session RPCs (``rolloutfleet.sim.transfer``), one result per rank."""
        try:
            if method == "rolloutfleet_push_group":
                result = self.transfer.push_group(kw)
            elif method == "rolloutfleet_push_begin":
                result = self.transfer.push_begin(kw)
            else:
                result = self.transfer.push_end(kw)
        except transfer.PushError as exc:
            return [{"ok": False, "error": {"code": exc.code, "message": exc.message}}] * self.spec.tp_size
        finally:
            await self._notify()
        return [{**result, "rank": r} for r in range(self.spec.tp_size)]

    async def _stage(self, method: str, kw: dict[str, Any], *, fail: bool) -> list[dict[str, Any]]:
        """``rolloutfleet_stage`` / ``rolloutfleet_unstage`` (``rolloutfleet.sim.staging``), one result per rank."""
        try:
            result = (
                await self.staging.stage_rpc(kw, fail=fail)
                if method == "rolloutfleet_stage"
                else self.staging.unstage()
            )
        except weights.LoadError as exc:
            return [{"ok": False, "error": {"code": exc.code, "message": exc.message}}] * self.spec.tp_size
        return [{**result, "rank": r} for r in range(self.spec.tp_size)]

    async def _load(self, kw: dict[str, Any], *, corrupt: bool) -> list[dict[str, Any]]:
        try:
            result = await self._load_checked(kw, corrupt=corrupt)
        except weights.LoadError as exc:
            return [{"ok": False, "error": {"code": exc.code, "message": exc.message}}] * self.spec.tp_size
        return [{**result, "rank": r} for r in range(self.spec.tp_size)]

    async def _load_checked(self, kw: dict[str, Any], *, corrupt: bool) -> dict[str, Any]:
        # Checks in the order of rolloutfleet_worker.extension._load, with the same codes.
        target, path = kw.get("target"), kw.get("path")
        restore = bool(kw.get("restore"))
        revision = None if restore else kw.get("revision")
        if "staged" in kw and not self.spec.staging:  # an older extension's method has no such parameter
            raise InternalError("TypeError: rolloutfleet_load() got an unexpected keyword argument 'staged'")
        if target not in ("verifier", "draft"):
            raise weights.LoadError("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
        if not restore and (not isinstance(revision, int) or isinstance(revision, bool) or revision < 0):
            raise weights.LoadError("invalid_revision", f"revision must be a non-negative integer, got {revision!r}")
        if not isinstance(path, str) or not path:
            raise weights.LoadError("invalid_path", "path must be a non-empty string")
        staged = None
        if kw.get("staged") is True:
            # As the extension: the path is checked as for any load (the directory must still be there),
            # then the commit is refused before any other rule, changing nothing, unless the stage holds
            # exactly this; its bytes come from the stage, not from the files.
            weights.check_path(path, self.cfg)
            staged = self.staging.commit_target(str(target), path, revision)
        if restore and self.spec.draft_path and path != self.spec.draft_path:
            raise weights.LoadError("invalid_path", f"the frozen draft comes from {self.spec.draft_path!r}")
        slot = self.verifier if target == "verifier" else self.draft
        if slot is None:
            raise weights.LoadError("no_draft", "this engine (or this pipeline rank) has no draft model")
        if self.transfer.vllm is not None or self.transfer.push is not None:
            raise weights.LoadError("busy", "a weight-transfer session is open: finish or abandon it first")
        if slot.unusable:
            raise weights.LoadError("destroyed", f"a failed weight-transfer session destroyed the {target}: restart")
        if target == "draft":
            frozen = self.spec.draft_policy == "frozen"
            if restore and not frozen:
                raise weights.LoadError("invalid_target", "restore_draft is only for a frozen draft")
            if not restore and frozen:
                raise weights.LoadError("frozen", "the draft policy is frozen: its weights are never overwritten")
            v = self.verifier
            if not restore and (v.lost or not v.verified or v.revision != revision or not self.weights_awake):
                held = v.revision if v.verified and not v.lost and self.weights_awake else None
                raise weights.LoadError("order", f"load the verifier at revision {revision} first (it holds {held})")
        if not self.weights_awake:
            # Real vLLM would write into unmapped memory; the extension refuses first (weights_mapped).
            raise weights.LoadError("order", f"the {target} weights are not mapped (asleep): wake_up(tags=weights)")
        if staged is None:
            weights.check_path(path, self.cfg)
        started = time.monotonic()
        slot.begin_load(path, revision)  # fail closed: a crash or error from here leaves no claim
        if staged is None:
            ckpt = await asyncio.to_thread(weights.resolve, path, target=target, config=self.cfg)
            rate = self.lat.load_bytes_per_s
        else:
            ckpt, rate = staged.checkpoint(), self.lat.commit_bytes_per_s
        # The fixed per-step latency was already spent by the server (``SimulatedEngine.run_step``), before
        # the action ran; here only the size-proportional part of the load (or commit) is simulated.
        duration = ckpt.bytes / rate if rate > 0 else 0.0
        if duration > 0:
            await asyncio.sleep(duration)
        if self.load_gate is not None:
            await self.load_gate.wait()
        if staged is not None and corrupt:
            # The extension hashes what reached the GPU and compares it with the staged digest: the corrupt
            # copy is caught, the target stays unknown (claimed by nothing), and the stage is failed.
            slot.content = ("corrupt", ckpt.path, revision)
            message = f"the {target} handed to the model does not hash to the staged digest {ckpt.digest}"
            self.staging.mismatched(str(target), message)
            await self._notify()
            raise weights.LoadError("staged_mismatch", message)
        digest = weights.synthetic_digest("corrupt:" + ckpt.path) if corrupt else ckpt.digest
        slot.finish_load(ckpt, revision, digest)
        if staged is not None:
            self.staging.committed(str(target), digest)
        await self._notify()
        extra = {"staged": staged is not None} if self.spec.staging else {}  # an older image has no such key
        return {
            "ok": True,
            "target": target,
            "revision": revision,
            "path": ckpt.path,
            "digest": digest,
            "bytes": ckpt.bytes,
            "seconds": round(time.monotonic() - started, 6),
            "tensors": ckpt.tensors,
            "skipped": list(self.spec.shared_tensors) if target == "draft" else [],
            **extra,
        }

    async def _preflight(self, kw: dict[str, Any]) -> list[dict[str, Any]]:
        """``rolloutfleet_preflight``: what the extension's pre-flight answers, on every rank alike.

        Checks in the order of ``rolloutfleet_worker.extension._preflight``, with its codes: the target
        (``invalid_target``); the path as a load checks it (``invalid_path``: not a non-empty string,
        control characters, relative, ``..``, no such directory); the target model (``no_draft`` on an
        engine without a draft); every ``*.safetensors`` header parses, tensors lie inside their files
        with the bytes their dtype and shape say, no name twice, every dtype loadable (``io``); then the
        element count (``incomplete``). Reads headers only (the project's header scanner,
        ``rolloutfleet_digest.scan_directory``), never tensor bytes, and changes nothing: no slot,
        no claim, no call-log entry (like the state read, it is logged only when a fault fires).

        What the simulator cannot model: allowed weight roots (it has none, so nothing is ``invalid_path``
        for lying outside them, nor for a shard linking out); torch's dtype support (every safetensors
        dtype the worker maps to torch is taken as loadable); and the model's parameters, which it takes
        to be the elements of the checkpoint the engine started from (``EngineSpec.verifier_path`` /
        ``draft_path``, shared tensors left out), compared unsharded whatever ``tp_size`` (a real rank
        compares against its own shards), and not compared at all when that checkpoint is synthetic or
        unreadable. Synthetic paths are not read: they report the configured size and tensor count.
        """
        try:
            result = await self._preflight_checked(kw)
        except weights.LoadError as exc:
            return [{"ok": False, "error": {"code": exc.code, "message": exc.message}}] * self.spec.tp_size
        return [dict(result) for _ in range(self.spec.tp_size)]

    async def _preflight_checked(self, kw: dict[str, Any]) -> dict[str, Any]:
        target, path = kw.get("target"), kw.get("path")
        if target not in ("verifier", "draft"):
            raise weights.LoadError("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
        if not isinstance(path, str) or not path:
            raise weights.LoadError("invalid_path", "path must be a non-empty string")
        if any(unicodedata.category(c) == "Cc" for c in path):
            raise weights.LoadError("invalid_path", f"path must not contain control characters: {path!r}")
        weights.check_path(path, self.cfg)
        if target == "draft" and self.draft is None:
            raise weights.LoadError("no_draft", "this engine (or this pipeline rank) has no draft model")
        if self._synthetic(path):
            size = self.cfg.verifier_bytes if target == "verifier" else self.cfg.draft_bytes
            return {"ok": True, "target": target, "path": path, "tensors": self.cfg.tensors, "bytes": size}
        shared = self.spec.shared_tensors if target == "draft" else ()
        infos = await asyncio.to_thread(weights.scan_headers, path)
        fed = [i for i in infos if not (shared and weights.matches_shared(i.name, shared))]
        need = await asyncio.to_thread(self._parameter_elements, str(target))
        have = sum(math.prod(i.shape) for i in fed)
        if need is not None and have < need:
            raise weights.LoadError(
                "incomplete",
                f"the checkpoint's {len(fed)} tensors hold {have} elements; the {target}'s parameters on this "
                f"rank need {need}: it cannot fill the model",
            )
        return {
            "ok": True,
            "target": target,
            "path": path,
            "tensors": len(infos),
            "bytes": sum(i.nbytes for i in infos),
        }

    def _synthetic(self, path: str) -> bool:
        root = self.cfg.synthetic_root
        return bool(root) and (path == root or path.startswith(str(root).rstrip("/") + "/"))

    def parameters(self, target: str) -> dict[str, transfer.Parameter] | None:
        """The simulated model's parameters: the tensors of the checkpoint it started from (None: unknown)."""
        if target not in self._parameters:
            initial = self.spec.verifier_path if target == "verifier" else self.spec.draft_path
            synthetic = initial is not None and self._synthetic(initial)
            self._parameters[target] = transfer.parameter_set(initial, synthetic)
        return self._parameters[target]

    def _parameter_elements(self, target: str) -> int | None:
        """The parameter elements a load must fill (shared ones left out; None: unknown)."""
        params = self.parameters(target)
        if params is None:
            return None
        shared = self.spec.shared_tensors if target == "draft" else ()
        return sum(math.prod(p.shape) for n, p in params.items() if not (shared and weights.matches_shared(n, shared)))

    # --- completions -------------------------------------------------------------------------------

    async def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """Generate ``max_tokens`` ids, one scheduler step at a time; return tokens, spans and pairs."""
        if (self.paused or self.draining) and self.pause_mode != "keep" and self.spec.reject_while_paused:
            raise RejectedError("the engine is paused")
        req = _Request(next(self._rid))
        self._active[req.rid] = req
        t_start = time.monotonic()
        tokens: list[int] = []
        logprobs: list[float] = []
        spans: list[dict[str, Any]] = []
        runs: list[dict[str, Any]] = []
        try:
            for i in range(max_tokens):
                async with self._changed:
                    await self._changed.wait_for(lambda: req.aborted or self.runnable)
                if req.aborted:
                    break
                if self.transfer.forward_blocked:
                    raise InternalError("the forward pass met parameters on the meta device (weight transfer)")
                if not req.holds_blocks:
                    req.holds_blocks = True  # allocated (again, after a preemption) when scheduled
                    await self._notify()
                tokens.append(self._token(prompt, i))
                logprobs.append(self._logprob(prompt, i))
                self._count_spec_step()
                self._extend(spans, self.weight_version, i)
                self._extend_run(runs, self.pair())
                if self.lat.token_s > 0:
                    await asyncio.sleep(self.lat.token_s)
        finally:
            del self._active[req.rid]
            await self._notify()
        self.counters["generation_tokens"] += len(tokens)
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["success"] += 0 if req.aborted else 1
        finish = "abort" if req.aborted else "length"
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "spans": spans,
            "runs": runs,
            "finish_reason": finish,
            "t_start": t_start,
        }

    def _token(self, prompt: list[int], i: int) -> int:
        content = self.verifier.content
        if content is None:
            return 0  # weights read zero after sleep(2) + wake without reload: token 0 forever
        h = blake3.blake3(f"{content}|{prompt}|{i}".encode()).digest(8)
        return 1 + int.from_bytes(h, "little") % (self.spec.vocab_size - 1)

    def _logprob(self, prompt: list[int], i: int) -> float:
        """The processed logprob of the greedy token: a function of the weights held (like a real engine)."""
        content = self.verifier.content
        if content is None:
            return 0.0  # all-zero weights give uniform logits... and token 0; what matters is it differs
        return reference_logprob(content[1], content[2], prompt, i)

    def _count_spec_step(self) -> None:
        if self.draft is None:
            return
        k = self.spec.num_speculative_tokens
        if self.verifier.content is None and self.draft.content is None:
            rate = 1.0  # zero verifier and zero draft agree on token 0: acceptance reads 1.0 (measured)
        elif self.verifier.content is None or self.draft.content is None:
            rate = 0.0
        elif self.spec.draft_policy == "frozen":
            rate = 0.6 if self.draft.good else 0.0
        else:
            rate = 0.99 if weights.same_checkpoint_generation(self.verifier, self.draft) else 0.0
        self.counters["drafts"] += 1
        self.counters["draft_tokens"] += k
        self.counters["accepted"] += round(k * rate)

    @staticmethod
    def _extend(spans: list[dict[str, Any]], version: str | None, i: int) -> None:
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})

    @staticmethod
    def _extend_run(runs: list[dict[str, Any]], pair: dict[str, Any]) -> None:
        if runs and all(runs[-1][k] == v for k, v in pair.items()):
            runs[-1]["tokens"] += 1
        else:
            runs.append({**pair, "tokens": 1})

    def metrics_text(self) -> str:
        labels = f'engine="0",model_name="{self.spec.served_model_name}"'
        c = self.counters
        state = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}.get(self.sleep_level, "awake")
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {sum(1 for r in self._active.values() if self.runnable)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {sum(1 for r in self._active.values() if not self.runnable)}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {c['prompt_tokens']}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {c['generation_tokens']}",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {c["success"]}',
            "# TYPE vllm:engine_sleep_state gauge",
            *(
                f'vllm:engine_sleep_state{{{labels},sleep_state="{s}"}} {1 if s == state else 0}'
                for s in ("awake", "weights_offloaded", "discard_all")
            ),
        ]
        if self.draft is not None:
            lines += [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {c['drafts']}",
                "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {c['draft_tokens']}",
                "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {c['accepted']}",
            ]
        return "\n".join(lines) + "\n"
