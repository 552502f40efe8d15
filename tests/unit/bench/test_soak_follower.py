"""The soak's pod follower (``bench/soak.py``, ``SoakFollower``) serves an engine on every running pod.

96d7c16 changed ``PodFollower.run`` to hand the watched pods to ``sync(pods)``; the soak's override still took
no argument, so ``run`` failed at its first sync, no engine ever started, and the soak waited 240 s for a
ready fleet that could not come. This test calls ``sync`` as ``run`` does.
"""

from __future__ import annotations

import asyncio
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


async def test_a_new_token_rotates_the_soak_engines_in_place_where_the_plain_follower_restarts_them() -> None:
    """The soak's engines rotate a new control token in place, as the worker image does (the previous one is
    accepted through a grace period): the soak's 401 counts and operator restarts measure that, not a fleet of
    engines restarting on their initial weights. The bench's plain follower restarts every engine instead,
    and counts each restart for the pod's restartCount (it did not: it counted the engines after stopping
    them, when the fleet had forgotten them, so a fleet at rest was never told its engines came back on the
    initial weights; found by this test when the soak's follower became two hooks of the plain one)."""
    port = _free_port()
    fleet: dict[str, Any] = {"spec": {"port": port}}
    pods = {"policy-0": FollowedPod("policy-0", "127.0.0.1", True, None)}
    key = f"127.0.0.1:{port}"
    rotating = soak.SoakFollower(api=mock.Mock(), namespace="soak", fleet="policy", token_propagation=0.0)
    plain = soak.PodFollower(api=mock.Mock(), namespace="soak", fleet="policy")
    for follower in (rotating, plain):
        read = mock.AsyncMock(return_value=(fleet, "token-1"))
        with mock.patch.object(follower, "_read", read), mock.patch.object(follower, "_report_restarts"):
            try:
                await follower.sync(pods)
                assert follower.sim is not None
                first = follower.sim.engines[key]
                read.return_value = (fleet, "token-2")
                await follower.sync(pods)
                await asyncio.sleep(0.05)  # the rotation's propagation delay (0 here) runs on the loop
                now = follower.sim.engines[key]
                if follower is rotating:
                    assert isinstance(now, soak.RotatingEngine) and now is first
                    assert now._token == "token-2" and follower._restarted == {}
                else:
                    assert now is not first and follower._restarted == {key: 1}
            finally:
                if follower.sim is not None:
                    await follower.sim.stop()
