"""Benchmark: 1,000 simulated engines in one process, driven through the operator's engine client.

Every engine answers ``/health`` and then completes a full sleep-mode transaction (pause keep -> sleep 2
-> wake weights -> load verifier -> load draft -> verify -> update_weight_version -> wake kv_cache ->
reset_prefix_cache -> resume), all engines concurrently. A report, not an assertion: it writes
``bench/results/engines_1000.md``.

The simulator runs in a separate process by default (``rolloutfleet sim serve``), so the client's numbers
are not mixed with the simulator's on one event loop; both processes' CPU time is reported. Simulated
latencies are zero (synthetic weights), so the wall time is pure software overhead: HTTP, JSON, asyncio.

    .venv/bin/python bench/engines_1000.py [--engines 1000] [--in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "operator"), str(REPO / "worker_image"), str(REPO / "digest")]

import aiohttp  # noqa: E402

from rolloutfleet.adapters.engine import EngineClient, EnginePool, EngineTimeouts  # noqa: E402
from rolloutfleet.sim import SimulatedFleet  # noqa: E402
from rolloutfleet.sim.commands import expand_range  # noqa: E402

TOKEN = "bench-token"


def ip_range(n: int) -> str:
    last = expand_range("127.1.0.1-127.1.255.255")[n - 1]
    return f"127.1.0.1-{last}"


async def transaction(c: EngineClient, revision: int) -> None:
    await c.pause("keep", clear_cache=False)
    await c.sleep(2)
    await c.wake_up(["weights"])
    v = await c.load("verifier", f"/synthetic/verifier/{revision}", revision)
    d = await c.load("draft", f"/synthetic/draft/{revision}", revision)
    state = await c.observe()
    assert state.verifier.digest == v.digest and state.draft is not None and state.draft.digest == d.digest
    await c.update_weight_version(str(revision))
    await c.wake_up(["kv_cache"])
    assert await c.reset_prefix_cache()
    await c.resume()


def proc_cpu(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def drive(urls: list[str], latencies: list[tuple[str, float, str]]) -> dict[str, float]:
    def hook(step: str, seconds: float, outcome: str) -> None:
        latencies.append((step, seconds, outcome))

    timeouts = EngineTimeouts(default=120, pause=120, sleep=120, wake_up=120, load=120, reset_prefix_cache=120)
    async with EnginePool(
        token=TOKEN, limit=len(urls) + 16, limit_per_host=2, timeouts=timeouts, on_latency=hook
    ) as pool:
        clients = [pool.client(u) for u in urls]
        t0 = time.perf_counter()
        await asyncio.gather(*(c.health() for c in clients))
        t_health = time.perf_counter() - t0
        n_health = len(latencies)
        t1 = time.perf_counter()
        await asyncio.gather(*(transaction(c, 2) for c in clients))
        t_tx = time.perf_counter() - t1
        n_tx = len(latencies) - n_health
        states = await asyncio.gather(*(c.observe() for c in clients))
        ok = sum(1 for s in states if s.serving and s.pair == (2, 2) and s.weight_version == "2")
    return {"t_health": t_health, "n_health": n_health, "t_tx": t_tx, "n_tx": n_tx, "ok": ok}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    addresses = expand_range(ip_range(args.engines))
    urls = [f"http://{ip}:{args.port}" for ip in addresses]
    latencies: list[tuple[str, float, str]] = []
    cpu0 = self_cpu()
    if args.in_process:
        async with SimulatedFleet(token=TOKEN) as fleet:
            t0 = time.perf_counter()
            await fleet.add_many([(ip, args.port) for ip in addresses])
            t_start = time.perf_counter() - t0
            res = await drive(urls, latencies)
        sim_cpu = 0.0
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
            f.write(TOKEN)
        cmd = [
            sys.executable,
            "-m",
            "rolloutfleet.cli",
            "sim",
            "serve",
            "--range",
            ip_range(args.engines),
            "--port",
            str(args.port),
            "--token-file",
            f.name,
        ]
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'worker_image'}:{REPO / 'digest'}"}
        t0 = time.perf_counter()
        # Blocking start-up on purpose: nothing else runs yet, and it is outside the measured part.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)  # noqa: ASYNC220
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            assert ready["engines"] == args.engines, ready
            t_start = time.perf_counter() - t0
            sim_cpu0 = proc_cpu(proc.pid)
            res = await drive(urls, latencies)
            sim_cpu = proc_cpu(proc.pid) - sim_cpu0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            os.unlink(f.name)
    client_cpu = self_cpu() - cpu0
    per_step: dict[str, list[float]] = {}
    for step, secs, outcome in latencies:
        assert outcome == "ok", (step, outcome)
        per_step.setdefault(step.split(":")[0], []).append(secs)
    return {
        **res,
        "t_start": t_start,
        "client_cpu": client_cpu,
        "sim_cpu": sim_cpu,
        "per_step": per_step,
        "all": [s for _, s, _ in latencies],
    }


def report(args: argparse.Namespace, r: dict) -> str:
    n = args.engines
    reqs = r["n_health"] + r["n_tx"]
    mode = "in one process with the client" if args.in_process else "in a separate process (`rolloutfleet sim serve`)"
    rows = "\n".join(
        f"| {step} | {len(v)} | {1000 * statistics.median(v):.1f} | {1000 * pct(v, 0.99):.1f} |"
        for step, v in sorted(r["per_step"].items())
    )
    cpu_total = r["client_cpu"] + r["sim_cpu"]
    tx = f"{r['t_tx']:.2f} s ({r['n_tx']} requests, {r['n_tx'] / r['t_tx']:.0f} req/s, {n / r['t_tx']:.0f} engines/s)"
    lat = f"p50 {1000 * statistics.median(r['all']):.1f} ms, p99 {1000 * pct(r['all'], 0.99):.1f} ms"
    return f"""# 1,000 simulated engines: health + full sleep-mode transaction

