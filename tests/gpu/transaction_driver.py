"""The operator's per-pod transaction, driven against one real engine (no Kubernetes on the device).

Used by the GPU tests: ``converge`` is exactly what ``reconcile.revision`` does for one pod — observe the
engine, ask the pure planner (``planning.transaction.next_step``) for the next step, run it with the
executor (``reconcile.executor.execute``) — until the planner says DONE. ``goal_for`` builds the goal the
operator would derive from a WeightRevision of the A or B pair with a co-updated draft.
"""

from __future__ import annotations

import gpu_support

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.api.fleet import StepTimeouts
from rolloutfleet.planning import transaction
from rolloutfleet.reconcile import executor


def goal_for(
    revisions: gpu_support.Revisions, digests: dict[str, str], revision: int, *, use_b: bool, sleep_mode: bool
) -> transaction.Goal:
    """The operator's goal for one pod: revision ``revision`` of the A or B pair, co-updated draft."""
    verifier = revisions.verifier_b if use_b else revisions.verifier_a
    draft = revisions.draft_b if use_b else revisions.draft_a
    return transaction.Goal(
        revision=revision,
        verifier_path=verifier,
        sleep_mode=sleep_mode,
        verifier_digest=digests[verifier],
        draft_path=draft,
        draft_digest=digests[draft],
    )


async def converge(client: EngineClient, goal: transaction.Goal, *, max_steps: int = 20) -> list[tuple[str, float]]:
    """The operator's per-pod transaction: observe → next_step → execute until DONE. Returns the steps run."""
    timeouts = StepTimeouts()
    steps: list[tuple[str, float]] = []
    for _ in range(max_steps):
        state = await client.observe()
        decision = transaction.next_step(goal, state)
        if decision.step == transaction.Step.DONE:
            return steps
        assert decision.step in transaction.ACTIONS, (decision, state)
        took, _ = await executor.execute(client, decision.step, goal, timeouts)
        steps.append((decision.step.value, round(float(took), 4)))
    raise AssertionError(f"no convergence to revision {goal.revision} within {max_steps} steps: {steps}")
