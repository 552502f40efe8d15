"""Staged updates on the GPU (docs/staging.md, issue 17): the part of bench/gpu_update.py behind ``--staged``.

Called by ``bench/gpu_update.py`` (``in_process`` before vLLM starts, in the same run as the pinned copy
ceiling; ``engine`` against the running server through the operator's ``EngineClient``; ``summarize`` and
``report_lines`` for gpu_update.md). Owns the staged measurements:

- in-process (torch + the worker package, no vLLM): staging the verifier + draft into page-locked host
  memory (``staging.stage``) with the default reader threads and with 16; the commit of the verifier from
  the stage through ``loader.commit_into`` into stand-in GPU parameters (GB/s and x the pinned ceiling);
- through the server: the pause window (pause → resume, wall time as the operator's client sees it) of a
  staged sleep-mode transaction and of staged and unstaged in-flight transactions (a steady load of
  concurrent requests running); the time to stage while serving; serving throughput (completed tokens/s of
  that load) idle and while staging.

Every measurement is guarded: an exception becomes ``{"error": ...}`` in the JSON and the run goes on. The
pure helpers (log parsing, throughput windows, statistics, the report) are unit-tested on CPU
(tests/unit/worker/test_worker_staging_bench.py). GB/s are 10^9 bytes per second.

Alone, the in-process part needs only torch with CUDA, safetensors and blake3 (no vLLM, no operator): it
writes a verifier and a draft of the bench's shapes, measures the pinned ceiling itself and writes
DIR/staged_in_process.json and .md (~1 min on the H200):

    python3 bench/staged_update.py --out DIR
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
import statistics
import time
from collections.abc import Awaitable, Iterable
from typing import Any

GB = 1e9

# -- pure helpers ---------------------------------------------------------------------------------------

STAGE_LINE = re.compile(
    r"staged revision (?P<revision>\S+) \(.*?\): (?P<gb>[\d.]+) GB in (?P<s>[\d.]+) s "
    r"\((?P<gbps>[\d.]+) GB/s, (?P<threads>\d+) threads"
)
COMMIT_LINE = re.compile(
    r"committed (?P<target>verifier|draft) revision (?P<revision>\S+) .*?: (?P<gb>[\d.]+) GB in (?P<s>[\d.]+) s "
    r"\((?P<gbps>[\d.]+) GB/s.*?load_weights (?P<model>[\d.]+) s, waiting for tensors (?P<waiting>[\d.]+) s, "
    r"finishing (?P<finish>[\d.]+) s"
)
_TEXT_FIELDS = ("target", "revision")


def worker_lines(text: str) -> dict[str, list[dict[str, Any]]]:
    """The worker's own account of each stage and each commit (its log lines), numbers as floats."""

    def parse(pattern: re.Pattern[str]) -> list[dict[str, Any]]:
        return [
            {k: (v if k in _TEXT_FIELDS else float(v)) for k, v in m.groupdict().items()}
            for m in pattern.finditer(text)
        ]

    return {"stages": parse(STAGE_LINE), "commits": parse(COMMIT_LINE)}


def tokens_per_second(completions: Iterable[tuple[float, int]], start: float, end: float) -> float:
    """Tokens of the requests that completed within ``[start, end]``, per second of that window."""
    if end <= start:
        return 0.0
    return sum(n for t, n in completions if start <= t <= end) / (end - start)


def latency(requests: Iterable[tuple[float, float]], start: float, end: float) -> dict[str, Any] | None:
    """p50/p99/max wall time (s) of the requests that completed within ``[start, end]``; ``requests``:
    (completion time, wall seconds). Nearest-rank percentiles; None when none completed."""
    got = sorted(w for t, w in requests if start <= t <= end)
    if not got:
        return None

    def rank(q: float) -> float:
        return got[max(0, min(len(got) - 1, math.ceil(q * len(got)) - 1))]

    return {"n": len(got), "p50": rank(0.50), "p99": rank(0.99), "max": got[-1]}


