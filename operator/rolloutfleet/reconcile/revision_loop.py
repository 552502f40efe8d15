"""The per-fleet revision loop: passes of ``reconcile_revisions`` until the fleet or the operator stops.

Called by the fleet daemon in ``handlers.wiring`` (which adapts kopf's stop flag to ``StopSignal``) and by
the unit tests. Owns when passes run (at once when one asks, on a kick from a WeightRevision change, or
after an idle period; ``ctx.on_pass`` hears when each starts and ends, so that the process's collector puts its
full passes off meanwhile) and how the loop stops:

- the operator is stopping (SIGTERM, an upgrade): the running pass starts no new engine step, lets the
  running ones finish, and the loop returns. A step is never abandoned half way by the operator's own
  shutdown; one cut short by a SIGKILL is picked up by the next operator from the engine's state.
- the fleet was deleted: nothing is worth finishing (its pods go with it), so the pass is cancelled at
  once and the deletion is not held up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.reconcile import revision
from rolloutfleet.reconcile.context import FleetMemory, OperatorContext

IDLE_SECONDS = 5.0  # a pass at rest runs again after this long (pods may have come back)
WAITING_SECONDS = 1.0  # a pass that waits on a budget or an unreachable engine runs again after this long


class StopSignal(Protocol):
    """Why and when the loop must stop (kopf's ``DaemonStopped``, or a test's own)."""

    def stopping(self) -> bool: ...

    def deleted(self) -> bool: ...

    async def wait(self) -> None: ...


async def run(
    ctx: OperatorContext,
    namespace: str,
    name: str,
    memory: FleetMemory,
    stop: StopSignal,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    *,
    idle_seconds: float = IDLE_SECONDS,
) -> None:
    """Run passes until ``stop`` says so (see the module docstring for how each stop ends)."""

    def interrupted() -> bool:
        # A newer revision (a kick) or a stop: the pass starts no new step, lets the running ones finish.
        # The trainer's marks alone do not end a pass: it reads them itself (``RolloutPass._take_marks``).
        # A kick that only repeats the revision the pass carries out (``FleetMemory.stale_kick``) does not.
        return (memory.kick.is_set() and not memory.marks_only and not memory.stale_kick()) or stop.stopping()

    while not stop.stopping():
        memory.clear_kick()
        if ctx.on_pass is not None:
            ctx.on_pass(True)
        task = asyncio.create_task(revision.reconcile_revisions(ctx, namespace, name, memory, interrupted))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and stop.deleted():
                task.cancel()
            outcome = await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the loop itself is cancelled (kopf gave up waiting): let it go
            return
        except KubeError as exc:
            logger.warning("revision pass: %s", exc)
            outcome = revision.PassOutcome()
        except Exception:
            logger.exception("revision pass failed")
            outcome = revision.PassOutcome()
        finally:
            stopped.cancel()
            if ctx.on_pass is not None:
                ctx.on_pass(False)
        if outcome.again or stop.stopping():
            continue
        kicked = asyncio.create_task(memory.kick.wait())
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait(
                {kicked, stopped},
                timeout=idle_seconds if outcome.idle else WAITING_SECONDS,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in (kicked, stopped):
                waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(kicked, stopped, return_exceptions=True)
