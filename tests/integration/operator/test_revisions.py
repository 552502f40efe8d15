"""WeightRevision rollouts end to end: the real control plane, the operator process, simulated engines on
every pod's loopback IP. Ordering, barriers and budgets are proven from the engines' own call logs."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import GROUP, VERSION, condition, eventually, fleet_manifest, get_fleet, weights_volume
from sim_harness import FollowerThread, max_overlap, out_of_service_intervals, step_names, write_checkpoint

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
    api: client.CustomObjectsApi,
    ns: str,
    root: pathlib.Path,
    name: str,
    replicas: int,
    *,
    draft_policy: str = "coUpdate",
    **strategy: Any,
) -> None:
    body = fleet_manifest(
        name,
        replicas,
        verifier={"path": str(root / "policy/step-0/verifier")},
        draft={"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": draft_policy},
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
    # Loads of a few ms rarely overlap by chance now that each pod moves on by itself; 0.3 s loads make
    # "the cap was used" a property of admission, not of timing.
    follower.call(_slow_loads(follower, 0.3))
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
        pre_resume.append(calls["rolloutfleet_load:draft"]["t"])
        load_windows += [
            (e["t0"], e["t"])
            for e in log
            if str(e.get("key", "")).startswith("rolloutfleet_load") and e.get("status") == 200
        ]
    # The barrier: every engine was loaded and verified before the first one resumed (the weight version is
    # stamped by the resume itself, right before it resumes: SLEEP_ORDER).
    assert max(pre_resume) < min(resumes)
    # maxConcurrentLoads=3: never more than 3 engines loading at once (16 loads in all), and the cap was used.
    # (That the admission fills the cap is pinned without timing by tests/unit/planning/test_rollout.py.)
    assert len(load_windows) == 16 and max_overlap(load_windows) <= 3
    eventually(
        lambda: all(
            p.get("revision") == 1 and p.get("draftRevision") == 1
            for p in (get_fleet(api, namespace, "pol").get("status") or {}).get("pods") or [{}]
        ),
        timeout=30,
        what="fleet pods at revision 1",
    )


def test_an_engine_restarted_at_rest_is_caught_up_from_its_pod(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    """A fleet at rest reads its engines only once a pod changed (docs/rollouts.md, "A fleet at rest"). An
    engine that crashes comes back on its initial weights; its pod's restartCount says so (counted by the
    kubelet; here by the pod follower, which stands in for it), and the operator moves it back to the served
    revision and admits it long before the full read that comes every 60 s whatever the pods show."""
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 2)
    wait_engines(api, follower, namespace, 2)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("step-1", "pol", 1, root))
    done = eventually(lambda: phase_is(api, namespace, "step-1", "Succeeded", "Failed"), timeout=90, what="step-1")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    key = sorted(follower.logs())[0]

    def engine_at(revision: int | None, admitted: bool) -> Any:
        async def read() -> tuple[int | None, bool]:
            sim = follower.follower.sim
            assert sim is not None
            core = sim.engines[key].core
            return core.state_results()[0]["verifier"]["revision"], core.admitted

        return follower.call(read()) == (revision, admitted)

    eventually(lambda: engine_at(1, True), timeout=30, what="the engine admitted on revision 1")

    # The fleet at rest: no call reaches the engine for longer than an idle period (5 s here). Waited for, so
    # that what follows starts from a fleet that reads nothing, not from a pass that reads every engine anyway.
    calls: dict[str, float] = {"count": -1, "since": time.monotonic()}

    def quiet_for(seconds: float) -> bool:
        count = len(follower.logs()[key])
        if count != calls["count"]:
            calls.update(count=count, since=time.monotonic())
        return time.monotonic() - calls["since"] >= seconds

    eventually(lambda: quiet_for(7), timeout=45, what="no engine call for 7 s (the fleet at rest)")

    async def crash() -> None:
        sim = follower.follower.sim
        assert sim is not None
        await sim.engines[key].crash(restart_after=0.2)

    follower.call(crash())
    eventually(lambda: engine_at(None, False), timeout=10, what="the engine back on its initial weights")
    started = time.monotonic()
    eventually(lambda: engine_at(1, True), timeout=40, what="the restarted engine caught up and admitted")
    assert time.monotonic() - started < 30, "caught up by the 60 s full read, not from its pod"


def test_each_pod_moves_on_without_waiting_for_a_slow_one(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    """One engine loads its verifier 2 s slower: the others load their drafts meanwhile (no lock-step
    rounds), and the AllAtOnce barrier still holds every resume until the slow one is ready."""
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 4)
    wait_engines(api, follower, namespace, 4)
    slow = follower.call(_slow_first_load(follower, 2.0))
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("step-1", "pol", 1, root))
    done = eventually(
        lambda: phase_is(api, namespace, "step-1", "Succeeded", "Failed", "RolledBack"), timeout=120, what="step-1"
    )
    assert done["status"]["phase"] == "Succeeded", done["status"]
    calls = {
        key: {str(e.get("key") or e["step"]): e for e in log if e.get("status") == 200}
        for key, log in follower.logs().items()
    }
    slow_verifier_done = calls[slow]["rolloutfleet_load:verifier"]["t"]
    others = [c for key, c in calls.items() if key != slow]
    assert len(others) == 3
    assert all(c["rolloutfleet_load:draft"]["t0"] < slow_verifier_done for c in others)
    resumes = [c["resume"]["t"] for c in calls.values()]
    assert calls[slow]["rolloutfleet_load:draft"]["t"] < min(resumes)  # the barrier


async def _slow_loads(follower: FollowerThread, seconds: float) -> None:
    """Every engine's every load takes ``seconds`` longer."""
    from rolloutfleet.sim.config import FaultKind, FaultRule

    sim = follower.follower.sim
    assert sim is not None
    for engine in sim.engines.values():
        engine.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.SLOW, delay=seconds, count=None))