def spread(values: Iterable[float | None]) -> dict[str, Any] | None:
    """min/median/max of the values that were measured (None when none was)."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return None
    return {"n": len(got), "min": min(got), "median": statistics.median(got), "max": max(got)}


def _median(values: Iterable[float | None]) -> float | None:
    s = spread(values)
    return None if s is None else float(s["median"])


def _ok(rows: Any) -> list[dict[str, Any]]:
    return [r for r in rows or [] if isinstance(r, dict) and "error" not in r]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """The staged numbers of one gpu_update run (``out`` is its JSON), next to today's unstaged ones."""
    ceiling = (out.get("ceiling") or {}).get("pinned_per_tensor_GBps")
    inproc = out.get("staged_in_process") or {}
    engine = out.get("staged_engine") or {}
    staging_rows = _ok(inproc.get("staging"))
    by_threads: dict[str, Any] = {}
    for row in staging_rows:
        key = str(row["threads"])
        by_threads.setdefault(key, []).append(row)
    commit = inproc.get("commit") or {}
    commit_best = commit.get("GBps_best")
    inflight = _ok(engine.get("inflight"))
    unstaged_inflight = _median(r["pause_window_s"] for r in inflight if not r["staged"])
    staged_inflight = _median(r["pause_window_s"] for r in inflight if r["staged"])
    unstaged_sleep = _median(r.get("pause_window_s") for r in _ok(out.get("ours")))
    staged_sleep = _median(r["pause_window_s"] for r in _ok(engine.get("sleep_mode")))
    idle = engine.get("idle") or {}
    serving = engine.get("staging_while_serving") or {}
    idle_tps = idle.get("tokens_per_s")
    sweep = []
    for row in engine.get("staging_sweep") or []:
        if not isinstance(row, dict):
            continue
        got = row.get("result") or {}
        lat = got.get("latency_s") or {}
        sweep.append(
            {
                "name": row.get("name"),
                "threads": row.get("threads"),
                "gbps": row.get("gbps"),
                "pin_chunk_bytes": row.get("pin_chunk_bytes"),
                "error": got.get("error"),
                "tokens_per_s": got.get("tokens_per_s"),
                "serving_ratio": _ratio(got.get("tokens_per_s"), idle_tps),
                "stage_s_median": _median(got.get("stage_s") or []),
                "stages": len(got.get("stage_s") or []),
                "latency_p50_s": lat.get("p50"),
                "latency_p99_s": lat.get("p99"),
            }
        )
    idle_lat = idle.get("latency_s") or {}
    after = engine.get("idle_after_sweep") or {}
    return {
        "ceiling_pinned_GBps": ceiling,
        "staging_in_process": {
            threads: {
                "seconds": spread(r["wall_s"] for r in rows),
                "GBps_median": _median(r["GBps"] for r in rows),
                "bytes": rows[0]["bytes_total"],
            }
            for threads, rows in by_threads.items()
        },
        "commit_verifier_GBps_best": commit_best,
        "commit_verifier_GBps_median": commit.get("GBps_median"),
        "commit_ratio_vs_ceiling": _ratio(commit_best, ceiling),
        "pause_window_sleep_mode_s": {"unstaged": unstaged_sleep, "staged": staged_sleep},
        "pause_window_inflight_s": {"unstaged": unstaged_inflight, "staged": staged_inflight},
        "sleep_mode_speedup": _ratio(unstaged_sleep, staged_sleep),
        "inflight_speedup": _ratio(unstaged_inflight, staged_inflight),
        "stage_while_serving_s": spread(serving.get("stage_s") or []),
        "tokens_per_s_idle": idle.get("tokens_per_s"),
        "tokens_per_s_staging": serving.get("tokens_per_s"),
        "serving_ratio_while_staging": _ratio(serving.get("tokens_per_s"), idle.get("tokens_per_s")),
        "latency_idle_s": {"p50": idle_lat.get("p50"), "p99": idle_lat.get("p99")},
        "tokens_per_s_idle_after_sweep": after.get("tokens_per_s"),
        "staging_sweep": sweep,
    }


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def report_lines(out: dict[str, Any]) -> list[str]:
    """The staged section of gpu_update.md (what was measured, and every error met)."""
    s = out.get("staged_summary") or {}
    if "error" in s:
        return ["## Staged updates", "", f"Not summarized: {s['error']}", ""]
    lines = [
        "## Staged updates (docs/staging.md; `--staged`)",
        "",
        "In-process (stand-in GPU parameters, files in the page cache, same run as the ceiling above):",
        "",
        "| measurement | value |",
        "|---|---|",
    ]
    for threads, row in (s.get("staging_in_process") or {}).items():
        secs = row.get("seconds") or {}
        label = "default threads" if threads == "None" else f"{threads} threads"
        median = _fmt(secs.get("median"), ".3f")
        lines.append(
            f"| stage verifier + draft ({row['bytes'] / GB:.2f} GB), {label} | median {median} s "
            f"({_fmt(row.get('GBps_median'), '.1f')} GB/s) |"
        )
    lines += [
        f"| commit the verifier (`loader.commit_into`), best | {_fmt(s.get('commit_verifier_GBps_best'), '.1f')} GB/s "
        f"= {_fmt(s.get('commit_ratio_vs_ceiling'))} x the pinned ceiling "
        f"({_fmt(s.get('ceiling_pinned_GBps'), '.1f')} GB/s) |",
        f"| commit the verifier, median | {_fmt(s.get('commit_verifier_GBps_median'), '.1f')} GB/s |",
    ]
    if "staged_engine" in out:
        lines += _engine_lines(s)
    errors = _errors(out)
    if errors:
        lines += ["", "Errors recorded (the run went on):", "", *(f"- {where}: {err}" for where, err in errors)]
    lines.append("")
    return lines


