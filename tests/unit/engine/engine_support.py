"""Shared helpers of the engine-client tests (constants, the transaction, a latency recorder)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from rolloutfleet.adapters.engine import EngineClient

TOKEN = "unit-token"
V1, D1, V2, D2 = "/synthetic/v/1", "/synthetic/d/1", "/synthetic/v/2", "/synthetic/d/2"


@dataclasses.dataclass
class Latencies:
    """Every (step, seconds, outcome) the client reported through its latency hook."""

    calls: list[tuple[str, float, str]] = dataclasses.field(default_factory=list)

    def __call__(self, step: str, seconds: float, outcome: str) -> None:
        self.calls.append((step, seconds, outcome))


Step = Callable[[EngineClient], Awaitable[object]]

# The sleep-mode transaction of DESIGN.md §4, as (fault step key, client call).
TRANSACTION: list[tuple[str, Step]] = [
    ("pause", lambda c: c.pause("keep", clear_cache=False)),
    ("sleep", lambda c: c.sleep(2)),
    ("wake_up:weights", lambda c: c.wake_up(["weights"])),
    ("rolloutfleet_load:verifier", lambda c: c.load("verifier", V2, 2)),
    ("rolloutfleet_load:draft", lambda c: c.load("draft", D2, 2)),
    ("rolloutfleet_state", lambda c: c.extension_state()),
    ("update_weight_version", lambda c: c.update_weight_version("2")),
    ("wake_up:kv_cache", lambda c: c.wake_up(["kv_cache"])),
    ("reset_prefix_cache", lambda c: c.reset_prefix_cache()),
    ("resume", lambda c: c.resume()),
]
