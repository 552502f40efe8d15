"""``bounded``: many engine calls at once, at most ``limit`` in flight.

Called by ``reconcile.rollout_pass`` (a pass's engine reads, each pre-flight with the read that follows it)
and ``reconcile.revision``. Each call takes milliseconds, but sent all together to thousands of engines they
queue behind each other (4,096 reads timed out inside one simulator process: bench/results/
rollout_overhead.md), and every one of them holds a connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")
# Engine calls in flight at once, for reads and pre-flights alike. Sent all together, 4,096 reads queued
# behind each other in the engines' host (one simulator process) and timed out as "unreachable"; pre-flights
# bounded at 64 took twice as long as the first read at 512 (1,024 pods on 16 cores: 0.30 s against 0.15 s,
# issue 18).
LIMIT = 512


async def bounded(calls: Iterable[Awaitable[T]], limit: int) -> list[T]:
    """The calls' results, in order, with at most ``limit`` running at once."""
    slots = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        async with slots:
            return await call

    return list(await asyncio.gather(*(one(c) for c in calls)))