def _engine_lines(s: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "Through the vLLM server (operator's `EngineClient`; pause window = pause → resume wall time, medians):",
        "",
        "| transaction | unstaged (s) | staged (s) | unstaged / staged |",
        "|---|---|---|---|",
    ]
    for label, key, speed in (
        (
            "sleep mode (pause, sleep 2, wake, load/commit both, verify, wake kv, resume)",
            "pause_window_sleep_mode_s",
            "sleep_mode_speedup",
        ),
        (
            "in flight, steady load running (pause keep, load/commit both, verify, resume)",
            "pause_window_inflight_s",
            "inflight_speedup",
        ),
    ):
        row = s.get(key) or {}
        unstaged, staged = _fmt(row.get("unstaged"), ".3f"), _fmt(row.get("staged"), ".3f")
        lines.append(f"| {label} | {unstaged} | {staged} | {_fmt(s.get(speed))}x |")
    stage_s = s.get("stage_while_serving_s") or {}
    lines += [
        "",
        f"- time to stage verifier + draft while serving: median {_fmt(stage_s.get('median'), '.3f')} s "
        f"(min {_fmt(stage_s.get('min'), '.3f')}, max {_fmt(stage_s.get('max'), '.3f')}, n {stage_s.get('n', 0)})",
        "- serving throughput (completed tokens/s of the steady load): "
        f"idle {_fmt(s.get('tokens_per_s_idle'), '.0f')}, while staging {_fmt(s.get('tokens_per_s_staging'), '.0f')} "
        f"(= {_fmt(s.get('serving_ratio_while_staging'))} x idle)",
    ]
    sweep = s.get("staging_sweep") or []
    if sweep:
        idle_lat = s.get("latency_idle_s") or {}
        lines += [
            "",
            "Serving while staging, by the stage's tuning (`rolloutfleet_stage` kwargs; the same steady load, "
            f"stages back to back through each window; idle: {_fmt(s.get('tokens_per_s_idle'), '.0f')} tokens/s, "
            f"request p50 {_fmt(idle_lat.get('p50'), '.3f')} s, p99 {_fmt(idle_lat.get('p99'), '.3f')} s; "
            f"idle again after the sweep: {_fmt(s.get('tokens_per_s_idle_after_sweep'), '.0f')} tokens/s):",
            "",
            "| setting | threads | cap (GB/s) | pin chunk | tokens/s | x idle | stage s (median, n) "
            "| request p50 (s) | request p99 (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sweep:
            chunk = "whole area" if not r.get("pin_chunk_bytes") else f"{r['pin_chunk_bytes'] / 2**20:.0f} MiB"
            cap = "none" if not r.get("gbps") else _fmt(r.get("gbps"), "g")
            if r.get("error"):
                lines.append(f"| {r['name']} | {r.get('threads')} | {cap} | {chunk} | error: {r['error']} ||||")
                continue
            lines.append(
                f"| {r['name']} | {r.get('threads')} | {cap} | {chunk} | {_fmt(r.get('tokens_per_s'), '.0f')} "
                f"| {_fmt(r.get('serving_ratio'))} | {_fmt(r.get('stage_s_median'), '.3f')} ({r.get('stages')}) "
                f"| {_fmt(r.get('latency_p50_s'), '.3f')} | {_fmt(r.get('latency_p99_s'), '.3f')} |"
            )
    return lines


def _errors(node: Any, where: str = "") -> list[tuple[str, str]]:
    """Every ``{"error": ...}`` under the staged parts of the run, with where it was."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "error" and isinstance(v, str) and where.startswith("staged"):
                found.append((where, v))
            else:
                found += _errors(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _errors(v, f"{where}[{i}]")
    return found


async def guarded(coro: Awaitable[Any]) -> Any:
    """A measurement's result, or ``{"error": ...}`` when it raised (a report: keep going)."""
    try:
        return await coro
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def guarded_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- in-process: staging and the commit, no vLLM --------------------------------------------------------


def _stand_in(path: str) -> Any:
    """A module with parameters of the checkpoint's shapes on the GPU; ``load_weights`` copies into them in
    place (what vLLM's default weight loader does for an unsharded tensor) and returns their names."""
    import torch

    import rolloutfleet_digest as digest
    from rolloutfleet_worker import loader

    class StandIn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            infos = digest.scan_directory(path)
            self.index = {t.name: i for i, t in enumerate(infos)}
            self.flat = torch.nn.ParameterList(
                torch.nn.Parameter(
                    torch.empty(t.shape, dtype=loader.torch_dtype(t.dtype, t.file), device="cuda"),
                    requires_grad=False,
                )
                for t in infos
            )

        def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
            for name, tensor in weights:
                self.flat[self.index[name]].copy_(tensor)

    return StandIn()


class _Worker:
    """What ``staging`` asks of a vLLM worker: its verifier (on the GPU: the stage is page-locked) and draft."""

    def __init__(self, verifier: str, draft: str) -> None:
        self.verifier, self.draft = _stand_in(verifier), _stand_in(draft)

    def get_model(self) -> Any:
        return self.verifier

    def get_draft_model(self) -> Any:
        return self.draft


def _stage_once(
    worker: Any, revision: int, verifier: str, draft: str, threads: int | None, expected: dict[str, str]
) -> dict[str, Any]:
    from rolloutfleet_worker import options, staging

    staging.unstage(worker)  # not timed: the previous stage's memory goes first
    saved = os.environ.get(options.STAGE_THREADS_ENV)
    if threads is None:
        os.environ.pop(options.STAGE_THREADS_ENV, None)
    else:
        os.environ[options.STAGE_THREADS_ENV] = str(threads)
    try:
        t0 = time.perf_counter()
        answer = staging.stage(worker, revision, verifier, draft)
        if not answer["ok"]:
            return {"threads": threads, "error": f"stage refused: {answer['error']}"}
        while (state := staging.report(worker)) is not None and state["phase"] == "staging":
            time.sleep(0.002)
        wall = time.perf_counter() - t0
    finally:
        if saved is None:
            os.environ.pop(options.STAGE_THREADS_ENV, None)
        else:
            os.environ[options.STAGE_THREADS_ENV] = saved
    assert state is not None
    held = staging.held(worker)
    row = {
        "threads": threads,
        "effective_threads": held.threads if held is not None else None,
        "phase": state["phase"],
        "wall_s": wall,
        "worker_s": state["seconds"],
        "bytes_total": state["bytes_total"],
        "GBps": state["bytes_total"] / wall / GB,
        "pinned_bytes": held.pinned_bytes if held is not None else 0,
        "digests_match": state["verifier"]["digest"] == expected["verifier"]
        and state["draft"] is not None
        and state["draft"]["digest"] == expected["draft"],
    }
    if state["phase"] != "staged":
        row["error"] = f"stage ended {state['phase']}: {state['error']}"
    return row


def _commit(
    worker: Any, revision: int, verifier: str, expected: str, ceiling: float | None, repeats: int
) -> dict[str, Any]:
    import torch

    from rolloutfleet_worker import loader, options, staging

    checkpoint = staging.committable(worker, "verifier", verifier, revision)
    if isinstance(checkpoint, str):
        return {"error": f"nothing to commit: {checkpoint}"}
    opts = options.load_options(pin=True, probe=False)  # what the worker's commit uses
    seconds, splits, device_hashed, nbytes = [], [], 0, 0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outcome = loader.commit_into(worker.verifier, checkpoint, options=opts)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        if outcome.digest != expected:
            raise AssertionError(f"commit digest {outcome.digest} != publisher's {expected}")
        nbytes, device_hashed = outcome.bytes, outcome.device_hashed_bytes
        splits.append([outcome.model_seconds, outcome.waiting_seconds, outcome.finish_seconds])
    best = nbytes / min(seconds) / GB
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "GBps_best": best,
        "GBps_median": nbytes / statistics.median(seconds) / GB,
        "ratio_best_vs_ceiling": _ratio(best, ceiling),
        "device_hashed_bytes": device_hashed,
        "split_s": splits,  # per commit: [load_weights' own time, its waits for tensors, after it returned]
        "gpu_hash": opts.gpu_hash,
    }


