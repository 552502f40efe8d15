"""Staged updates end to end (docs/staging.md): real control plane, the operator process, simulated engines on
every pod's loopback IP. What staging promises is proven from the engines' own call logs: every stage ends
before the first pod pauses, a checkpoint that fails its check never takes a pod out of service, a fleet over
its staging limit still moves (and says it fell back), an operator killed between stage and commit converges
without staging again, and an AllAtOnce fleet is out of service for about one commit.
"""

from __future__ import annotations

import contextlib
import gc
import pathlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import GROUP, VERSION, eventually, get_fleet, weights_volume
from operator_process import OperatorProcess, start_operator, stop_operator
from sim_harness import FollowerThread, out_of_service_intervals, step_names, write_checkpoint
from test_revisions import make_fleet, phase_is, wait_engines, wrev

from rolloutfleet.sandbox import nodes
from rolloutfleet.sim.config import Latencies

pytestmark = pytest.mark.integration

STAGING = {"enabled": True, "hostMemoryLimit": "1Gi"}


@pytest.fixture
def weights(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "weights"
    for rev in range(0, 5):
        write_checkpoint(root / "policy" / f"step-{rev}" / "verifier", seed=100 + rev)
        write_checkpoint(root / "policy" / f"step-{rev}" / "draft", seed=200 + rev, tensors=2)
    return root


def _follower(k8s_api: client.ApiClient, namespace: str, latencies: Latencies) -> Iterator[FollowerThread]:
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, "pol", latencies=latencies)
    try:
        yield follower
    finally:
        follower.stop()


@pytest.fixture
def staged_fleet(operator_process: Any, k8s_api: client.ApiClient, namespace: str) -> Iterator[FollowerThread]:
    # Stages take long enough (0.4 s) that a pause issued before every stage ended would show in the logs.
    yield from _follower(k8s_api, namespace, Latencies(stage_s=0.4, commit_s=0.05))


def _entries(log: list[dict[str, Any]], step: str) -> list[dict[str, Any]]:
    return [e for e in log if e.get("step") == step]


def _pauses(follower: FollowerThread) -> dict[str, int]:
    return {k: step_names(v).count("pause:keep") for k, v in follower.logs().items()}


def _create(api: client.CustomObjectsApi, ns: str, body: dict[str, Any]) -> None:
    api.create_namespaced_custom_object(GROUP, VERSION, ns, "weightrevisions", body)


def _final(api: client.CustomObjectsApi, ns: str, name: str, timeout: float = 120) -> dict[str, Any]:
    return eventually(
        lambda: phase_is(api, ns, name, "Succeeded", "Failed", "RolledBack"), timeout=timeout, what=f"{name} final"
    )


def _all_serve(api: client.CustomObjectsApi, ns: str, revision: int, pods: int) -> None:
    eventually(
        lambda: (
            len(ps := (get_fleet(api, ns, "pol").get("status") or {}).get("pods") or []) == pods
            and all(p.get("revision") == revision and p.get("step") == "Done" for p in ps)
        ),
        timeout=30,
        what=f"every pod serving revision {revision}",
    )


def test_stage_verify_then_pause_bad_checkpoints_touch_no_pod(
    staged_fleet: FollowerThread, k8s_api: client.ApiClient, namespace: str, weights: pathlib.Path
) -> None:
    follower, root = staged_fleet, weights
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 4, mode="inflight", staging=STAGING)
    wait_engines(api, follower, namespace, 4)

    # A good revision: every engine staged it while serving, every stage ended before the first pause
    # (AllAtOnce), and both loads were commits from the stage.
    _create(api, namespace, wrev("step-1", "pol", 1, root))
    done = _final(api, namespace, "step-1")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert done["status"]["staging"] == {"podsStaged": 4, "podsFallback": 0, "message": ""}, done["status"]
    assert {p["staging"] for p in done["status"]["pods"]} == {"Committed"}, done["status"]["pods"]
    logs = follower.logs()
    first_pause = min(e["t"] for log in logs.values() for e in log if e.get("key") == "pause:keep")
    for key, log in logs.items():
        finished = _entries(log, "stage_finished")
        assert finished and finished[-1]["t"] < first_pause, (key, "a pod paused before every stage ended")
        assert len(_entries(log, "stage_committed")) == 2, (key, step_names(log))
        loads = [e for e in log if e.get("step") == "rolloutfleet_load" and e.get("status") == 200]
        assert loads and all(e.get("staged") for e in loads), (key, loads)

    # A corrupt checkpoint (its bytes changed after the publisher pinned the digest; the headers still
    # parse, so the pre-flight cannot see it): the staged digests differ, every pod keeps serving revision 1,
    # and the revision fails with no pod paused.
    before = _pauses(follower)
    corrupt = wrev("step-2", "pol", 2, root)
    shard = root / "policy/step-2/verifier/model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8:] = bytes(8)  # the last tensor's last bytes: same size, header untouched
    shard.write_bytes(bytes(data))
    _create(api, namespace, corrupt)
    done = _final(api, namespace, "step-2")
    assert (done["status"]["phase"], done["status"]["reason"]) == ("Failed", "StagingFailed"), done["status"]
    assert "no pod touched" in done["status"]["message"], done["status"]
    assert {f["reason"] for f in done["status"]["failures"]} == {"StagedDigestMismatch"}, done["status"]
    assert _pauses(follower) == before
    _all_serve(api, namespace, 1, 4)
    # The failed revision's stages are released once the fleet is back at rest (no pinned memory left held).
    eventually(
        lambda: all(
            (log_ := _entries(log, "stage_released")) and log_[-1]["t"] > _entries(log, "stage_finished")[-1]["t"]
            for log in follower.logs().values()
        ),
        timeout=30,
        what="stages of the failed revision released",
    )

    # A missing checkpoint: refused before anything is staged or paused (the pre-flight).
    _create(api, namespace, wrev("step-3", "pol", 3, root, verifier=str(root / "policy/missing/verifier")))
    done = _final(api, namespace, "step-3")
    assert (done["status"]["phase"], done["status"]["reason"]) == ("Failed", "PreflightFailed"), done["status"]
    assert _pauses(follower) == before

    # A checkpoint whose files cannot be read while staging (the engines' readers fail): StageFailed,
    # retried, then Failed with no pod touched.
    follower.call(_fail_stages(follower))
    _create(api, namespace, wrev("step-4", "pol", 4, root))
    done = _final(api, namespace, "step-4")
    assert (done["status"]["phase"], done["status"]["reason"]) == ("Failed", "StagingFailed"), done["status"]
    assert {f["reason"] for f in done["status"]["failures"]} == {"StageFailed"}, done["status"]
    assert _pauses(follower) == before
    _all_serve(api, namespace, 1, 4)


