"""The bench's CPU profiler inside the operator process (``bench/rollout_overhead.py --profile-cprofile``).

Not part of the operator: the bench puts this directory first on the operator's ``PYTHONPATH`` only when asked,
and Python imports ``sitecustomize`` at start-up. SIGUSR2 starts a ``cProfile`` of the thread that handles
signals (the main thread: the operator's event loop) with that thread's CPU clock (``time.thread_time``), so a
wait for the network or for a core counts nothing, and says so with an empty
``$ROLLOUTFLEET_BENCH_CPROFILE_DIR/operator-<pid>-<n>.started`` (the bench creates the revision only then); the
next SIGUSR2 stops it and writes the statistics to ``operator-<pid>-<n>.pstats`` beside it. Unlike py-spy's
samples, each function's calls are counted exactly; every call pays the profiler's own cost, so call-heavy code
looks heavier than it is.

From Python 3.12 cProfile listens through ``sys.monitoring``, whose events come from every thread of the process,
and the operator runs threads beside its loop (the metrics server the bench scrapes, the Kubernetes client's
pool): their calls went onto the loop's call stack and were timed with the loop thread's clock, so the device's
3.12 profiles had shares over 100 % and under zero. ``_only_this_thread`` puts a filter in front of each of
cProfile's callbacks that drops the events of every other thread.
"""

from __future__ import annotations

import cProfile
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_profile: cProfile.Profile | None = None
_written = 0


def _toggle(_signum: int, _frame: Any) -> None:
    global _profile, _written
    out = pathlib.Path(os.environ["ROLLOUTFLEET_BENCH_CPROFILE_DIR"]) / f"operator-{os.getpid()}-{_written + 1}"
    if _profile is None:
        _profile = cProfile.Profile(time.thread_time)
        _profile.enable()
        _only_this_thread()
        # Only now may the revision start: a signal is handled when the loop next runs Python, and before this
        # marker the bench slept 0.5 s and hoped (a busy 2-core box could have missed the revision's start).
        out.with_suffix(".started").touch()
        return
    _profile.disable()
    _written += 1
    _profile.dump_stats(f"{out}.partial")
    os.replace(f"{out}.partial", f"{out}.pstats")  # the bench waits for this name: whole or absent
    _profile = None


def _only_this_thread() -> None:
    """Wraps each ``sys.monitoring`` callback cProfile registered (3.12 and later; before, cProfile profiled the
    calling thread only) so that events of other threads reach it no more."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return
    ident = threading.get_ident()
    tool = monitoring.PROFILER_ID
    for name in dir(monitoring.events):
        event = getattr(monitoring.events, name)
        # single events only: the callbacks are registered per event, and NO_EVENTS or combined masks are not
        if not isinstance(event, int) or event <= 0 or event & (event - 1):
            continue
        registered = monitoring.register_callback(tool, event, None)
        if registered is not None:
            monitoring.register_callback(tool, event, _filtered(registered, ident))


def _filtered(callback: Callable[..., Any], ident: int) -> Callable[..., Any]:
    get_ident = threading.get_ident

    def on_this_thread_only(*args: Any) -> Any:
        if get_ident() == ident:
            return callback(*args)
        return None

    return on_this_thread_only


if os.environ.get("ROLLOUTFLEET_BENCH_CPROFILE_DIR"):
    signal.signal(signal.SIGUSR2, _toggle)