def in_process(
    verifier: str,
    draft: str,
    expected: dict[str, str],
    ceiling: float | None,
    *,
    thread_counts: tuple[int | None, ...] = (None, 16),
    repeats: int = 2,
    commits: int = 4,
) -> dict[str, Any]:
    """Stage the verifier + draft (each thread count, ``repeats`` times), then commit the verifier
    ``commits`` times from one stage. ``expected``: the publisher's digests (``verifier``/``draft``)."""
    import torch

    from rolloutfleet_worker import loader_cuda, staging

    out: dict[str, Any] = {"staging": []}
    # The device hash compiles its kernels once per machine (~30 s): not inside a timed commit.
    out["gpu_hash_self_test"] = guarded_sync(loader_cuda.check_device_hash, torch.cuda.current_device())
    worker = _Worker(verifier, draft)
    revision = itertools.count(1)
    try:
        for threads in thread_counts:
            for _ in range(repeats):
                out["staging"].append(
                    guarded_sync(_stage_once, worker, next(revision), verifier, draft, threads, expected)
                )
        rev = next(revision)
        staged = guarded_sync(_stage_once, worker, rev, verifier, draft, None, expected)
        out["commit"] = (
            staged
            if "error" in staged
            else guarded_sync(_commit, worker, rev, verifier, expected["verifier"], ceiling, commits)
        )
    finally:
        out["released_bytes"] = staging.unstage(worker)
        del worker
        torch.cuda.empty_cache()
    return out


