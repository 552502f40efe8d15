"""Benchmark: what one readiness-gate write costs the control plane, per process, and per patch type.

A report, not a test. The operator writes each pod's readiness gate (``rolloutfleet.io/weights-ready``)
twice per revision: out of the Service before the pause, back in after the resume. At 1,024 pods on this
2-core machine those 2,048 status writes were most of a revision's wall time
(bench/results/rollout_overhead.md), so this measures what each one costs the processes that handle it.

It starts the local control plane with enough fake 8-GPU nodes, creates the operator's own StatefulSet for
an ``--pods``-pod fleet (``resources.children.build_statefulset``, so the pods are the size the operator's
pods are), waits until every pod is Running, then flips every pod's gate ``--rounds`` times each way with
each patch type, 16 requests in flight (the operator's own limit until 2026-12-04; 64 since), and reads every
control-plane process's CPU from /proc before and after (1.5 s after the last answer, so the watchers'
reactions are counted). Patch types: a strategic merge of the one condition (what the operator sends,
conditions merge by ``type``) and a JSON patch that tests the uid and the condition's index, then replaces
it (what would avoid the server's merge); and the strategic merge asking for the pod's metadata only as the
answer (what the operator asks since it stopped reading these answers), with the answers' size.

    .venv/bin/python bench/gate_write_cost.py --pods 256 --rounds 3 --out bench/results/gate_write_cost.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rollout_overhead import create_weights_volume, fleet_spec  # bench/, the scripts' directory, is sys.path[0]

from rolloutfleet.adapters.kube_http import METADATA_ONLY

GATE = "rolloutfleet.io/weights-ready"
NAMESPACE = "gates"
IN_FLIGHT = 16
SETTLE_SECONDS = 1.5  # after the last answer: the watchers (kwok, the controllers) react to each write


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_name(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().rsplit("/", 1)[-1]


def strategic(body: dict[str, Any], value: str) -> Any:
    """The operator's patch (``Kube.patch_pod_condition``): the uid as a precondition, one condition."""
    condition = {"type": GATE, "status": value, "reason": "Bench", "message": "gate write cost"}
    return {"metadata": {"uid": body["metadata"]["uid"]}, "status": {"conditions": [condition]}}


def json_patch(body: dict[str, Any], value: str) -> Any:
    """The same change as a JSON patch: test the uid and the condition's index, replace the condition."""
    conditions = body["status"].get("conditions") or []
    index = next((i for i, c in enumerate(conditions) if c["type"] == GATE), None)
    condition = {"type": GATE, "status": value, "reason": "Bench", "message": "gate write cost"}
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": body["metadata"]["uid"]}]
    if index is None:
        ops.append({"op": "add", "path": "/status/conditions/-", "value": condition})
    else:
        ops.append({"op": "test", "path": f"/status/conditions/{index}/type", "value": GATE})
        ops.append({"op": "replace", "path": f"/status/conditions/{index}", "value": condition})
    return ops  # a list: the client sends it as application/json-patch+json


# (patch body, Accept header: None for the whole pod) per row. "metadata-only answer" is what the operator
# sends since its writes stopped reading their answer (``adapters.kube_http.METADATA_ONLY``).
PATCHES: dict[str, tuple[Callable[[dict[str, Any], str], Any], str | None]] = {
    "strategic merge": (strategic, None),
    "JSON patch": (json_patch, None),
    "strategic merge, metadata-only answer": (strategic, METADATA_ONLY),
}


