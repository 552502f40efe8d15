"""The simulator's pod watch (``rolloutfleet.sim.follower.PodWatch``) against the real API server.

Why it is tested apart: the pod follower used to list every pod of a fleet every 0.2 s, and those lists
took the GIL from the simulated engines it serves (the 64-pod staging test measured engine answers up to
0.15 s late). The watch must still see every pod that comes, changes what the follower reads, or goes, and
must wake the follower for nothing else. Runs against the session cluster of ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from rolloutfleet.sandbox import nodes
from rolloutfleet.sim.follower import PodWatch

pytestmark = pytest.mark.integration

SELECTOR = "rolloutfleet.io/fleet=watched"


def _pod(name: str, fleet: str = "watched") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"rolloutfleet.io/fleet": fleet}},
        "spec": {
            # kwok never pulls images; the name only has to be valid.
            "containers": [{"name": "engine", "image": "vllm-rolloutfleet:test", "args": ["--port", "8000"]}],
            "nodeSelector": {nodes.POOL_LABEL: "default"},
            "terminationGracePeriodSeconds": 0,
        },
    }


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_the_watch_follows_pods_and_wakes_only_for_what_the_follower_reads(
    k8s_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    watch = PodWatch(k8s_api, namespace, SELECTOR, asyncio.get_running_loop())
    watch.start()
    try:
        await asyncio.wait_for(watch.listed.wait(), 30)
        assert watch.pods == {}

        await asyncio.to_thread(core.create_namespaced_pod, namespace, _pod("policy-0"))
        await asyncio.to_thread(core.create_namespaced_pod, namespace, _pod("other-0", fleet="other"))
        await _until(
            lambda: (p := watch.pods.get("policy-0")) is not None and p.running and p.ip is not None,
            "policy-0 Running with an IP",
        )
        followed = watch.pods["policy-0"]
        assert followed.args == ["--port", "8000"]
        assert set(watch.pods) == {"policy-0"}, "the selector keeps other fleets' pods out"

        # A change the follower does not read (an annotation here; readiness and conditions in a rollout)
        # must not wake it: a rollout patches every pod's readiness gate twice per revision.
        watch.changed.clear()
        patched = await asyncio.to_thread(
            core.patch_namespaced_pod, "policy-0", namespace, {"metadata": {"annotations": {"seen": "1"}}}
        )
        await _until(lambda: watch.version == patched.metadata.resource_version, "the annotation's event")
        assert not watch.changed.is_set()
        assert watch.pods["policy-0"] is followed

        # A deletion is followed (the simulated engine on that IP must stop).
        await asyncio.to_thread(core.delete_namespaced_pod, "policy-0", namespace, grace_period_seconds=0)
        await asyncio.wait_for(watch.changed.wait(), 30)
        await _until(lambda: "policy-0" not in watch.pods, "policy-0 gone from the watch")
    finally:
        started = time.monotonic()
        await asyncio.to_thread(watch.stop)
        await asyncio.to_thread(watch._thread.join, 15)
        stopped_in = time.monotonic() - started
    # stop() shuts the open watch's socket: closing it from another thread waited ~10 s for the blocked
    # read, which held every test's teardown. 5 s is far from both (it returns in milliseconds).
    assert not watch._thread.is_alive()
    assert stopped_in < 5, f"stopping the watch took {stopped_in:.1f} s"
