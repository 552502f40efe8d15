"""``scripts/bench/device-bench.sh start`` and ``wait``: a bench run longer than one device call.

A device call lasts at most 10 minutes and the machine is held (and its time counted) while a call waits, so a
long run must go on in the background and be waited for in calls of their own. A hand-made loop that looked for
the run's process with ``pgrep -f`` matched its own command line and held the device for minutes after the run had
ended. These tests pin what ``wait`` relies on instead: the status file the background run writes last. The
bench itself is a stand-in interpreter (``PY``) that sleeps and exits as told; nothing here needs the device.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

import pytest

pytestmark = pytest.mark.unit

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "bench" / "device-bench.sh"

# Stands in for python3: the script's version probe (``-c``) answers at once; the bench run prints its arguments,
# sleeps FAKE_SLEEP seconds and exits with FAKE_RC.
FAKE_PY = """#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "fake python 3.12"; exit 0; fi
echo "fake bench: $*"
sleep "${FAKE_SLEEP:-0}"
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def device(tmp_path: pathlib.Path) -> dict[str, str]:
    """An unpacked device state (its ``ready`` file) in ``tmp_path``, and the environment that points at it."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "ready").write_text("2026-12-06T00:00:00Z\n")
    py = tmp_path / "python3"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "RFBENCH_STATE": str(state), "PY": str(py), "OUT": str(out)}
    return env


def _call(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env={**env, **extra}, capture_output=True, text=True, timeout=60, check=False
    )


def test_wait_returns_when_the_run_ends_and_brings_back_what_it_wrote(device: dict[str, str]) -> None:
    started = _call(device, "start", "big", "--sizes", "4096", FAKE_SLEEP="2")
    assert started.returncode == 0, started.stderr
    assert "started big" in started.stdout

    t0 = time.monotonic()
    waited = _call(device, "wait", "big", "30")
    # It returned on the status file, well before its 30 s, and says how the run ended.
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert time.monotonic() - t0 < 20
    assert "run big ended: rc=0" in waited.stdout
    log = pathlib.Path(device["OUT"]) / "big" / "bench.log"
    assert "fake bench: bench/rollout_overhead.py --sizes 4096" in log.read_text()


def test_wait_gives_up_after_its_seconds_and_says_to_call_again(device: dict[str, str]) -> None:
    assert _call(device, "start", "slow", FAKE_SLEEP="6").returncode == 0
    early = _call(device, "wait", "slow", "1")
    assert early.returncode == 75
    assert "still going" in early.stdout
    # A second start of a run still going is refused: it would delete what the first one is writing.
    again = _call(device, "start", "slow")
    assert again.returncode == 1
    assert "still going" in again.stderr
    late = _call(device, "wait", "slow", "30")
    assert late.returncode == 0
    assert "run slow ended: rc=0" in late.stdout


def test_a_failed_bench_is_waited_for_with_its_exit_status(device: dict[str, str]) -> None:
    assert _call(device, "start", "bad", FAKE_RC="3").returncode == 0
    waited = _call(device, "wait", "bad", "30")
    assert waited.returncode == 3
    assert "run bad ended: rc=3" in waited.stdout


def test_start_needs_an_unpacked_device_and_wait_a_known_run(device: dict[str, str], tmp_path: pathlib.Path) -> None:
    assert _call(device, "wait", "nothing").returncode == 2
    assert _call(device, "start", "../escape").returncode == 2
    (tmp_path / "state" / "ready").unlink()
    refused = _call(device, "start", "cold")
    assert refused.returncode == 1
    assert "not unpacked" in refused.stderr
