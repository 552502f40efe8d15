"""The chart rendered without a cluster: `helm lint --strict` and `helm template` of every value set, with
assertions on the objects (flags, peering, least-privilege RBAC, PodSecurity, the operator's contracts)."""

from __future__ import annotations

import filecmp
from typing import Any

import pytest
import yaml
from chart_support import CHART, REPO, VALUE_SETS, helm, kinds, one, operator_container, render, values_for

from rolloutfleet.resources import labels

pytestmark = pytest.mark.chart

NS, OTHER = "rf-system", "rl-team"
# Everything the operator may do in a namespace it serves; the integration test proves it is needed
# (tests/integration/chart/test_chart_identity.py). Adding a verb here needs a reason in _helpers.tpl.
EXPECTED_RULES = {
    ("rolloutfleet.io", "rolloutfleets"): {"get", "list", "watch", "patch"},
    ("rolloutfleet.io", "rolloutfleets/status"): {"patch"},
    ("rolloutfleet.io", "weightrevisions"): {"get", "list", "watch", "patch"},
    ("rolloutfleet.io", "weightrevisions/status"): {"patch"},
    ("", "pods"): {"list", "watch", "delete"},  # delete: the repair of a target a failed push session destroyed
    ("", "pods/status"): {"patch"},  # the weights readiness gate
    ("", "services"): {"create", "patch"},
    ("apps", "statefulsets"): {"get", "create", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): {"create", "patch"},
    ("", "secrets"): {"get", "create"},
    ("", "events"): {"create"},
}


def rendered(value_set: str) -> list[dict[str, Any]]:
    return render(values_for(value_set, NS, OTHER), NS)[1]


