"""The soak's pod follower (``bench/soak.py``, ``SoakFollower``) serves an engine on every running pod.

96d7c16 changed ``PodFollower.run`` to hand the watched pods to ``sync(pods)``; the soak's override still took
no argument, so ``run`` failed at its first sync, no engine ever started, and the soak waited 240 s for a
ready fleet that could not come. This test calls ``sync`` as ``run`` does.
"""

from __future__ import annotations

import socket
from typing import Any
from unittest import mock

import bench_modules
import pytest

from rolloutfleet.sim.follower import FollowedPod

pytestmark = pytest.mark.unit

soak = bench_modules.load("soak")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_sync_serves_an_engine_on_each_running_pod_as_run_hands_them() -> None:
    port = _free_port()
    follower = soak.SoakFollower(api=mock.Mock(), namespace="soak", fleet="policy")
    fleet: dict[str, Any] = {"spec": {"port": port}}
    pods = {
        "policy-0": FollowedPod("policy-0", "127.0.0.1", True, None),
        "policy-1": FollowedPod("policy-1", None, False, None),  # not running yet: no engine
    }
    with mock.patch.object(follower, "_read", mock.AsyncMock(return_value=(fleet, "token"))):
        try:
            assert await follower.sync(pods) == 1
            assert follower.sim is not None and list(follower.sim.engines) == [f"127.0.0.1:{port}"]
        finally:
            if follower.sim is not None:
                await follower.sim.stop()
