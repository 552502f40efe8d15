"""The operator process's garbage-collector settings, applied once by ``rolloutfleet run`` before kopf starts.

Why (issue 18, bench/results/rollout_overhead.md "Garbage collection"): with Python's defaults (a young
collection every 700 net allocations) the cycle collector took 18.6 % of the operator's CPU over a 1,024-pod
bench run (the fleet's creation and one rollout), 2.1 of its 3.4 CPU-seconds in 21 full collections that
walk every object the process holds, the modules and models loaded at start-up included. Freezing what
exists at start-up (it lives as long as the process) and collecting the young generation ten times less
often took it to 7 % of the same run (within the rollout alone: 21 % -> 9-11 %); 20,000 did not help
further (the young objects mostly survive: tasks and requests in flight). Cycles are still collected, in
larger batches: the 1,000-revision soak holds ~9 MB more throughout, flat as before.

``FullCollections`` keeps the collector's full passes out of revision passes (bench/results/
rollout_overhead_16_cores.md and rollout_overhead.md, "Full collections put off while a pass runs"): a full pass
walks every object the process holds, a large fleet's settled pods among them, and at 8,192-16,384 pods they
were 10-15 % of the operator's CPU during a revision and stalled its event loop for seconds; put off, a
8,192-pod revision spent 7 % less and its loop's worst stall went from up to 2.5 s to under 1 s.

``CollectorClock`` times every collection (``rolloutfleet_gc_seconds_total`` on /metrics), so the cost stays
visible where the operator runs. ``ROLLOUTFLEET_GC_THRESHOLD`` overrides the settings: three integers
``"gen0,gen1,gen2"`` for ``gc.set_threshold``, or ``python`` for Python's own (no freeze either).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Mapping
from typing import Any

ENV = "ROLLOUTFLEET_GC_THRESHOLD"
DEFAULT_THRESHOLD = (7000, 10, 10)
# Full passes are put off for at most this long at a time: the cyclic garbage that reaches the oldest generation
# during a revision waits for them, so a pass that runs on (or fleets whose passes always overlap) gets one full
# pass this often. Longer than an AllAtOnce revision of 16,384 pods (42 s on 16 cores).
MAX_DEFERRAL_SECONDS = 120.0
_DEFERRED = 1_000_000  # gen2's threshold while deferred: no full pass comes from allocations


def threshold_from(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """The thresholds the environment asks for (``None``: leave Python's); ``ValueError`` names a bad value."""
    raw = env.get(ENV, "").strip()
    if not raw:
        return DEFAULT_THRESHOLD
    if not tuned(env):
        return None
    parts = [p.strip() for p in raw.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or values[0] < 1 or min(values) < 0:
        raise ValueError(f'{ENV}={raw!r}: expected "python" or three integers "gen0,gen1,gen2" with gen0 >= 1')
    return values[0], values[1], values[2]


def tuned(env: Mapping[str, str]) -> bool:
    """Whether the operator runs with its own collector settings (not ``ROLLOUTFLEET_GC_THRESHOLD=python``)."""
    return env.get(ENV, "").strip() != "python"


def apply(threshold: tuple[int, int, int] | None) -> None:
    """Freeze what the process holds now and set the thresholds; nothing for ``None``."""
    if threshold is None:
        return
    gc.collect()  # garbage made while importing is not frozen with the rest
    gc.freeze()
    gc.set_threshold(*threshold)


class FullCollections:
    """Puts off the collector's full passes while a revision pass runs (the revision loop calls ``enter`` and
    ``leave`` around each pass; several fleets' passes may overlap).

    While any pass runs, gen2's threshold is out of reach, so no full pass comes from allocations; young
    collections run as before. When the last pass ends, the thresholds are restored and a full pass that came
    due meanwhile runs at the next young collection, between passes. Passes that run on for ``max_seconds``
    (a long Rolling revision, fleets whose passes always overlap) get one full pass then, and the deferral
    starts over: what waits for a full pass is never more than ``max_seconds`` old, and a long revision meets
    at most one full pass per ``max_seconds`` instead of one whenever its allocations ask. Off (``enabled``
    False) with Python's own collector settings (``ROLLOUTFLEET_GC_THRESHOLD=python``).
    """

    def __init__(
        self,
        enabled: bool = True,
        *,
        max_seconds: float = MAX_DEFERRAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], object] = gc.collect,
    ) -> None:
        self.enabled = enabled
        self.max_seconds = max_seconds
        self.clock = clock
        self.collect = collect
        self.running = 0  # passes running now
        self.deferred_since: float | None = None
        self.deferrals = 0  # deferrals started: one per stretch of passes, and one after each of ``due``'s passes
        self.collected = 0  # full passes run because a deferral reached ``max_seconds``
        self._saved: tuple[int, int, int] | None = None  # the thresholds a deferral restores
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def deferring(self) -> bool:
        return self.deferred_since is not None

    def enter(self) -> None:
        self.running += 1
        if self.deferring:
            self.due()
        elif self.enabled:
            self._defer()

    def leave(self) -> None:
        self.running = max(self.running - 1, 0)
        if self.running == 0:
            self._restore()
        else:
            self.due()

    def due(self) -> None:
        """The full pass of a deferral that reached ``max_seconds`` while passes still run (the loop's timer
        calls it; ``enter`` and ``leave`` too, for a caller without a running loop)."""
        if self.deferred_since is None or self.clock() - self.deferred_since < self.max_seconds:
            return
        self._restore()
        if self.running > 0:
            self.collect()
            self.collected += 1
            self._defer()

    def _defer(self) -> None:
        self.deferred_since = self.clock()
        self.deferrals += 1
        young, middle, _ = self._saved = gc.get_threshold()
        gc.set_threshold(young, middle, _DEFERRED)
        try:
            self._expiry = asyncio.get_running_loop().call_later(self.max_seconds, self.due)
        except RuntimeError:  # no running loop: ``enter`` and ``leave`` check the time instead
            self._expiry = None

    def _restore(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        self.deferred_since = None


class CollectorClock:
    """CPU seconds spent in the cycle collector, by generation (a ``gc.callbacks`` entry while installed).

    Plain floats, no lock: a callback runs in whichever thread's allocation started the collection, the
    metrics server's included, so a lock taken here could be one that thread already holds. Collections
    never nest (CPython runs callbacks inside the collection), so one start time is enough.
    """

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds[int(info["generation"])] += time.thread_time() - self._started

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
