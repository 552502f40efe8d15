"""Staged updates through real reconcile passes (``FakeKube``, simulated engines, one process).

Orders are read from the engines' call logs, whose entries share one harness-wide ``order`` counter.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from kube_fakes import FakeCall
from reconcile_fakes import call_name, harness, ok_calls

from rolloutfleet.sim.config import Latencies

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60), pytest.mark.both_loops]

STAGING = {"enabled": True, "hostMemoryLimit": "1Gi"}


async def test_all_at_once_pauses_without_waiting_for_the_fleet_s_gate_writes(tmp_path: pathlib.Path) -> None:
    """AllAtOnce: the fleet leaves as one, so no pod is left to take the traffic a gate would send elsewhere;
    the pauses go out beside the gate writes instead of after all of them (1,024 gate patches took 10.9 s on
    2 cores, every engine serving and the rollout waiting meanwhile: issue 18). Each engine is still
    withdrawn (its readiness probe fails) in its pause's own request, before it pauses, and each pod's gate is
    closed before it is opened again."""
    async with harness(tmp_path, replicas=4, mode="inflight") as h:
        written = h.record_gates()

        async def slow_gate(call: FakeCall) -> None:
            if call.verb == "patch_status" and call.kind == "Pod" and call.name == "policy-2":
                await asyncio.sleep(0.5)  # the API server's answer for this pod's gate is slow

        h.kube.before_call = slow_gate
        h.apply_revision("step-1", 1)
        await h.settle()
        logs = h.logs()
        pauses = [e["order"] for log in logs.values() for e in ok_calls(log) if call_name(e) == "pause:keep"]
        slow_out = next(order for pod, status, order in written if pod == "policy-2" and status == "False")
        assert len(pauses) == 4 and max(pauses) < slow_out  # no pause waited for the slow pod's gate write
        for log in logs.values():
            names = [call_name(e) for e in ok_calls(log)]
            assert names.index("withdraw") < names.index("pause:keep"), names
        for pod in h.pods:
            assert [status for name, status, _ in written if name == pod] == ["False", "True"], written
        assert all(h.served(p) == (1, 1, False) for p in h.pods)


async def test_staged_rollout_stages_every_engine_before_any_pause_and_commits(tmp_path: pathlib.Path) -> None:
    """Staging on: every engine stages while serving, nobody pauses before all staged, both loads are
    commits, and the revision's status says every pod staged and committed."""
    async with harness(tmp_path, replicas=3, mode="inflight", staging=STAGING) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        logs = h.logs()
        staged = [e for log in logs.values() for e in log if e["step"] == "stage_finished"]
        first_pause = min(e["order"] for log in logs.values() for e in ok_calls(log) if call_name(e) == "pause:keep")
        assert len(staged) == 3 and max(e["order"] for e in staged) < first_pause
        for log in logs.values():
            commits = [e for e in ok_calls(log) if e["step"] == "rolloutfleet_load"]
            assert len(commits) == 2 and all(e.get("staged") for e in commits)
        status = h.revision_status("step-1")
        assert status["phase"] == "Succeeded"
        assert status["staging"] == {"podsStaged": 3, "podsFallback": 0, "message": ""}
        assert {p["staging"] for p in status["pods"]} == {"Committed"}


async def test_an_engine_that_restarts_after_staging_is_staged_again(tmp_path: pathlib.Path) -> None:
    """A restarted engine has lost its stage (it lived in the process), and the operator remembers none: it
    reads the new process (serving, no stage) and stages it again before it may pause, so the whole fleet
    still commits from staged bytes and pauses only for the commit."""
    async with harness(tmp_path, replicas=3, mode="inflight", staging=STAGING, max_retries=2) as h:
        restarted, slow = h.pods[0], h.pods[2]
        # The slow pod stages for longer: the others wait (serving) at the AllAtOnce barrier meanwhile.
        engine = h.engine(slow)
        engine.latencies = engine.core.lat = engine.core.staging.lat = Latencies(stage_s=0.5)

        async def restart_once_staged() -> None:
            await h.wait_for([restarted], lambda log: any(e["step"] == "stage_finished" for e in log))
            await h.engine(restarted).restart()

        h.apply_revision("step-1", 1)
        await asyncio.gather(h.settle(), restart_once_staged())
        assert all(h.served(p) == (1, 1, False) for p in h.pods)
        log = h.engine_log(restarted)
        steps = [e["step"] for e in log if e["step"] in ("restart", "stage_finished", "pause")]
        assert steps == ["stage_finished", "restart", "stage_finished", "pause"], steps
        for pod in h.pods:
            commits = [e for e in ok_calls(h.engine_log(pod)) if e["step"] == "rolloutfleet_load"]
            assert len(commits) == 2 and all(e.get("staged") for e in commits), (pod, commits)
        assert h.revision_status("step-1")["phase"] == "Succeeded"