# -- through the vLLM server -----------------------------------------------------------------------------


class SteadyLoad:
    """``concurrency`` clients, each sending greedy requests of ``max_tokens`` back to back; records
    (completion time, completion tokens) of every request answered 200."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.completions: list[tuple[float, int]] = []
        self.latencies: list[tuple[float, float]] = []  # (completion time, request wall seconds)
        self.errors: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def _client(self, prompt: list[int]) -> None:
        import aiohttp

        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            while True:
                try:
                    sent = time.perf_counter()
                    async with session.post(self.url + "/v1/completions", json=body) as resp:
                        answer = await resp.json(content_type=None)
                    if resp.status != 200:
                        self.errors.append(f"HTTP {resp.status}: {str(answer)[:120]}")
                        await asyncio.sleep(0.1)
                        continue
                    usage = answer.get("usage") or {}
                    done = time.perf_counter()
                    self.completions.append((done, int(usage.get("completion_tokens", self.max_tokens))))
                    self.latencies.append((done, done - sent))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a report: count it, keep the load going
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.1)

    async def __aenter__(self) -> SteadyLoad:
        self.tasks = [asyncio.create_task(self._client(p)) for p in self.prompts]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def summary(self) -> dict[str, Any]:
        return {
            "clients": len(self.prompts),
            "max_tokens": self.max_tokens,
            "requests": len(self.completions),
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
        }


async def _stage_state(client: Any) -> dict[str, Any] | None:
    states = await client.extension_state()
    staged: dict[str, Any] | None = states[0].get("staged")
    return staged


async def _stage_and_wait(
    client: Any,
    revision: int,
    verifier: str,
    draft: str,
    limit_s: float = 180.0,
    tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Stage through the operator's client and poll the engine's state until the stage left ``staging``;
    the wall time as the client sees it, and the engine's own account. ``tuning``: ``rolloutfleet_stage``'s
    benchmark kwargs (``threads``, ``gbps``, ``pin_chunk_bytes``), sent over the raw RPC (the operator's
    ``stage`` never sends them)."""
    t0 = time.perf_counter()
    if tuning is None:
        await client.stage(revision, verifier, draft)
    else:
        kwargs = {"revision": revision, "verifier_path": verifier, "draft_path": draft, "limit_bytes": None, **tuning}
        results = await client.collective_rpc("rolloutfleet_stage", kwargs=kwargs, idempotent=True)
        refused = [r for r in results if not (isinstance(r, dict) and r.get("ok") is True)]
        if refused or not results:
            raise RuntimeError(f"rolloutfleet_stage{tuning} refused: {refused or results}")
    while True:
        state = await _stage_state(client)
        if state is not None and state["revision"] == revision and state["phase"] != "staging":
            break
        if time.perf_counter() - t0 > limit_s:
            raise TimeoutError(f"revision {revision} still staging after {limit_s} s: {state}")
        await asyncio.sleep(0.05)
    return {"wall_s": time.perf_counter() - t0, "state": state}


