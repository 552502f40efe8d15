"""The operator's event loop: uvloop where it is installed (the default), asyncio's own when asked for.

Called by ``handlers.commands.run`` before kopf starts. The operator is one event loop: every engine call,
Kubernetes request, watch event and plan of a rollout runs on it, so the loop's own cost per callback,
socket read and TLS record is paid thousands of times per revision on a large fleet, on the rollout's
critical path. uvloop (libuv underneath, the same asyncio API) is what kopf's own CLI runs on when it is
installed; the operator's distribution depends on it (bench/results/rollout_overhead.md has what it saved).
``ROLLOUTFLEET_EVENT_LOOP=asyncio`` runs the standard loop instead (to rule the loop out when debugging);
``uvloop`` insists on it (an error when it is missing rather than a silent fallback).

``watch_lag`` (started by ``handlers.wiring.configure``) measures how far behind the loop runs: the one signal
that says when the operator itself, not the engines or the API server, holds a rollout back
(``rolloutfleet_event_loop_lag_seconds``, docs/metrics.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

ENV = "ROLLOUTFLEET_EVENT_LOOP"
# Two samples a second: enough to catch a busy second, and a wake-up (~20 µs) too few to show in the operator's
# CPU (1,024 pods: ~2 s of CPU per 25 s revision).
LAG_INTERVAL_SECONDS = 0.5

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def choose(environ: Mapping[str, str]) -> tuple[str, LoopFactory | None]:
    """(the loop's name, its factory for ``asyncio.Runner``; None: asyncio's default).

    Raises ValueError for a value that is neither ``uvloop`` nor ``asyncio``, or ``uvloop`` when it is not
    installed.
    """
    value = environ.get(ENV, "").strip().lower()
    if value not in ("", "uvloop", "asyncio"):
        raise ValueError(f"{ENV}={environ[ENV]!r}: expected 'uvloop' or 'asyncio'")
    if value == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if value == "uvloop":
            raise ValueError(f"{ENV}=uvloop, but uvloop is not installed") from None
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


async def watch_lag(observe: Callable[[float], None], interval: float = LAG_INTERVAL_SECONDS) -> None:
    """Until cancelled: sleep ``interval``, then ``observe`` how many seconds after its due time the sleep ended.

    A timer's callback runs once the loop has run what was queued before it: the lag is what any callback due
    then (an engine's answer, a watch event, a step's next request) waited for the loop, and it grows with the
    CPU the loop's work needs per second, not with the wall time requests take.
    """
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(loop.time() - due, 0.0))
