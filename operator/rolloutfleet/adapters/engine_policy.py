"""The engine client's policies: deadlines, retries, and the ledger of loads whose outcome is unknown.

Used by ``rolloutfleet.adapters.engine`` (which re-exports the public names); plain data and one small
bookkeeping class, no I/O. Deadlines come from the caller (``reconcile.executor`` passes the fleet's
``updateStrategy.timeouts``); ``EngineTimeouts`` holds only the fallbacks for callers that pass none.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Callable

RPC_TIMEOUT_MARGIN_SECONDS = 5.0  # vLLM's RPC timeout is the HTTP deadline less this (or less 10%)


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter for idempotent calls; ``attempts`` counts the first try."""

    attempts: int = 3
    base_delay: float = 0.1
    max_delay: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2**attempt)))


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTimeouts:
    """Deadlines in seconds for calls made *without* one (the sandbox, benchmarks), and the TCP connect.

    The operator does not rely on these: ``reconcile.executor`` passes each step's deadline from the
    fleet's ``updateStrategy.timeouts``. ``connect`` bounds only establishing a connection, for every call.
    """

    default: float = 10.0
    pause: float = 120.0  # mode=wait drains in-flight requests
    sleep: float = 120.0
    wake_up: float = 120.0
    load: float = 900.0
    reset_prefix_cache: float = 30.0
    connect: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class ResetPolicy:
    """How often to re-send ``/reset_prefix_cache`` while it answers ``success: false`` (within its deadline)."""

    attempts: int = 20
    base_delay: float = 0.05
    max_delay: float = 1.0


def rpc_timeout_below(http_deadline: float) -> float:
    """vLLM's RPC ``timeout`` for an HTTP deadline: a little shorter, so the engine answers first."""
    return http_deadline - min(RPC_TIMEOUT_MARGIN_SECONDS, 0.1 * http_deadline)


class LoadLedger:
    """Per engine URL: a load whose outcome is unknown, and since when. Shared by a pool's clients.

    ``ticket()`` orders events: a state read settles an entry only if it started (took its ticket) after
    the load was marked unknown, i.e. it was sent after the load and so ran after it (vLLM runs RPCs one
    at a time). Times are ``clock()`` readings (monotonic), for messages only.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seq = itertools.count()
        self._unknown: dict[str, tuple[int, float]] = {}

    def ticket(self) -> int:
        return next(self._seq)

    def mark(self, url: str) -> None:
        self._unknown[url] = (next(self._seq), self._clock())

    def since(self, url: str) -> float | None:
        entry = self._unknown.get(url)
        return None if entry is None else entry[1]

    def age(self, url: str) -> float:
        since = self.since(url)
        return 0.0 if since is None else self._clock() - since

    def settle(self, url: str, ticket: int) -> None:
        entry = self._unknown.get(url)
        if entry is not None and entry[0] < ticket:
            del self._unknown[url]