async def _slow_first_load(follower: FollowerThread, seconds: float) -> str:
    from rolloutfleet.sim.config import FaultKind, FaultRule

    sim = follower.follower.sim
    assert sim is not None
    key, engine = sorted(sim.engines.items())[0]
    engine.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.SLOW, delay=seconds, count=1))
    return str(key)


INFLIGHT_ORDER = [
    "pause:keep",
    "rolloutfleet_load:verifier",
    "rolloutfleet_load:draft",
    "update_weight_version",
    "resume",
]


def test_rolling_inflight_then_bad_path_rolls_back(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 8, mode="inflight", rollout="Rolling", maxUnavailable=2)
    wait_engines(api, follower, namespace, 8)
    follower.call(_slow_loads(follower, 0.2))  # long enough that two pods are surely out of service at once
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("step-1", "pol", 1, root))
    done = eventually(
        lambda: phase_is(api, namespace, "step-1", "Succeeded", "Failed", "RolledBack"), timeout=120, what="step-1"
    )
    assert done["status"]["phase"] == "Succeeded", done["status"]
    logs = follower.logs()
    intervals = []
    for key, log in logs.items():
        assert [n for n in step_names(log) if n in INFLIGHT_ORDER] == INFLIGHT_ORDER, key
        assert "sleep:2" not in step_names(log)
        intervals += out_of_service_intervals(log)
    # That Rolling uses its whole budget is pinned without timing by tests/unit/planning/test_rollout.py.
    assert max_overlap(intervals) <= 2, "more than maxUnavailable pods out of service at once"

    # A revision whose checkpoint does not exist: the engines' pre-flight refuses it before any pod leaves
    # service (Failed/PreflightFailed, no pod paused), and no pod ever serves a mixed or unverified pair.
    before = {k: step_names(v).count("pause:keep") for k, v in follower.logs().items()}
    bad = wrev("step-2", "pol", 2, root, verifier=str(root / "policy/missing/verifier"))
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", bad)
    done = eventually(
        lambda: phase_is(api, namespace, "step-2", "Succeeded", "Failed", "RolledBack"), timeout=120, what="step-2"
    )
    assert (done["status"]["phase"], done["status"]["reason"]) == ("Failed", "PreflightFailed"), done["status"]
    assert "missing" in done["status"]["message"] and "no pod touched" in done["status"]["message"]
    failures = done["status"]["failures"]
    assert failures and {f["reason"] for f in failures} == {"PreflightFailed"}, failures
    assert all("missing" in f["message"] and f["step"] == "Preflight" for f in failures), failures
    assert {k: step_names(v).count("pause:keep") for k, v in follower.logs().items()} == before
    fleet = get_fleet(api, namespace, "pol")
    assert fleet["status"]["currentRevision"] == 1
    eventually(
        lambda: all(
            p.get("revision") == 1 and p.get("step") == "Done"
            for p in (get_fleet(api, namespace, "pol").get("status") or {}).get("pods") or [{}]
        ),
        timeout=30,
        what="all pods back on revision 1 and serving",
    )
    for key, log in follower.logs().items():
        calls = [e for e in log if e.get("status") == 200]
        steps = [e["step"] for e in calls if e["step"] not in ("admit", "withdraw")]
        assert steps[-1] == "resume", (key, steps[-1])  # none left paused
        assert calls[-1]["step"] == "admit", (key, calls[-1])  # and back behind the Service
        state = [e for e in calls if e["step"] == "resume"][-1].get("state") or {}
        assert not state.get("mixed"), (key, state)