A report, not an assertion. Produced by `bench/engines_1000.py`.

## Command

```
{" ".join(["cd /work/main &&", ".venv/bin/python", "bench/engines_1000.py", *sys.argv[1:]])}
```

## Machine

- CPU: {platform.processor() or "?"} / `{_cpu_model()}`, {os.cpu_count()} cores (shared with other work
  while this ran; load average at start {os.getloadavg()[0]:.2f})
- Python {platform.python_version()}, aiohttp {aiohttp.__version__}, Linux {platform.release()}

## Setup

- {n} simulated engines on 127.1.0.1 onwards, port {args.port}, {mode}; synthetic weights, all
  simulated latencies zero, so every number below is software overhead (HTTP, JSON, asyncio).
- One `EnginePool` (one aiohttp session, connector limit {n + 16}, 2 per host), bearer token on every
  control route; all engines driven concurrently.
- Transaction per engine: pause(keep) -> sleep(2) -> wake(weights) -> load verifier -> load draft ->
  observe (4 reads) + digest check -> update_weight_version -> wake(kv_cache) -> reset_prefix_cache ->
  resume, then a final observe of every engine.

## Results

| measure | value |
|---|---|
| engines started (sim process ready) | {r["t_start"]:.2f} s |
| `/health` on all {n} engines | {r["t_health"]:.2f} s ({r["n_health"] / r["t_health"]:.0f} req/s) |
| full transaction on all {n} engines | {tx} |
| engines verified serving (2, 2), version "2" | {r["ok"]} / {n} |
| client CPU | {r["client_cpu"]:.2f} s ({1e3 * r["client_cpu"] / reqs:.2f} ms per request) |
| simulator CPU | {r["sim_cpu"]:.2f} s ({1e3 * r["sim_cpu"] / reqs:.2f} ms per request) |
| CPU per request, both sides | {1e3 * cpu_total / reqs:.2f} ms |
| request latency (client-side, all) | {lat} |

Per step (client-side latency of each HTTP request, ms, with {n} engines in flight at once):

| step | requests | p50 ms | p99 ms |
|---|---|---|---|
{rows}

## Reading

Latencies are queueing on 2 shared cores, not engine work: with every engine in flight at once the
p50 is the time to serve the whole wave. The useful number is CPU per request: it bounds what the
operator's engine I/O costs at 1,000 pods against engine load times of seconds to minutes.
"""


def _cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--in-process", action="store_true", help="run the simulator in this process")
    parser.add_argument("--out", default=str(REPO / "bench/results/engines_1000.md"))
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8 * args.engines)), hard))
    r = asyncio.run(main_async(args))
    text = report(args, r)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0 if r["ok"] == args.engines else 1


if __name__ == "__main__":
    sys.exit(main())
