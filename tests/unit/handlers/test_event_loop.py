"""The operator's event loop (``handlers.event_loop``): uvloop unless asked otherwise.

The operator is one event loop, and its cost per callback, socket read and TLS record is paid thousands of
times per revision on a large fleet (bench/results/rollout_overhead.md, "uvloop"). These tests hold the
choice (uvloop by default, asyncio's on request, a bad value or a missing uvloop that was insisted on stops
the operator with one line before kopf starts) and that ``rolloutfleet run`` starts on the loop chosen.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import time

import pytest
import run_cli
import uvloop

from rolloutfleet.handlers import event_loop
from rolloutfleet.metrics import Metrics

pytestmark = pytest.mark.unit


def test_uvloop_by_default() -> None:
    name, factory = event_loop.choose({})
    assert name == "uvloop" and factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


@pytest.mark.parametrize(("raw", "expected"), [("asyncio", "asyncio"), (" AsyncIO ", "asyncio"), ("uvloop", "uvloop")])
def test_asked_for(raw: str, expected: str) -> None:
    name, factory = event_loop.choose({event_loop.ENV: raw})
    assert name == expected and (factory is None) == (expected == "asyncio")


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=f"{event_loop.ENV}='trio'"):
        event_loop.choose({event_loop.ENV: "trio"})


def test_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where uvloop cannot be installed the operator still runs, on asyncio's loop; unless uvloop was asked
    for by name: then a silent fallback would hide a misbuilt image."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # ``import uvloop`` raises ImportError
    assert event_loop.choose({}) == ("asyncio", None)
    with pytest.raises(ValueError, match="not installed"):
        event_loop.choose({event_loop.ENV: "uvloop"})


def test_a_bad_value_stops_run_before_kopf_starts(tmp_path: pathlib.Path) -> None:
    line = run_cli.refused_line(tmp_path, {event_loop.ENV: "trio"}, drop=(event_loop.ENV,))
    assert line.startswith(f"rolloutfleet run: {event_loop.ENV}='trio'")


@pytest.mark.parametrize("asked", ["", "asyncio"])
async def test_run_starts_on_the_loop_chosen(tmp_path: pathlib.Path, asked: str) -> None:
    """``rolloutfleet run`` says which loop it runs on before kopf starts (kopf then retries its login to
    the unreachable API server until the process is stopped)."""
    env = run_cli.environment(tmp_path, {event_loop.ENV: asked} if asked else {}, drop=(event_loop.ENV,))
    proc = await asyncio.create_subprocess_exec(
        *run_cli.COMMAND,
        "--metrics-port",
        "0",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        line = b""
        async with asyncio.timeout(60):
            while b"event loop:" not in line:
                line = await proc.stderr.readline()
                assert line, "the operator exited without naming its event loop"
        assert line.decode().rstrip().endswith(f"event loop: {asked or 'uvloop'}")
    finally:
        proc.terminate()
        await proc.wait()


async def test_the_lag_is_how_late_a_due_timer_ran_behind_the_loop_s_work() -> None:
    """``watch_lag`` feeds ``rolloutfleet_event_loop_lag_seconds``: the time a callback that is due waits for the
    loop. An idle loop runs it on time; a callback that holds the loop 0.2 s (as a large status build or a burst
    of watch events would) delays the next sample by about that much, and that is what must be observed."""
    observed: list[float] = []
    watch = asyncio.create_task(event_loop.watch_lag(observed.append, interval=0.05))
    try:
        while len(observed) < 3:
            await asyncio.sleep(0.01)
        assert all(0 <= lag < 0.04 for lag in observed)  # idle: on time, within the loop's timer resolution
        before = len(observed)
        asyncio.get_running_loop().call_soon(time.sleep, 0.2)  # the loop's one thread busy for 0.2 s
        while len(observed) <= before + 1:
            await asyncio.sleep(0.01)
        assert max(observed[before:]) >= 0.1
    finally:
        watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch


def test_the_lag_is_exported_with_buckets_from_an_idle_loop_to_a_stalled_one() -> None:
    metrics = Metrics()
    metrics.loop_lag.observe(0.002)
    metrics.loop_lag.observe(1.5)
    sample = metrics.registry.get_sample_value
    assert sample("rolloutfleet_event_loop_lag_seconds_count") == 2
    assert sample("rolloutfleet_event_loop_lag_seconds_bucket", {"le": "0.005"}) == 1
    assert sample("rolloutfleet_event_loop_lag_seconds_bucket", {"le": "2.5"}) == 2
