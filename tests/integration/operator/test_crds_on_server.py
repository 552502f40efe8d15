"""The generated CRDs on a real API server: examples are accepted, invalid objects are refused by the
server's own schema and CEL validation (each assertion names the server's message)."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest
import yaml
from kubernetes import client

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[3]
GROUP, VERSION = "rolloutfleet.io", "v1alpha1"


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    return doc


def create(api: client.CustomObjectsApi, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    plural = "rolloutfleets" if obj["kind"] == "RolloutFleet" else "weightrevisions"
    out: dict[str, Any] = api.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, obj)
    return out


def test_examples_are_accepted_and_defaulted(
    crds_installed: list[str], k8s_api: client.ApiClient, namespace: str
) -> None:
    api = client.CustomObjectsApi(k8s_api)
    fleet = create(api, namespace, example("rolloutfleet-eagle.yaml"))
    assert fleet["spec"]["parity"]["logprobsMode"] == "processed_logprobs"  # server-side default from the schema
    assert fleet["spec"]["updateStrategy"]["timeouts"]["loadSeconds"] == 1800
    for name in ("weightrevision-step-1.yaml", "weightrevision-step-2-rolling.yaml"):
        wrev = create(api, namespace, example(name))
        assert wrev["spec"]["fleetRef"]["name"] == "policy-7b"


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    node = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return out


FLEET = example("rolloutfleet-eagle.yaml")
WREV = example("weightrevision-step-1.yaml")

INVALID = [
    ("fleet-negative-replicas", FLEET, "spec.replicas", -1, "spec.replicas: Invalid value: -1"),
    ("fleet-relative-path", FLEET, "spec.verifier.path", "weights/x", "spec.verifier.path: Invalid value"),
    ("fleet-dotdot-path", FLEET, "spec.verifier.path", "/weights/a/../b", "must not contain a '..' segment"),
    ("fleet-unknown-method", FLEET, "spec.draft.method", "medusa", 'spec.draft.method: Unsupported value: "medusa"'),
    (
        "fleet-tp-not-dividing",
        FLEET,
        "spec.tensorParallelSize",
        3,
        "gpusPerPod must be a multiple of tensorParallelSize",
    ),
    ("fleet-draft-without-path", FLEET, "spec.draft", {"method": "eagle"}, "draft.path is required"),
    (
        "fleet-max-unavailable-zero",
        FLEET,
        "spec.updateStrategy.maxUnavailable",
        0,
        "must be an integer >= 1 or a percentage",
    ),
    (
        "fleet-max-unavailable-bad-pct",
        FLEET,
        "spec.updateStrategy.maxUnavailable",
        "0%",
        "must be an integer >= 1 or a percentage",
    ),
    ("fleet-no-roots", FLEET, "spec.weights.allowedRoots", [], "spec.weights.allowedRoots: Invalid value"),
    ("fleet-mode", FLEET, "spec.updateStrategy.mode", "hot", 'spec.updateStrategy.mode: Unsupported value: "hot"'),
    ("wrev-negative-revision", WREV, "spec.revision", -3, "spec.revision: Invalid value: -3"),
    ("wrev-bad-digest", WREV, "spec.verifier.digest", "sha256:00", "spec.verifier.digest: Invalid value"),
    ("wrev-no-verifier", WREV, "spec.verifier", None, "spec.verifier: Required value"),
    ("wrev-dotdot", WREV, "spec.draft.path", "/weights/policy-7b/../../etc", "must not contain a '..' segment"),
    # Pushed sources (docs/push.md): the API server refuses what nothing could verify or act on.
    ("wrev-push-no-digest", WREV, "spec.verifier", {"push": {}}, "a pushed source needs the digest"),
    (
        "wrev-push-and-path",
        WREV,
        "spec.verifier",
        {"push": {}, "path": "/weights/policy-7b/v", "digest": "blake3:" + "1" * 64},
        "set exactly one of path and push",
    ),
    ("wrev-neither", WREV, "spec.draft", {"digest": "blake3:" + "1" * 64}, "set exactly one of path and push"),
    ("fleet-transfer-backend", FLEET, "spec.weightTransfer", {"backend": "gloo"}, 'Unsupported value: "gloo"'),
    (
        "fleet-keep-alive",
        FLEET,
        "spec.env",
        [{"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "5s"}],
        "spec.env[0].value: Invalid value: VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be whole seconds",
    ),
]


@pytest.mark.parametrize(("case", "base", "path", "value", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_server_rejects_invalid_objects(
    crds_installed: list[str],
    k8s_api: client.ApiClient,
    namespace: str,
    case: str,
    base: dict[str, Any],
    path: str,
    value: Any,
    message: str,
) -> None:
    obj = _set(base, path, value)
    if value is None:
        obj["spec"].pop(path.rsplit(".", 1)[-1])
    obj["metadata"] = {"name": case}
    with pytest.raises(client.ApiException) as err:
        create(client.CustomObjectsApi(k8s_api), namespace, obj)
    assert err.value.status == 422, err.value.body
    server_message = json.loads(err.value.body)["message"]
    assert message in server_message, server_message


@pytest.mark.parametrize("field", ["revision", "fleetRef"])
def test_revision_and_fleet_ref_are_immutable(
    crds_installed: list[str], k8s_api: client.ApiClient, namespace: str, field: str
) -> None:
    api = client.CustomObjectsApi(k8s_api)
    create(api, namespace, WREV)
    patch = {"spec": {"revision": 99}} if field == "revision" else {"spec": {"fleetRef": {"name": "other"}}}
    with pytest.raises(client.ApiException) as err:
        api.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "weightrevisions", WREV["metadata"]["name"], patch
        )
    assert err.value.status == 422 and "is immutable" in err.value.body, err.value.body


def test_short_names_and_columns(crds_installed: list[str], k8s_api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(k8s_api)
    wrev = ext.read_custom_resource_definition("weightrevisions.rolloutfleet.io")
    assert wrev.spec.names.short_names == ["wrev"]
    assert [c.name for c in wrev.spec.versions[0].additional_printer_columns] == [
        "Fleet",
        "Revision",
        "Phase",
        "Updated",
        "Age",
    ]


def test_a_16000_pod_fleet_s_status_is_accepted(
    crds_installed: list[str], k8s_api: client.ApiClient, namespace: str
) -> None:
    """The API server stores a fleet whole, and etcd refuses an object over 1.5 MiB (its default
    --max-request-bytes). With a row per pod (~115 bytes here) a 16,000-pod fleet's status was 1.8 MB: every
    write of it failed, so readyReplicas and the conditions never moved. The status the operator builds now lists
    the pods that stand out (``planning.fleet_status.listing``) and is accepted; the row-per-pod form of the same
    status is refused, which is why."""
    from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutFleetStatus
    from rolloutfleet.planning import fleet_status
    from rolloutfleet.resources import labels

    api = client.CustomObjectsApi(k8s_api)
    doc = copy.deepcopy(FLEET)
    doc["spec"]["replicas"] = 0  # its pods here are only the status's: the control plane runs none
    fleet = create(api, namespace, doc)
    name, n = fleet["metadata"]["name"], 16_000
    pods = [
        {
            "metadata": {"name": f"{name}-{i}", "namespace": namespace, "uid": f"u-{i}"},
            "spec": {"readinessGates": [{"conditionType": labels.WEIGHTS_READY_CONDITION}]},
            "status": {
                "phase": "Running",
                "podIP": f"127.{1 + i // 65536}.{i // 256 % 256}.{i % 256}",
                "conditions": [
                    {"type": "ContainersReady", "status": "True"},
                    {"type": labels.WEIGHTS_READY_CONDITION, "status": "False" if i % 4 else "True"},
                ],
            },
        }
        for i in range(n)
    ]
    # Midway through a Rolling revision: a quarter of the pods serve revision 8, the rest still 7.
    engines = {
        p["metadata"]["name"]: fleet_status.EngineSummary(8, 8, "Done", "8")
        if i % 4 == 0
        else fleet_status.EngineSummary(7, 7, None, "7")
        for i, p in enumerate(pods)
    }
    spec = RolloutFleetSpec.model_validate({**fleet["spec"], "replicas": n})
    status = fleet_status.observed(RolloutFleetStatus(), spec, name, 1, None, pods, engines)
    summary = {k: v for k, v in status.to_wire().items() if k not in ("pods", "podsCommon", "podsTruncated")}
    rows = [
        {"name": p["metadata"]["name"], "ip": p["status"]["podIP"], "phase": "Running", "ready": i % 4 == 0}
        | {
            "revision": engines[p["metadata"]["name"]].revision,
            "draftRevision": engines[p["metadata"]["name"]].draft_revision,
            "weightVersion": engines[p["metadata"]["name"]].weight_version,
        }
        for i, p in enumerate(pods)
    ]
    with pytest.raises(client.ApiException) as refused:
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, "rolloutfleets", name, {"status": {**summary, "pods": rows}}
        )
    assert len(json.dumps(rows)) > 1.5 * 2**20
    assert "request is too large" in str(refused.value.body), refused.value.body
    written = api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "rolloutfleets", name, {"status": status.to_wire()}
    )
    stored = written["status"]
    assert len(json.dumps(stored)) < 100_000
    assert stored["podsCommon"]["pods"] == n - n // 4 and stored["podsCommon"]["revision"] == 7
    assert len(stored["pods"]) == 256 and stored["podsTruncated"] == n // 4 - 256
    assert stored["readyReplicas"] == n // 4


def test_a_pushed_revision_s_handshake_at_its_limit_is_stored_and_past_it_would_not_be(
    crds_installed: list[str], k8s_api: client.ApiClient, namespace: str
) -> None:
    """A pushed revision's status lists every pod (``push.sessions``, and with NCCL the group's ``ranks``), and
    etcd refuses an object over 1.5 MiB. ``validation.push_bytes_per_pod`` bounds what a pod adds; a push to more
    pods than ``PUSH_LISTS_MAX_BYTES`` holds is refused (``validation._check_push_lists``). Here that bound is held to
    the real API server: the lists at the limit, every entry at its longest (the longest fleet name, IPv6
    addresses), beside a status whose other per-pod lists are full, are stored; the same handshake of a
    12,000-pod fleet with short names and IPv4 addresses is refused by etcd, as every write of it was before the
    rule."""
    from rolloutfleet.api import validation
    from rolloutfleet.api.fleet import FLEET_NAME_MAX_LENGTH, RolloutFleetSpec
    from rolloutfleet.api.revision import WeightRevisionSpec

    api = client.CustomObjectsApi(k8s_api)
    rev = create(api, namespace, copy.deepcopy(WREV))
    name = rev["metadata"]["name"]

    def nccl_fleet(replicas: int) -> RolloutFleetSpec:
        raw = {**FLEET["spec"], "replicas": replicas, "weightTransfer": {"backend": "nccl"}}
        return RolloutFleetSpec.model_validate(raw)

    def handshake(fleet_name: str, pods: int, address: Any) -> dict[str, Any]:
        names = [f"{fleet_name}-{i}" for i in range(pods)]
        return {
            "protocol": 1,
            "epoch": 10**10 - 1,
            "sessions": [
                {"pod": p, "address": address(i), "target": "verifier", "epoch": 10**10 - 1}
                for i, p in enumerate(names)
            ],
            "group": {
                "epoch": 1,
                "worldSize": 1 + pods,
                "formed": True,
                "ranks": [{"pod": p, "rankOffset": 1 + i, "worldSize": 1} for i, p in enumerate(names)],
            },
        }

    longest = "f" * FLEET_NAME_MAX_LENGTH
    most = validation.PUSH_LISTS_MAX_BYTES // validation.push_bytes_per_pod(longest, nccl_fleet(100_000))
    assert 3_000 < most < 4_000  # what docs/push.md says of the longest names
    digest = "blake3:" + "e" * 64
    rest = {
        "phase": "Progressing",
        "pods": [
            {"name": f"{longest}-{i}", "step": "LoadDraft", "verifierDigest": digest, "draftDigest": digest}
            | {"attempts": 3, "message": "m" * 256, "staging": "Fallback"}
            for i in range(256)
        ],
        "failures": [
            {"name": f"{longest}-{i}", "step": "LoadDraft", "reason": "ExtensionIo", "message": "m" * 256}
            for i in range(256)
        ],
    }
    full = handshake(longest, most, lambda i: "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535")
    written = api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "weightrevisions", name, {"status": {**rest, "push": full}}
    )
    assert len(written["status"]["push"]["sessions"]) == most
    assert len(json.dumps(written, separators=(",", ":"))) > 1_000_000

    typical = handshake("policy-7b", 12_000, lambda i: f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000")
    with pytest.raises(client.ApiException) as refused:
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, "weightrevisions", name, {"status": {"phase": "Progressing", "push": typical}}
        )
    assert "request is too large" in str(refused.value.body), refused.value.body
    spec = WREV["spec"] | {"verifier": {"push": {}, "digest": digest}}
    errors = validation.validate_revision(WeightRevisionSpec.model_validate(spec), nccl_fleet(12_000))
    assert [e.path for e in errors] == ["spec.verifier.push"], errors
