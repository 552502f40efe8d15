"""A pass decides the step ends that come close together in one iteration (``rollout_pass._gather_ends``).

Under uneven engines the ends come one at a time, and an iteration per end was a decision for nothing at the
AllAtOnce barrier (issue 18). What must hold besides: the barrier's last end is not held for the window (the
window is made 30 s here, so a pass that waited for it would not end within the test's bound).
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import re

import pytest
from reconcile_fakes import harness

from rolloutfleet.reconcile import rollout_pass

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]  # a hang fails, never blocks the run

PODS = 16


async def _iterations_with_loads_ending_apart(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> int:
    """One AllAtOnce revision whose loads end one after the other, 5 ms apart; the pass's iterations."""
    caplog.clear()
    async with harness(tmp_path, replicas=PODS) as h:
        holds = [h.hold_loads(p) for p in h.pods]

        async def release_one_at_a_time() -> None:
            # Every pod has paused: its load follows in the same request and waits for its release, so the
            # loads end in the order and at the spacing of the releases.
            await h.wait_for(h.pods, lambda log: any(e.get("step") == "pause" for e in log))
            for hold in holds:
                hold.set()
                await asyncio.sleep(0.005)

        h.apply_revision("step-1", 1)
        with caplog.at_level(logging.INFO, logger=rollout_pass.__name__):
            await asyncio.wait_for(asyncio.gather(h.settle(), release_one_at_a_time()), 20)
        assert h.revision_status("step-1")["phase"] == "Succeeded"
    counts = [int(m.group(1)) for m in re.finditer(r"pass step-1: (\d+) iterations", caplog.text)]
    assert counts, caplog.text
    return sum(counts)


async def test_ends_close_together_are_decided_in_one_iteration_and_the_last_is_not_held(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollout_pass, "STEP_ENDS_GATHER_SECONDS", 0.0)
    one_by_one = await _iterations_with_loads_ending_apart(tmp_path / "apart", caplog)
    monkeypatch.setattr(rollout_pass, "STEP_ENDS_GATHER_SECONDS", 30.0)
    gathered = await _iterations_with_loads_ending_apart(tmp_path / "gathered", caplog)
    # 16 ends one at a time are at least 16 iterations; gathered, the loads' ends are one.
    assert one_by_one >= PODS, one_by_one
    assert gathered <= one_by_one - PODS // 2, (gathered, one_by_one)
