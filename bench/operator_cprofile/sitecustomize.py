"""The bench's CPU profiler inside the operator process (``bench/rollout_overhead.py --profile-cprofile``).

Not part of the operator: the bench puts this directory first on the operator's ``PYTHONPATH`` only when asked,
and Python imports ``sitecustomize`` at start-up. SIGUSR2 starts a ``cProfile`` of the thread that handles
signals (the main thread: the operator's event loop) with that thread's CPU clock (``time.thread_time``), so a
wait for the network or for a core counts nothing; the next SIGUSR2 stops it and writes the statistics to
``$ROLLOUTFLEET_BENCH_CPROFILE_DIR/operator-<pid>-<n>.pstats``. Unlike py-spy's samples, each function's calls
are counted exactly; every call pays the profiler's own cost, so call-heavy code looks heavier than it is.
"""

from __future__ import annotations

import cProfile
import os
import pathlib
import signal
import time
from typing import Any

_profile: cProfile.Profile | None = None
_written = 0


def _toggle(_signum: int, _frame: Any) -> None:
    global _profile, _written
    if _profile is None:
        _profile = cProfile.Profile(time.thread_time)
        _profile.enable()
        return
    _profile.disable()
    _written += 1
    out = pathlib.Path(os.environ["ROLLOUTFLEET_BENCH_CPROFILE_DIR"]) / f"operator-{os.getpid()}-{_written}"
    _profile.dump_stats(f"{out}.partial")
    os.replace(f"{out}.partial", f"{out}.pstats")  # the bench waits for this name: whole or absent
    _profile = None


if os.environ.get("ROLLOUTFLEET_BENCH_CPROFILE_DIR"):
    signal.signal(signal.SIGUSR2, _toggle)
