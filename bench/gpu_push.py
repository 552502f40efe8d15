"""Benchmark: the 3.49 GB model of bench/gpu_update pushed by CUDA IPC vs loaded by path, one server, one run.

Runs on the lent GPU (docs/gpu.md; never CI). Writes bench/gpu_update's random-init bf16 Llama (revisions A
and B, 3.49 GB verifier, 0.27 GB draft), starts one vLLM 0.26 with our extension, DESIGN.md §4 flags and
``--weight-transfer-config '{"backend":"ipc"}'`` (scripts/gpu/push_proof.py's ``start_server``), and this
process is both the operator and the trainer. The trainer holds both revisions' tensors on the GPU
(``load_file(device="cuda")``), pins their digests with ``rolloutfleet.trainer.digest.digest_tensors`` and
sends them with the trainer library's ``IpcSender`` (prepare → POST /update_weights → release). Transactions
alternate A/B, each measured per step:

- ``path``: the operator's client, step by step, as bench/gpu_update.py does (pause, sleep(2), wake weights,
  load verifier, load draft, verify, wake kv, resume);
- ``path_planner``: the same goal driven by observe → ``planning.transaction.next_step`` →
  ``reconcile.executor.execute`` (what the operator runs per pod);
- ``push``: a pushed goal (sleep mode) through the same loop with a ``SessionContext``: Pause, Sleep,
  WakeWeights, OpenVerifierSession, AwaitPush (the trainer sends), EndSession, then the draft session, Resume;
- ``push_inplace``: the same without sleep (Pause, sessions, Resume).

After each: the engine's digests = ``digest_directory`` of the files = the trainer's, and greedy output
equal to the fresh server's (A) or the first path load's (B). Writes DIR/push.json, push.md, vllm-push.log.

    python3 bench/gpu_push.py --out DIR        # on the device; scripts/gpu/run-device-suite.sh stage2 push
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import re
import statistics
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts" / "gpu"), str(REPO / "bench")]

import gpu_update  # noqa: E402  (puts operator/, worker_image/, tests/gpu on sys.path)
import push_proof  # noqa: E402
from gpu_update import GB, gpu_support  # noqa: E402

from rolloutfleet.adapters.engine import EnginePool, EngineTimeouts  # noqa: E402
from rolloutfleet.api.fleet import StepTimeouts  # noqa: E402
from rolloutfleet.planning import transaction  # noqa: E402
from rolloutfleet.reconcile import executor  # noqa: E402
from rolloutfleet.trainer.digest import digest_tensors  # noqa: E402
from rolloutfleet.trainer.senders import IpcSender  # noqa: E402
from rolloutfleet_digest import digest_directory  # noqa: E402

KINDS = ("path", "push", "path_planner", "push", "push_inplace")  # odd length: every kind meets A and B
RECEIVED = re.compile(
    r"received (?P<target>verifier|draft) revision (?P<revision>\d+) \(epoch (?P<epoch>\d+)\): (?P<tensors>\d+) "
    r"tensors, (?P<gb>[\d.]+) GB in (?P<calls>\d+) calls, (?P<gpu_gb>[\d.]+) GB hashed on the GPU, session open "
    r"(?P<open_s>[\d.]+) s"
)


@dataclasses.dataclass
class Trainer:
    """Holds both revisions on the GPU and sends one target into the session it is shown."""

    address: str
    held: dict[str, list[tuple[str, Any]]]  # checkpoint path -> its tensors on the GPU
    sender: IpcSender = dataclasses.field(default_factory=IpcSender)

    def send(self, path: str, target: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        prepared = self.sender.prepare(self.held[path], target)
        t1 = time.perf_counter()
        self.sender.send(self.address, push_proof.TOKEN, prepared, 600.0)
        t2 = time.perf_counter()
        self.sender.release(prepared)
        t3 = time.perf_counter()
        return {
            "bytes": prepared.nbytes,
            "tensors": prepared.tensors,
            "body_bytes": len(prepared.body),
            "prepare_s": t1 - t0,
            "post_s": t2 - t1,
            "release_s": t3 - t2,
            "GBps_post": prepared.nbytes / (t2 - t1) / GB,
        }


async def planner(client: Any, goal: Any, trainer: Trainer, epochs: push_proof.Epochs) -> dict[str, Any]:
    """observe → next_step → execute until Done, every step and every observe timed."""
    steps: list[tuple[str, float]] = []
    sends: list[dict[str, Any]] = []
    observe_s: list[float] = []
    epoch = 0
    t_start = time.perf_counter()
    for _ in range(60):
        t0 = time.perf_counter()
        state = await client.observe()
        observe_s.append(time.perf_counter() - t0)
        decision = transaction.next_step(goal, state)
        step = decision.step
        if step.value == "Done":
            break
        if step == transaction.Step.AWAIT_PUSH:
            session = state.session
            target = str(session.target)
            path = goal_paths(goal)[target]
            t0 = time.perf_counter()
            sent = await asyncio.to_thread(trainer.send, path, target)
            steps.append((f"push {target}", time.perf_counter() - t0))
            sends.append(sent | {"target": target, "epoch": session.epoch})
            field = "verifier_epoch" if target == "verifier" else "draft_epoch"
            goal = dataclasses.replace(goal, push=dataclasses.replace(goal.push, **{field: session.epoch}))
            continue
        if step not in transaction.ACTIONS or step == transaction.Step.RESTART_POD:
            raise RuntimeError(f"planner said {step.value}: {decision.reason}")
        if step in (transaction.Step.OPEN_VERIFIER_SESSION, transaction.Step.OPEN_DRAFT_SESSION):
            epoch = epochs.next()
        ctx = executor.SessionContext(epoch=epoch, session=state.session, init_info=None, why=decision.reason)
        t0 = time.perf_counter()
        await executor.execute(client, step, goal, StepTimeouts(), ctx)
        steps.append((step.value, time.perf_counter() - t0))
    else:
        raise RuntimeError("no Done after 60 decisions")
    return {
        "steps_s": steps,
        "observe_s": observe_s,
        "total_s": time.perf_counter() - t_start,
        "sends": sends,
    }


PATHS: dict[int, dict[str, str]] = {}  # revision -> the checkpoints a pushed goal's trainer sends


def goal_paths(goal: Any) -> dict[str, str]:
    return PATHS[goal.revision]


async def measure(args: argparse.Namespace, revs: dict[str, str], digests: dict[str, str], out: dict[str, Any]) -> None:
    log = args.out / "vllm-push.log"
    t0 = time.monotonic()
    server = push_proof.start_server(args.work / "vllm", log, revs["verifier-a"], revs["draft-a"])
    out["server_start_s"] = time.monotonic() - t0
    batch = gpu_support.prompts(4)
    try:
        async with EnginePool(
            token=push_proof.TOKEN, timeouts=EngineTimeouts(load=900.0, sleep=300.0, wake_up=300.0)
        ) as pool:
            client = pool.client(server.url)
            refs = {"a": await gpu_support.generate(server.url, batch, max_tokens=16)}  # vLLM's own load of A
            t_warm = time.monotonic()
            await client.observe()  # starts the worker's loader warm-up, as a fleet's first state read does
            out["warm_up"] = await asyncio.to_thread(gpu_update.wait_for_warm_up, log, 180.0)
            out["warm_up"]["seconds"] = time.monotonic() - t_warm
            # The trainer: both revisions on the GPU, loaded after the server's start (its memory profiling
            # must not see another process change its usage), digests over the tensors it holds.
            t0 = time.monotonic()
            held = hold(revs)
            out["trainer_load_s"] = time.monotonic() - t0
            out["trainer_digest"] = {}
            for name in ("verifier-b", "verifier-a", "verifier-b", "draft-a", "draft-b"):
                t0 = time.perf_counter()
                d = digest_tensors(held[revs[name]])
                out["trainer_digest"].setdefault(name, []).append(
                    {"digest": d, "equals_files": d == digests[name], "seconds": time.perf_counter() - t0}
                )
            out["engine_hash_in_process"] = hash_probe(held[revs["verifier-b"]])
            trainer = Trainer(server.url.removeprefix("http://"), held)
            epochs = push_proof.Epochs()
            out["runs"] = []
            pair = "a"
            for k in range(args.repeats * len(KINDS)):
                kind = KINDS[k % len(KINDS)]
                pair = "b" if pair == "a" else "a"
                revision = k + 1
                v, d = revs[f"verifier-{pair}"], revs[f"draft-{pair}"]
                by_path = {v: digests[f"verifier-{pair}"], d: digests[f"draft-{pair}"]}
                record: dict[str, Any] = {"kind": kind, "pair": pair.upper(), "revision": revision}
                if kind == "path":
                    goal = {"verifier": v, "draft": d, "verifier_digest": by_path[v], "draft_digest": by_path[d]}
                    r = await gpu_update.ours(client, server.url, goal, revision)
                    record |= {"steps_s": list(r["steps_s"].items()), "total_s": r["total_s"]}
                    record["verifier_GBps_http"] = r["verifier_GBps_http"]
                else:
                    if kind == "path_planner":
                        goal = push_proof.path_goal(revision, by_path, v, d, sleep_mode=True)
                    else:
                        PATHS[revision] = {"verifier": v, "draft": d}
                        goal = push_proof.push_goal(revision, by_path, v, d, sleep_mode=kind == "push")
                    r = await planner(client, goal, trainer, epochs)
                    record |= {k2: r[k2] for k2 in ("steps_s", "observe_s", "total_s", "sends")}
                state = await client.observe()
                record["engine_digests"] = [state.verifier.digest, state.draft.digest if state.draft else None]
                record["digests_equal_files"] = record["engine_digests"] == [by_path[v], by_path[d]]
                record["revision_held"] = [state.verifier.revision, state.draft.revision if state.draft else None]
                outputs = await gpu_support.generate(server.url, batch, max_tokens=16)
                refs.setdefault(pair, outputs)  # B: the first path load's output
                record["output_equal_reference"] = outputs == refs[pair]
                out["runs"].append(record)
                print(json.dumps(record, default=str), flush=True)
            out["a_differs_from_b"] = refs.get("a") != refs.get("b")
    finally:
        server.stop()
        text = log.read_text(errors="replace") if log.exists() else ""
        out["worker_loads"] = gpu_update.worker_loads(log)
        out["worker_received"] = [m.groupdict() for m in RECEIVED.finditer(text)]
        out["extension_log"] = [line for line in text.splitlines() if "rolloutfleet:" in line][-80:]


def hold(revs: dict[str, str]) -> dict[str, list[tuple[str, Any]]]:
    """The trainer's model: every revision's tensors on the GPU, in file then name order (push_proof's)."""
    import torch

    held = {
        revs[name]: push_proof.load_tensors(revs[name]) for name in ("verifier-a", "draft-a", "verifier-b", "draft-b")
    }
    torch.cuda.synchronize()
    return held


def hash_probe(tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    """The extension's own hash of received tensors (``transfer.hash_received``), on these GPU tensors."""
    import torch

    from rolloutfleet_worker import transfer

    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        transfer.hash_received([t for _, t in tensors], lambda _device: True)
        out.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return {"seconds": out, "GBps_best": nbytes / min(out) / GB}


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(KINDS):
        runs = [r for r in out["runs"] if r["kind"] == kind]
        steps: dict[str, list[float]] = {}
        for r in runs:
            for name, s in r["steps_s"]:
                steps.setdefault(name, []).append(s)
        by_kind[kind] = {
            "n": len(runs),
            "total_s": [r["total_s"] for r in runs],
            "total_median_s": statistics.median(r["total_s"] for r in runs),
            "steps_median_s": {n: statistics.median(v) for n, v in steps.items()},
            "all_digests_equal": all(r["digests_equal_files"] for r in runs),
            "all_outputs_equal": all(r["output_equal_reference"] for r in runs),
        }
        posts = [s for r in runs for s in r.get("sends", []) if s["target"] == "verifier"]
        if posts:
            by_kind[kind]["verifier_post_GBps_median"] = statistics.median(s["GBps_post"] for s in posts)
    return by_kind


def report(out: dict[str, Any]) -> str:
    s = out["summary"]
    lines = [
        "# Pushed by CUDA IPC vs loaded by path: the 3.49 GB model, one server, one run (generated)",
        "",
        f"- {out['date']}; device {out['device']}; vLLM {out['vllm_version']}; torch {out['torch_version']}",
        f"- verifier {out['verifier_bytes'] / GB:.2f} GB, draft {out['draft_bytes'] / GB:.2f} GB; server start "
        f"{out['server_start_s']:.0f} s; warm-up {out['warm_up'].get('seconds', 0):.1f} s",
        f"- trainer: both revisions to the GPU {out['trainer_load_s']:.1f} s; digest_tensors: "
        + "; ".join(f"{k} " + ", ".join(f"{x['seconds']:.3f} s" for x in v) for k, v in out["trainer_digest"].items()),
        f"- the extension's hash_received on the 3.49 GB verifier in this process: "
        f"{', '.join(f'{x * 1e3:.1f} ms' for x in out['engine_hash_in_process']['seconds'])}",
        "",
        "| kind | n | total median (s) | digests = files | output = reference | verifier POST GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for kind, k in s.items():
        gbps = k.get("verifier_post_GBps_median")
        lines.append(
            f"| {kind} | {k['n']} | {k['total_median_s']:.3f} | {k['all_digests_equal']} | {k['all_outputs_equal']} "
            f"| {'' if gbps is None else f'{gbps:.1f}'} |"
        )
    lines += ["", "## Per transaction (seconds)", ""]
    for r in out["runs"]:
        steps = ", ".join(f"{n} {v:.3f}" for n, v in r["steps_s"])
        obs = f"; {len(r['observe_s'])} observes {sum(r['observe_s']):.3f}" if "observe_s" in r else ""
        lines.append(f"- {r['revision']} {r['kind']} {r['pair']}: total {r['total_s']:.3f}{obs}; {steps}")
        for x in r.get("sends", []):
            lines.append(
                f"  - send {x['target']}: prepare {x['prepare_s']:.4f}, POST {x['post_s']:.4f} "
                f"({x['GBps_post']:.1f} GB/s), release {x['release_s']:.4f}, body {x['body_bytes']} B"
            )
    lines += ["", "## The worker's lines", "", *(f"    {line}" for line in out["extension_log"][-40:]), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/rf-push-bench"))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the five transaction kinds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    shape = gpu_support.LlamaShape(hidden=8192, layers=2, heads=64, kv_heads=8, intermediate=28672)
    draft_shape = gpu_support.LlamaShape(hidden=2048, layers=2, heads=16, kv_heads=8, intermediate=8192)
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "cpus": os.cpu_count(),
        "command": "python3 " + " ".join(sys.argv),
    }
    revs = {}
    for pair, seed in (("a", 1), ("b", 2)):  # bench/gpu_update's model: same shapes, same seeds
        revs[f"verifier-{pair}"] = str(
            gpu_support.write_llama(args.work / f"verifier-{pair}", shape, seed, device="cuda")
        )
        revs[f"draft-{pair}"] = str(
            gpu_support.write_llama(args.work / f"draft-{pair}", draft_shape, seed + 10, device="cuda")
        )
    out["verifier_bytes"] = gpu_update.checkpoint_bytes(revs["verifier-b"])
    out["draft_bytes"] = gpu_update.checkpoint_bytes(revs["draft-b"])
    digests = {name: digest_directory(path) for name, path in revs.items()}
    out["digests"] = digests
    out["ceiling"] = gpu_update.copy_ceiling(revs["verifier-b"], repeats=3)
    torch.cuda.empty_cache()
    try:
        asyncio.run(measure(args, revs, digests, out))
        out["summary"] = summarize(out)
    finally:
        (args.out / "push.json").write_text(json.dumps(out, indent=1, default=str))
    (args.out / "push.md").write_text(report(out))
    print(json.dumps(out["summary"], indent=1), flush=True)
    ok = all(k["all_digests_equal"] and k["all_outputs_equal"] for k in out["summary"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
