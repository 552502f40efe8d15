"""``reconcile.waits.event_set`` never loses a cancellation.

Python 3.11's ``asyncio.wait_for`` returns normally when what it awaited completed just before the caller was
cancelled: the rollout pass, waiting for a step's end, then carried on after its fleet was deleted and
waited for a held load (test_revision_loop's deletion test failed 4 runs in 30). Each interleaving below
sets the event, lets the loop turn 0-3 times, then cancels: the waiter either finished before the cancel
or raises CancelledError, never returns as if nothing happened. With ``asyncio.wait_for`` inside, the turns
0-2 return normally (checked when this was written).
"""

from __future__ import annotations

import asyncio

import pytest

from rolloutfleet.reconcile.waits import event_set

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("within", [5, None])
@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_a_cancel_right_after_the_event_is_never_lost(turns: int, within: float | None) -> None:
    event = asyncio.Event()
    waiter = asyncio.create_task(event_set(event, within))
    await asyncio.sleep(0)  # the waiter is waiting
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    if waiter.done():  # it saw the event before the cancel: a normal return is right
        assert waiter.result() is True
        return
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_set_in_time() -> None:
    event = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await event_set(event, 5) is True


async def test_times_out() -> None:
    assert await event_set(asyncio.Event(), 0.01) is False


async def test_no_limit() -> None:
    event = asyncio.Event()
    event.set()
    assert await event_set(event, None) is True
    later = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, later.set)
    assert await event_set(later, None) is True


async def test_already_set_with_a_limit() -> None:
    event = asyncio.Event()
    event.set()
    assert await event_set(event, 0) is True  # set before the wait: no timer to run out
