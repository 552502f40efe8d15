"""``verification.DigestTally``: the reference digests counted as pods change equal those counted afresh.

The rollout pass keeps one tally per goal and updates one pod's ballot per state change (counting over the
whole fleet at each acknowledged load was 10 % of the operator's CPU in a 1,024-pod Rolling rollout, issue
18). The oracle below is the rule written out over a list of states, the way ``with_reference_digests``
counted before the tally: per target the pods that loaded it at the goal's revision vote with what they
loaded, pods that staged it (and did not load it) with the staged digest, a frozen draft's reference is
what every engine holds, unreachable engines do not vote; a strict majority sets the reference, a split
gives ``NO_AGREEMENT``, unanimity or no vote leaves the goal alone. Random fleets (seeded) go through
random sequences of single-pod changes, pods leaving included.
"""

from __future__ import annotations

import collections
import dataclasses
import random

import pytest

from rolloutfleet.api.engine import EngineState, StagedTarget, StagePhase, StageState, TargetState
from rolloutfleet.planning import verification
from rolloutfleet.planning.transaction import Goal

pytestmark = pytest.mark.unit

DIGESTS = ["blake3:a", "blake3:b", "blake3:c"]
GOALS = [
    Goal(revision=2, verifier_path="/w/2/v", draft_path="/w/2/d", sleep_mode=False),
    Goal(revision=2, verifier_path="/w/2/v", verifier_digest="blake3:a", draft_path="/w/2/d", sleep_mode=False),
    Goal(revision=2, verifier_path="/w/2/v", sleep_mode=False, frozen_draft_path="/w/d"),
    Goal(revision=2, verifier_path="/w/2/v", sleep_mode=False),
]


def _oracle(goal: Goal, states: list[EngineState]) -> Goal:
    states = [s for s in states if s.reachable]

    def staged(s: EngineState, verifier: bool) -> str | None:
        stage = s.staged
        if stage is None or stage.phase != StagePhase.STAGED or stage.revision != goal.revision:
            return None
        held = s.verifier if verifier else s.draft
        if held is not None and held.revision == goal.revision and held.digest:
            return None
        target = stage.verifier if verifier else stage.draft
        return target.digest if target is not None and target.digest and not target.committed else None

    def reference(votes: list[str]) -> str | None:
        counts = collections.Counter(votes)
        if len(counts) <= 1:
            return None
        digest, n = counts.most_common(1)[0]
        return digest if 2 * n > len(votes) else verification.NO_AGREEMENT

    out = goal
    if goal.verifier_digest is None:
        votes = [s.verifier.digest for s in states if s.verifier.revision == goal.revision and s.verifier.digest]
        votes += [d for s in states if (d := staged(s, True))]
        if (ref := reference(votes)) is not None:
            out = dataclasses.replace(out, verifier_digest=ref)
    if goal.draft_digest is None and goal.draft_path is not None:
        votes = [s.draft.digest for s in states if s.draft and s.draft.revision == goal.revision and s.draft.digest]
        votes += [d for s in states if (d := staged(s, False))]
        if (ref := reference(votes)) is not None:
            out = dataclasses.replace(out, draft_digest=ref)
    if goal.frozen_draft_path is not None and goal.frozen_draft_digest is None:
        votes = [s.draft.digest for s in states if s.draft is not None and s.draft.digest]
        if (ref := reference(votes)) is not None:
            out = dataclasses.replace(out, frozen_draft_digest=ref)
    return out


def _random_state(rng: random.Random) -> EngineState:
    def target() -> TargetState:
        return TargetState(revision=rng.choice([None, 1, 2]), digest=rng.choice([None, *DIGESTS]))

    stage = None
    if rng.random() < 0.3:
        stage = StageState(
            revision=rng.choice([1, 2]),
            phase=rng.choice(list(StagePhase)),
            verifier=StagedTarget("/s/v", digest=rng.choice([None, *DIGESTS]), committed=rng.random() < 0.2),
            draft=StagedTarget("/s/d", digest=rng.choice([None, *DIGESTS])) if rng.random() < 0.7 else None,
        )
    return EngineState(
        reachable=rng.random() < 0.9,
        verifier=target(),
        draft=target() if rng.random() < 0.8 else None,
        staged=stage,
    )


@pytest.mark.parametrize("seed", range(200))
def test_incremental_counts_equal_a_fresh_count(seed: int) -> None:
    rng = random.Random(seed)
    goal = rng.choice(GOALS)
    pods = [f"p{i}" for i in range(rng.randint(1, 9))]
    states = {p: _random_state(rng) for p in pods}
    tally = verification.DigestTally(goal)
    for pod, state in states.items():
        tally.update(pod, state)
    assert tally.goal_with_references() == _oracle(goal, list(states.values()))
    for _ in range(25):
        pod = rng.choice(pods)
        if rng.random() < 0.1:
            states.pop(pod, None)
            tally.update(pod, None)
        else:
            states[pod] = _random_state(rng)
            tally.update(pod, states[pod])
        assert tally.goal_with_references() == _oracle(goal, list(states.values()))
        assert verification.with_reference_digests(goal, list(states.values())) == _oracle(goal, list(states.values()))


def test_the_random_fleets_reach_every_outcome() -> None:
    """The oracle test is only worth something if the random fleets produce majorities, splits and unanimity."""
    seen = set()
    for seed in range(200):
        rng = random.Random(seed)
        goal = rng.choice(GOALS)
        out = _oracle(goal, [_random_state(rng) for _ in range(rng.randint(1, 9))])
        for field in ("verifier_digest", "draft_digest", "frozen_draft_digest"):
            before, after = getattr(goal, field), getattr(out, field)
            seen.add("split" if after == verification.NO_AGREEMENT else "majority" if after != before else "none")
    assert seen == {"split", "majority", "none"}