def flat_rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict(value_set: str) -> None:
    out = helm("lint", "--strict", str(CHART), "--namespace", NS, "--values", "-",
               stdin=yaml.safe_dump(values_for(value_set, NS, OTHER)))  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_common_shape(value_set: str) -> None:
    objs = rendered(value_set)
    for obj in objs:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert obj["metadata"]["namespace"], obj["metadata"]
    for role in kinds(objs, "Role") + kinds(objs, "ClusterRole"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert not any("*" in item for item in rule[key]), (role["metadata"]["name"], rule)
            forbidden = {"delete", "deletecollection", "update", "escalate", "bind", "impersonate"}
            if rule["apiGroups"] == [""] and rule["resources"] == ["pods"]:
                # The one deletion: an engine pod whose target a failed push session destroyed is repaired
                # only by a new process (docs/push.md); never any other kind, never a collection.
                forbidden.discard("delete")
            assert not forbidden & set(rule["verbs"]), rule
    deployment = one(objs, "Deployment")
    pod = deployment["spec"]["template"]
    # The engine NetworkPolicies admit the operator by this exact label in ROLLOUTFLEET_OPERATOR_NAMESPACE.
    for key, value in labels.OPERATOR_POD_LABELS.items():
        assert pod["metadata"]["labels"][key] == value
    container = operator_container(objs)
    env = {e["name"]: e for e in container["env"]}
    assert env["ROLLOUTFLEET_OPERATOR_NAMESPACE"]["value"] == NS
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Restricted PodSecurity.
    psc, sc = pod["spec"]["securityContext"], container["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"mountPath": "/tmp", "name": "tmp"} in container["volumeMounts"]
    # Probes and ports match the flags.
    args = container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--metrics-port={ports['metrics']}" in args
    assert f"--liveness=http://0.0.0.0:{ports['healthz']}/healthz" in args
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    service = one(objs, "Service")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    # Every binding points at the chart's ServiceAccount.
    account = one(objs, "ServiceAccount")["metadata"]
    for binding in kinds(objs, "RoleBinding") + kinds(objs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"], "namespace": NS}]
    assert pod["spec"]["serviceAccountName"] == account["name"]


def test_default_is_one_standalone_replica_serving_the_release_namespace() -> None:
    objs = rendered("default")
    deployment = one(objs, "Deployment")
    args = operator_container(objs)["args"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two standalone operators
    assert "--standalone" in args and not any(a.startswith("--peering") for a in args)
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={NS}"]
    assert "--all-namespaces" not in args
    role = one(objs, "Role")
    assert role["metadata"]["namespace"] == NS
    assert flat_rules(role) == EXPECTED_RULES
    assert one(objs, "RoleBinding")["roleRef"]["name"] == role["metadata"]["name"]
    # Namespaced, kopf takes the namespaces as given (scanning off): nothing at cluster scope at all.
    assert not kinds(objs, "ClusterRole") and not kinds(objs, "ClusterRoleBinding")
    assert not kinds(objs, "KopfPeering") and not kinds(objs, "ServiceMonitor") and not kinds(objs, "NetworkPolicy")


def test_namespaced_has_a_role_in_every_watched_namespace() -> None:
    objs = rendered("namespaced")
    args = operator_container(objs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={NS}", f"--namespace={OTHER}"]
    roles = {r["metadata"]["namespace"]: r for r in kinds(objs, "Role")}
    assert set(roles) == {NS, OTHER}
    assert all(flat_rules(r) == EXPECTED_RULES for r in roles.values())
    assert {b["metadata"]["namespace"] for b in kinds(objs, "RoleBinding")} == {NS, OTHER}
    policy = one(objs, "NetworkPolicy")
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [8080, 8081]


def test_cluster_wide_uses_one_cluster_role() -> None:
    objs = rendered("cluster-wide")
    args = operator_container(objs)["args"]
    assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)
    assert not kinds(objs, "Role") and not kinds(objs, "RoleBinding")
    role = one(objs, "ClusterRole")
    expected = {**EXPECTED_RULES, ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
    assert flat_rules(role) == expected
    assert one(objs, "ClusterRoleBinding")["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }


def test_ha_runs_peered_replicas_with_their_peering_object() -> None:
    objs = rendered("ha")
    deployment = one(objs, "Deployment")
    args = operator_container(objs)["args"]
    assert deployment["spec"]["replicas"] == 2
    assert "--standalone" not in args
    peering = one(objs, "KopfPeering")
    assert f"--peering={peering['metadata']['name']}" in args
    assert peering["metadata"]["namespace"] == NS
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    rules = flat_rules(one(objs, "Role"))
    assert rules.pop(("kopf.dev", "kopfpeerings")) == {"list", "watch", "patch"}
    assert rules == EXPECTED_RULES


def test_ha_cluster_wide_peers_through_a_cluster_peering() -> None:
    _, objs = render({"replicaCount": 3, "watch": {"clusterWide": True}, "peering": {"name": "rf-peers"}}, NS)
    assert "--peering=rf-peers" in operator_container(objs)["args"]
    assert one(objs, "ClusterKopfPeering")["metadata"]["name"] == "rf-peers"
    assert not kinds(objs, "KopfPeering")
    assert flat_rules(one(objs, "ClusterRole"))[("kopf.dev", "clusterkopfpeerings")] == {"list", "watch", "patch"}


def test_service_monitor_and_scheduling_values() -> None:
    values = {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {}},
        "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}},
        "image": {"digest": "sha256:" + "a" * 64},
        "operator": {"verbose": True, "extraArgs": ["--foo"]},
    }
    _, objs = render(values, NS)
    monitor = one(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"][0]["key"] == "dedicated"
    assert pod["affinity"] == {"podAntiAffinity": {}}
    container = operator_container(objs)
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    assert container["image"].endswith("@sha256:" + "a" * 64)
    assert container["args"][-2:] == ["--verbose", "--foo"]


@pytest.mark.parametrize(
    "values",
    [{"replicaCount": 0}, {"unknownKey": 1}, {"watch": {"namespaces": ["Not_A_Namespace"]}}, {"image": {"tag": 3}}],
)
def test_schema_refuses_bad_values(values: dict[str, Any]) -> None:
    out = helm("template", "rf", str(CHART), "--values", "-", stdin=yaml.safe_dump(values))
    assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, out.stderr


def test_crds_ship_with_the_chart() -> None:
    for path in (REPO / "crds").glob("*.yaml"):
        assert filecmp.cmp(path, CHART / "crds" / path.name, shallow=False), path.name
    _, objs = render({}, NS, "rf", "--include-crds")
    crds = {o["metadata"]["name"] for o in kinds(objs, "CustomResourceDefinition")}
    assert crds == {
        "rolloutfleets.rolloutfleet.io",
        "weightrevisions.rolloutfleet.io",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    }
    _, objs = render({"peering": {"installCRDs": False}}, NS, "rf", "--include-crds")
    assert {o["metadata"]["name"] for o in kinds(objs, "CustomResourceDefinition")} == {
        "rolloutfleets.rolloutfleet.io",
        "weightrevisions.rolloutfleet.io",
    }


def test_notes_name_the_next_steps() -> None:
    out = helm("install", "rf", str(CHART), "--dry-run=client", "--namespace", NS, "--set", "replicaCount=2")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NS} rollout status deployment/rf-rolloutfleet" in notes
    assert "kubectl -n rf-system wait --for=condition=Ready wrev/policy-step-1" in notes
    assert "ghcr.io/rolloutfleet/rolloutfleet-worker:" in notes
    assert "kubectl apply --server-side -f charts/rolloutfleet/crds/" in notes
    assert 'kopf peering "rf-rolloutfleet"' in notes
