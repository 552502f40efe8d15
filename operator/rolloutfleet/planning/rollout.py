"""Pure rollout arithmetic: which pods may take their next step now, under the strategy's budget.

Called by ``reconcile.revision`` whenever a step finished, with every pod's ``transaction.Decision``.
Pods already out of service always continue (leaving them paused would be worse than any budget); new
pods are admitted while the budget allows; canaries go first; under ``AllAtOnce`` no pod resumes before
every pod is ready to (the barrier). Load concurrency (``maxConcurrentLoads``) is enforced by the executor's semaphore.

Staging (docs/staging.md) happens while pods serve, so it costs no availability: ``Stage`` steps are not
held back by ``maxUnavailable`` (under ``Rolling`` staging runs ahead of the wave), only by
``maxConcurrentLoads`` (stages read the same shared storage as loads). Under ``AllAtOnce`` no pod pauses
before every pod staged and verified what it staged: a checkpoint that cannot be staged, or whose staged
bytes do not verify, fails the revision with every pod still serving.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Collection, Mapping

from rolloutfleet.api.fleet import RolloutType, UpdateMode, UpdateStrategy
from rolloutfleet.api.revision import StrategyOverride
from rolloutfleet.planning.transaction import ACTIONS, IN_SERVICE_STEPS, STAGING_STEPS, Decision, Step


@dataclasses.dataclass(frozen=True)
class Budget:
    """The effective strategy of one revision on one fleet."""

    mode: UpdateMode
    rollout: RolloutType
    max_unavailable: int
    max_concurrent_loads: int | None
    canary: int
    max_retries: int


def resolve_max_unavailable(value: int | str, total: int) -> int:
    """An integer, or a percentage of ``total`` rounded down, never below 1."""
    if isinstance(value, str) and value.endswith("%"):
        return max(1, math.floor(total * int(value[:-1]) / 100))
    return max(1, int(value))


def budget(strategy: UpdateStrategy, override: StrategyOverride | None, total: int) -> Budget:
    """Merge the fleet's strategy with a revision's override."""
    o = override or StrategyOverride()
    return Budget(
        mode=o.mode or strategy.mode,
        rollout=o.rollout or strategy.rollout,
        max_unavailable=resolve_max_unavailable(
            o.max_unavailable if o.max_unavailable is not None else strategy.max_unavailable, total
        ),
        max_concurrent_loads=o.max_concurrent_loads or strategy.max_concurrent_loads,
        canary=min(o.canary if o.canary is not None else strategy.canary, total),
        max_retries=strategy.max_retries,
    )


# Verdicts of pods that serve nobody useful: unreachable, answering errors, or not the fleet's pair (a pod
# that is not at its goal is kept out of the Service by its readiness gate).
UNAVAILABLE_VERDICTS = frozenset({Step.UNREACHABLE, Step.ENGINE_ERROR, Step.ENGINE_MISMATCH})


_SERVING_OR_VERDICT = IN_SERVICE_STEPS | UNAVAILABLE_VERDICTS
# The steps whose pod serves nobody (``is_unavailable`` without the routing part), as one set: ``admit``
# tests every pod of the fleet at each of the pass's iterations.
_UNAVAILABLE_STEPS = frozenset(
    s for s in Step if s in UNAVAILABLE_VERDICTS or (s != Step.DONE and s not in IN_SERVICE_STEPS)
)


def out_of_service(decision: Decision) -> bool:
    """The pod is paused or asleep for this transaction (it still serves before its PAUSE, while it stages)."""
    return decision.step != Step.DONE and decision.step not in _SERVING_OR_VERDICT


def is_unavailable(name: str, decision: Decision, not_ready: Collection[str]) -> bool:
    """The pod serves nobody now: out of service for this transaction, unreachable, answering errors, or
    not routed to by Kubernetes (not Ready: starting, restarted, or not yet on the fleet's weights)."""
    return out_of_service(decision) or decision.step in UNAVAILABLE_VERDICTS or name in not_ready


_AVAILABLE_STEPS = tuple(s for s in Step if s not in _UNAVAILABLE_STEPS)
# The actions chosen whatever the budgets and the barrier (a tuple: ``set().union`` over it takes the sets in
# one call). PAUSE and STAGE are budgeted and RESUME waits at the AllAtOnce barrier: under Rolling most of the
# fleet waits to pause, under AllAtOnce to resume, so those sets are walked only when they may yield a pod.
_UNBUDGETED = tuple(s for s in ACTIONS if s not in (Step.PAUSE, Step.STAGE, Step.RESUME))


@dataclasses.dataclass
class StepTally:
    """The pods at each step of a fleet's decisions.

    Kept by ``reconcile.rollout_pass`` as it sets each decision (``move``), so that ``admit`` reads its counts
    and sets of waiting pods instead of going over the whole fleet at each of the pass's iterations: at 1,024
    pods, with the fleet waiting at the AllAtOnce barrier, those scans were 8 % of the operator's samples
    (issue 18). ``of`` builds one from decisions at once (what ``admit`` does when given none).
    """

    at: dict[Step, set[str]] = dataclasses.field(default_factory=lambda: {s: set() for s in Step})

    @classmethod
    def of(cls, decisions: Mapping[str, Decision]) -> StepTally:
        tally = cls()
        for name, decision in decisions.items():
            tally.at[decision.step].add(name)
        return tally

    def move(self, pod: str, old: Decision | None, new: Decision) -> None:
        """``pod``'s decision changed from ``old`` (None: it had none) to ``new``."""
        if old is not None:
            self.at[old.step].discard(pod)
        self.at[new.step].add(pod)


def admit(
    decisions: dict[str, Decision],
    order: list[str],
    plan: Budget,
    *,
    gate_open: bool = True,
    inflight: Collection[str] = (),
    unavailable: Collection[str] = (),
    tally: StepTally | None = None,
    rank: Mapping[str, int] | None = None,
) -> dict[str, Decision]:
    """The decisions to execute now (a subset of ``decisions``, in ``order``; verdicts are never returned).

    ``gate_open`` is False while the canaries still await their parity probe: the rest do not start.
    ``inflight``: pods whose step is still running (their decision is that step); never chosen again,
    and a pod pausing counts against the budget already. ``unavailable``: pods Kubernetes does not route
    to; they count against the budget, and their own PAUSE is admitted whatever the budget (moving a pod
    that serves nobody costs no availability, and leaving it behind would keep it out of service longer).
    ``tally``: ``decisions`` by step, when the caller keeps them (built here otherwise). ``rank``: each pod's
    index in ``order``, when the caller keeps it (built here otherwise, and only when something may start).

    Called at every iteration of a pass, so the rules are applied to the tally's sets of pods (in C), not
    pod by pod: under Rolling most of the fleet waits to pause on a full budget, and going over it in Python
    at each step's end was 13 % of the operator's CPU at 1,024 pods (issue 18). ``tests/unit/planning/
    test_rollout.py`` holds the rules written out pod by pod as the oracle.
    """
    at = (tally or StepTally.of(decisions)).at
    # Most calls choose nothing (a step ended and its pod's next step is still running, or waits for the
    # barrier's last pod, or for room in the budget): found out from the tally's sets, in C, before anything
    # per pod. Under Rolling most of the fleet waits to pause on a full budget: that set (the fleet's size) is
    # walked only when the budget has room (at each iteration it was 5 % of the operator's samples, issue 18).
    others = set().union(*(at[s] for s in _UNBUDGETED)).difference(inflight)  # chosen whatever the budgets
    pauses, stages, resumes = at[Step.PAUSE], at[Step.STAGE], at[Step.RESUME]
    # (Each stops at the first pod not in flight: intersecting with the pods in flight walks all of them.)
    pause_idle = any(p not in inflight for p in pauses)  # some pod waits to pause
    stage_idle = any(p not in inflight for p in stages)
    resume_idle = any(p not in inflight for p in resumes)
    if not (others or pause_idle or stage_idle or resume_idle):
        return {}
    not_ready = unavailable if isinstance(unavailable, (set, frozenset)) else frozenset(unavailable)
    canaries = order[: plan.canary]
    canary_set = frozenset(canaries)
    canaries_done = gate_open and all(decisions[p].step == Step.DONE for p in canaries if p in decisions)
    busy = sum(len(at[s]) for s in _UNAVAILABLE_STEPS)
    busy += sum(len(not_ready & at[s]) for s in _AVAILABLE_STEPS)  # not routed to, whatever their step
    staging = len(at[Step.AWAIT_STAGE])
    # A pod pausing counts against the budget already (one not ready is counted above), a stage in flight
    # against the loads' limit.
    if pauses:
        busy += len(pauses.intersection(inflight).difference(not_ready))
    if stages:
        staging += len(stages.intersection(inflight))
    limit = plan.max_unavailable if plan.rollout == RolloutType.ROLLING else len(order)
    stage_limit = plan.max_concurrent_loads or len(order)
    rank = rank if rank is not None else {name: i for i, name in enumerate(order)}
    staged_all = barrier_open = True  # what Rolling never holds back for
    if plan.rollout == RolloutType.ALL_AT_ONCE:
        in_order: Mapping[Step, int] = (
            {s: len(pods) for s, pods in at.items()}
            if decisions.keys() == rank.keys()
            else collections.Counter(d.step for name, d in decisions.items() if name in rank)
        )
        # Nobody pauses while any pod still stages (or failed to): the pause holds only commits.
        staged_all = not any(in_order.get(s) for s in STAGING_STEPS)
        # (Canaries resume before the barrier: then the pods other than them are what counts, one by one.)
        barrier_open = in_order.get(Step.DONE, 0) + in_order.get(Step.RESUME, 0) == sum(in_order.values()) or (
            bool(canary_set)
            and all(
                decisions[name].step in (Step.DONE, Step.RESUME)
                for name in order
                if name in decisions and name not in canary_set
            )
        )
    if resume_idle:  # nobody resumes on the new weights before everyone can (AllAtOnce; canaries aside)
        others.update((resumes if barrier_open else canary_set & resumes).difference(inflight))
    # Only the fleet's pods start anything (tested pod by pod: intersecting with the ranks' keys walks them all).
    chosen = {p for p in others if p in rank}
    if pause_idle and staged_all:
        # A pod that serves nobody pauses whatever the budget; the others, canaries first, while it lasts.
        chosen.update(p for p in not_ready & pauses if p in rank and p not in inflight)
        room = limit - busy
        if room > 0:
            candidates = pauses if canaries_done else canary_set & pauses
            ready = {p for p in candidates if p in rank and p not in inflight and p not in not_ready}
            chosen.update(_first(ready, room, rank))
    if stage_idle:
        waiting = {p for p in stages if p in rank and p not in inflight}
        chosen.update(_first(waiting, stage_limit - staging, rank))
    return {name: decisions[name] for name in sorted(chosen, key=rank.__getitem__)}


def _first(pods: set[str], room: int, rank: Mapping[str, int]) -> Collection[str]:
    """The first ``room`` of ``pods`` in the fleet's order (all of them when they fit)."""
    if room >= len(pods):
        return pods
    return heapq.nsmallest(room, pods, key=rank.__getitem__) if room > 0 else ()
