"""Benchmark: the operator's own overhead when rolling a WeightRevision across 64, 256 and 1,024 pods.

A report, not a test. For each fleet size it starts the local control plane with enough fake 8-GPU nodes,
runs the real operator as a process, serves simulated engines on every pod's loopback IP from a separate
follower process (fixed per-step latencies, synthetic weights), applies one sleep-mode AllAtOnce revision
and measures: wall time from creation to Succeeded vs the ideal lower bound (the critical path: every
pod's steps back to back, all pods in parallel), the operator's CPU seconds and peak RSS (from /proc), and
the operator's Kubernetes API requests per pod (its own counter on /metrics).

    .venv/bin/python bench/rollout_overhead.py --sizes 64 256 1024 --out bench/results/rollout_overhead.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

# Per-step simulated latencies (seconds). The sum is the per-pod critical path.
STEPS = {
    "pause": 0.05,
    "sleep": 0.5,
    "wake_up:weights": 0.3,
    "rolloutfleet_load:verifier": 2.0,
    "rolloutfleet_load:draft": 0.5,
    "update_weight_version": 0.02,
    "wake_up:kv_cache": 0.2,
    "resume": 0.05,
}
LOWER_BOUND = sum(STEPS.values())
NAMESPACE, FLEET = "bench", "policy"


def follower_main(kubeconfig: str) -> None:
    """Child process: serve simulated engines on every pod of the fleet until killed."""
    from kubernetes import config

    from rolloutfleet.sim.config import Latencies, WeightsConfig
    from rolloutfleet.sim.follower import PodFollower

    api = config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    follower = PodFollower(
        api,
        NAMESPACE,
        FLEET,
        weights=WeightsConfig(synthetic_root="/synthetic", verifier_bytes=16 * 2**30, draft_bytes=2**30),
        latencies=Latencies(steps=dict(STEPS)),
        interval=3.0,  # pods do not change during the rollout; listing 1,024 pods often loads the apiserver
    )
    asyncio.run(follower.run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _component_pids(local: Any) -> dict[str, int]:
    """The control-plane components' pids, by the name of their binary."""
    out = {}
    for pid in local.pids():
        try:
            name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        out[name] = pid
    return out