async def _timed(label: str, steps: dict[str, float], coro: Awaitable[Any]) -> Any:
    t0 = time.perf_counter()
    result = await coro
    steps[label] = time.perf_counter() - t0
    return result


async def _transaction(
    client: Any, goal: dict[str, Any], revision: int, *, staged: bool, sleep: bool
) -> dict[str, Any]:
    """One transaction, each step timed; ``pause_window_s`` is pause → resume as the client sees it."""
    out: dict[str, Any] = {"revision": revision, "staged": staged, "sleep": sleep}
    if staged:
        got = await _stage_and_wait(client, revision, goal["verifier"], goal["draft"])
        state = got["state"]
        out["stage_s"], out["stage_worker_s"] = got["wall_s"], state["seconds"]
        out["staged_digests_match"] = (
            state["phase"] == "staged"
            and state["verifier"]["digest"] == goal["verifier_digest"]
            and state["draft"] is not None
            and state["draft"]["digest"] == goal["draft_digest"]
        )
        if not out["staged_digests_match"]:  # the operator would not pause on a stage it cannot verify
            out["error"] = f"stage not usable: {state}"
            return out
    else:
        await client.unstage()  # today's path: nothing held in host memory
    verb = "commit" if staged else "load"
    s: dict[str, float] = {}
    t0 = time.perf_counter()
    await _timed("pause", s, client.pause(mode="keep", clear_cache=False))
    if sleep:
        await _timed("sleep(2)", s, client.sleep(2))
        await _timed("wake weights", s, client.wake_up(["weights"]))
    v = await _timed(f"{verb} verifier", s, client.load("verifier", goal["verifier"], revision, staged=staged))
    d = await _timed(f"{verb} draft", s, client.load("draft", goal["draft"], revision, staged=staged))
    state = await _timed("verify", s, client.observe())
    if sleep:
        await _timed("wake kv", s, client.wake_up(["kv_cache"]))
    await _timed("resume", s, client.resume())
    out["pause_window_s"] = time.perf_counter() - t0
    out["steps_s"] = s
    out["verifier"] = {"bytes": v.bytes, "worker_s": v.seconds, "GBps_worker": v.bytes / max(v.seconds, 1e-9) / GB}
    out["draft"] = {"bytes": d.bytes, "worker_s": d.seconds}
    out["digests_verified"] = (
        state.pair == (revision, revision)
        and state.verifier.digest == goal["verifier_digest"]
        and state.draft is not None
        and state.draft.digest == goal["draft_digest"]
    )
    out["stage_released"] = getattr(state, "staged", None) is None if staged else None
    return out


