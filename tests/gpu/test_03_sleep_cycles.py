"""GPU tier (3): ten level-2 sleep cycles driven by the operator's real per-pod transaction code.

Each cycle is ``transaction_driver.converge``: observe → ``planning.transaction.next_step`` →
``reconcile.executor.execute`` until DONE, alternating revisions of the A and B pairs in mode ``sleep``
(pause keep → sleep 2 → wake weights + load verifier → load draft → set version → wake kv + resume).
After each cycle the greedy outputs are token-identical to those of the same weights before (A: the fresh
server's own load; B: an in-place load), and the digests equal the publisher's.

Negative control: sleep(2) and wake without a reload. Our state check must see it (revisions None,
``resident`` False, the planner refuses DONE), not only the garbage output; the spec-decode acceptance
(which looks healthy) is recorded next to it. Then the transaction repairs the engine.
"""

from __future__ import annotations

from typing import Any

import gpu_support
import pytest
from transaction_driver import converge, expected, goal_for

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.planning import transaction

pytestmark = pytest.mark.gpu

# vLLM 0.26 has no weight-version routes: the resume stamps no version there (feature-detected).
# With ROLLOUTFLEET_GPU_STAGING=1: Stage first (while serving), commits instead of loads (``expected``).
SLEEP_STEPS = expected(["Pause", "Sleep", "WakeWeights", "LoadVerifier", "LoadDraft", "Resume"])
INFLIGHT_STEPS = expected(["Pause", "LoadVerifier", "LoadDraft", "Resume"])


async def test_ten_level2_sleep_cycles_through_the_transaction(
    server: gpu_support.Server,
    engine: EngineClient,
    revisions: gpu_support.Revisions,
    digests: dict[str, str],
    record: dict[str, Any],
) -> None:
    batch = gpu_support.prompts()
    # References: A as the fresh server loaded it (before any test), B after an in-place load.
    expected_a = record["fresh_outputs_a"]
    steps_b = await converge(engine, goal_for(revisions, digests, 200, use_b=True, sleep_mode=False))
    assert [s for s, _ in steps_b] == INFLIGHT_STEPS
    expected_b = await gpu_support.generate(server.url, batch)
    assert expected_b != expected_a
    cycles = []
    for k in range(10):
        use_b = k % 2 == 1
        goal = goal_for(revisions, digests, 201 + k, use_b=use_b, sleep_mode=True)
        steps = await converge(engine, goal)
        state = await engine.observe()
        outputs = await gpu_support.generate(server.url, batch)
        cycles.append({"revision": goal.revision, "pair": "B" if use_b else "A", "steps": steps})
        assert [s for s, _ in steps] == SLEEP_STEPS, steps
        assert state.serving and state.resident and state.pair == (goal.revision, goal.revision)
        assert state.verifier.digest == digests[goal.verifier_path]
        assert state.draft is not None and state.draft.digest == digests[str(goal.draft_path)]
        assert outputs == (expected_b if use_b else expected_a), f"cycle {k}: output differs"
    record["sleep_cycles"] = cycles


async def test_wake_without_reload_is_caught_by_the_state_check(
    server: gpu_support.Server,
    engine: EngineClient,
    revisions: gpu_support.Revisions,
    digests: dict[str, str],
    record: dict[str, Any],
) -> None:
    batch = gpu_support.prompts()
    goal = goal_for(revisions, digests, 300, use_b=False, sleep_mode=True)
    await converge(engine, goal)
    before = await gpu_support.generate(server.url, batch)
    assert before == record["fresh_outputs_a"]

    await engine.pause(mode="keep", clear_cache=False)
    await engine.sleep(2)
    await engine.wake_up()  # every tag, and no reload: what a naive controller does
    asleep_state = await engine.observe()
    decision_paused = transaction.next_step(goal, asleep_state)
    await engine.resume()
    garbage = await gpu_support.generate(server.url, batch[:1], max_tokens=16)
    metrics = await gpu_support.acceptance(server.url, batch)
    served_state = await engine.observe()
    decision_serving = transaction.next_step(goal, served_state)

    record["negative_control"] = {
        "observe_after_wake": {
            "resident": asleep_state.resident,
            "pair": asleep_state.pair,
            "verifier_digest": asleep_state.verifier.digest,
            "paused": asleep_state.paused,
            "sleeping": asleep_state.sleeping,
        },
        "next_step_while_paused": [decision_paused.step.value, decision_paused.reason],
        "next_step_after_resume": [decision_serving.step.value, decision_serving.reason],
        "output_tokens": garbage[0],
        "spec_decode_acceptance": metrics,
    }
    assert not asleep_state.resident and asleep_state.pair == (None, None)
    assert asleep_state.verifier.digest is None and not asleep_state.verifier.verified
    assert decision_paused.step != transaction.Step.DONE
    # Never Done: it must leave service again (with staging on it first stages what it will commit).
    assert not served_state.resident and decision_serving.step.value == expected(["Pause"])[0]
    assert garbage[0] != before[0][:16]

    repair = await converge(engine, goal)
    record["negative_control"]["repair_steps"] = repair
    assert await gpu_support.generate(server.url, batch) == before