def _machine_busy() -> float:
    """CPU seconds all cores spent busy since boot (from /proc/stat)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else float("nan")


def _kube_requests(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(m) for m in re.findall(r"^rolloutfleet_kube_api_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def run_size(n: int) -> dict[str, Any]:
    from kubernetes import client, config

    from rolloutfleet.api import crdgen
    from rolloutfleet.sandbox import cluster

    nodes = max(4, (n + 7) // 8)
    with tempfile.TemporaryDirectory(prefix=f"rf-bench-{n}-") as tmp:
        local = cluster.Cluster(pathlib.Path(tmp), name=f"bench{n}", nodes=nodes, gpus_per_node=8, tie_to_parent=True)
        local.start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            api = config.new_client_from_config(config_file=str(local.kubeconfig), persist_config=False)
            ext = client.ApiextensionsV1Api(api)
            for crd in crdgen.custom_resource_definitions().values():
                ext.create_custom_resource_definition(crd)
            time.sleep(2)
            core = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})
            while not core.list_namespaced_service_account(NAMESPACE).items:
                time.sleep(0.2)
            core.create_persistent_volume(
                {
                    "metadata": {"name": "w"},
                    "spec": {
                        "capacity": {"storage": "1Gi"},
                        "accessModes": ["ReadOnlyMany"],
                        "storageClassName": "",
                        "hostPath": {"path": "/synthetic"},
                        "claimRef": {"namespace": NAMESPACE, "name": "w"},
                    },
                }
            )
            core.create_namespaced_persistent_volume_claim(
                NAMESPACE,
                {
                    "metadata": {"name": "w"},
                    "spec": {
                        "accessModes": ["ReadOnlyMany"],
                        "storageClassName": "",
                        "volumeName": "w",
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                },
            )
            metrics_port = _free_port()
            env = dict(
                os.environ,
                KUBECONFIG=str(local.kubeconfig),
                ROLLOUTFLEET_IDLE_SECONDS="1",
                ROLLOUTFLEET_RESYNC_SECONDS="10",
            )
            log = open(pathlib.Path(tmp) / "operator.log", "wb")  # noqa: SIM115 - lives as long as the process
            operator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rolloutfleet.cli",
                    "run",
                    "-A",
                    "--standalone",
                    "--metrics-port",
                    str(metrics_port),
                    "--liveness",
                    "",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs.append(operator)
            follower = subprocess.Popen(
                [sys.executable, __file__, "--follower", str(local.kubeconfig)], stdout=subprocess.DEVNULL
            )
            procs.append(follower)
            custom = client.CustomObjectsApi(api)
            custom.create_namespaced_custom_object(
                "rolloutfleet.io",
                "v1alpha1",
                NAMESPACE,
                "rolloutfleets",
                {
                    "apiVersion": "rolloutfleet.io/v1alpha1",
                    "kind": "RolloutFleet",
                    "metadata": {"name": FLEET},
                    "spec": {
                        "replicas": n,
                        "image": "vllm-rolloutfleet:0.33.0",
                        "verifier": {"path": "/synthetic/policy/step-0/verifier"},
                        "draft": {"method": "draft_model", "path": "/synthetic/policy/step-0/draft"},
                        "weights": {"claimName": "w", "mountPath": "/synthetic", "allowedRoots": ["/synthetic/policy"]},
                        "updateStrategy": {"mode": "sleep", "rollout": "AllAtOnce", "timeouts": {"wakeSeconds": 60}},
                    },
                },
            )
            started = time.monotonic()
            pods_ready = _wait_engines(core, n, timeout=600)
            print(
                f"[bench] n={n}: {n} pods Running with engines answering in {time.monotonic() - started:.1f}s",
                file=sys.stderr,
            )
            time.sleep(3)  # let the fleet settle (first resync passes)
            cpu0, req0 = _proc_cpu(operator.pid), _kube_requests(metrics_port)
            sim0, machine0 = _proc_cpu(follower.pid), _machine_busy()
            components = _component_pids(local)
            others0 = {name: _proc_cpu(pid) for name, pid in components.items()}
            t0 = time.monotonic()
            custom.create_namespaced_custom_object(
                "rolloutfleet.io",
                "v1alpha1",
                NAMESPACE,
                "weightrevisions",
                {
                    "apiVersion": "rolloutfleet.io/v1alpha1",
                    "kind": "WeightRevision",
                    "metadata": {"name": "step-1"},
                    "spec": {
                        "fleetRef": {"name": FLEET},
                        "revision": 1,
                        "verifier": {"path": "/synthetic/policy/step-1/verifier"},
                        "draft": {"path": "/synthetic/policy/step-1/draft"},
                    },
                },
            )
            phase = ""
            while time.monotonic() - t0 < 600:
                status = (
                    custom.get_namespaced_custom_object(
                        "rolloutfleet.io", "v1alpha1", NAMESPACE, "weightrevisions", "step-1"
                    ).get("status")
                    or {}
                )
                phase = status.get("phase", "")
                if phase in ("Succeeded", "Failed", "RolledBack"):
                    break
                time.sleep(0.2)  # each GET returns the per-pod status of the whole fleet: poll gently
            total = time.monotonic() - t0
            cpu = _proc_cpu(operator.pid) - cpu0
            requests = _kube_requests(metrics_port) - req0
            rss = _peak_rss_mb(operator.pid)
            sim_cpu = _proc_cpu(follower.pid) - sim0
            machine = _machine_busy() - machine0
            others = {name: round(_proc_cpu(pid) - others0[name], 2) for name, pid in components.items()}
            return {
                "pods": n,
                "phase": phase,
                "total_s": round(total, 2),
                "lower_bound_s": round(LOWER_BOUND, 2),
                "overhead_s": round(total - LOWER_BOUND, 2),
                "overhead_pct": round(100 * (total - LOWER_BOUND) / LOWER_BOUND, 1),
                "target_s": round(LOWER_BOUND * 0.05 + 1, 2),
                "operator_cpu_s": round(cpu, 2),
                "peak_rss_mb": round(rss, 1),
                "kube_requests": requests,
                "kube_requests_per_pod": round(requests / n, 3),
                "pods_ready_s": round(pods_ready, 1),
                "sim_cpu_s": round(sim_cpu, 2),
                "machine_busy_s": round(machine, 2),
                "control_plane_cpu_s": others,
            }
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            local.stop()
            log_copy = pathlib.Path(tempfile.gettempdir()) / f"rf-bench-operator-{n}.log"
            log_copy.write_bytes((pathlib.Path(tmp) / "operator.log").read_bytes())


def _wait_engines(core: Any, n: int, timeout: float) -> float:
    import aiohttp

    started = time.monotonic()

    async def healthy(ips: list[str]) -> int:
        async with aiohttp.ClientSession(trust_env=False) as session:

            async def one(ip: str) -> bool:
                try:
                    async with session.get(f"http://{ip}:8000/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        return resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    return False

            return sum(await asyncio.gather(*(one(ip) for ip in ips)))

    while time.monotonic() - started < timeout:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"rolloutfleet.io/fleet={FLEET}").items
        ips = [p.status.pod_ip for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        if len(ips) == n and asyncio.run(healthy(ips)) == n:
            return time.monotonic() - started
        time.sleep(1)
    raise TimeoutError(f"{n} engines did not come up in {timeout}s")


def report(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Rollout overhead of the operator (simulated engines)",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}.",
        f"Command: `{command}`",
        "",
        "One sleep-mode AllAtOnce WeightRevision (no load cap) per fleet size; simulated per-step latencies",
        "(the bench polls the revision every 0.2 s, so totals carry up to 0.2 s of polling granularity),",
        f"{json.dumps(STEPS)}, so the ideal lower bound is their sum, {LOWER_BOUND:.2f} s (every pod in parallel).",
        "The operator and the simulated engines run as separate processes on the same 2 cores, next to the",
        "local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok).",
        "",
        "| pods | phase | total s | lower bound s | overhead s | overhead % | target s (5 % + 1 s) "
        "| operator CPU s | peak RSS MB | kube API req | req/pod |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            r["pods"],
            r["phase"],
            r["total_s"],
            r["lower_bound_s"],
            r["overhead_s"],
            r["overhead_pct"],
            r["target_s"],
            r["operator_cpu_s"],
            r["peak_rss_mb"],
            int(r["kube_requests"]),
            r["kube_requests_per_pod"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--follower":
        follower_main(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--out", default="bench/results/rollout_overhead.md")
    args = parser.parse_args()
    rows = []
    for n in args.sizes:
        row = run_size(n)
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    text = report(rows, "python bench/rollout_overhead.py --sizes " + " ".join(map(str, args.sizes)))
    pathlib.Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
