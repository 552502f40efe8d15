"""Shared setup of the publish and trainer-loop integration tests: a small fleet with simulated engines
whose weights are real tiny checkpoints in a temporary directory, and a least-privilege client."""

from __future__ import annotations

import base64
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_helpers import GROUP, VERSION, eventually, fleet_manifest, get_fleet, weights_volume
from sim_harness import FollowerThread, write_checkpoint

FLEET = "pol"


def checkpoints(root: pathlib.Path, revisions: range) -> pathlib.Path:
    for rev in revisions:
        write_checkpoint(root / "policy" / f"step-{rev}" / "verifier", seed=100 + rev)
        write_checkpoint(root / "policy" / f"step-{rev}" / "draft", seed=200 + rev, tensors=2)
    return root


def fleet_body(root: pathlib.Path, replicas: int = 2, name: str = FLEET, draft: bool = True) -> dict[str, Any]:
    return fleet_manifest(
        name,
        replicas,
        verifier={"path": str(root / "policy/step-0/verifier")},
        draft=(
            {"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"}
            if draft
            else {"method": "none"}
        ),
        weights={"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
        updateStrategy={"maxRetries": 1, "timeouts": {"wakeSeconds": 5, "loadSeconds": 10}},
    )


def revisions_of(api: client.CustomObjectsApi, namespace: str) -> list[dict[str, Any]]:
    return list(api.list_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions")["items"])


@pytest.fixture
def live_fleet(
    operator_process: Any, k8s_api: client.ApiClient, namespace: str, tmp_path: pathlib.Path
) -> Iterator[tuple[FollowerThread, pathlib.Path]]:
    """Fleet ``pol`` (2 pods, co-updated draft) with simulated engines, all Ready; yields (follower, root)."""
    root = checkpoints(tmp_path / "weights", range(0, 3))
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, FLEET)
    api = client.CustomObjectsApi(k8s_api)
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", fleet_body(root))
        eventually(
            lambda: (
                follower.engines() == 2
                and (get_fleet(api, namespace, FLEET).get("status") or {}).get("readyReplicas") == 2
            ),
            timeout=90,
            what="2 engines ready",
        )
        yield follower, root
    finally:
        follower.stop()


def read_only_client(
    k8s_api: client.ApiClient, namespace: str, tmp_path: pathlib.Path
) -> tuple[client.ApiClient, pathlib.Path]:
    """A client and a kubeconfig for a ServiceAccount that may only get/list/watch fleets and revisions."""
    core, rbac = client.CoreV1Api(k8s_api), client.RbacAuthorizationV1Api(k8s_api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "trainer-ro"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "trainer-ro"},
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": ["weightrevisions", "rolloutfleets"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "trainer-ro"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "trainer-ro"},
            "subjects": [{"kind": "ServiceAccount", "name": "trainer-ro", "namespace": namespace}],
        },
    )
    token = core.create_namespaced_service_account_token(
        "trainer-ro", namespace, {"spec": {"expirationSeconds": 900}}
    ).status.token
    base = k8s_api.configuration
    cfg = client.Configuration()
    cfg.host = base.host
    cfg.ssl_ca_cert = base.ssl_ca_cert
    cfg.verify_ssl = base.verify_ssl
    cfg.api_key = {"authorization": f"Bearer {token}"}
    cluster: dict[str, Any] = {"server": base.host}
    if base.ssl_ca_cert:
        ca = pathlib.Path(base.ssl_ca_cert).read_bytes()
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    else:
        cluster["insecure-skip-tls-verify"] = True
    kubeconfig = tmp_path / "trainer-ro.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "trainer-ro", "user": {"token": token}}],
                "contexts": [{"name": "ro", "context": {"cluster": "c", "user": "trainer-ro", "namespace": namespace}}],
                "current-context": "ro",
            }
        )
    )
    return client.ApiClient(cfg), kubeconfig
