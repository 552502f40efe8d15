"""Fixtures of the integration tier: a real Kubernetes API server, per-test namespaces, a waiting helper.

Used by every test in ``tests/integration``. Without ``KUBECONFIG`` the session starts the local control
plane of :mod:`rolloutfleet.sandbox.cluster` (Go-built binaries, fake GPU nodes, pod IPs on loopback) in
a temporary directory and stops it at the end; its processes also die if pytest itself is killed. With
``KUBECONFIG`` set (e.g. a kind cluster) the same tests run against that cluster's current context, but
only if the context looks like a disposable test cluster.

Fixtures: ``kube_cluster`` (:class:`KubeTarget`), ``kubeconfig_path`` (``pathlib.Path``), ``k8s_api``
(``kubernetes.client.ApiClient``), ``local_cluster`` (the :class:`Cluster`, skips on a KUBECONFIG run),
``namespace`` (a fresh namespace name, deleted afterwards) and ``wait_for``
(:func:`rolloutfleet.sandbox.waiting.wait_for`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, config

from rolloutfleet.sandbox import binaries, cluster, waiting

# Substrings of context names that mark a disposable cluster; anything else needs an explicit opt-in.
TEST_CONTEXT_MARKERS = ("kind-", "kwok", "rolloutfleet-sandbox", "minikube", "k3d", "envtest")
OPT_IN_ENV = "ROLLOUTFLEET_TEST_CLUSTER_OK"
LOOPBACK_PODS_ENV = "ROLLOUTFLEET_TEST_LOOPBACK_PODS"
# Pod subnets of a test session: 127.1.<offset + node>.0/24. Each session picks its own block of 8 so that
# concurrent sessions on one machine (developers' parallel runs) never serve engines on the same IP:port.
TEST_SUBNET_OFFSET = int(os.environ.get("ROLLOUTFLEET_TEST_SUBNET_OFFSET") or 128 + 8 * (os.getpid() % 15))


@dataclasses.dataclass(frozen=True)
class KubeTarget:
    """The cluster the tests talk to; ``local`` is None when it came from ``KUBECONFIG``."""

    kubeconfig: pathlib.Path
    context: str
    local: cluster.Cluster | None


def looks_like_test_context(context: str) -> bool:
    return any(marker in context for marker in TEST_CONTEXT_MARKERS) or os.environ.get(OPT_IN_ENV) == "1"


def _from_kubeconfig_env(value: str) -> KubeTarget:
    # KUBECONFIG may list several files; kubectl merges them and so does the Python client.
    paths = [p for p in value.split(os.pathsep) if p]
    _, current = config.list_kube_config_contexts(config_file=paths[0])
    context = str(current["name"])
    if not looks_like_test_context(context):
        pytest.exit(
            f"refusing to run integration tests against kube context {context!r} from KUBECONFIG: its name "
            f"contains none of {TEST_CONTEXT_MARKERS}. Use a disposable cluster, or set {OPT_IN_ENV}=1 "
            "if this one really is one.",
            returncode=4,
        )
    return KubeTarget(pathlib.Path(paths[0]), context, None)


@pytest.fixture(scope="session")
def kube_cluster(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeTarget]:
    env = os.environ.get("KUBECONFIG")
    if env:
        # Simulated engines listen on pod IPs only when those are loopback (the local control plane).
        os.environ[LOOPBACK_PODS_ENV] = "0"
        yield _from_kubeconfig_env(env)
        return
    os.environ[LOOPBACK_PODS_ENV] = "1"
    local = cluster.Cluster(
        tmp_path_factory.mktemp("kube"),
        name="pytest",
        nodes=4,
        gpus_per_node=8,
        # Pod IPs 127.1.128.x and up: disjoint from a `sandbox up` cluster (127.1.0.x ...) that may be
        # running with simulated engines on the same machine.
        subnet_offset=TEST_SUBNET_OFFSET,
        tie_to_parent=True,
    )
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    # Show progress live: a cold build of the binaries takes many minutes and must not look like a hang.
    with capture.global_and_fixture_disabled():
        missing = [t for t in cluster.COMPONENTS if not binaries.binary_path(t).exists()]
        if missing:
            print(f"\n[sandbox] building {', '.join(missing)} from Go modules (cold: 10-20 min on 2 cores)")
        local.start()
    try:
        yield KubeTarget(local.kubeconfig, local.context, local)
    finally:
        local.stop()


@pytest.fixture(scope="session")
def kubeconfig_path(kube_cluster: KubeTarget) -> pathlib.Path:
    return kube_cluster.kubeconfig


@pytest.fixture(scope="session")
def k8s_api(kube_cluster: KubeTarget) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(
        config_file=str(kube_cluster.kubeconfig), context=kube_cluster.context, persist_config=False
    )
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def local_cluster(kube_cluster: KubeTarget) -> cluster.Cluster:
    if kube_cluster.local is None:
        pytest.skip("needs the local control plane (KUBECONFIG is set)")
    return kube_cluster.local


@pytest.fixture
def wait_for() -> Callable[..., Any]:
    return waiting.wait_for


@pytest.fixture
def namespace(k8s_api: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    core = client.CoreV1Api(k8s_api)
    slug = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"t-{slug}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"rolloutfleet.io/test": "1"}))
    )

    # Pods are refused until the service-account controller has made the namespace's `default` account.
    def has_default_account() -> bool:
        return bool(core.list_namespaced_service_account(name, field_selector="metadata.name=default").items)

    waiting.wait_for(has_default_account, timeout=30, what=f"serviceaccount default in {name}")
    try:
        yield name
    finally:
        # Not waiting for the namespace controller: deletion finishes in the background.
        core.delete_namespace(name, propagation_policy="Background")
