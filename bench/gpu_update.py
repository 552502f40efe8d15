"""Benchmark: one real vLLM engine through the sleep-mode weight update, per step, against two baselines.

Runs on the lent GPU (docs/gpu.md; never CI). Writes a random-init bf16 Llama of a few GB (few layers,
wide) as revisions A and B plus a small same-vocab draft, starts vLLM with our extension and DESIGN.md §4
flags, and measures in one run:

- ours: pause(keep) → sleep(2) → wake(weights) → load verifier → load draft → verify (observe + compare
  with the publisher's digests) → wake(kv_cache) → resume, timed per step through the operator's client,
  plus the load throughput the extension reports (bytes / seconds inside the worker);
- (a) the ceiling: a raw host→device copy of the same checkpoint bytes from pinned memory (and from
  pageable memory for reference), in this process, before the engine starts;
- (b) vLLM's stock reload: ``/collective_rpc`` ``reload_weights`` with ``weights_path`` (vLLM 0.26's
  ``GPUModelRunner.reload_weights``: its default loader reads the safetensors from disk and calls
  ``model.load_weights``; verifier only — it never restores the draft), after the same sleep/wake, and
  in place without sleep.

With ``--staged`` (or ``ROLLOUTFLEET_BENCH_STAGED=1`` in the environment, which reaches it through the
device script: ``ROLLOUTFLEET_BENCH_STAGED=1 bash scripts/gpu/run-device-suite.sh stage2 bench``) it also
measures staged updates (docs/staging.md, ``bench/staged_update.py``): in-process, right after the
ceiling, staging the verifier + draft with the default reader threads and with 16 and the commit of the
verifier from the stage (x the ceiling); through the server, the pause window of staged sleep-mode and
staged vs unstaged in-flight transactions, the time to stage while serving, and serving throughput idle
vs while staging. ``--skip-stock`` leaves out (b).

    python3 bench/gpu_update.py --out DIR            # on the device; see scripts/gpu/run-device-suite.sh

A report, not a test: DIR gets bench.json, gpu_update.md and vllm-bench.log. Targets: our verifier load
≥ 0.8 x the pinned ceiling and ≥ 1.0 x stock reload. GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
# The model writer and the server launcher are the GPU tier's own (tests/gpu/gpu_support.py).
sys.path[:0] = [
    str(REPO / "operator"),
    str(REPO / "worker_image"),
    str(REPO / "digest"),
    str(REPO / "tests" / "gpu"),
    str(REPO / "bench"),
]

import gpu_support  # noqa: E402
import loader_stages  # noqa: E402
import staged_update  # noqa: E402

from rolloutfleet.adapters.engine import EngineClient, EnginePool, EngineTimeouts  # noqa: E402
from rolloutfleet_digest import digest_directory, scan_directory  # noqa: E402

GB = 1e9


def checkpoint_bytes(path: str) -> int:
    return sum(t.nbytes for t in scan_directory(path))


def copy_ceiling(path: str, repeats: int) -> dict[str, Any]:
    """Host→device copies of exactly the checkpoint's tensor bytes: pinned (per tensor, and one buffer), pageable."""
    import torch

    infos = scan_directory(path)
    total = sum(t.nbytes for t in infos)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    offset = 0
    views = []
    for info in infos:
        with info.file.open("rb") as f:
            f.seek(info.offset)
            f.readinto(memoryview(pinned[offset : offset + info.nbytes].numpy()))
        views.append((offset, info.nbytes))
        offset += info.nbytes
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    targets = [device[o : o + n] for o, n in views]

    def timed(fn: Any) -> list[float]:
        out = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    def per_tensor() -> None:
        for (o, n), dst in zip(views, targets, strict=True):
            dst.copy_(pinned[o : o + n], non_blocking=True)

    one_buffer = timed(lambda: device.copy_(pinned, non_blocking=True))
    tensors = timed(per_tensor)
    pageable = torch.empty(total, dtype=torch.uint8)
    pageable.copy_(pinned)
    pageable_s = timed(lambda: device.copy_(pageable))
    return {
        "bytes": total,
        "pinned_one_buffer_GBps": total / min(one_buffer) / GB,
        "pinned_per_tensor_GBps": total / min(tensors) / GB,
        "pageable_GBps": total / min(pageable_s) / GB,
        "seconds": {"one_buffer": one_buffer, "per_tensor": tensors, "pageable": pageable_s},
    }


async def timed(label: str, steps: dict[str, float], coro: Any) -> Any:
    t0 = time.perf_counter()
    result = await coro
    steps[label] = time.perf_counter() - t0
    return result


