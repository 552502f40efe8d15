"""Carry out one step of the per-pod transaction against one engine, each call with its spec deadline.

Called by ``reconcile.revision`` for each admitted ``transaction.Decision``. Each step is one or a few
engine calls (the bracketed compositions of ``planning.transaction``). This is the one place that maps a
step's calls to the fleet's ``updateStrategy.timeouts``: every call is given exactly its deadline, which
the client uses as its HTTP timeout (retries included), so nothing waits longer or shorter than the spec
says. A failure raises ``StepError`` with a CamelCase reason; the caller counts attempts and decides
between retrying and rolling back.

Resume is fail-closed: the prefix cache is reset *before* the engine resumes, in both modes, and a reset
that does not go through fails the step while the engine is still paused (the planner derives RESUME
again and retries it). Requests frozen by ``pause(keep)`` hold KV blocks, which makes vLLM refuse a plain
reset, so the reset preempts them (``reset_running_requests``): their KV came from the old weights anyway,
and vLLM recomputes it with the new ones when they are scheduled after the resume.
"""

from __future__ import annotations

import re
import time

from rolloutfleet.adapters import engine_wire
from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.api.engine import LoadResult, Target
from rolloutfleet.api.fleet import StepTimeouts
from rolloutfleet.planning.transaction import Goal, Step


class StepError(RuntimeError):
    """A step did not complete; ``reason`` is a CamelCase code for metrics and conditions."""

    def __init__(self, step: Step, reason: str, message: str) -> None:
        super().__init__(f"{step.value}: {message}")
        self.step = step
        self.reason = reason


def reason_of(exc: engine_wire.EngineError) -> str:
    """The CamelCase reason of an engine error (an extension code ``load_failed`` → ``ExtensionLoadFailed``).

    ``StepTimeout``: a call outlived the deadline the spec gives its step. ``LoadOutcomeUnknown``: a load was
    not sent because an earlier one may still be running (observe the engine, then retry).
    """
    if isinstance(exc, engine_wire.EngineRPCError):
        return "Extension" + "".join(p.title() for p in re.split(r"[^0-9A-Za-z]+", exc.code) if p)
    if isinstance(exc, engine_wire.LoadOutcomeUnknown):
        return "LoadOutcomeUnknown"
    if isinstance(exc, engine_wire.EngineTimeout):
        return "StepTimeout"
    if isinstance(exc, engine_wire.EngineUnreachable):
        return "EngineUnreachable"
    if isinstance(exc, engine_wire.EngineHTTPError):
        return "EngineHTTPError"
    if isinstance(exc, engine_wire.EngineInconsistent):
        return "EngineInconsistent"
    if isinstance(exc, engine_wire.EngineProtocolError):
        return "EngineProtocolError"
    return "EngineError"


async def _run(engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts) -> LoadResult | None:
    pause = float(timeouts.pause_seconds)  # pause(keep) and the resume composition's reset and resume
    wake = float(timeouts.wake_seconds)  # each wake_up
    load = float(timeouts.load_seconds)  # each load or restore
    if step == Step.PAUSE:
        await engine.pause(mode="keep", clear_cache=False, deadline=pause)
    elif step == Step.SLEEP:
        await engine.sleep(2, deadline=float(timeouts.sleep_seconds))
    elif step == Step.WAKE_WEIGHTS:
        await engine.wake_up(["weights"], deadline=wake)
    elif step == Step.LOAD_VERIFIER:
        return await engine.load(Target.VERIFIER, goal.verifier_path, goal.revision, deadline=load)
    elif step == Step.LOAD_DRAFT:
        assert goal.draft_path is not None
        return await engine.load(Target.DRAFT, goal.draft_path, goal.revision, deadline=load)
    elif step == Step.RESTORE_DRAFT:
        assert goal.frozen_draft_path is not None
        return await engine.restore_draft(goal.frozen_draft_path, deadline=load)
    elif step == Step.SET_VERSION:
        await engine.update_weight_version(goal.weight_version, deadline=float(timeouts.verify_seconds))
    elif step == Step.RESUME:
        if goal.sleep_mode:
            await engine.wake_up(["kv_cache"], deadline=wake)
        if goal.reset_prefix_cache and not await engine.reset_prefix_cache(reset_running_requests=True, deadline=pause):
            raise StepError(step, "PrefixCacheNotReset", "the prefix cache could not be reset: not resumed")
        await engine.resume(deadline=pause)
    else:
        raise ValueError(f"{step} is not an action")
    return None


async def execute(
    engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts
) -> tuple[float, LoadResult | None]:
    """Run one step; return its duration in seconds and a load's result, or raise ``StepError``."""
    started = time.perf_counter()
    try:
        load = await _run(engine, step, goal, timeouts)
    except engine_wire.EngineError as exc:
        raise StepError(step, reason_of(exc), str(exc)) from exc
    return time.perf_counter() - started, load
