"""The local control plane itself: auth is on, GPU pods get loopback IPs we can serve on, down is clean.

Runs against the session cluster of ``conftest.py`` (or a KUBECONFIG test cluster: the loopback and
sandbox-lifecycle checks then skip, because a kind cluster's pods live in containers).
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import pathlib
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from rolloutfleet.resources import labels
from rolloutfleet.sandbox import cluster, nodes, processes

from .conftest import KubeTarget, looks_like_test_context

pytestmark = pytest.mark.integration

POD_NETWORK = ipaddress.ip_network("127.1.0.0/16")


def _raw_get(api: client.ApiClient, path: str, token: str | None) -> int:
    conf = api.configuration
    context = ssl.create_default_context(cafile=conf.ssl_ca_cert) if conf.ssl_ca_cert else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(conf.host + path, headers=headers)
    try:
        with urllib.request.urlopen(req, context=context, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_apiserver_rejects_unauthenticated_and_bad_tokens(k8s_api: client.ApiClient) -> None:
    assert _raw_get(k8s_api, "/api/v1/namespaces/kube-system/secrets", None) in (401, 403)
    assert _raw_get(k8s_api, "/api/v1/namespaces", "not-a-valid-token") == 401
    # The admin credentials of the kubeconfig do work (so the refusals above are auth, not a dead server).
    assert client.CoreV1Api(k8s_api).list_namespace().items


def test_context_guard_accepts_only_disposable_clusters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUTFLEET_TEST_CLUSTER_OK", raising=False)
    for ok in ("kind-kind", "rolloutfleet-sandbox-pytest", "k3d-dev", "minikube", "kwok-demo"):
        assert looks_like_test_context(ok), ok
    for bad in ("prod-eu-west", "arn:aws:eks:us-east-1:1:cluster/main", "gke_proj_zone_training"):
        assert not looks_like_test_context(bad), bad
    monkeypatch.setenv("ROLLOUTFLEET_TEST_CLUSTER_OK", "1")
    assert looks_like_test_context("prod-eu-west")


def test_fake_gpu_nodes_have_capacity_labels_and_loopback_pod_cidrs(
    local_cluster: cluster.Cluster, k8s_api: client.ApiClient
) -> None:
    node_list = client.CoreV1Api(k8s_api).list_node(label_selector=f"{nodes.POOL_LABEL}=default").items
    assert len(node_list) == local_cluster.node_count
    for node in node_list:
        assert node.status.allocatable[nodes.GPU_RESOURCE] == str(local_cluster.gpus_per_node)
        assert node.metadata.labels[nodes.PRODUCT_LABEL] == nodes.GPU_PRODUCT
        assert ipaddress.ip_network(node.spec.pod_cidr).subnet_of(POD_NETWORK)
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True"


def _gpu_statefulset(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    container = {
        "name": "engine",
        # kwok never pulls images; the name only has to be valid.
        "image": "registry.invalid/rolloutfleet/engine-sim:test",
        "ports": [{"name": "http", "containerPort": 8000}],
        "resources": {"limits": {nodes.GPU_RESOURCE: "1"}, "requests": {nodes.GPU_RESOURCE: "1"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "nodeSelector": {nodes.POOL_LABEL: "default"},
                    "terminationGracePeriodSeconds": 0,
                },
            },
        },
    }


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"served_on": self.server.server_address[0]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve_on() -> Iterator[Callable[[str], int]]:
    """Start an HTTP server bound to a given IP (port chosen by the kernel); stopped after the test."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(ip: str) -> int:
        server = http.server.ThreadingHTTPServer((ip, 0), _Hello)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return int(server.server_address[1])

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_gpu_statefulset_runs_on_fake_nodes_with_reachable_loopback_ips(
    kube_cluster: KubeTarget,
    k8s_api: client.ApiClient,
    namespace: str,
    wait_for: Callable[..., Any],
    serve_on: Callable[[str], int],
) -> None:
    core = client.CoreV1Api(k8s_api)
    gpu_nodes = [n for n in core.list_node().items if int((n.status.allocatable or {}).get(nodes.GPU_RESOURCE, 0))]
    if not gpu_nodes:
        pytest.skip(f"no node with {nodes.GPU_RESOURCE} allocatable in context {kube_cluster.context}")
    client.AppsV1Api(k8s_api).create_namespaced_stateful_set(namespace, _gpu_statefulset("engine", 3))

    def running_pods() -> list[Any] | None:
        pods = core.list_namespaced_pod(namespace, label_selector="app=engine").items
        running = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        return running if len(running) == 3 else None

    pods = wait_for(running_pods, timeout=60, what="3 GPU pods Running with an IP")
    gpu_node_names = {n.metadata.name for n in gpu_nodes}
    assert {p.spec.node_name for p in pods} <= gpu_node_names
    if kube_cluster.local is None:
        return  # a real cluster's pod IPs live in its nodes' network namespaces, not on our loopback
    ips = [p.status.pod_ip for p in pods]
    assert len(set(ips)) == 3, ips
    for pod, ip in zip(pods, ips, strict=True):
        assert ipaddress.ip_address(ip) in POD_NETWORK, (pod.metadata.name, ip)
        port = serve_on(ip)
        with urllib.request.urlopen(f"http://{ip}:{port}/health", timeout=5) as resp:
            assert json.load(resp) == {"served_on": ip}