async def ours(client: EngineClient, url: str, goal: dict[str, Any], revision: int) -> dict[str, Any]:
    """One sleep-mode transaction through the operator's client, each step timed."""
    s: dict[str, float] = {}
    t_pause = time.perf_counter()
    await timed("pause", s, client.pause(mode="keep", clear_cache=False))
    await timed("sleep(2)", s, client.sleep(2))
    await timed("wake weights", s, client.wake_up(["weights"]))
    v = await timed("load verifier", s, client.load("verifier", goal["verifier"], revision))
    d = await timed("load draft", s, client.load("draft", goal["draft"], revision))
    state = await timed("verify", s, client.observe())
    await timed("wake kv", s, client.wake_up(["kv_cache"]))
    await timed("resume", s, client.resume())
    pause_window = time.perf_counter() - t_pause  # pause → resume, as the operator's client sees it
    verified = (
        state.pair == (revision, revision)
        and state.verifier.digest == goal["verifier_digest"]
        and state.draft is not None
        and state.draft.digest == goal["draft_digest"]
    )
    tokens = (await gpu_support.generate(url, gpu_support.prompts(1), max_tokens=8))[0]
    return {
        "revision": revision,
        "steps_s": s,
        "total_s": sum(s.values()),
        "pause_window_s": pause_window,
        "verifier": {"bytes": v.bytes, "worker_s": v.seconds, "GBps_worker": v.bytes / v.seconds / GB},
        "draft": {"bytes": d.bytes, "worker_s": d.seconds},
        "verifier_GBps_http": v.bytes / s["load verifier"] / GB,
        "digests_verified": verified,
        "output_nonzero": any(t != 0 for t in tokens),
    }


async def stock(client: EngineClient, url: str, path: str, nbytes: int, sleep: bool) -> dict[str, Any]:
    """vLLM's own reload of the verifier from disk (``reload_weights``), after sleep/wake or in place."""
    s: dict[str, float] = {}
    await timed("pause", s, client.pause(mode="keep", clear_cache=False))
    if sleep:
        await timed("sleep(2)", s, client.sleep(2))
        await timed("wake weights", s, client.wake_up(["weights"]))
    error = None
    try:
        await timed(
            "reload_weights",
            s,
            client.collective_rpc("reload_weights", kwargs={"weights_path": path}, http_timeout=600),
        )
    except Exception as exc:  # a report: record what stock vLLM answered
        error = f"{type(exc).__name__}: {exc}"
    if sleep:
        await timed("wake kv", s, client.wake_up(["kv_cache"]))
    await timed("resume", s, client.resume())
    tokens = (await gpu_support.generate(url, gpu_support.prompts(1), max_tokens=8))[0]
    out: dict[str, Any] = {"sleep": sleep, "steps_s": s, "error": error, "output_nonzero": any(t != 0 for t in tokens)}
    if error is None:
        out["GBps_http"] = nbytes / s["reload_weights"] / GB
    return out


LOAD_LINE = re.compile(
    r"loaded (?P<target>verifier|draft) revision (?P<revision>\S+) .*?: (?P<gb>[\d.]+) GB in (?P<s>[\d.]+) s .*?"
    r"load_weights (?P<model>[\d.]+) s, waiting for tensors (?P<waiting>[\d.]+) s, finishing (?P<finish>[\d.]+) s"
)


