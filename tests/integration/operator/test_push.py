"""Pushed revisions end to end: the real control plane, the operator process, simulated engines on every
pod's loopback IP (started with the fleet's ``--weight-transfer-config``), and the trainer library's push
client running as a ServiceAccount that holds exactly ``examples/rbac/trainer.yaml``.

Orders are read from the engines' own call logs: per pod, verifier session → verify → draft session →
verify → resume; a trainer that never sends meets the push deadline, its pods are restarted (never
resumed on what the session left), and the next good push recovers the fleet.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_helpers import GROUP, VERSION, eventually, fleet_manifest, get_fleet, weights_volume
from safetensors.numpy import load_file
from sim_harness import FollowerThread, ok_calls, write_checkpoint

from rolloutfleet.digest import digest_directory
from rolloutfleet.trainer import push_revision
from rolloutfleet.trainer.senders import SimulatedSender

pytestmark = pytest.mark.integration

FLEET = "pushed"
REPO = pathlib.Path(__file__).resolve().parents[3]
SESSION_CALLS = (
    "rolloutfleet_push_begin",
    "start_weight_update",
    "start_draft_weight_update",
    "update_weights",
    "finish_weight_update",
    "rolloutfleet_push_end",
    "resume",
)


def records(checkpoint: pathlib.Path) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """The tensors a trainer holds in memory for one step (here read from a tiny checkpoint)."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    return [(name, "F32", tuple(t.shape), t.tobytes()) for name, t in sorted(tensors.items())]


