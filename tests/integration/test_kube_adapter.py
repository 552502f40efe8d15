"""The operator's Kubernetes adapter against the real API server, where its safety rests on server behaviour.

Runs against the session cluster of ``conftest.py`` (or a KUBECONFIG test cluster).
"""

from __future__ import annotations

import asyncio
import pathlib
import time

import pytest
from kubernetes import client, config

from rolloutfleet.adapters.kube import Kube, KubeError
from rolloutfleet.adapters.kube_http import KubeHTTP

pytestmark = pytest.mark.integration

GATE = "rolloutfleet.io/weights-ready"


# No scheduler answers to this name, so the pods stay unbound and kwok never plays them. A bound pod
# deleted with grace 0 first gets a deletionTimestamp, and kwok's pod-delete stage then deletes it by name,
# without a uid precondition: when kwok lags (CI on 2 busy cores) that late delete removed the replacement
# pod below, and the gate patch got 404 instead of the refusal this file pins (reproduced by stopping kwok
# across the delete and the re-create).
UNSCHEDULED = "rolloutfleet-test-nobody"


def _pod(name: str) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            scheduler_name=UNSCHEDULED,
            containers=[client.V1Container(name="engine", image="vllm-rolloutfleet:test")],
            readiness_gates=[client.V1PodReadinessGate(condition_type=GATE)],
            termination_grace_period_seconds=0,
        ),
    )


async def test_a_gate_patch_for_a_replaced_pod_is_refused(
    k8s_api: client.ApiClient, kubeconfig_path: pathlib.Path, namespace: str
) -> None:
    """The soak caught a gate opened on a pod nobody had looked at: the operator decided for pod X, X was
    deleted and recreated under the same name, and the patch by name landed on the new pod. The patch now
    names the pod's uid: the API server must refuse it for the replacement (the operator skips it)."""
    core = client.CoreV1Api(k8s_api)
    old = core.create_namespaced_pod(namespace, _pod("policy-0"))
    core.delete_namespaced_pod("policy-0", namespace, grace_period_seconds=0)
    for _ in range(100):  # bounded: a deletion that never completes fails the test below
        try:
            core.read_namespaced_pod("policy-0", namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                break
        time.sleep(0.1)
    new = core.create_namespaced_pod(namespace, _pod("policy-0"))
    assert new.metadata.uid != old.metadata.uid
    kube = Kube.from_environment(str(kubeconfig_path))
    condition = {"type": GATE, "status": "True", "reason": "Serving", "message": "serves revision 3, verified"}
    try:
        with pytest.raises(KubeError) as refused:
            await kube.patch_pod_condition(namespace, "policy-0", condition, uid=old.metadata.uid)
        assert refused.value.status in (409, 422), refused.value
        conditions = core.read_namespaced_pod_status("policy-0", namespace).status.conditions or []
        assert all(c.type != GATE for c in conditions)
        await kube.patch_pod_condition(namespace, "policy-0", condition, uid=new.metadata.uid)
        conditions = core.read_namespaced_pod_status("policy-0", namespace).status.conditions or []
        assert any(c.type == GATE and c.status == "True" for c in conditions)
    finally:
        await kube.aclose()


async def test_a_write_whose_answer_is_not_read_is_answered_with_metadata_only(
    k8s_api: client.ApiClient, kubeconfig_path: pathlib.Path, namespace: str
) -> None:
    """The operator's status writes do not read their answer (``decode=False``) and ask the API server for the
    object's metadata only (``METADATA_ONLY``): this pins that a real API server honours that for a pod's
    status subresource, so a gate write is not answered with the whole pod, and that the write lands."""
    core = client.CoreV1Api(k8s_api)
    core.create_namespaced_pod(namespace, _pod("policy-1"))
    configuration = config.new_client_from_config(config_file=str(kubeconfig_path), persist_config=False).configuration
    http = KubeHTTP(configuration, limit=1)
    condition = {"type": GATE, "status": "True", "reason": "Serving", "message": "serves revision 3, verified"}
    try:
        answer = await http.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/policy-1/status",
            body={"status": {"conditions": [condition]}},
            content_type="application/strategic-merge-patch+json",
            timeout=10,
            metadata_only=True,
        )
    finally:
        await http.close()
    assert answer["kind"] == "PartialObjectMetadata" and set(answer) == {"kind", "apiVersion", "metadata"}
    assert answer["metadata"]["name"] == "policy-1" and answer["metadata"]["resourceVersion"]
    conditions = core.read_namespaced_pod_status("policy-1", namespace).status.conditions or []
    assert any(c.type == GATE and c.status == "True" for c in conditions)


async def test_a_burst_of_calls_reuses_kept_alive_connections(namespace: str, kubeconfig_path: pathlib.Path) -> None:
    """A rollout writes one gate per pod at once: many more calls in flight than the adapter keeps
    connections. Each must wait for a kept-alive connection instead of opening (and then discarding) one of
    its own: with urllib3's default pool (10) under 16 threads, every burst reopened connections
    (bench/results/push_overhead.md); reads and patches now share one bounded session on the event loop, at
    most its requests in flight (``ROLLOUTFLEET_KUBE_IN_FLIGHT``, 64 by default) connections for any burst.
    (Counted through the operator's own hook, rolloutfleet_kube_connections_opened_total: until 2026-12-04 this
    test counted aiohttp's connections, which the requests stopped using when they moved to ``adapters.http11``.)
    """
    kube = Kube.from_environment(str(kubeconfig_path))
    opened: list[int] = []
    kube.on_connect = lambda: opened.append(1)
    limit = kube._in_flight
    try:
        for _ in range(3):
            await asyncio.gather(*(kube.list("v1", "Pod", namespace) for _ in range(4 * limit)))
        assert 1 <= len(opened) <= limit, f"{len(opened)} connections opened for {12 * limit} calls"
    finally:
        await kube.aclose()
