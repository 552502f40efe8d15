"""Benchmark: how long 1,000 one-GPU pods take to reach Running on 125 fake 8-GPU nodes.

A report, not an assertion (DESIGN §5.6). It starts its own local control plane
(:mod:`rolloutfleet.sandbox.cluster`) in a temporary directory, creates one Deployment of ``--pods``
replicas each requesting ``nvidia.com/gpu: 1``, watches the pods and records, per pod, when the watch
first saw it, when it was bound to a node and when it was Running with a pod IP. Times are taken from
the watch with a monotonic clock (condition timestamps have 1 s resolution). The Markdown report goes to
stdout and, with ``--output``, to a file.

    .venv/bin/python bench/pods_to_running.py --output bench/results/pods_to_running.md
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from rolloutfleet.sandbox import binaries, cluster, nodes, waiting

POD_NETWORK = ipaddress.ip_network("127.1.0.0/16")


def _deployment(replicas: int) -> dict[str, Any]:
    labels = {"app": "bench"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "bench", "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "registry.invalid/rolloutfleet/engine-sim:bench",
                            "resources": {"limits": {nodes.GPU_RESOURCE: "1"}},
                        }
                    ],
                    "terminationGracePeriodSeconds": 0,
                },
            },
        },
    }


class PodClock:
    """Per-pod first-seen / bound / running times from one watch stream."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.ips: dict[str, str] = {}
        self.nodes: dict[str, str] = {}
        self.lock = threading.Lock()

    def observe(self, pod: dict[str, Any], now: float) -> None:
        name = pod["metadata"]["name"]
        node = pod["spec"].get("nodeName")
        status = pod.get("status", {})
        with self.lock:
            self.seen.setdefault(name, now)
            if node:
                self.bound.setdefault(name, now)
                self.nodes[name] = node
            if status.get("phase") == "Running" and status.get("podIP"):
                self.running.setdefault(name, now)
                self.ips[name] = status["podIP"]


def _watch(local: cluster.Cluster, namespace: str, clock: PodClock, stop: threading.Event) -> None:
    # A raw watch (one JSON event per line) rather than the kubernetes client's: its per-event model
    # deserialization is slower than the pods arrive and would distort the timings.
    version = ""
    while not stop.is_set():
        query = "watch=1&timeoutSeconds=60" + (f"&resourceVersion={version}" if version else "")
        req = urllib.request.Request(
            f"{local.server}/api/v1/namespaces/{namespace}/pods?{query}",
            headers={"Authorization": f"Bearer {local.pki.admin_token()}"},
        )
        with urllib.request.urlopen(req, context=local.ssl_context(), timeout=90) as resp:
            for line in resp:
                now = time.monotonic()
                event = json.loads(line)
                if event["type"] == "ERROR":  # e.g. 410 Gone: start over from a fresh list
                    version = ""
                    break
                version = event["object"]["metadata"]["resourceVersion"]
                clock.observe(event["object"], now)
                if stop.is_set():
                    return


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _row(label: str, values: list[float]) -> str:
    cells = [_pct(values, q) for q in (50, 90, 99)] + [max(values), statistics.fmean(values)]
    return f"| {label} | " + " | ".join(f"{v:.2f}" for v in cells) + " |"


def _machine() -> list[str]:
    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    meminfo = pathlib.Path("/proc/meminfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")
    mem_kb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal"))
    return [
        f"- CPU: {cpu}, {os.cpu_count()} logical cores available to the run",
        f"- memory: {mem_kb / 1024 / 1024:.0f} GiB; kernel {platform.release()}; Python {platform.python_version()}",
        f"- binaries: Kubernetes {binaries.KUBERNETES_VERSION}, etcd {binaries.ETCD_VERSION}, "
        f"kwok {binaries.KWOK_VERSION} (Go-built, `rolloutfleet sandbox build`)",
        f"- load average at the start: {pathlib.Path('/proc/loadavg').read_text().split()[0]} "
        "(the machine is shared with builds and other test runs)",
        "- etcd data on tmpfs with --unsafe-no-fsync; scheduler client QPS 500; controller-manager QPS 200",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=125)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--output", type=pathlib.Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        local = cluster.Cluster(
            pathlib.Path(tmp), name="bench", nodes=args.nodes, gpus_per_node=args.gpus, tie_to_parent=True
        )
        started = time.monotonic()
        local.start()
        startup = time.monotonic() - started
        try:
            report = _run(local, args, startup)
        finally:
            local.stop()
    print(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report)
    return 0


def _run(local: cluster.Cluster, args: argparse.Namespace, startup: float) -> str:
    namespace = "bench"
    local.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    waiting.wait_for(
        lambda: local.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts")["items"],
        timeout=30,
        what="the namespace's default service account",
    )
    clock, stop = PodClock(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(local, namespace, clock, stop), daemon=True)
    watcher.start()
    time.sleep(0.5)  # let the watch open before the first pod exists
    t0 = time.monotonic()
    local.request("POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", _deployment(args.pods))
    deadline = t0 + args.timeout
    while len(clock.running) < args.pods and time.monotonic() < deadline:
        time.sleep(0.05)
    total = time.monotonic() - t0
    stop.set()
    with clock.lock:
        running = dict(clock.running)
        since_create = [running[p] - t0 for p in running]
        since_seen = [running[p] - clock.seen[p] for p in running]
        to_bound = [clock.bound[p] - clock.seen[p] for p in running if p in clock.bound]
        created = [clock.seen[p] - t0 for p in clock.seen]
        ips = set(clock.ips.values())
        used_nodes = set(clock.nodes.values())
    loopback = all(ipaddress.ip_address(ip) in POD_NETWORK for ip in ips)
    lines = [
        "# Benchmark: pods to Running on the local control plane",
        "",
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC} with "
        f"`.venv/bin/python bench/pods_to_running.py {' '.join(sys.argv[1:])}`.",
        "",
        *_machine(),
        "",
        f"One Deployment of {args.pods} replicas, each `{nodes.GPU_RESOURCE}: 1`, on {args.nodes} kwok nodes "
        f"with {args.gpus} GPUs each ({args.nodes * args.gpus} GPUs).",
        "",
        f"- cluster start (warm binaries, {args.nodes} nodes created and Ready): **{startup:.1f} s**",
        f"- all {len(running)}/{args.pods} pods Running: **{total:.1f} s** after the Deployment was created",
        f"- pods spread over {len(used_nodes)} nodes; {len(ips)} distinct pod IPs, all in {POD_NETWORK}: {loopback}",
        "",
        "Per-pod times in seconds (watch observations, monotonic clock):",
        "",
        "| measure | p50 | p90 | p99 | max | mean |",
        "|---|---|---|---|---|---|",
        _row("Deployment created -> pod created (ReplicaSet slow start)", created),
        _row("pod created -> bound by the scheduler", to_bound),
        _row("pod created -> Running with IP (kwok)", since_seen),
        _row("Deployment created -> pod Running", since_create),
        "",
        "This is a report, not a test: numbers vary with the machine and its load.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