def _sandbox(*args: str) -> subprocess.CompletedProcess[str]:
    operator_dir = pathlib.Path(cluster.__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(operator_dir), os.environ.get("PYTHONPATH")])))
    env.pop("KUBECONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "rolloutfleet.cli", "sandbox", *args],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )  # fmt: skip


def test_sandbox_up_status_down_leaves_no_process(local_cluster: cluster.Cluster, tmp_path: pathlib.Path) -> None:
    where = ["--name", "lifecycle", "--dir", str(tmp_path / "sandbox")]
    up = _sandbox("up", *where, "--nodes", "1")
    assert up.returncode == 0, up.stderr
    assert f"export KUBECONFIG={tmp_path / 'sandbox' / 'kubeconfig'}" in up.stdout
    assert "kubectl" in up.stdout
    target = cluster.Cluster(tmp_path / "sandbox", name="lifecycle")
    try:
        # Detached from the CLI process that started it, and one process per component.
        assert target.running()
        assert len(target.pids()) == len(cluster.COMPONENTS), target.pids()
        status = _sandbox("status", *where)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "nodes 1/1 ready" in status.stdout
        data_dir = json.loads(target.state_file.read_text())["etcd_data_dir"]
        down = _sandbox("down", *where)
        assert down.returncode == 0, down.stderr
        assert target.pids() == []
        assert processes.matching(data_dir) == []
        assert not pathlib.Path(data_dir).exists()
        assert _sandbox("status", *where).returncode == 3
    finally:
        target.stop(quiet=True)


def test_the_controller_manager_s_and_scheduler_s_metrics_are_read_as_the_admin(local_cluster: cluster.Cluster) -> None:
    """The bench splits the control plane's CPU by what the controller manager's work queues did
    (``Cluster.component_metrics``): both serve /metrics only to a client the API server authorizes, so this
    proves the admin's token is accepted through their delegated checks and the queues are there to read."""
    text = local_cluster.component_metrics("kube-controller-manager")
    assert 'workqueue_adds_total{name="statefulset"}' in text
    assert "workqueue_work_duration_seconds_sum" in text
    assert "scheduler_" in local_cluster.component_metrics("kube-scheduler")
    with pytest.raises(cluster.ClusterError):
        local_cluster.component_metrics("kwok")  # not one of the two


def test_a_gated_pod_is_ready_only_while_its_weights_gate_is_true_as_a_kubelet_decides(
    local_cluster: cluster.Cluster, k8s_api: client.ApiClient, namespace: str, wait_for: Callable[..., Any]
) -> None:
    """A kubelet's Ready is its containers ready and every readiness gate True, recomputed when a gate changes;
    kwok's own stages made a pod Ready at start and kept it so (``cluster.with_kubelet_readiness``). Pods behind
    the fleet's Service, its StatefulSet's rolling update and its disruption budget all go by Ready, so the sandbox
    must flip it as a cluster does: not Ready before the operator opens the gate, Ready after, not Ready again
    while the gate is closed for a reload. (A pod without gates stays Ready from the start: the test above.)"""
    core = client.CoreV1Api(k8s_api)
    spec = _gpu_statefulset("gated", 1)
    spec["spec"]["template"]["spec"]["readinessGates"] = [{"conditionType": labels.WEIGHTS_READY_CONDITION}]
    client.AppsV1Api(k8s_api).create_namespaced_stateful_set(namespace, spec)

    def conditions() -> dict[str, str]:
        pod = core.read_namespaced_pod("gated-0", namespace)
        return {c.type: c.status for c in pod.status.conditions or []}

    def running() -> bool:
        pods = core.list_namespaced_pod(namespace, label_selector="app=gated").items
        return bool(pods) and pods[0].status.phase == "Running"

    wait_for(running, timeout=60, what="the gated pod Running")
    wait_for(lambda: conditions().get("ContainersReady") == "True", timeout=30, what="containers ready")
    assert conditions().get("Ready") == "False", conditions()  # started gated: not Ready, as a kubelet reports it

    def set_gate(value: str) -> None:
        condition = {"type": labels.WEIGHTS_READY_CONDITION, "status": value}
        core.patch_namespaced_pod_status("gated-0", namespace, {"status": {"conditions": [condition]}})

    set_gate("True")
    wait_for(lambda: conditions().get("Ready") == "True", timeout=30, what="Ready after the gate opened")
    set_gate("False")
    wait_for(lambda: conditions().get("Ready") == "False", timeout=30, what="not Ready after the gate closed")
    assert conditions()[labels.WEIGHTS_READY_CONDITION] == "False"
    set_gate("True")
    wait_for(lambda: conditions().get("Ready") == "True", timeout=30, what="Ready again")
