"""WeightRevision rollouts end to end: the real control plane, the operator process, simulated engines on
every pod's loopback IP. Ordering, barriers and budgets are proven from the engines' own call logs."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import GROUP, VERSION, condition, eventually, fleet_manifest, get_fleet, weights_volume
from sim_harness import FollowerThread, step_names, write_checkpoint

from rolloutfleet.api import vllm_flags  # noqa: F401 - keeps the operator package importable here
from rolloutfleet.digest import digest_directory

pytestmark = pytest.mark.integration


@pytest.fixture
def weights(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "weights"
    for rev in range(0, 4):
        write_checkpoint(root / "policy" / f"step-{rev}" / "verifier", seed=100 + rev)
        write_checkpoint(root / "policy" / f"step-{rev}" / "draft", seed=200 + rev, tensors=2)
    return root


def make_fleet(
    api: client.CustomObjectsApi, ns: str, root: pathlib.Path, name: str, replicas: int, **strategy: Any
) -> None:
    body = fleet_manifest(
        name,
        replicas,
        verifier={"path": str(root / "policy/step-0/verifier")},
        draft={"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
        weights={"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
        updateStrategy={"maxRetries": 1, "timeouts": {"wakeSeconds": 5, "loadSeconds": 10}, **strategy},
    )
    api.create_namespaced_custom_object(GROUP, VERSION, ns, "rolloutfleets", body)


def wrev(
    name: str,
    fleet: str,
    revision: int,
    root: pathlib.Path,
    *,
    digest: bool = True,
    verifier: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    vpath = verifier or str(root / f"policy/step-{revision}/verifier")
    spec: dict[str, Any] = {
        "fleetRef": {"name": fleet},
        "revision": revision,
        "verifier": {"path": vpath},
        "draft": {"path": str(root / f"policy/step-{revision}/draft")},
    }
    if digest and verifier is None:
        spec["verifier"]["digest"] = digest_directory(vpath)
    spec.update(extra)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WeightRevision", "metadata": {"name": name}, "spec": spec}


def get_wrev(api: client.CustomObjectsApi, ns: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = api.get_namespaced_custom_object(GROUP, VERSION, ns, "weightrevisions", name)
    return out


def phase_is(api: client.CustomObjectsApi, ns: str, name: str, *phases: str) -> dict[str, Any] | None:
    obj = get_wrev(api, ns, name)
    return obj if (obj.get("status") or {}).get("phase") in phases else None


@pytest.fixture
def sim_fleet(
    operator_process: Any, k8s_api: client.ApiClient, namespace: str, weights: pathlib.Path
) -> Iterator[tuple[FollowerThread, pathlib.Path]]:
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, "pol")
    try:
        yield follower, weights
    finally:
        follower.stop()


def wait_engines(api: client.CustomObjectsApi, follower: FollowerThread, ns: str, n: int) -> None:
    eventually(
        lambda: follower.engines() == n and (get_fleet(api, ns, "pol").get("status") or {}).get("readyReplicas") == n,
        timeout=90,
        what=f"{n} engines",
    )


SLEEP_ORDER = [
    "pause:keep",
    "sleep:2",
    "wake_up:weights",
    "rolloutfleet_load:verifier",
    "rolloutfleet_load:draft",
    "update_weight_version",
    "wake_up:kv_cache",
    "resume",
]


def test_all_at_once_sleep_mode_barrier(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 8, maxConcurrentLoads=3)
    wait_engines(api, follower, namespace, 8)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("step-1", "pol", 1, root))
    done = eventually(
        lambda: phase_is(api, namespace, "step-1", "Succeeded", "Failed", "RolledBack"),
        timeout=120,
        what="step-1 final",
    )
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert done["status"]["updated"] == "8/8"
    assert (condition(done, "Ready") or {}).get("status") == "True"
    assert (condition(done, "Verified") or {}).get("status") == "True"
    fleet = get_fleet(api, namespace, "pol")
    assert fleet["status"]["currentRevision"] == 1
    logs = follower.logs()
    assert len(logs) == 8
    resumes, pre_resume = [], []
    load_windows = []
    for key, log in logs.items():
        names = [n for n in step_names(log) if n in SLEEP_ORDER]
        assert names == SLEEP_ORDER, (key, names)
        calls = {str(e.get("key") or e["step"]): e for e in log if e.get("status") == 200}
        resumes.append(calls["resume"]["t"])
        pre_resume.append(calls["update_weight_version"]["t"])
        load_windows += [(e["t"] - 0.0, e["t"]) for e in log if str(e.get("key", "")).startswith("rolloutfleet_load")]
    # The barrier: every engine was loaded, verified and stamped before the first one resumed.
    assert max(pre_resume) < min(resumes)
    eventually(
        lambda: all(
            p.get("revision") == 1 and p.get("draftRevision") == 1
            for p in get_fleet(api, namespace, "pol")["status"]["pods"]
        ),
        timeout=30,
        what="fleet pods at revision 1",
    )
