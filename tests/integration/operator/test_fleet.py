"""RolloutFleet end to end on the real control plane with the operator running as a process.

create → pods Running on fake GPU nodes → Available; scale 3→5→2 (spec and scale subresource); an image
change rolls pods; a bad spec is Degraded/ValidationFailed with one Warning event and untouched children;
deleting the fleet deletes its children. Simulated engines serve the pods: a pod counts as ready only once
the operator checked what its engine serves (the weights readiness gate), so pods alone are never Available.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import (
    GROUP,
    VERSION,
    condition,
    events_for,
    eventually,
    fleet_manifest,
    get_fleet,
    weights_volume,
)
from sim_harness import FollowerThread

pytestmark = pytest.mark.integration


def available(api: client.CustomObjectsApi, ns: str, name: str, replicas: int) -> dict[str, Any] | None:
    fleet = get_fleet(api, ns, name)
    cond = condition(fleet, "Available")
    status = fleet.get("status") or {}
    ok = (
        cond
        and cond["status"] == "True"
        and status.get("readyReplicas") == replicas
        and status.get("replicas") == replicas
    )
    return fleet if ok else None


def _operator_fields(obj: Any) -> list[tuple[str, str, Any, Any]]:
    """The operator's managed-fields entries (when and what it last wrote), not anyone else's."""
    return [
        (m.manager, m.operation, m.time, m.fields_v1)
        for m in obj.metadata.managed_fields or []
        if m.manager == "rolloutfleet-operator"
    ]


def test_fleet_lifecycle(operator_process: Any, k8s_api: client.ApiClient, namespace: str) -> None:
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, "pol")
    try:
        _lifecycle(k8s_api, namespace)
    finally:
        follower.stop()


def _lifecycle(k8s_api: client.ApiClient, namespace: str) -> None:
    api = client.CustomObjectsApi(k8s_api)
    apps = client.AppsV1Api(k8s_api)
    core = client.CoreV1Api(k8s_api)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", fleet_manifest("pol", 3))

    fleet = eventually(lambda: available(api, namespace, "pol", 3), timeout=90, what="Available with 3 pods")
    pods = fleet["status"]["pods"]
    assert [p["name"] for p in pods] == ["pol-0", "pol-1", "pol-2"]
    assert all(p["ip"].startswith("127.1.") and p["phase"] == "Running" for p in pods), pods
    assert fleet["status"]["observedGeneration"] == fleet["metadata"]["generation"]
    for kind, name in [("Service", "pol"), ("Service", "pol-engines"), ("Secret", "pol-control-token")]:
        reader = core.read_namespaced_service if kind == "Service" else core.read_namespaced_secret
        assert reader(name, namespace).metadata.owner_references[0].name == "pol"
    client.NetworkingV1Api(k8s_api).read_namespaced_network_policy("pol-engine-access", namespace)
    client.PolicyV1Api(k8s_api).read_namespaced_pod_disruption_budget("pol", namespace)
    pod = core.read_namespaced_pod("pol-0", namespace)
    assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    assert pod.spec.node_name.startswith("rolloutfleet-gpu-") or pod.spec.node_name
    token_before = core.read_namespaced_secret("pol-control-token", namespace).data["token"]

    # Scale up through spec, down through the scale subresource.
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", "pol", {"spec": {"replicas": 5}})
    eventually(lambda: available(api, namespace, "pol", 5), timeout=90, what="5 ready pods")
    api.patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, "rolloutfleets", "pol", {"spec": {"replicas": 2}}
    )
    fleet = eventually(lambda: available(api, namespace, "pol", 2), timeout=90, what="2 ready pods")
    assert get_fleet(api, namespace, "pol")["spec"]["replicas"] == 2
    assert apps.read_namespaced_stateful_set("pol", namespace).spec.replicas == 2

    # An image change rolls every pod onto the new template.
    old_uids = {
        p.metadata.uid for p in core.list_namespaced_pod(namespace, label_selector="rolloutfleet.io/fleet=pol").items
    }
    api.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "rolloutfleets", "pol", {"spec": {"image": "vllm-rolloutfleet:0.33.1"}}
    )

    def rolled() -> bool:
        pods = core.list_namespaced_pod(namespace, label_selector="rolloutfleet.io/fleet=pol").items
        fleet = get_fleet(api, namespace, "pol")
        return (
            len(pods) == 2
            and all(p.spec.containers[0].image == "vllm-rolloutfleet:0.33.1" for p in pods)
            and not ({p.metadata.uid for p in pods} & old_uids)
            and (fleet.get("status") or {}).get("updatedReplicas") == 2
            and (condition(fleet, "Progressing") or {}).get("status") == "False"
        )

    eventually(rolled, timeout=120, what="pods rolled to the new image")
    assert core.read_namespaced_secret("pol-control-token", namespace).data["token"] == token_before

    # A spec the operator refuses: Degraded/ValidationFailed, one Warning event, children untouched.
    sts_before = apps.read_namespaced_stateful_set("pol", namespace)
    api.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "rolloutfleets",
        "pol",
        {"spec": {"extraArgs": ["--enable-prefix-caching"], "replicas": 4}},
    )

    def degraded() -> dict[str, Any] | None:
        cond = condition(get_fleet(api, namespace, "pol"), "Degraded")
        return cond if cond and cond["reason"] == "ValidationFailed" else None

    cond = eventually(degraded, timeout=60, what="Degraded/ValidationFailed")
    assert cond["status"] == "True"
    assert "spec.extraArgs[0]: --enable-prefix-caching contradicts the parity profile" in cond["message"]
    time.sleep(6)  # several resync periods: no hot loop of events, no child change
    warnings = [e for e in events_for(k8s_api, namespace, "pol") if e.reason == "ValidationFailed"]
    assert len(warnings) == 1 and warnings[0].type == "Warning", [(e.reason, e.message) for e in warnings]
    sts_after = apps.read_namespaced_stateful_set("pol", namespace)
    # Not the resourceVersion: the StatefulSet controller may still write the object's status after the roll
    # (CI saw 3221 -> 3227 here). What the operator owns is the spec (generation) and its own managed fields.
    assert sts_after.metadata.generation == sts_before.metadata.generation
    assert _operator_fields(sts_before), "the operator applies the StatefulSet: its entry must be there"
    assert _operator_fields(sts_after) == _operator_fields(sts_before)
    assert sts_after.spec.replicas == 2

    # Fix it: the fleet recovers and converges to the new replica count.
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", "pol", {"spec": {"extraArgs": []}})
    eventually(lambda: available(api, namespace, "pol", 4), timeout=90, what="recovered with 4 pods")
    assert (condition(get_fleet(api, namespace, "pol"), "Degraded") or {}).get("status") == "False"

    # Deleting the fleet deletes its children (owner references + garbage collector).
    api.delete_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", "pol")

    def gone() -> bool:
        sts = apps.list_namespaced_stateful_set(namespace).items
        svcs = core.list_namespaced_service(namespace, label_selector="rolloutfleet.io/fleet=pol").items
        secrets = core.list_namespaced_secret(namespace, label_selector="rolloutfleet.io/fleet=pol").items
        return not sts and not svcs and not secrets

    eventually(gone, timeout=90, what="children garbage-collected")