def trainer_client(k8s_api: client.ApiClient, namespace: str) -> client.ApiClient:
    """A client for a ServiceAccount bound to examples/rbac/trainer.yaml (namespace and Secret adapted)."""
    role, binding = (copy.deepcopy(d) for d in yaml.safe_load_all((REPO / "examples/rbac/trainer.yaml").read_text()))
    role["metadata"]["namespace"] = binding["metadata"]["namespace"] = namespace
    binding["subjects"][0]["namespace"] = namespace
    for rule in role["rules"]:
        if "resourceNames" in rule:
            rule["resourceNames"] = [f"{FLEET}-control-token"]
    core, rbac = client.CoreV1Api(k8s_api), client.RbacAuthorizationV1Api(k8s_api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": binding["subjects"][0]["name"]}})
    rbac.create_namespaced_role(namespace, role)
    rbac.create_namespaced_role_binding(namespace, binding)
    token = core.create_namespaced_service_account_token(
        binding["subjects"][0]["name"], namespace, {"spec": {"expirationSeconds": 900}}
    ).status.token
    cfg = client.Configuration()
    base = k8s_api.configuration
    cfg.host, cfg.ssl_ca_cert, cfg.verify_ssl = base.host, base.ssl_ca_cert, base.verify_ssl
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


@pytest.fixture
def weights(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "weights"
    for rev in range(0, 4):
        write_checkpoint(root / "policy" / f"step-{rev}" / "verifier", seed=100 + rev)
        write_checkpoint(root / "policy" / f"step-{rev}" / "draft", seed=200 + rev, tensors=2)
    return root


def start_fleet(
    k8s_api: client.ApiClient,
    namespace: str,
    root: pathlib.Path,
    replicas: int,
    *,
    fleet_extra: dict[str, Any] | None = None,
    **strategy: Any,
) -> FollowerThread:
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, FLEET)
    body = fleet_manifest(
        FLEET,
        replicas,
        verifier={"path": str(root / "policy/step-0/verifier")},
        draft={"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
        weights={"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
        **{"weightTransfer": {"backend": "ipc"}, **(fleet_extra or {})},
        updateStrategy={"maxRetries": 0, **strategy},
    )
    api = client.CustomObjectsApi(k8s_api)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", body)
    eventually(
        lambda: (
            follower.engines() == replicas
            and (get_fleet(api, namespace, FLEET).get("status") or {}).get("readyReplicas") == replicas
        ),
        timeout=120,
        what=f"{replicas} engines ready",
    )
    return follower


@pytest.fixture
def follower_holder() -> Iterator[list[FollowerThread]]:
    held: list[FollowerThread] = []
    yield held
    for follower in held:
        follower.stop()


def push(trainer: client.ApiClient, namespace: str, root: pathlib.Path, revision: int, sender: Any = None) -> Any:
    step = root / "policy" / f"step-{revision}"
    return push_revision(
        FLEET,
        revision,
        records(step / "verifier"),
        records(step / "draft"),
        namespace,
        sender=sender or SimulatedSender(),
        api_client=trainer,
        timeout=180,
        session_timeout=60,
        progress=False,
    )


def session_calls(log: list[dict[str, Any]]) -> list[str]:
    names = [str(e.get("key") or e["step"]) for e in ok_calls(log)]
    return [n for n in names if n.split(":")[0] in SESSION_CALLS]


@pytest.mark.parametrize(
    "strategy", [{}, {"rollout": "Rolling", "maxUnavailable": "25%"}], ids=["all-at-once", "rolling-25pct"]
)
def test_push_reaches_every_pod_verifier_then_draft(
    operator_process: Any,
    k8s_api: client.ApiClient,
    namespace: str,
    weights: pathlib.Path,
    follower_holder: list[FollowerThread],
    strategy: dict[str, Any],
) -> None:
    follower = start_fleet(k8s_api, namespace, weights, 8, **strategy)
    follower_holder.append(follower)
    result = push(trainer_client(k8s_api, namespace), namespace, weights, 1)
    assert result.phase == "Succeeded", result.object.get("status")
    api = client.CustomObjectsApi(k8s_api)
    served = get_fleet(api, namespace, FLEET)["status"]["served"]
    assert served["revision"] == 1 and served["verifierPushed"] and served["draftPushed"]
    assert served["verifierDigest"] == digest_directory(weights / "policy/step-1/verifier")
    logs = follower.logs()
    assert len(logs) == 8
    for key, log in logs.items():
        assert session_calls(log)[-11:] == [
            "rolloutfleet_push_begin:verifier",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "rolloutfleet_push_end",
            "rolloutfleet_push_begin:draft",
            "start_draft_weight_update",
            "update_weights",
            "finish_weight_update",
            "rolloutfleet_push_end",
            "resume",
        ], key


def test_a_trainer_that_never_sends_then_the_next_push_recovers(
    operator_process: Any,
    k8s_api: client.ApiClient,
    namespace: str,
    weights: pathlib.Path,
    follower_holder: list[FollowerThread],
) -> None:
    """A trainer killed before it sends: the sessions meet pushSeconds, the operator restarts the pods
    (their targets are on meta) and rolls back to what the fleet served (the initial weights, by path);
    no pod serves in between. The next training step's push then moves the whole fleet."""
    follower = start_fleet(k8s_api, namespace, weights, 2, timeouts={"pushSeconds": 3})
    follower_holder.append(follower)
    api = client.CustomObjectsApi(k8s_api)
    step = weights / "policy/step-1"
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightRevision",
        "metadata": {"name": f"{FLEET}-r1"},
        "spec": {
            "fleetRef": {"name": FLEET},
            "revision": 1,
            "verifier": {"push": {}, "digest": digest_directory(step / "verifier")},
            "draft": {"push": {}, "digest": digest_directory(step / "draft")},
        },
    }
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", body)

    def rolled_back() -> dict[str, Any] | None:
        obj = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", f"{FLEET}-r1")
        return obj if (obj.get("status") or {}).get("phase") in ("RolledBack", "Failed") else None

    final = eventually(rolled_back, timeout=120, what="the unsent push to end")
    status = final["status"]
    assert (status["phase"], status["reason"]) == ("RolledBack", "RolledBack"), status.get("message")
    assert {f["reason"] for f in status["failures"]} == {"PushAbandoned"}
    events = client.CoreV1Api(k8s_api).list_namespaced_event(namespace).items
    assert sum(1 for e in events if e.reason == "EngineRestarted") >= 2
    for key, log in follower.logs().items():
        names = [str(e.get("key") or e["step"]) for e in ok_calls(log)]
        if "rolloutfleet_push_begin:verifier" in names:  # an engine that had the session never resumed after
            assert "resume" not in names[names.index("rolloutfleet_push_begin:verifier") :], key
    eventually(
        lambda: (get_fleet(api, namespace, FLEET).get("status") or {}).get("readyReplicas") == 2,
        timeout=120,
        what="the recreated pods back in service",
    )

    result = push(trainer_client(k8s_api, namespace), namespace, weights, 2)
    assert result.phase == "Succeeded", result.object.get("status")
    assert get_fleet(api, namespace, FLEET)["status"]["currentRevision"] == 2


def test_nccl_push_joins_the_group_at_the_trainers_rendezvous_then_serves_every_pod(
    operator_process: Any,
    k8s_api: client.ApiClient,
    namespace: str,
    weights: pathlib.Path,
    follower_holder: list[FollowerThread],
) -> None:
    """NCCL (docs/push.md, "Transfer group"): the operator publishes the group (tensor parallel 2 on 4 pods:
    ranks 1, 3, 5, 7 of 9), the trainer library publishes its rendezvous as rank 0, every engine joins it
    with its own ranks before any session, and a second push reuses the group (no second join)."""
    nccl = {"weightTransfer": {"backend": "nccl"}, "tensorParallelSize": 2, "gpusPerPod": 2}
    follower = start_fleet(k8s_api, namespace, weights, 4, fleet_extra=nccl)
    follower_holder.append(follower)
    trainer = trainer_client(k8s_api, namespace)
    sender = SimulatedSender(rendezvous="127.0.0.1:29611")
    first = push(trainer, namespace, weights, 1, sender)
    assert first.phase == "Succeeded", first.object.get("status")
    group = first.object["status"]["push"]["group"]
    assert group["worldSize"] == 9
    annotations = first.object["metadata"]["annotations"]
    assert annotations["push.rolloutfleet.io/rendezvous"] == f"{group['epoch']}@127.0.0.1:29611"
    second = push(trainer, namespace, weights, 2, sender)
    assert second.phase == "Succeeded", second.object.get("status")
    assert second.object["status"]["push"]["group"] == group
    offsets = {}
    for key, log in follower.logs().items():
        inits = [e for e in ok_calls(log) if e["step"] == "init_weight_transfer_engine"]
        assert len(inits) == 1, key  # joined once, kept for the second push
        info = inits[0]["args"]["init_info"]
        assert (info["master_address"], info["master_port"], info["world_size"]) == ("127.0.0.1", 29611, 9)
        offsets[key] = info["rank_offset"]
        calls = session_calls(log)
        assert calls.count("rolloutfleet_push_begin:verifier") == 2 and calls[-1] == "resume", key
        first_session = next(i for i, e in enumerate(ok_calls(log)) if e["step"] == "rolloutfleet_push_begin")
        assert ok_calls(log).index(inits[0]) < first_session, key  # in the group before any session
    assert sorted(offsets.values()) == [1, 3, 5, 7]

    # A new trainer process (a new sender) is not rank 0 of that group: it asks for a new one, and every
    # engine joins it at the new rendezvous before the sessions of revision 3.
    restarted = SimulatedSender(rendezvous="127.0.0.1:29612")
    third = push(trainer, namespace, weights, 2 + 1, restarted)
    assert third.phase == "Succeeded", third.object.get("status")
    assert third.object["status"]["push"]["group"]["epoch"] > group["epoch"]
    for key, log in follower.logs().items():
        inits = [e["args"]["init_info"] for e in ok_calls(log) if e["step"] == "init_weight_transfer_engine"]
        assert [i["master_port"] for i in inits] == [29611, 29612], key
