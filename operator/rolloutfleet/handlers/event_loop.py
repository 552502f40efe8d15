"""The operator's event loop: uvloop where it is installed (the default), asyncio's own when asked for.

Called by ``handlers.commands.run`` before kopf starts. The operator is one event loop: every engine call,
Kubernetes request, watch event and plan of a rollout runs on it, so the loop's own cost per callback,
socket read and TLS record is paid thousands of times per revision on a large fleet, on the rollout's
critical path. uvloop (libuv underneath, the same asyncio API) is what kopf's own CLI runs on when it is
installed; the operator's distribution depends on it (bench/results/rollout_overhead.md has what it saved).
``ROLLOUTFLEET_EVENT_LOOP=asyncio`` runs the standard loop instead (to rule the loop out when debugging);
``uvloop`` insists on it (an error when it is missing rather than a silent fallback).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

ENV = "ROLLOUTFLEET_EVENT_LOOP"

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