def test_newer_revision_supersedes_and_invalid_ones_are_refused(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 3, maxConcurrentLoads=1)
    wait_engines(api, follower, namespace, 3)
    # Slow loads so that step-1 is still rolling when step-2 arrives.
    follower.call(_slow_loads(follower, 0.6))
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("step-1", "pol", 1, root))
    eventually(lambda: phase_is(api, namespace, "step-1", "Progressing"), timeout=30, what="step-1 progressing")
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("step-2", "pol", 2, root))
    one = eventually(
        lambda: phase_is(api, namespace, "step-1", "Superseded", "Succeeded"), timeout=60, what="step-1 final"
    )
    assert one["status"]["phase"] == "Superseded"
    # Issue 15 defect 22: no finalizer on revisions, so a prune while no operator runs is not held up.
    assert not one["metadata"].get("finalizers"), one["metadata"].get("finalizers")
    two = eventually(
        lambda: phase_is(api, namespace, "step-2", "Succeeded", "Failed", "RolledBack"), timeout=120, what="step-2"
    )
    assert two["status"]["phase"] == "Succeeded", two["status"]
    assert get_fleet(api, namespace, "pol")["status"]["currentRevision"] == 2
    for log in follower.logs().values():
        steps = [e["step"] for e in log if e.get("status") == 200 and e["step"] not in ("admit", "withdraw")]
        assert steps[-1] == "resume"  # nobody left paused or asleep by the superseded revision

    # Refused without touching an engine: not newer, duplicate number.
    before = {k: len(v) for k, v in follower.logs().items()}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", wrev("old", "pol", 1, root))
    refused = eventually(lambda: phase_is(api, namespace, "old", "Failed"), timeout=30, what="old refused")
    assert refused["status"]["reason"] == "NotNewer"
    assert "must be newer than the fleet's current revision (2)" in refused["status"]["message"]
    assert {k: len(v) for k, v in follower.logs().items()} == before


async def _slow_loads(follower: FollowerThread, seconds: float) -> None:
    from rolloutfleet.sim.config import FaultKind, FaultRule

    sim = follower.follower.sim
    assert sim is not None
    for engine in sim.engines.values():
        engine.add_fault(FaultRule(step="rolloutfleet_load", kind=FaultKind.SLOW, delay=seconds, count=100))


