"""``event_set``: wait for an ``asyncio.Event`` with a deadline, without ever losing a cancellation.

Called by ``reconcile.rollout_pass`` wherever a pass waits on an event with a timeout (a step's end, the
trainer's marks, a resume batch). Not ``asyncio.wait_for``: on Python 3.11 it returns the awaited result when
the event was set just before the caller was cancelled (up to two loop turns earlier), so the cancellation is
lost. A fleet deleted while one pod's load was held and another pod's step had just ended then waited for the
held load instead of returning (test_revision_loop's deletion test failed 4 runs in 30).
"""

from __future__ import annotations

import asyncio


async def event_set(event: asyncio.Event, within: float | None) -> bool:
    """Whether ``event`` was set within ``within`` seconds (``None``: no limit); a cancellation propagates."""
    # Without a timer when none is needed: the pass waits here at each of its iterations (~2,000 in a 1,024-pod
    # long-tail Rolling revision), and an ``asyncio.timeout`` costs a Timeout object, its entry and exit.
    if event.is_set():
        return True
    if within is None:
        await event.wait()
        return True
    try:
        async with asyncio.timeout(within):
            await event.wait()
    except TimeoutError:
        return False
    return True
