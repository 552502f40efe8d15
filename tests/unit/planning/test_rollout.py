"""Budget arithmetic: barrier, maxUnavailable, canaries."""

from __future__ import annotations

import random

from rolloutfleet.api.fleet import RolloutType, UpdateMode, UpdateStrategy
from rolloutfleet.api.revision import StrategyOverride
from rolloutfleet.planning import rollout
from rolloutfleet.planning.transaction import ACTIONS, IN_SERVICE_STEPS, STAGING_STEPS, Decision, Step

PODS = [f"p-{i}" for i in range(6)]


def plan(**kw: object) -> rollout.Budget:
    base = dict(
        mode=UpdateMode.SLEEP,
        rollout=RolloutType.ALL_AT_ONCE,
        max_unavailable=1,
        max_concurrent_loads=None,
        canary=0,
        max_retries=2,
    )
    base.update(kw)
    return rollout.Budget(**base)  # type: ignore[arg-type]


def decisions(*steps: Step) -> dict[str, Decision]:
    return {p: Decision(s) for p, s in zip(PODS, steps, strict=True)}


def test_percentages_round_down_but_never_to_zero() -> None:
    assert rollout.resolve_max_unavailable("25%", 8) == 2
    assert rollout.resolve_max_unavailable("10%", 4) == 1
    assert rollout.resolve_max_unavailable(3, 100) == 3


def test_override_wins_over_fleet_strategy() -> None:
    b = rollout.budget(
        UpdateStrategy(),
        StrategyOverride(mode=UpdateMode.INFLIGHT, rollout=RolloutType.ROLLING, max_unavailable="50%"),
        8,
    )
    assert (b.mode, b.rollout, b.max_unavailable) == (UpdateMode.INFLIGHT, RolloutType.ROLLING, 4)


def test_all_at_once_barrier_holds_resume_until_everyone_is_ready() -> None:
    d = decisions(Step.RESUME, Step.RESUME, Step.LOAD_DRAFT, Step.RESUME, Step.RESUME, Step.RESUME)
    chosen = rollout.admit(d, PODS, plan())
    assert set(chosen) == {"p-2"}
    d["p-2"] = Decision(Step.RESUME)
    assert set(rollout.admit(d, PODS, plan())) == set(PODS)


def test_rolling_admits_at_most_max_unavailable() -> None:
    d = decisions(*([Step.PAUSE] * 6))
    assert set(rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=2))) == {"p-0", "p-1"}
    d = decisions(Step.DONE, Step.LOAD_VERIFIER, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert set(rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=2))) == {"p-1", "p-2"}


def test_pods_with_a_step_running_are_not_chosen_and_a_pause_counts_against_the_budget() -> None:
    # Pods move on independently, so admission also runs while other pods' steps are still running.
    d = decisions(*([Step.PAUSE] * 6))
    rolling = plan(rollout=RolloutType.ROLLING, max_unavailable=2)
    assert rollout.admit(d, PODS, rolling, inflight={"p-0", "p-1"}) == {}
    assert set(rollout.admit(d, PODS, rolling, inflight={"p-0"})) == {"p-1"}
    d = decisions(Step.LOAD_DRAFT, Step.RESUME, Step.RESUME, Step.RESUME, Step.RESUME, Step.RESUME)
    assert rollout.admit(d, PODS, plan(), inflight={"p-0"}) == {}  # the barrier waits for the running load


def test_rolling_resumes_individually() -> None:
    d = decisions(Step.RESUME, Step.LOAD_VERIFIER, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert "p-0" in rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=2))


def test_pods_already_out_of_service_always_continue() -> None:
    # After an operator restart, more pods may be paused than the budget: finishing them is safer.
    d = decisions(Step.LOAD_VERIFIER, Step.SLEEP, Step.LOAD_DRAFT, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    chosen = rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=1))
    assert set(chosen) == {"p-0", "p-1", "p-2"}


def test_canaries_first() -> None:
    d = decisions(*([Step.PAUSE] * 6))
    assert set(rollout.admit(d, PODS, plan(canary=2))) == {"p-0", "p-1"}
    d = decisions(Step.RESUME, Step.DONE, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert set(rollout.admit(d, PODS, plan(canary=2))) == {"p-0"}  # canaries resume before the barrier
    d = decisions(Step.DONE, Step.DONE, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert set(rollout.admit(d, PODS, plan(canary=2))) == set(PODS[2:])


def test_unreachable_pods_count_against_max_unavailable() -> None:
    """Issue 15 defect 4: two unreachable engines already serve nobody; with maxUnavailable=1 pausing a
    third would leave three of six out of service. Nothing new is paused until they are back."""
    d = decisions(Step.UNREACHABLE, Step.UNREACHABLE, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=1)) == {}
    assert set(rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=3))) == {"p-2"}