def start(pods: int, tmp: pathlib.Path) -> tuple[Any, Any]:
    """The control plane and the fleet's StatefulSet, up to every pod Running; (cluster, CoreV1Api)."""
    from kubernetes import client, config

    from rolloutfleet.api.fleet import RolloutFleetSpec
    from rolloutfleet.resources.children import Owner, build_statefulset
    from rolloutfleet.sandbox import cluster

    local = cluster.Cluster(tmp, name="gates", nodes=pods // 8 + 1, gpus_per_node=8, tie_to_parent=True)
    local.start()
    api = config.new_client_from_config(config_file=str(local.kubeconfig), persist_config=False)
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    while not core.list_namespaced_service_account(NAMESPACE).items:
        time.sleep(0.2)
    create_weights_volume(core, NAMESPACE, "/synthetic")
    spec = RolloutFleetSpec.model_validate(fleet_spec(pods))
    statefulset = build_statefulset(Owner("policy", NAMESPACE, "00000000-0000-0000-0000-000000000001"), spec)
    statefulset["metadata"].pop("ownerReferences", None)  # no fleet object here: nothing would own it
    client.AppsV1Api(api).create_namespaced_stateful_set(NAMESPACE, statefulset)
    started = time.monotonic()
    while True:
        running = sum(p.status.phase == "Running" for p in core.list_namespaced_pod(NAMESPACE).items)
        print(f"[gates] {running}/{pods} pods Running ({time.monotonic() - started:.0f} s)", file=sys.stderr)
        if running == pods:
            return local, core
        time.sleep(2)


def measure(local: Any, core: Any, pods: int, rounds: int) -> list[dict[str, Any]]:
    pids = local.pids()
    names = {pid: process_name(pid) for pid in pids}
    rows = []
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        for index in range(rounds):
            for kind, (build, accept) in PATCHES.items():
                for value in ("False", "True"):
                    items = json.loads(core.list_namespaced_pod(NAMESPACE, _preload_content=False).data)["items"]
                    time.sleep(2)  # the previous flip's aftermath is over
                    before = {pid: cpu_seconds(pid) for pid in pids}
                    started = time.monotonic()

                    def write(
                        body: dict[str, Any], build: Any = build, value: str = value, accept: Any = accept
                    ) -> int:
                        name = body["metadata"]["name"]
                        headers = {"Accept": accept} if accept else None
                        answer = core.patch_namespaced_pod_status(
                            name, NAMESPACE, build(body, value), _preload_content=False, _headers=headers
                        )
                        return len(answer.data)

                    sizes = list(pool.map(write, items))
                    wall = time.monotonic() - started
                    time.sleep(SETTLE_SECONDS)
                    per_write = {names[p]: 1000 * (cpu_seconds(p) - before[p]) / pods for p in pids}
                    answer_bytes = statistics.median(sizes)
                    rows.append(
                        {
                            "round": index,
                            "patch": kind,
                            "to": value,
                            "wall_s": wall,
                            "ms": per_write,
                            "bytes": answer_bytes,
                        }
                    )
                    print(f"[gates] round {index} {kind} -> {value}: {wall:.2f} s, {per_write}", file=sys.stderr)
    return rows


def report(rows: list[dict[str, Any]], pods: int, rounds: int, command: str) -> str:
    processes = sorted({p for r in rows for p in r["ms"]})
    lines = [
        "# What one readiness-gate write costs the control plane",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}.",
        f"Run {datetime.date.today().isoformat()}:",
        "",
        f"    {command}",
        "",
        f"{pods} pods of the operator's own StatefulSet (the fleet of `bench/rollout_overhead.py`), every gate",
        f"flipped {rounds} time(s) each way per patch type, {IN_FLIGHT} writes in flight. CPU milliseconds per write",
        "(medians over the flips), counted until 1.5 s after the last answer so that the watchers' work is in:",
        "",
        "| patch | " + " | ".join(processes) + " | control plane in all | writes/s | answer bytes |",
        "|---|" + "---:|" * (len(processes) + 3),
    ]
    for kind in PATCHES:
        mine = [r for r in rows if r["patch"] == kind]
        medians = [statistics.median(r["ms"][p] for r in mine) for p in processes]
        total = statistics.median(sum(r["ms"].values()) for r in mine)
        rate = statistics.median(pods / r["wall_s"] for r in mine)
        size = statistics.median(r["bytes"] for r in mine)
        lines.append(
            f"| {kind} | " + " | ".join(f"{m:.2f}" for m in medians) + f" | {total:.2f} | {rate:.0f} | {size:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pods", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "bench/gate_write_cost.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as tmp:
        local, core = start(args.pods, pathlib.Path(tmp))
        try:
            rows = measure(local, core, args.pods, args.rounds)
        finally:
            local.stop()
    text = report(rows, args.pods, args.rounds, command)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
