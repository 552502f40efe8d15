"""Polling with a deadline, for the cluster's readiness checks and for integration tests.

Called by :mod:`rolloutfleet.sandbox.cluster`, the pytest fixtures in ``tests/integration`` and
``bench/``. Synchronous on purpose: the callers are start-up code and tests, never the operator's event
loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeoutError(TimeoutError):
    """The condition did not hold in time; the message says what was awaited and the last value seen."""


def wait_for(
    condition: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.2,
    what: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``condition`` until it returns a truthy value and return that value.

    Exceptions listed in ``ignore`` count as "not yet" (e.g. connection refused while a server starts).
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
        except ignore as err:
            value, last = None, err
        else:
            last = value
            if value:
                return value
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