async def _fail_stages(follower: FollowerThread) -> None:
    from rolloutfleet.sim.config import FaultKind, FaultRule

    sim = follower.follower.sim
    assert sim is not None
    for engine in sim.engines.values():
        engine.add_fault(FaultRule(step="rolloutfleet_stage", kind=FaultKind.FAIL_STAGE, count=None))


def test_over_the_staging_limit_the_fleet_falls_back_and_says_so(
    staged_fleet: FollowerThread, k8s_api: client.ApiClient, namespace: str, weights: pathlib.Path
) -> None:
    follower, root = staged_fleet, weights
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 3, mode="inflight", staging={"enabled": True, "hostMemoryLimit": "1k"})
    wait_engines(api, follower, namespace, 3)
    _create(api, namespace, wrev("step-1", "pol", 1, root))
    done = _final(api, namespace, "step-1")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    staging = done["status"]["staging"]
    assert (staging["podsStaged"], staging["podsFallback"]) == (0, 3), staging
    assert "staging limit is 0.00 GB" in staging["message"] and "hostMemoryLimit" in staging["message"], staging
    assert {p["staging"] for p in done["status"]["pods"]} == {"Fallback"}
    for key, log in follower.logs().items():
        loads = [e for e in log if e.get("step") == "rolloutfleet_load" and e.get("status") == 200]
        assert len(loads) == 2 and not any(e.get("staged") for e in loads), (key, loads)


@pytest.fixture
def slow_stages(operator_process: Any, k8s_api: client.ApiClient, namespace: str) -> Iterator[FollowerThread]:
    # Stages of 4 s: the operator is killed while every engine is still staging.
    yield from _follower(k8s_api, namespace, Latencies(stage_s=4.0, commit_s=0.05))


def test_operator_killed_between_stage_and_commit_converges(
    slow_stages: FollowerThread,
    operator_process: OperatorProcess,
    kubeconfig_path: pathlib.Path,
    k8s_api: client.ApiClient,
    namespace: str,
    weights: pathlib.Path,
) -> None:
    follower, root = slow_stages, weights
    api = client.CustomObjectsApi(k8s_api)
    make_fleet(api, namespace, root, "pol", 3, mode="sleep", staging=STAGING)
    wait_engines(api, follower, namespace, 3)
    _create(api, namespace, wrev("step-1", "pol", 1, root))
    eventually(
        lambda: all(_entries(log, "stage_started") for log in follower.logs().values()) and len(follower.logs()) == 3,
        timeout=60,
        interval=0.05,
        what="every engine staging",
    )
    stop_operator(operator_process, signal.SIGKILL)
    time.sleep(0.5)
    fresh = start_operator(kubeconfig_path, operator_process.log_path)
    operator_process.proc = fresh.proc
    done = _final(api, namespace, "step-1", timeout=90)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    _all_serve(api, namespace, 1, 3)
    for key, log in follower.logs().items():
        # The restarted operator read the stages back (its Stage was answered with the stage held): each
        # engine staged once, and committed from it.
        assert len(_entries(log, "stage_started")) == 1, (key, [e["step"] for e in log if "stage" in e["step"]])
        assert len(_entries(log, "stage_committed")) == 2, key
        assert _entries(log, "stage_finished")[-1]["t"] < min(e["t"] for e in log if e.get("key") == "pause:keep"), key


