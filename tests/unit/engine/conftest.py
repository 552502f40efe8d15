"""Fixtures of the engine-client tests: a simulated engine on loopback and a client with short timeouts."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
from engine_support import TOKEN, Latencies
from transfer_support import Checkpoints, checkpoints

from rolloutfleet.adapters.engine import EngineClient, EnginePool, EngineTimeouts, ResetPolicy, RetryPolicy
from rolloutfleet.sim import EngineSpec, SimulatedEngine, SimulatedFleet


@pytest.fixture
def spec() -> EngineSpec:
    return EngineSpec()


@pytest.fixture
def ckpts(tmp_path: pathlib.Path) -> Checkpoints:
    """Two revisions of a small verifier/draft pair on disk (a module's ``spec`` may start its engines on A)."""
    return checkpoints(tmp_path)


@pytest.fixture
async def fleet(spec: EngineSpec) -> AsyncIterator[SimulatedFleet]:
    async with SimulatedFleet(token=TOKEN, spec=spec, admin_port=0) as f:
        yield f


@pytest.fixture
async def sim(fleet: SimulatedFleet) -> SimulatedEngine:
    return await fleet.add("127.0.0.1", 0)


@pytest.fixture
def latencies() -> Latencies:
    return Latencies()


# Short deadlines are what the fault tests need: a call that hangs fails its test in a quarter second. A
# module whose tests are not about time (the simulator's routes, loads of checkpoint files) sets
# ``ROOMY_DEADLINES = True`` and gets the client's defaults: loads of a checkpoint outlasted 0.25 s on a loaded
# CI box and failed a staging test and, later, a weight-transfer test.
SHORT = EngineTimeouts(default=0.25, pause=0.25, sleep=0.25, wake_up=0.25, load=0.25, reset_prefix_cache=0.25)


@pytest.fixture
async def pool(latencies: Latencies, request: pytest.FixtureRequest) -> AsyncIterator[EnginePool]:
    timeouts = None if getattr(request.module, "ROOMY_DEADLINES", False) else SHORT
    async with EnginePool(
        token=TOKEN,
        timeouts=timeouts,
        retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02),
        reset=ResetPolicy(attempts=3, base_delay=0.01, max_delay=0.02),
        on_latency=latencies,
    ) as p:
        yield p


@pytest.fixture
def client(pool: EnginePool, sim: SimulatedEngine) -> EngineClient:
    return pool.client(sim.url)
