"""Budget arithmetic: barrier, maxUnavailable, canaries."""

from __future__ import annotations

from rolloutfleet.api.fleet import RolloutType, UpdateMode, UpdateStrategy
from rolloutfleet.api.revision import StrategyOverride
from rolloutfleet.planning import rollout
from rolloutfleet.planning.transaction import Decision, Step

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
