"""The operator process's garbage-collector settings, applied once by ``rolloutfleet run`` before kopf starts.

Why (issue 18, bench/results/rollout_overhead.md "Garbage collection"): with Python's defaults (a young
collection every 700 net allocations) the cycle collector took 18.6 % of the operator's CPU over a 1,024-pod
bench run (the fleet's creation and one rollout), 2.1 of its 3.4 CPU-seconds in 21 full collections that
walk every object the process holds, the modules and models loaded at start-up included. Freezing what
exists at start-up (it lives as long as the process) and collecting the young generation ten times less
often took it to 7 % of the same run (within the rollout alone: 21 % -> 9-11 %); 20,000 did not help
further (the young objects mostly survive: tasks and requests in flight). Cycles are still collected, in
larger batches: the 1,000-revision soak holds ~9 MB more throughout, flat as before.

``CollectorClock`` times every collection (``rolloutfleet_gc_seconds_total`` on /metrics), so the cost stays
visible where the operator runs. ``ROLLOUTFLEET_GC_THRESHOLD`` overrides the settings: three integers
``"gen0,gen1,gen2"`` for ``gc.set_threshold``, or ``python`` for Python's own (no freeze either).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping
from typing import Any

ENV = "ROLLOUTFLEET_GC_THRESHOLD"
DEFAULT_THRESHOLD = (7000, 10, 10)


def threshold_from(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """The thresholds the environment asks for (``None``: leave Python's); ``ValueError`` names a bad value."""
    raw = env.get(ENV, "").strip()
    if not raw:
        return DEFAULT_THRESHOLD
    if raw == "python":
        return None
    parts = [p.strip() for p in raw.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or values[0] < 1 or min(values) < 0:
        raise ValueError(f'{ENV}={raw!r}: expected "python" or three integers "gen0,gen1,gen2" with gen0 >= 1')
    return values[0], values[1], values[2]


def apply(threshold: tuple[int, int, int] | None) -> None:
    """Freeze what the process holds now and set the thresholds; nothing for ``None``."""
    if threshold is None:
        return
    gc.collect()  # garbage made while importing is not frozen with the rest
    gc.freeze()
    gc.set_threshold(*threshold)


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
