"""What the fleet's status is handed for a pod whose chain of steps runs (``RolloutPass._remember_states``).

While a chain runs (pause, sleep, wake the weights, then the loads, in one request), the status shows the
engine as it is once the steps before the load succeeded (``transaction.as_step_starts``), not as it was
before the chain. That state is worked out once per chain and handed over as the same object at every
refresh: the fleet status keeps each pod's summary while its observation is the same object
(``reconcile.fleet._engines``), and working both out again for every pod in a chain at every refresh (every
2 s at 1,024 pods, a quarter of them in a chain under Rolling) was a fifth of each refresh (issue 18).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

import pytest
from reconcile_fakes import harness

from rolloutfleet.api.engine import EngineState
from rolloutfleet.planning.transaction import Step
from rolloutfleet.reconcile import rollout_pass

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LOADS = {Step.LOAD_VERIFIER.value, Step.LOAD_DRAFT.value}


async def test_a_pod_in_a_chain_is_shown_as_the_same_started_state_at_every_refresh(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollout_pass, "FLEET_STATUS_INTERVAL", 0.02)  # a refresh at each step's end
    # Rolling, two at a time, the first pod's load held: the other pods' steps end meanwhile, and each end
    # schedules a refresh of the fleet's status.
    async with harness(tmp_path, replicas=5, rollout="Rolling", max_unavailable=2) as h:
        pod = h.pods[0]
        holds = [h.hold_loads(pod)]
        seen: list[EngineState] = []
        three_refreshes = asyncio.Event()
        hand_over = rollout_pass.RolloutPass._remember_states

        def remember(self: rollout_pass.RolloutPass) -> None:
            hand_over(self)
            if pod in self.chains and h.memory.steps.get(pod) in LOADS:
                seen.append(h.memory.engine_view[pod])
                if len(seen) >= 3:
                    three_refreshes.set()

        monkeypatch.setattr(rollout_pass.RolloutPass, "_remember_states", remember)
        h.apply_revision("step-1", 1)
        settling = asyncio.create_task(h.settle())
        with contextlib.suppress(TimeoutError):  # refreshes that never come fail below
            await asyncio.wait_for(three_refreshes.wait(), 10)
        for hold in holds:
            hold.set()
        await settling
        assert h.revision_status("step-1")["phase"] == "Succeeded"

    assert len(seen) >= 3, f"{len(seen)} refreshes while the load was held"
    assert all(s is seen[0] for s in seen), "the started state was worked out again at a refresh"
    # Shown as the chain has it while the load runs: the level-2 sleep released what the engine served.
    assert seen[0].verifier.revision is None or seen[0].verifier.revision != 1
