"""Cross-pod digest consistency: when a revision carries no expected digest, the pods must agree.

Called by ``reconcile.revision`` every round, before ``transaction.next_step``. The publisher normally
pins digests (``rolloutfleet publish`` computes them); without them, the only evidence of a bad load
is disagreement. A strict majority of the pods that loaded a target at the goal's revision sets the
reference, and the others fail verification (and are reloaded); without a strict majority nobody is
trusted, so every loaded pod fails verification until they agree or the revision rolls back.

Staged bytes (docs/staging.md) are evidence too: a pod that staged the goal's revision and has not loaded it
yet votes with its staged digest, so a pod whose staging read something else is caught before it pauses.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from rolloutfleet.api.engine import EngineState, StagedTarget, StagePhase, Target
from rolloutfleet.planning.transaction import Goal

NO_AGREEMENT = "blake3:disagreement"  # never a real digest: fails every comparison


def _reference(digests: list[str]) -> str | None:
    if not digests:
        return None
    counts = collections.Counter(digests)
    digest, n = counts.most_common(1)[0]
    if len(counts) == 1:
        return None  # everyone agrees: nothing to enforce beyond what the goal already pins
    return digest if n * 2 > len(digests) else NO_AGREEMENT


def with_reference_digests(goal: Goal, states: Iterable[EngineState]) -> Goal:
    """The goal with expected digests filled from a strict majority where the revision gives none."""
    states = [s for s in states if s.reachable]
    updates: dict[str, str | None] = {}
    if goal.verifier_digest is None:
        seen = [s.verifier.digest for s in states if s.verifier.revision == goal.revision and s.verifier.digest]
        seen += _staged_votes(goal, states, Target.VERIFIER)
        ref = _reference(seen)
        if ref is not None:
            updates["verifier_digest"] = ref
    if goal.draft_digest is None and goal.draft_path is not None:
        seen = [
            s.draft.digest
            for s in states
            if s.draft is not None and s.draft.revision == goal.revision and s.draft.digest
        ]
        seen += _staged_votes(goal, states, Target.DRAFT)
        ref = _reference(seen)
        if ref is not None:
            updates["draft_digest"] = ref
    if goal.frozen_draft_path is not None and goal.frozen_draft_digest is None:
        seen = [s.draft.digest for s in states if s.draft is not None and s.draft.digest]
        ref = _reference(seen)
        if ref is not None:
            updates["frozen_draft_digest"] = ref
    if not updates:
        return goal
    return dataclasses.replace(
        goal,
        verifier_digest=updates.get("verifier_digest", goal.verifier_digest),
        draft_digest=updates.get("draft_digest", goal.draft_digest),
        frozen_draft_digest=updates.get("frozen_draft_digest", goal.frozen_draft_digest),
    )


def votes(state: EngineState) -> tuple[object, ...]:
    """What of an engine's state ``with_reference_digests`` counts: equal votes, equal reference digests
    (``reconcile.rollout_pass`` counts them again only when some pod's votes changed)."""
    draft = state.draft
    return (
        state.reachable,
        state.verifier.revision,
        state.verifier.digest,
        None if draft is None else (draft.revision, draft.digest),
        state.staged,
    )


def _staged_votes(goal: Goal, states: list[EngineState], target: Target) -> list[str]:
    """Staged digests of ``target`` at the goal's revision, from pods that have not loaded it (one vote each)."""
    votes = []
    for s in states:
        stage = s.staged
        if stage is None or stage.phase != StagePhase.STAGED or stage.revision != goal.revision:
            continue
        held = s.verifier if target == Target.VERIFIER else s.draft
        if held is not None and held.revision == goal.revision and held.digest:
            continue  # loaded: it votes with what it loaded
        staged: StagedTarget | None = stage.verifier if target == Target.VERIFIER else stage.draft
        if staged is not None and staged.digest and not staged.committed:
            votes.append(staged.digest)
    return votes


def probe_verdict(expected: list[float], observed: list[float], tolerance: float) -> tuple[float, str | None]:
    """(largest absolute difference, why it fails or None) of one canary's parity probe."""
    if len(observed) != len(expected):
        return float("inf"), f"the engine returned {len(observed)} logprobs, expected {len(expected)}"
    worst = max((abs(a - b) for a, b in zip(expected, observed, strict=True)), default=0.0)
    if worst > tolerance:
        index = max(range(len(expected)), key=lambda i: abs(expected[i] - observed[i]))
        return worst, (
            f"token {index}: logprob {observed[index]:.4f} vs expected {expected[index]:.4f} "
            f"(|diff| {worst:.4f} > tolerance {tolerance})"
        )
    return worst, None
