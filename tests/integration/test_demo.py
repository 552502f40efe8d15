"""The README's first command, end to end: ``rolloutfleet sandbox demo`` on the local control plane.

- It runs without torch (a stand-in that fails on import is first on the path of the demo and of the
  operator it starts): ``make demo`` installs no worker extra (issue "first run").
- ``sandbox demo --keep`` then ``sandbox down`` leaves no process: the demo's operator and the demo
  process itself (it serves the simulated engines) stop with the cluster.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from rolloutfleet.sandbox import cluster, processes

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]
NO_TORCH = pathlib.Path(__file__).parent / "sandbox_fixtures" / "no_torch"
NAME = "pytest-demo"


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(NO_TORCH), str(REPO / "operator"), str(REPO / "worker_image"), str(REPO / "digest")])
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return {**env, "PYTHONPATH": path}


def _sandbox(command: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``rolloutfleet sandbox COMMAND --name NAME`` without torch on the path."""
    argv = [sys.executable, "-m", "rolloutfleet.cli", "sandbox", command, "--name", NAME]
    return subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def demo_cluster() -> Iterator[cluster.Cluster]:
    target = cluster.Cluster.named(NAME)
    yield target
    target.stop(quiet=True)


def test_the_demo_runs_its_three_revisions_without_torch(demo_cluster: cluster.Cluster) -> None:
    # The cluster's directory (and its operator log) outlives a run on the same machine: only what this run
    # appends is this run's (a traceback of an earlier run, fixed since, failed every run after it).
    log_path = demo_cluster.directory / "logs" / "operator.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    out = _sandbox("demo", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "nothing left running" in out.stdout
    with log_path.open("rb") as f:
        f.seek(start if log_path.stat().st_size >= start else 0)  # (a log started afresh: all of it)
        log = f.read().decode(errors="replace")
    assert "event loop:" in log  # this run's operator did log here
    assert "imported torch" not in log and "Traceback" not in log, log[-3000:]
    assert not demo_cluster.pids()


def test_down_after_a_kept_demo_leaves_no_process(demo_cluster: cluster.Cluster) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "rolloutfleet.cli", "sandbox", "demo", "--name", NAME, "--keep"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 600
        for line in demo.stdout:
            seen.append(line)
            if "kept running" in line or time.monotonic() > deadline:
                break
        assert any("kept running" in line for line in seen), "".join(seen[-40:])
        adopted = {r.name: r.pid for r in demo_cluster.adopted()}
        assert set(adopted) == {"operator", "demo"} and adopted["demo"] == demo.pid

        down = _sandbox("down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "no process left" in down.stdout
        assert demo.wait(timeout=30) is not None  # the demo process itself was stopped
        assert not processes.cmdline(adopted["operator"])  # and its operator
        assert not demo_cluster.pids()
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGKILL)
            demo.wait()
