"""The rendered chart against the real API server: a server-side dry run of every value set (schemas,
RBAC escalation checks, admission), the pod template admitted under the `restricted` PodSecurity level,
and two operator replicas sharing kopf peering."""

from __future__ import annotations

import json
import pathlib
import uuid
from collections.abc import Iterator

import pytest
import yaml
from chart_support import RBAC_KINDS, REPO, VALUE_SETS, kinds, one, render, to_yaml, values_for
from kubernetes import client
from operator_helpers import eventually, weights_volume
from sim_harness import FollowerThread

from .conftest import (
    create_fleet_and_revision,
    forbidden_lines,
    kubectl,
    phase,
    service_account_kubeconfig,
    start_operator_as,
)

pytestmark = [pytest.mark.chart, pytest.mark.integration]


@pytest.fixture
def restricted_namespace(k8s_api: client.ApiClient, namespace: str) -> str:
    """The test namespace, enforcing (and warning about) the `restricted` Pod Security Standard."""
    levels = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn")}
    client.CoreV1Api(k8s_api).patch_namespace(namespace, {"metadata": {"labels": levels}})
    return namespace


@pytest.fixture
def other_namespace(k8s_api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(k8s_api)
    name = f"t-chart-other-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_server_dry_run(
    value_set: str,
    chart_crds: list[str],
    kubeconfig_path: pathlib.Path,
    restricted_namespace: str,
    other_namespace: str,
) -> None:
    text, objs = render(values_for(value_set, restricted_namespace, other_namespace), restricted_namespace)
    out = kubectl(kubeconfig_path, "apply", "--dry-run=server", "-f", "-", stdin=text)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr  # PodSecurity warns about workload templates
    assert len(out.stdout.strip().splitlines()) == len(objs), out.stdout


def test_operator_pod_is_admitted_under_restricted_pod_security(
    chart_crds: list[str], kubeconfig_path: pathlib.Path, restricted_namespace: str
) -> None:
    _, objs = render({}, restricted_namespace)
    template = one(objs, "Deployment")["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "operator-pss", "namespace": restricted_namespace},
        "spec": {**template["spec"], "serviceAccountName": "default"},
    }
    ok = kubectl(kubeconfig_path, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod))
    assert ok.returncode == 0, ok.stderr
    # The check has teeth: the same pod without the chart's securityContext is refused.
    pod["spec"]["containers"][0].pop("securityContext")
    refused = kubectl(kubeconfig_path, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod))
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


def test_two_peered_replicas_complete_a_rollout(
    chart_crds: list[str],
    k8s_api: client.ApiClient,
    kubeconfig_path: pathlib.Path,
    namespace: str,
    weights: pathlib.Path,
    tmp_path: pathlib.Path,
    cluster_scoped_cleanup: list[str],
) -> None:
    _, objs = render({"replicaCount": 2, "watch": {"namespaces": [namespace]}}, namespace, f"rf{namespace[-6:]}")
    installed = [o for o in objs if o["kind"] in (*RBAC_KINDS, "KopfPeering")]
    assert len(kinds(installed, "KopfPeering")) == 1
    cluster_scoped_cleanup.extend(
        f"{o['kind'].lower()}/{o['metadata']['name']}" for o in installed if o["kind"].startswith("Cluster")
    )
    applied = kubectl(kubeconfig_path, "apply", "-f", "-", stdin=to_yaml(installed))
    assert applied.returncode == 0, applied.stderr
    account = one(installed, "ServiceAccount")["metadata"]["name"]
    kubeconfig = service_account_kubeconfig(k8s_api, kubeconfig_path, namespace, account, tmp_path / "sa.kubeconfig")
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, "pol")
    replicas = [start_operator_as(kubeconfig, objs, tmp_path / f"replica-{i}.log") for i in (0, 1)]
    try:
        api = client.CustomObjectsApi(k8s_api)
        name = create_fleet_and_revision(api, namespace, weights)
        eventually(lambda: phase(api, namespace, name) == "Succeeded", timeout=25, what=f"{name} Succeeded")
        for op in replicas:
            assert op.proc.poll() is None
            assert forbidden_lines(op.log()) == []
    finally:
        for op in replicas:
            op.stop()
        follower.stop()


def test_flux_fleet_example_is_valid_on_the_server(
    chart_crds: list[str], kubeconfig_path: pathlib.Path, namespace: str
) -> None:
    built = kubectl(kubeconfig_path, "kustomize", str(REPO / "docs" / "gitops" / "flux" / "fleet"))
    assert built.returncode == 0, built.stderr
    objs = [o for o in yaml.safe_load_all(built.stdout) if o]
    assert {o["kind"] for o in objs} == {"RolloutFleet", "WeightRevision"}
    for obj in objs:
        obj["metadata"]["namespace"] = namespace
    out = kubectl(kubeconfig_path, "apply", "--dry-run=server", "-f", "-", stdin=to_yaml(objs))
    assert out.returncode == 0, out.stderr
