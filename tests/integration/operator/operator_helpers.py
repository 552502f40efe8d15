"""Small helpers shared by the operator integration tests (objects, waits, events)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client

GROUP, VERSION = "rolloutfleet.io", "v1alpha1"
T = TypeVar("T")
REPO = pathlib.Path(__file__).resolve().parents[3]


def run_example(script: str, *args: str, timeout: float) -> list[str]:
    """Run ``examples/SCRIPT`` as a user would (the repo's packages on the path); assert it succeeded and
    return its ``step ...`` lines (one per training step)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO / "operator"), str(REPO / "worker_image"), str(REPO / "digest")]),
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("step ")]


def weights_volume(k8s_api: client.ApiClient, namespace: str, claim: str = "ckpt") -> None:
    """A statically bound PV/PVC pair (the scheduler will not place pods whose claim is unbound)."""
    core = client.CoreV1Api(k8s_api)
    pv_name = f"{namespace}-{claim}"
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "labels": {"rolloutfleet.io/test": "1"}},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": "/weights"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )


def fleet_manifest(name: str, replicas: int = 3, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutFleet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "image": "vllm-rolloutfleet:0.33.0",
            "verifier": {"path": "/weights/policy/step-0/verifier"},
            "draft": {"method": "eagle", "path": "/weights/policy/step-0/draft"},
            "weights": {"claimName": "ckpt", "allowedRoots": ["/weights/policy"]},
        },
    }
    body["spec"].update(spec)
    return body


def get_fleet(api: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", name)
    return out


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return None


def eventually(fn: Callable[[], T | None], timeout: float = 60, interval: float = 0.5, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}{_cluster_snapshot()}")


def _cluster_snapshot() -> str:
    """Pods and their phases across namespaces, to explain a timeout (best effort)."""
    import os

    from kubernetes import config

    try:
        api = config.new_client_from_config(config_file=os.environ.get("ROLLOUTFLEET_TEST_KUBECONFIG"))
        pods = client.CoreV1Api(api).list_pod_for_all_namespaces().items
    except Exception as exc:
        return f"\n(no cluster snapshot: {exc})"
    lines = [
        f"{p.metadata.namespace}/{p.metadata.name} {p.status.phase} {p.status.pod_ip} {p.spec.node_name}" for p in pods
    ]
    return "\ncluster pods:\n" + "\n".join(lines[:60])


def events_for(k8s_api: client.ApiClient, namespace: str, name: str) -> list[Any]:
    core = client.CoreV1Api(k8s_api)
    return list(core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items)
