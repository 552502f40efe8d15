"""The operator's per-pod transaction, driven against one real engine (no Kubernetes on the device).

Used by the GPU tests: ``converge`` is exactly what ``reconcile.revision`` does for one pod — observe the
engine, ask the pure planner (``planning.transaction.next_step``) for the next step, run it and the steps
that follow it for certain (``transaction.chain``) with the executor (``reconcile.executor.execute_chain``) —
until the planner says DONE. ``goal_for`` builds the goal the
operator would derive from a WeightRevision of the A or B pair with a co-updated draft.

``ROLLOUTFLEET_GPU_STAGING=1`` runs the suite with staging on (docs/staging.md): goals carry the fleet's
staging limit, so the planner stages while the engine serves and commits from pinned host memory in the
pause; ``expected`` turns a test's step list into the staged one, and ``load`` stages before a direct load.
"""

from __future__ import annotations

import asyncio
import os
import time

import gpu_support

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.api.engine import LoadResult, StagePhase, StageState
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
        stage_limit=STAGE_LIMIT if STAGING else None,
    )


STAGING = os.environ.get("ROLLOUTFLEET_GPU_STAGING") == "1"
STAGE_LIMIT = 64 << 30  # the suite's models are tiny; the bench's 3.76 GB pair fits too
STAGE_WAIT_SECONDS = 120.0


def expected(steps: list[str]) -> list[str]:
    """A test's step list as the planner runs it with staging on: stage first, commits instead of loads, and
    the draft's commit inside the verifier's step (one sequence of calls: ``executor``)."""
    if not STAGING:
        return steps
    commits = {"LoadVerifier": "CommitVerifier"}
    return ["Stage", *(commits.get(s, s) for s in steps if s != "LoadDraft")]


async def staged(client: EngineClient, revision: int, verifier: str, draft: str | None) -> StageState:
    """Stage ``revision`` and wait until the engine holds it (it keeps serving meanwhile)."""
    stage = await client.stage(revision, verifier, draft, STAGE_LIMIT)
    deadline = time.monotonic() + STAGE_WAIT_SECONDS
    while stage.phase == StagePhase.STAGING and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        stage = (await client.observe()).staged or stage
    assert stage.phase == StagePhase.STAGED, stage
    return stage


async def load(client: EngineClient, target: str, path: str, revision: int) -> LoadResult:
    """A direct load, or with staging on a commit of what ``staged`` put in host memory for it."""
    return await client.load(target, path, revision, staged=STAGING)


async def converge(client: EngineClient, goal: transaction.Goal, *, max_steps: int = 20) -> list[tuple[str, float]]:
    """The operator's per-pod transaction: observe → next_step → execute until DONE. Returns the steps run."""
    timeouts = StepTimeouts()
    steps: list[tuple[str, float]] = []
    deadline = time.monotonic() + STAGE_WAIT_SECONDS
    while len(steps) < max_steps:
        state = await client.observe()
        decision = transaction.next_step(goal, state)
        if decision.step == transaction.Step.DONE:
            return steps
        if decision.step == transaction.Step.AWAIT_STAGE and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the engine stages (and serves) by itself: read it again
            continue
        assert decision.step in transaction.ACTIONS, (decision, state)
        # As the operator runs it: the steps that follow for certain go in one request (a sleep-mode pause,
        # sleep, wake and verifier load; a pause and its commits), the state decided on guards the resume
        # (and lets a commit take both).
        chain = transaction.chain(goal, state, decision.step)
        session = executor.SessionContext(known=state)
        for done in await executor.execute_chain(client, chain, goal, timeouts, session):
            steps.append((done.step.value, round(float(done.seconds or 0.0), 4)))
    raise AssertionError(f"no convergence to revision {goal.revision} within {max_steps} steps: {steps}")
