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

import pytest
import run_cli
import uvloop

from rolloutfleet.handlers import event_loop

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