def worker_loads(log: pathlib.Path) -> list[dict[str, Any]]:
    """The worker's own account of each load (its log line): seconds and where they went."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        {k: (v if k in ("target", "revision") else float(v)) for k, v in m.groupdict().items()}
        for m in LOAD_LINE.finditer(text)
    ]


def wait_for_warm_up(log: pathlib.Path, limit_s: float) -> dict[str, Any]:
    """Poll the engine's log for the warm-up's last line (bounce buffers ready, or a failure)."""
    deadline = time.monotonic() + limit_s
    marks = ("bounce buffers ready", "loader warm-up failed", "warm-up not started")
    seen: dict[str, Any] = {"done": False, "lines": []}
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        seen["lines"] = [
            line.strip() for line in text.splitlines() if "GPU hashing" in line or any(m in line for m in marks)
        ]
        if any(m in text for m in marks):
            seen["done"] = True
            return seen
        time.sleep(0.5)
    return seen


async def measure(args: argparse.Namespace, revs: dict[str, str], digests: dict[str, str], out: dict[str, Any]) -> None:
    nbytes = checkpoint_bytes(revs["verifier-b"])
    t0 = time.monotonic()
    server = gpu_support.start_server(
        revs["verifier-a"],
        revs["draft-a"],
        args.work / "vllm",
        args.out / "vllm-bench.log",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=1024,
        token="bench-token",
    )
    out["server_start_s"] = time.monotonic() - t0
    try:
        timeouts = EngineTimeouts(load=900.0, sleep=300.0, wake_up=300.0)
        async with EnginePool(token=server.token, timeouts=timeouts) as pool:
            client = pool.client(server.url)
            # The operator reads an engine's state long before its first update; that first read starts
            # the worker's loader warm-up (GPU hash self-test, pinned bounce buffers). Wait for it the way
            # a fleet does, so load 1 measures a steady worker, and report how long the warm-up took.
            t_warm = time.monotonic()
            await client.observe()
            out["warm_up"] = await asyncio.to_thread(wait_for_warm_up, args.out / "vllm-bench.log", 180.0)
            out["warm_up"]["seconds"] = time.monotonic() - t_warm
            print(json.dumps({"warm_up": out["warm_up"]}), flush=True)
            out["ours"] = []
            for k in range(args.repeats):
                pair = "b" if k % 2 == 0 else "a"
                goal = {
                    "verifier": revs[f"verifier-{pair}"],
                    "draft": revs[f"draft-{pair}"],
                    "verifier_digest": digests[f"verifier-{pair}"],
                    "draft_digest": digests[f"draft-{pair}"],
                }
                out["ours"].append(await ours(client, server.url, goal, k + 1))
                print(json.dumps(out["ours"][-1]), flush=True)
            out["stock"] = []
            for k in range(0 if args.skip_stock else args.repeats):
                path = revs["verifier-b" if k % 2 == 0 else "verifier-a"]
                out["stock"].append(await stock(client, server.url, path, nbytes, sleep=True))
                print(json.dumps(out["stock"][-1]), flush=True)
            for k in range(0 if args.skip_stock else args.repeats):
                path = revs["verifier-b" if k % 2 == 0 else "verifier-a"]
                out["stock"].append(await stock(client, server.url, path, nbytes, sleep=False))
                print(json.dumps(out["stock"][-1]), flush=True)
            if args.staged:
                goals = [
                    {
                        "verifier": revs[f"verifier-{pair}"],
                        "draft": revs[f"draft-{pair}"],
                        "verifier_digest": digests[f"verifier-{pair}"],
                        "draft_digest": digests[f"draft-{pair}"],
                    }
                    for pair in ("a", "b")
                ]
                out["staged_engine"] = await staged_update.guarded(
                    staged_update.engine(
                        client,
                        server.url,
                        goals,
                        gpu_support.prompts(args.staged_concurrency),
                        repeats=args.repeats,
                        window_s=args.staged_window,
                        sweep_window_s=args.staged_sweep_window,
                    )
                )
                print(json.dumps({"staged_engine": out["staged_engine"]}, default=str), flush=True)
    finally:
        server.stop()
        out["worker_loads"] = worker_loads(args.out / "vllm-bench.log")
        log_text = (args.out / "vllm-bench.log").read_text(errors="replace") if args.staged else ""
        out["worker_staged_lines"] = staged_update.worker_lines(log_text)


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    ours_gbps = [r["verifier"]["GBps_worker"] for r in out["ours"]]
    ours_http = [r["verifier_GBps_http"] for r in out["ours"]]
    stock_sleep = [r["GBps_http"] for r in out["stock"] if r["sleep"] and "GBps_http" in r]
    stock_inplace = [r["GBps_http"] for r in out["stock"] if not r["sleep"] and "GBps_http" in r]
    ceiling = out["ceiling"]["pinned_per_tensor_GBps"]
    ours_med = statistics.median(ours_http)
    summary = {
        "ours_verifier_GBps_worker_median": statistics.median(ours_gbps),
        "ours_verifier_GBps_http_median": ours_med,
        "ceiling_pinned_GBps": ceiling,
        "stock_reload_after_sleep_GBps_median": statistics.median(stock_sleep) if stock_sleep else None,
        "stock_reload_in_place_GBps_median": statistics.median(stock_inplace) if stock_inplace else None,
        "ratio_vs_ceiling": ours_med / ceiling,
    }
    if stock_sleep:
        summary["ratio_vs_stock"] = ours_med / statistics.median(stock_sleep)
    return summary


def report(out: dict[str, Any]) -> str:
    """The markdown report (bench/results/gpu_update.md)."""
    s = out["summary"]
    lines = [
        "# Weight update on a real GPU: our sleep-mode transaction vs the copy ceiling and vLLM's stock reload",
        "",
        f"- device: {out['device']}; vLLM {out['vllm_version']}; torch {out['torch_version']}; "
        f"host {out['host']['cpus']} CPUs",
        f"- model: random-init bf16 Llama, {out['shape']['layers']} layers, hidden {out['shape']['hidden']}, "
        f"intermediate {out['shape']['intermediate']}, {out['shape']['heads']}/{out['shape']['kv_heads']} heads, "
        f"vocab {out['shape']['vocab']}: **{out['verifier_bytes'] / GB:.2f} GB** of tensors (verifier); "
        f"draft {out['draft_bytes'] / GB:.2f} GB; files in the page cache (written just before)",
        f"- command: `{out['command']}`",
        f"- vLLM start-up: {out['server_start_s']:.0f} s; publisher digest (CPU, blake3): "
        f"{out['publisher_digest_GBps']:.1f} GB/s",
        f"- worker loader warm-up after the first state read (GPU hash self-test, pinned bounce buffers): "
        f"{out.get('warm_up', {}).get('seconds', float('nan')):.1f} s; "
        + "; ".join(f"`{line.split('rolloutfleet: ')[-1]}`" for line in out.get("warm_up", {}).get("lines", [])),
        "",
        "## Load throughput (verifier, GB/s = 10^9 B/s; median of the repeats)",
        "",
        "| path | GB/s | ratio of ours to it | target |",
        "|---|---|---|---|",
        f"| ours, `rolloutfleet_load` (HTTP round trip) | {s['ours_verifier_GBps_http_median']:.1f} | | |",
        f"| ours, inside the worker (`seconds` it reports) | {s['ours_verifier_GBps_worker_median']:.1f} | | |",
        f"| (a) pinned host→device copy, same bytes, per tensor | {s['ceiling_pinned_GBps']:.1f} | "
        f"{s['ratio_vs_ceiling']:.2f}x | ≥ 0.8x |",
        f"| (a) pinned, one buffer | {out['ceiling']['pinned_one_buffer_GBps']:.1f} | | |",
        f"| (a) pageable host→device copy | {out['ceiling']['pageable_GBps']:.1f} | | |",
    ]
    if s.get("stock_reload_after_sleep_GBps_median"):
        lines.append(
            f"| (b) stock `reload_weights` after sleep(2)+wake | {s['stock_reload_after_sleep_GBps_median']:.1f} | "
            f"{s['ratio_vs_stock']:.2f}x | ≥ 1.0x |"
        )
    if s.get("stock_reload_in_place_GBps_median"):
        lines.append(f"| (b) stock `reload_weights` in place | {s['stock_reload_in_place_GBps_median']:.1f} | | |")
    lines += ["", *verdict(out), *stages_section(out)]
    loads = [r for r in out.get("worker_loads", []) if r["target"] == "verifier"]
    if loads:
        lines += [
            "## Where each verifier load's time went (the worker's log line, seconds)",
            "",
            "| revision | total | load_weights' own code | waiting for the next tensor | after load_weights |",
            "|---|---|---|---|---|",
            *(
                f"| {r['revision']} | {r['s']:.3f} | {r['model']:.3f} | {r['waiting']:.3f} | {r['finish']:.3f} |"
                for r in loads
            ),
            "",
        ]
    lines += ["## Our transaction, per step (seconds)", ""]
    names = list(out["ours"][0]["steps_s"])
    lines.append("| repeat | " + " | ".join(names) + " | total | digests verified | output ok |")
    lines.append("|---" * (len(names) + 4) + "|")
    for r in out["ours"]:
        cells = " | ".join(f"{r['steps_s'][n]:.3f}" for n in names)
        lines.append(
            f"| {r['revision']} | {cells} | {r['total_s']:.3f} | {r['digests_verified']} | {r['output_nonzero']} |"
        )
    lines += ["", "## Stock reload, per step (seconds)", ""]
    for r in out["stock"]:
        steps = ", ".join(f"{k} {v:.3f}" for k, v in r["steps_s"].items())
        lines.append(f"- sleep={r['sleep']}: {steps}; error={r['error']}; output ok={r['output_nonzero']}")
    lines.append("")
    if "staged_summary" in out:
        lines += staged_update.report_lines(out)
    return "\n".join(lines)


def verdict(out: dict[str, Any]) -> list[str]:
    """The targets of issue 8, each with its measured value and met/missed."""
    s = out["summary"]
    ceiling, ratio = s["ceiling_pinned_GBps"], s["ratio_vs_ceiling"]
    rows = [
        f"| ours ≥ 0.8 x pinned ceiling (≥ {0.8 * ceiling:.1f} GB/s) | "
        f"{s['ours_verifier_GBps_http_median']:.1f} GB/s = {ratio:.2f}x | {'met' if ratio >= 0.8 else 'missed'} |"
    ]
    if "ratio_vs_stock" in s:
        rs = s["ratio_vs_stock"]
        rows.append(
            f"| ours ≥ 1.0 x stock `reload_weights` after sleep | {s['ours_verifier_GBps_http_median']:.1f} vs "
            f"{s['stock_reload_after_sleep_GBps_median']:.1f} GB/s = {rs:.2f}x | {'met' if rs >= 1.0 else 'missed'} |"
        )
    return ["## Verdict against the targets", "", "| target | measured | result |", "|---|---|---|", *rows, ""]


def stages_section(out: dict[str, Any]) -> list[str]:
    stages = out.get("loader_stages") or {}
    if "error" in stages or not stages:
        return [f"Loader stages not measured: {stages.get('error', 'skipped')}", ""]
    return loader_stages.report_lines(stages, out["ceiling"]["pinned_per_tensor_GBps"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/rf-bench"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--intermediate", type=int, default=28672)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--staged",
        action="store_true",
        default=os.environ.get("ROLLOUTFLEET_BENCH_STAGED", "").strip().lower() in ("1", "true", "yes", "on"),
        help="also measure staged updates (bench/staged_update.py)",
    )
    parser.add_argument("--staged-concurrency", type=int, default=16, help="clients of the steady load")
    parser.add_argument("--staged-window", type=float, default=8.0, help="seconds of each throughput window")
    parser.add_argument(
        "--staged-sweep-window",
        type=float,
        default=6.0,
        help="seconds of each staging-while-serving window of the tuning sweep (bench/staged_update.py SWEEP)",
    )
    parser.add_argument("--skip-stock", action="store_true", help="leave out vLLM's stock reload_weights (b)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    shape = gpu_support.LlamaShape(
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate
    )
    draft_shape = gpu_support.LlamaShape(hidden=2048, layers=2, heads=16, kv_heads=8, intermediate=8192)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "shape": dataclasses.asdict(shape),
        "command": "python3 " + " ".join(sys.argv),
    }
    t0 = time.monotonic()
    revs = {}
    for pair, seed in (("a", 1), ("b", 2)):
        revs[f"verifier-{pair}"] = str(
            gpu_support.write_llama(args.work / f"verifier-{pair}", shape, seed, device="cuda")
        )
        revs[f"draft-{pair}"] = str(
            gpu_support.write_llama(args.work / f"draft-{pair}", draft_shape, seed + 10, device="cuda")
        )
    out["write_checkpoints_s"] = time.monotonic() - t0
    out["verifier_bytes"] = checkpoint_bytes(revs["verifier-b"])
    out["draft_bytes"] = checkpoint_bytes(revs["draft-b"])
    t0 = time.monotonic()
    digests = {name: digest_directory(path) for name, path in revs.items()}
    out["publisher_digest_GBps"] = 2 * (out["verifier_bytes"] + out["draft_bytes"]) / (time.monotonic() - t0) / GB
    out["ceiling"] = copy_ceiling(revs["verifier-b"], repeats=5)
    torch.cuda.empty_cache()
    try:
        out["loader_stages"] = loader_stages.measure(revs["verifier-b"], digests["verifier-b"])
    except Exception as exc:  # a report: keep going to the engine measurements, say what failed
        out["loader_stages"] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.cuda.empty_cache()
    if args.staged:  # in the same run as the ceiling, before vLLM takes the GPU
        out["staged_in_process"] = staged_update.guarded_sync(
            staged_update.in_process,
            revs["verifier-b"],
            revs["draft-b"],
            {"verifier": digests["verifier-b"], "draft": digests["draft-b"]},
            out["ceiling"]["pinned_per_tensor_GBps"],
        )
        torch.cuda.empty_cache()
    print(json.dumps(out, default=str), flush=True)
    asyncio.run(measure(args, revs, digests, out))
    out["summary"] = summarize(out)
    if args.staged:
        out["staged_summary"] = staged_update.guarded_sync(staged_update.summarize, out)
    (args.out / "bench.json").write_text(json.dumps(out, indent=1, default=str))
    (args.out / "gpu_update.md").write_text(report(out))
    print(json.dumps(out["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