def test_engines_in_error_count_against_max_unavailable() -> None:
    """An engine answering 401s or garbage is not available either."""
    d = decisions(Step.ENGINE_ERROR, Step.ENGINE_MISMATCH, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert set(rollout.admit(d, PODS, plan(rollout=RolloutType.ROLLING, max_unavailable=3))) == {"p-2"}


def test_pods_not_ready_count_against_the_budget_and_are_caught_up_outside_it() -> None:
    """Issue 15 defects 4 and 6: a pod Kubernetes does not route to (restarted, still starting, or not yet
    holding the fleet's weights) is unavailable, so it uses up budget; and since it serves nobody, moving it
    to the goal costs no availability: it is admitted at once, whatever the budget."""
    d = decisions(Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    rolling = plan(rollout=RolloutType.ROLLING, max_unavailable=1)
    assert set(rollout.admit(d, PODS, rolling, unavailable={"p-4"})) == {"p-4"}
    assert set(rollout.admit(d, PODS, rolling, unavailable={"p-4", "p-5"})) == {"p-4", "p-5"}
    d = decisions(Step.LOAD_VERIFIER, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE, Step.PAUSE)
    assert set(rollout.admit(d, PODS, rolling, unavailable={"p-5"})) == {"p-0", "p-5"}


def test_the_budgets_set_of_unavailable_steps_is_is_unavailable() -> None:
    # ``admit`` counts the pods that serve nobody with one set lookup per pod (it runs at every iteration of a
    # pass over the whole fleet); it must say exactly what ``is_unavailable`` says of a routed pod.
    for step in Step:
        assert (step in rollout._UNAVAILABLE_STEPS) == rollout.is_unavailable("p", Decision(step), frozenset()), step
        assert rollout.is_unavailable("p", Decision(step), frozenset({"p"}))  # not routed: serves nobody


def _admit_by_the_rules(
    decisions: dict[str, Decision],
    order: list[str],
    budget: rollout.Budget,
    *,
    gate_open: bool,
    inflight: set[str],
    unavailable: set[str],
) -> dict[str, Decision]:
    """``rollout.admit`` as its rules read, one pod at a time, with no regard for speed: the oracle for the
    fast version (issue 18 rewrote it to count by step; a rewrite for speed must not change one decision)."""
    canaries = order[: budget.canary]
    canaries_done = gate_open and all(decisions[p].step == Step.DONE for p in canaries if p in decisions)
    unavailable_steps = {
        s for s in Step if s in rollout.UNAVAILABLE_VERDICTS or (s != Step.DONE and s not in IN_SERVICE_STEPS)
    }
    busy = sum(
        1
        for p, d in decisions.items()
        if d.step in unavailable_steps or p in unavailable or (d.step == Step.PAUSE and p in inflight)
    )
    staging = sum(
        1 for p, d in decisions.items() if d.step == Step.AWAIT_STAGE or (d.step == Step.STAGE and p in inflight)
    )
    in_order = [decisions[p] for p in order if p in decisions]
    barrier_open = all(
        decisions[p].step in (Step.DONE, Step.RESUME) for p in order if p in decisions and p not in canaries
    )
    staged_all = budget.rollout != RolloutType.ALL_AT_ONCE or not any(d.step in STAGING_STEPS for d in in_order)
    limit = budget.max_unavailable if budget.rollout == RolloutType.ROLLING else len(order)
    chosen: dict[str, Decision] = {}
    for p in order:
        d = decisions.get(p)
        if d is None or d.step not in ACTIONS or p in inflight:
            continue
        if d.step == Step.STAGE:
            if staging >= (budget.max_concurrent_loads or len(order)):
                continue
            staging += 1
        elif d.step == Step.PAUSE and not staged_all:
            continue
        elif d.step == Step.PAUSE and p not in unavailable:
            if (p not in canaries and not canaries_done) or busy >= limit:
                continue
            busy += 1
        elif (
            d.step == Step.RESUME
            and budget.rollout == RolloutType.ALL_AT_ONCE
            and p not in canaries
            and not barrier_open
        ):
            continue
        chosen[p] = d
    return chosen


def test_the_fast_admit_decides_as_the_rules_read_on_random_fleets() -> None:
    """Seeded random fleets (steps, pods in flight, pods not routed, canaries, budgets, both rollouts, pods
    known on one side only): the same pods chosen, in the same order, as the one-pod-at-a-time oracle."""
    rng = random.Random(18)
    common = [Step.PAUSE, Step.DONE, Step.RESUME, Step.STAGE, Step.AWAIT_STAGE, Step.LOAD_VERIFIER]
    chose = 0
    for _ in range(5000):
        names = [f"p-{i}" for i in range(rng.randint(1, 12))]
        order = [p for p in names if rng.random() < 0.9] + [f"q-{i}" for i in range(rng.randint(0, 2))]
        rng.shuffle(order)
        fleet = {
            p: Decision(rng.choice(common if rng.random() < 0.7 else list(Step))) for p in names if rng.random() < 0.95
        }
        inflight = {p for p in fleet if rng.random() < 0.3}
        unavailable = {p for p in order + names if rng.random() < 0.2}
        budget = plan(
            rollout=rng.choice(list(RolloutType)),
            max_unavailable=rng.randint(1, 4),
            max_concurrent_loads=rng.choice([None, 1, 2]),
            canary=rng.randint(0, 2),
        )
        gate_open = rng.random() < 0.8
        kw = {"gate_open": gate_open, "inflight": inflight, "unavailable": unavailable}
        fast = rollout.admit(fleet, order, budget, **kw)  # type: ignore[arg-type]
        assert list(fast.items()) == list(_admit_by_the_rules(fleet, order, budget, **kw).items()), (fleet, order, kw)  # type: ignore[arg-type]
        # The same with a tally kept as a pass keeps it: each pod moved from an earlier decision (or none).
        before = {p: Decision(rng.choice(list(Step))) for p in fleet if rng.random() < 0.7}
        kept = rollout.StepTally.of(before)
        for p, d in fleet.items():
            kept.move(p, before.get(p), d)
        assert kept.at == rollout.StepTally.of(fleet).at
        assert list(rollout.admit(fleet, order, budget, tally=kept, **kw).items()) == list(fast.items())  # type: ignore[arg-type]
        # And with the pods' ranks kept by the caller, as a pass keeps them.
        ranks = {p: i for i, p in enumerate(order)}
        assert list(rollout.admit(fleet, order, budget, tally=kept, rank=ranks, **kw).items()) == list(fast.items())  # type: ignore[arg-type]
        chose += bool(fast)
    assert chose > 1000  # the cases exercise choosing, not only the early return