def probe_for(root: pathlib.Path, revision: int, *, shift: float = 0.0) -> dict[str, Any]:
    from rolloutfleet.sim.engine import reference_logprob

    prompt = [5, 17, 42, 7]
    path = str(root / f"policy/step-{revision}/verifier")
    expected = [reference_logprob(path, revision, prompt, i) + shift for i in range(6)]
    return {"promptTokenIds": prompt, "expectedLogprobs": expected, "tolerance": 0.01}


def test_parity_probe_gates_the_fleet_on_its_canary(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 4, rollout="Rolling", maxUnavailable=2)
    wait_engines(api, follower, namespace, 4)
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "weightrevisions", wrev("step-1", "pol", 1, root, parityProbe=probe_for(root, 1))
    )
    done = eventually(lambda: phase_is(api, namespace, "step-1", *FINAL), timeout=120, what="step-1")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    probe = done["status"]["parityProbe"]
    assert probe["passed"] and probe["pods"] == ["pol-0"] and probe["maxAbsDiff"] <= 0.01, probe
    logs = list(follower.logs().values())
    canary = min(logs, key=lambda log: _first(log, "pause"))
    others = [log for log in logs if log is not canary]
    # Nobody else left service before the canary served the new weights and passed the probe.
    assert all(_first(log, "pause") > _first(canary, "resume") for log in others)

    # Logprobs that do not match: the canary fails the probe, the revision rolls back, the rest never moved.
    before = {k: step_names(v).count("pause:keep") for k, v in follower.logs().items()}
    api.create_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "weightrevisions",
        wrev("step-2", "pol", 2, root, parityProbe=probe_for(root, 2, shift=-0.5)),
    )
    bad = eventually(lambda: phase_is(api, namespace, "step-2", *FINAL), timeout=120, what="step-2")
    assert bad["status"]["phase"] == "RolledBack", bad["status"]
    assert not bad["status"]["parityProbe"]["passed"]
    assert {f["reason"] for f in bad["status"]["failures"]} == {"ParityProbeFailed"}
    after = {k: step_names(v).count("pause:keep") for k, v in follower.logs().items()}
    moved = [k for k in after if after[k] > before[k]]
    assert len(moved) == 1, moved  # only the canary was ever taken out of service
    assert get_fleet(api, namespace, "pol")["status"]["currentRevision"] == 1


FINAL = ("Succeeded", "Failed", "RolledBack")


def _first(log: list[dict[str, Any]], step: str) -> float:
    return min((e["t"] for e in log if e.get("step") == step and e.get("status") == 200), default=float("inf"))


def test_frozen_draft_is_restored_after_every_sleep_and_never_loaded(
    sim_fleet: tuple[FollowerThread, pathlib.Path], k8s_api: client.ApiClient, namespace: str
) -> None:
    follower, root = sim_fleet
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 3, draft_policy="frozen")
    wait_engines(api, follower, namespace, 3)
    frozen = digest_directory(str(root / "policy/step-0/draft"))
    for number in (1, 2):
        body = wrev(f"step-{number}", "pol", number, root)
        del body["spec"]["draft"]  # a frozen draft takes no revision
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", body)
        done = eventually(
            lambda n=number: phase_is(api, namespace, f"step-{n}", *FINAL), timeout=90, what=f"step-{number}"
        )
        assert done["status"]["phase"] == "Succeeded", done["status"]
        assert {p["draftDigest"] for p in done["status"]["pods"]} == {frozen}
    for key, log in follower.logs().items():
        names = step_names(log)
        assert "rolloutfleet_load:draft" not in names, key  # never overwritten
        assert names.count("rolloutfleet_restore_draft") == names.count("sleep:2") == 2, (key, names)
        # restored after the verifier, before the pod serves again
        for i, name in enumerate(names):
            if name == "rolloutfleet_restore_draft":
                assert names[i - 1] == "rolloutfleet_load:verifier" and "resume" in names[i + 1 :], names
