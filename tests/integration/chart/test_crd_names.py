"""Every name of our kinds works with kubectl get, and the category lists both kinds.

The category used to be `rolloutfleet`, the singular of RolloutFleet: whenever the object was not in the
namespace asked (a forgotten `-n`, `-A`), kubectl fell back to the category, expanded it to both kinds and
answered "you must specify only one resource" instead of "not found". Run against the real API server's
discovery, which is where kubectl resolves names.
"""

from __future__ import annotations

import pathlib

import pytest
from kubernetes import client
from operator_helpers import GROUP, VERSION, fleet_manifest

from rolloutfleet.api import crdgen

from .conftest import kubectl

pytestmark = pytest.mark.chart

REVISION = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": "WeightRevision",
    "metadata": {"name": "step-1"},
    "spec": {"fleetRef": {"name": "names"}, "revision": 1, "verifier": {"path": "/weights/step-1/verifier"}},
}


def test_kubectl_get_by_every_name(
    chart_crds: list[str], k8s_api: client.ApiClient, namespace: str, kubeconfig_path: pathlib.Path
) -> None:
    objects = client.CustomObjectsApi(k8s_api)
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", fleet_manifest("names"))
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", REVISION)
    for resource, name in [
        ("rolloutfleet", "names"),
        ("rolloutfleets", "names"),
        ("rfleet", "names"),
        ("weightrevision", "step-1"),
        ("weightrevisions", "step-1"),
        ("wrev", "step-1"),
    ]:
        found = kubectl(kubeconfig_path, "get", resource, name, "-n", namespace, "-o", "name")
        assert found.returncode == 0, f"kubectl get {resource} {name}: {found.stderr}"
        assert found.stdout.strip().endswith(f"/{name}"), found.stdout
        # Where the object is not, kubectl must say so. With the old category it fell back to expanding
        # the category here and answered "you must specify only one resource" (seen in a fleet's own
        # namespace whenever -n was forgotten).
        missing = kubectl(kubeconfig_path, "get", resource, name, "-n", "default")
        assert missing.returncode != 0
        assert "not found" in missing.stderr, f"kubectl get {resource} {name} -n default: {missing.stderr}"
    listed = kubectl(kubeconfig_path, "get", crdgen.CATEGORY, "-n", namespace, "-o", "name")
    assert listed.returncode == 0, listed.stderr
    assert sorted(listed.stdout.split()) == [
        f"rolloutfleet.{GROUP}/names",
        f"weightrevision.{GROUP}/step-1",
    ]