async def _window(client: Any, seconds: float) -> tuple[float, float]:
    """Poll the stage state for ``seconds`` (the same RPC traffic as while staging); the window's ends."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        await _stage_state(client)
        await asyncio.sleep(0.05)
    return t0, time.perf_counter()


async def _staging_while_serving(
    client: Any,
    load: SteadyLoad,
    goals: list[dict[str, Any]],
    revisions: Iterable[int],
    seconds: float,
    tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Stage pair after pair back to back for at least ``seconds`` while the load runs; staging times and
    the load's throughput and request latency over the whole window."""
    times: list[float] = []
    worker_times: list[float] = []
    nbytes = 0
    t0 = time.perf_counter()
    for revision, goal in zip(revisions, itertools.cycle(goals), strict=False):
        got = await _stage_and_wait(client, revision, goal["verifier"], goal["draft"], tuning=tuning)
        if got["state"]["phase"] != "staged":
            raise RuntimeError(f"stage ended {got['state']['phase']}: {got['state']['error']}")
        times.append(got["wall_s"])
        worker_times.append(got["state"]["seconds"])
        nbytes = got["state"]["bytes_total"]
        if time.perf_counter() - t0 >= seconds:
            break
    t1 = time.perf_counter()
    await client.unstage()
    return {
        "stage_s": times,
        "stage_worker_s": worker_times,
        "bytes_total": nbytes,
        "GBps_median": nbytes / statistics.median(times) / GB if times else None,
        "window_s": t1 - t0,
        "tokens_per_s": tokens_per_second(load.completions, t0, t1),
        "latency_s": latency(load.latencies, t0, t1),
    }


# The tuning swept while serving (``rolloutfleet_stage`` kwargs); the first is today's default.
MiB = 1 << 20
SWEEP: tuple[dict[str, Any], ...] = (
    {"name": "t4-uncapped", "threads": 4, "gbps": 0.0, "pin_chunk_bytes": None},
    {"name": "t2-uncapped", "threads": 2, "gbps": 0.0, "pin_chunk_bytes": None},
    {"name": "t1-uncapped", "threads": 1, "gbps": 0.0, "pin_chunk_bytes": None},
    {"name": "t4-cap2", "threads": 4, "gbps": 2.0, "pin_chunk_bytes": None},
    {"name": "t2-cap1", "threads": 2, "gbps": 1.0, "pin_chunk_bytes": None},
    {"name": "t4-uncapped-pin256MiB", "threads": 4, "gbps": 0.0, "pin_chunk_bytes": 256 * MiB},
)


async def _sweep(
    client: Any,
    load: SteadyLoad,
    goals: list[dict[str, Any]],
    revisions: Iterable[int],
    seconds: float,
    settings: Iterable[dict[str, Any]] = SWEEP,
    gap_s: float = 1.0,
) -> list[dict[str, Any]]:
    """``_staging_while_serving`` once per setting (each guarded), a short gap between them so the load
    settles after the previous stage's release."""
    rows = []
    for setting in settings:
        tuning = {k: setting[k] for k in ("threads", "gbps", "pin_chunk_bytes")}
        await asyncio.sleep(gap_s)
        result = await guarded(_staging_while_serving(client, load, goals, revisions, seconds, tuning))
        if "error" in result:
            await guarded(client.unstage())
        rows.append({**setting, "result": result})
    return rows