@pytest.fixture
def big_fleet(
    operator_process: Any, k8s_api: client.ApiClient, namespace: str, more_gpus: None
) -> Iterator[FollowerThread]:
    yield from _follower(k8s_api, namespace, Latencies(stage_s=STAGE_S, commit_s=COMMIT_S))


@pytest.fixture
def more_gpus(k8s_api: client.ApiClient) -> Iterator[None]:
    """Four more fake 8-GPU nodes for a 64-pod fleet, removed after the test: the session's cluster keeps four,
    so the tests after this one do not share the machine with twice the node heartbeats."""
    core = client.CoreV1Api(k8s_api)
    used = [int(str(n.spec.pod_cidr).split(".")[2]) for n in core.list_node().items if n.spec and n.spec.pod_cidr]
    names = []
    try:
        for i in range(4):
            body = nodes.fake_gpu_node(i, prefix="gpu-node-staging", subnet=max(used) + 1 + i)
            core.create_node(body)
            names.append(body["metadata"]["name"])
        eventually(
            lambda: all(nodes.is_ready(k8s_api.sanitize_for_serialization(core.read_node(n))) for n in names),
            timeout=60,
            what="the extra nodes ready",
        )
        yield
    finally:
        for name in names:
            core.delete_node(name)


COMMIT_S = 0.3  # the simulated commit of one target (pinned host memory → GPU)
STAGE_S = 1.0  # the simulated stage: longer than the window's slack, so a stage inside the window shows
# The target is commits + 0.2 s. Measured here (2 cores shared by the API server, etcd, kwok, the operator
# and all 64 simulated engines in one thread of this process) since the simulator watches pods instead of listing
# them every 0.2 s: 0.66-0.76 s over 24 runs, every one within the target (bench/results/staged_update.md).
# Performance targets live in that report; this bound leaves a loaded CI box 0.3 s more, and still fails if any
# stage (1 s) or file read ran inside the window, or if the pause round spread as it did before (up to 1.2 s).
WINDOW_SLACK_S = 0.5


@contextlib.contextmanager
def _test_process_heap_frozen() -> Iterator[None]:
    """The simulated engines answer from a thread of this pytest process, whose heap by this point of a full run
    holds ~500,000 objects: a full collection of it stalled every engine for 0.51 s in the middle of this test
    (measured with a gc.callbacks probe over `make test`'s integration run), and the CI run of 2026-12-05 failed
    with the pauses spread over 0.498 s (0.01-0.04 s when the test runs alone). That stall is the harness's, not
    the operator's: the heap is collected and frozen before the revision (its objects skip later collections) and
    unfrozen after, and the bound stays what it was."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_all_at_once_64_pods_are_out_of_service_for_about_one_commit(
    big_fleet: FollowerThread, k8s_api: client.ApiClient, namespace: str, weights: pathlib.Path
) -> None:
    """The fleet's out-of-service window (first pause → last resume, from the engines' logs) holds the commits
    of both targets and not the stage: staging took every read out of the pause, and the barrier before the
    pause means nobody waits paused for another pod's stage."""
    follower, root = big_fleet, weights
    api = client.CustomObjectsApi(k8s_api)
    pods = 64
    make_fleet(api, namespace, root, "pol", pods, mode="inflight", staging=STAGING)
    eventually(lambda: follower.engines() == pods, timeout=300, what=f"{pods} engines")
    wait_engines(api, follower, namespace, pods)
    with _test_process_heap_frozen():
        _create(api, namespace, wrev("step-1", "pol", 1, root))
        done = _final(api, namespace, "step-1", timeout=180)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    intervals = [i for log in follower.logs().values() for i in out_of_service_intervals(log)]
    assert len(intervals) == pods
    window = max(b for _, b in intervals) - min(a for a, _ in intervals)
    commit = 2 * COMMIT_S  # verifier then draft, each a simulated commit
    timeline = _timeline(follower.logs())
    print(
        f"64 pods, AllAtOnce inflight, staged: out-of-service window {window:.3f} s "
        f"(commits {commit:.2f} s): {timeline}"
    )
    first_pause = min(a for a, _ in intervals)
    for key, log in follower.logs().items():
        assert _entries(log, "stage_finished")[-1]["t"] < first_pause, (key, "staged inside the window")
    assert window <= commit + WINDOW_SLACK_S, f"window {window:.3f} s > commits {commit:.2f} s + slack: {timeline}"


def _timeline(logs: dict[str, list[dict[str, Any]]]) -> str:
    """When each step of the window happened across the fleet (first..last, seconds after the first pause)."""
    ok = [e for log in logs.values() for e in log if e.get("status") == 200]
    start = min(e["t"] for e in ok if e.get("key") == "pause:keep")
    spans = []
    for name in (
        "pause:keep",
        "rolloutfleet_load:staged",  # every commit (the verifier's and the draft's, in one request each pod)
        "update_weight_version",
        "resume",
    ):
        ts = [e["t"] - start for e in ok if (e.get("key") or e["step"]) == name]
        if ts:
            spans.append(f"{name} {min(ts):.3f}..{max(ts):.3f}")
    return ", ".join(spans)
