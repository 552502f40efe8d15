"""Benchmark: what one write of a RolloutFleet's status costs, by how many pods the status lists.

A report, not a test. A revision's pass writes the fleet's own fields of its status twice on the rollout's
critical path (``targetRevision`` when it starts, ``currentRevision`` and ``served`` before the revision is
called Succeeded), and at 1,024 pods on the 16-core device each write took ~0.2-0.27 s
(bench/results/rollout_overhead_16_cores.md) while a write of the revision itself took 0.04 s. Each is a merge
patch of one or two fields, but the object carries ``status.pods``, one entry per pod, and the API server
handles the whole object on every write.

It starts the local control plane (no nodes needed), installs the CRDs as generated, creates one RolloutFleet
whose status lists ``--pods`` pods (entries as the operator writes them), then times ``--writes`` merge
patches of ``status.targetRevision`` one after the other (the operator's own write: the fields only, the
answer not decoded) and reads the API server's and etcd's CPU from /proc around them; with ``status.pods``
a map keyed by name (the CRDs before 2026-12-03), then an atomic list (the CRD updated in place, as a
``kubectl apply`` of the new CRDs would): a map's entries are each tracked in ``managedFields``.

    .venv/bin/python bench/fleet_status_write_cost.py --pods 64 256 1024 --out bench/results/fleet_status_write_cost.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

from gate_write_cost import cpu_seconds, process_name  # bench/, the scripts' directory, is sys.path[0]
from rollout_overhead import fleet_spec

NAMESPACE = "fleetstatus"
GROUP, VERSION, PLURAL = "rolloutfleet.io", "v1alpha1", "rolloutfleets"


def pod_entries(n: int) -> list[dict[str, Any]]:
    """``status.pods`` as the operator writes it for a fleet at rest on revision 7."""
    return [
        {
            "name": f"policy-{i}",
            "ip": f"127.1.{i // 250}.{i % 250 + 1}",
            "phase": "Running",
            "ready": True,
            "revision": 7,
            "draftRevision": 7,
            "weightVersion": "step-7",
        }
        for i in range(n)
    ]


def with_pods_as(crd: dict[str, Any], layout: str) -> dict[str, Any]:
    """The RolloutFleet CRD with ``status.pods`` a map keyed by name (``map``) or an atomic list."""
    crd = copy.deepcopy(crd)
    for version in crd["spec"]["versions"]:
        pods = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["pods"]
        pods["x-kubernetes-list-type"] = layout
        if layout == "map":
            pods["x-kubernetes-list-map-keys"] = ["name"]
        else:
            pods.pop("x-kubernetes-list-map-keys", None)
    return crd


def measure(api: Any, pids: list[int], pods: int, writes: int) -> dict[str, Any]:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    name = f"policy-{pods}"
    spec = fleet_spec(pods)
    custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        NAMESPACE,
        PLURAL,
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutFleet", "metadata": {"name": name}, "spec": spec},
    )
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NAMESPACE, PLURAL, name, {"status": {"pods": pod_entries(pods), "currentRevision": 7}}
    )
    size = len(json.dumps(custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)))
    time.sleep(1.0)
    names = {pid: process_name(pid) for pid in pids}
    before = {pid: cpu_seconds(pid) for pid in pids}
    latencies = []
    for i in range(writes):
        started = time.monotonic()
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, PLURAL, name, {"status": {"targetRevision": 8 + i % 2}}, _preload_content=False
        )
        latencies.append(time.monotonic() - started)
    time.sleep(1.0)  # the watchers' share
    cpu: dict[str, float] = {}
    for pid in pids:
        cpu[names[pid]] = cpu.get(names[pid], 0.0) + 1000 * (cpu_seconds(pid) - before[pid]) / writes
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    return {
        "pods": pods,
        "object_kb": round(size / 1024, 1),
        "median_ms": round(1000 * statistics.median(latencies), 1),
        "p90_ms": round(1000 * sorted(latencies)[int(0.9 * (len(latencies) - 1))], 1),
        "cpu_ms": {k: round(v, 1) for k, v in sorted(cpu.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--writes", type=int, default=40)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    from kubernetes import client, config

    from rolloutfleet.api import crdgen
    from rolloutfleet.sandbox import cluster

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rf-fleetstatus-") as tmp:
        local = cluster.Cluster(pathlib.Path(tmp), name="fleetstatus", nodes=1, gpus_per_node=8, tie_to_parent=True)
        local.start()
        try:
            api = config.new_client_from_config(config_file=str(local.kubeconfig), persist_config=False)
            ext = client.ApiextensionsV1Api(api)
            crds = crdgen.custom_resource_definitions()
            fleet_crd = next(c for c in crds.values() if c["spec"]["names"]["plural"] == PLURAL)
            generated = fleet_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
            print(f"[fleet-status] generated: {generated['properties']['pods'].get('x-kubernetes-list-type')}")
            for crd in crds.values():
                if crd is not fleet_crd:
                    ext.create_custom_resource_definition(crd)
            client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
            pids = local.pids()
            for layout in ("map", "atomic"):  # the CRD updated in place between them
                crd = with_pods_as(fleet_crd, layout)
                if layout == "map":
                    ext.create_custom_resource_definition(crd)
                else:
                    current = ext.read_custom_resource_definition(crd["metadata"]["name"])
                    crd["metadata"]["resourceVersion"] = current.metadata.resource_version
                    ext.replace_custom_resource_definition(crd["metadata"]["name"], crd)
                time.sleep(3)
                for pods in args.pods:
                    row = measure(api, pids, pods, args.writes)
                    row["layout"] = layout
                    rows.append(row)
                    print(f"[fleet-status] {layout} {pods} pods: {row}", file=sys.stderr)
        finally:
            local.stop()

    command = " ".join([".venv/bin/python", *sys.argv])
    lines = [
        "# What one write of a RolloutFleet's status costs, by pods listed",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}. "
        f"Run {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}.",
        f"Command: `{command}`",
        "",
        (__doc__ or "").split("\n\n")[1].replace("\n", " "),
        "",
        f"{args.writes} merge patches of `status.targetRevision` per row, one after the other; CPU per write "
        "includes 1 s after the last one (the watchers' reactions).",
        "",
        "| status.pods | pods | object KB | median ms | p90 ms | CPU ms per write (per process) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cpu = ", ".join(f"{k} {v}" for k, v in r["cpu_ms"].items())
        lines.append(f"| {r['layout']} | {r['pods']} | {r['object_kb']} | {r['median_ms']} | {r['p90_ms']} | {cpu} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