async def engine(
    client: Any,
    url: str,
    goals: list[dict[str, Any]],
    prompts: list[list[int]],
    *,
    first_revision: int = 100,
    repeats: int = 3,
    max_tokens: int = 64,
    window_s: float = 8.0,
    sweep_window_s: float = 6.0,
) -> dict[str, Any]:
    """The server-side staged measurements. ``goals``: the A and B pairs (paths and publisher digests),
    alternated so every transaction changes the weights; ``prompts``: one per concurrent client;
    ``window_s``: the idle window; ``sweep_window_s``: each ``SWEEP`` setting's window (at least; it ends
    with the stage under way)."""
    revision = itertools.count(first_revision)
    pick = itertools.cycle(goals)  # A, B, A, ...: every transaction changes the weights
    out: dict[str, Any] = {"sleep_mode": [], "inflight": []}
    for _ in range(repeats):
        out["sleep_mode"].append(
            await guarded(_transaction(client, next(pick), next(revision), staged=True, sleep=True))
        )
    load = SteadyLoad(url, prompts, max_tokens)
    async with load:
        await asyncio.sleep(3.0)  # let the load reach its steady state
        t0, t1 = await _window(client, window_s)
        out["idle"] = {
            "window_s": t1 - t0,
            "tokens_per_s": tokens_per_second(load.completions, t0, t1),
            "latency_s": latency(load.latencies, t0, t1),
        }
        out["staging_sweep"] = await guarded(_sweep(client, load, goals, revision, sweep_window_s))
        first = out["staging_sweep"][0]["result"] if isinstance(out["staging_sweep"], list) else out["staging_sweep"]
        out["staging_while_serving"] = first  # today's default (the first setting), as before the sweep
        await asyncio.sleep(1.0)
        t0, t1 = await _window(client, sweep_window_s)
        out["idle_after_sweep"] = {
            "window_s": t1 - t0,
            "tokens_per_s": tokens_per_second(load.completions, t0, t1),
            "latency_s": latency(load.latencies, t0, t1),
        }
        for _ in range(repeats):
            for staged in (False, True):  # today's and the staged transaction, alternately
                out["inflight"].append(
                    await guarded(_transaction(client, next(pick), next(revision), staged=staged, sleep=False))
                )
    out["load"] = load.summary()
    out["released_bytes"] = await guarded(client.unstage())
    return out


# -- alone: the in-process part without vLLM ------------------------------------------------------------


def _write(directory: Any, shapes: dict[str, tuple[int, ...]], shards: int) -> str:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(shapes)
    for k in range(shards):
        part = names[k * len(names) // shards : (k + 1) * len(names) // shards]
        tensors = {n: torch.randn(shapes[n], dtype=torch.bfloat16, device="cuda").cpu() for n in part}
        save_file(tensors, str(directory / f"model-{k + 1:05d}-of-{shards:05d}.safetensors"))
    return str(directory)


def _llama(hidden: int, inter: int, kv: int, layers: int, vocab: int = 2048) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def _ceiling(path: str, repeats: int = 5) -> dict[str, Any]:
    """Host→device copies of the checkpoint's tensor bytes from one pinned buffer, tensor by tensor (the
    ceiling bench/gpu_update.py reports as ``pinned_per_tensor_GBps``)."""
    import torch

    import rolloutfleet_digest as digest

    infos = digest.scan_directory(path)
    total = sum(t.nbytes for t in infos)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    spans, offset = [], 0
    for info in infos:
        with info.file.open("rb") as f:
            f.seek(info.offset)
            f.readinto(memoryview(pinned[offset : offset + info.nbytes].numpy()))
        spans.append((offset, info.nbytes))
        offset += info.nbytes
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for o, n in spans:
            device[o : o + n].copy_(pinned[o : o + n], non_blocking=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return {"bytes": total, "pinned_per_tensor_GBps": total / min(seconds) / GB, "seconds": seconds}


def main() -> int:
    import argparse
    import json
    import pathlib
    import sys

    sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "worker_image")]
    import torch

    import rolloutfleet_digest as digest

    parser = argparse.ArgumentParser(description="staging and the commit in-process on the GPU, no vLLM")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/rf-staged"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # The shapes of bench/gpu_update.py: a 3.49 GB verifier (2 layers, hidden 8192) and a small draft.
    verifier = _write(args.work / "verifier", _llama(8192, 28672, 1024, 2), shards=2)
    draft = _write(args.work / "draft", _llama(2048, 8192, 1024, 2), shards=1)
    expected = {"verifier": digest.digest_directory(verifier), "draft": digest.digest_directory(draft)}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch_version": torch.__version__}
    out["host"] = {"cpus": os.cpu_count()}
    out["ceiling"] = _ceiling(verifier)
    torch.cuda.empty_cache()
    out["staged_in_process"] = guarded_sync(
        in_process, verifier, draft, expected, out["ceiling"]["pinned_per_tensor_GBps"]
    )
    out["staged_summary"] = guarded_sync(summarize, out)
    (args.out / "staged_in_process.json").write_text(json.dumps(out, indent=1, default=str))
    (args.out / "staged_in_process.md").write_text("\n".join(report_lines(out)))
    print(json.dumps(out, indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
