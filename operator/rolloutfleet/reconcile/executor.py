"""Carry out one step of the per-pod transaction against one engine, with its timeout.

Called by ``reconcile.revision`` for each admitted ``transaction.Decision``. Each step is one or a few
engine calls (the bracketed compositions of ``planning.transaction``); the per-step timeout comes from the
fleet's ``updateStrategy.timeouts``. A failure raises ``StepError`` with a one-line reason; the caller
counts attempts and decides between retrying and rolling back.
"""

from __future__ import annotations

import asyncio
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


def _timeout(step: Step, timeouts: StepTimeouts) -> float:
    if step in (Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.RESTORE_DRAFT):
        return float(timeouts.load_seconds)
    if step == Step.WAKE_WEIGHTS:
        return float(timeouts.wake_seconds)
    if step == Step.SLEEP:
        return float(timeouts.sleep_seconds)
    if step == Step.RESUME:
        return float(timeouts.wake_seconds + timeouts.pause_seconds + timeouts.verify_seconds)
    if step == Step.SET_VERSION:
        return float(timeouts.verify_seconds)
    return float(timeouts.pause_seconds)


async def _run(engine: EngineClient, step: Step, goal: Goal) -> LoadResult | None:
    if step == Step.PAUSE:
        await engine.pause(mode="keep", clear_cache=False)
    elif step == Step.SLEEP:
        await engine.sleep(2)
    elif step == Step.WAKE_WEIGHTS:
        await engine.wake_up(["weights"])
    elif step == Step.LOAD_VERIFIER:
        return await engine.load(Target.VERIFIER, goal.verifier_path, goal.revision)
    elif step == Step.LOAD_DRAFT:
        assert goal.draft_path is not None
        return await engine.load(Target.DRAFT, goal.draft_path, goal.revision)
    elif step == Step.RESTORE_DRAFT:
        assert goal.frozen_draft_path is not None
        return await engine.restore_draft(goal.frozen_draft_path)
    elif step == Step.SET_VERSION:
        await engine.update_weight_version(goal.weight_version)
    elif step == Step.RESUME:
        if goal.sleep_mode:
            # Level 2 freed every KV block, so the reset cannot find blocks in use; it must succeed.
            await engine.wake_up(["kv_cache"])
            if goal.reset_prefix_cache and not await engine.reset_prefix_cache():
                raise StepError(step, "PrefixCacheBusy", "the prefix cache could not be reset")
            await engine.resume()
        else:
            # In-flight: requests held by pause(keep) still own KV blocks, and vLLM refuses a reset while
            # any block is in use; they finish after resume, then the reset goes through (the client
            # retries while vLLM answers success=false).
            await engine.resume()
            if goal.reset_prefix_cache and not await engine.reset_prefix_cache():
                raise StepError(step, "PrefixCacheBusy", "the prefix cache could not be reset after resume")
    else:
        raise ValueError(f"{step} is not an action")
    return None


async def execute(
    engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts
) -> tuple[float, LoadResult | None]:
    """Run one step; return its duration in seconds and a load's result, or raise ``StepError``."""
    started = time.perf_counter()
    try:
        load = await asyncio.wait_for(_run(engine, step, goal), timeout=_timeout(step, timeouts))
    except TimeoutError as exc:
        raise StepError(step, "StepTimeout", f"no answer within {_timeout(step, timeouts):.0f}s") from exc
    except engine_wire.EngineRPCError as exc:
        raise StepError(step, "Extension" + "".join(p.title() for p in exc.code.split("_")), str(exc)) from exc
    except engine_wire.EngineUnreachable as exc:
        raise StepError(step, "EngineUnreachable", str(exc)) from exc
    except engine_wire.EngineTimeout as exc:
        raise StepError(step, "EngineTimeout", str(exc)) from exc
    except engine_wire.EngineHTTPError as exc:
        raise StepError(step, "EngineHTTPError", str(exc)) from exc
    except engine_wire.EngineError as exc:
        raise StepError(step, "EngineError", str(exc)) from exc
    return time.perf_counter() - started, load
