"""``sandbox down`` stops what the demo started beside the cluster (issue 21: after ``sandbox demo --keep``,
``down`` printed "no process left" while the demo's operator still ran against the stopped cluster).

No control plane needed: a cluster directory whose state records adopted processes only.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from rolloutfleet.sandbox import cluster, processes

pytestmark = pytest.mark.unit

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def exec_done(pid: int) -> bool:
    """The child runs the sleeper (between fork and exec it still shows the parent's command line)."""
    for _ in range(500):
        if processes.cmdline(pid)[1:2] == ["-c"]:
            return True
        time.sleep(0.01)
    return False


def test_stop_ends_adopted_processes_and_pids_lists_them(tmp_path: pathlib.Path) -> None:
    target = cluster.Cluster(tmp_path / "sandbox", name="adopt")
    target.directory.mkdir(parents=True)
    # Like the demo's operator: a session leader of its own group.
    leader, record = processes.spawn("operator", SLEEPER, tmp_path / "op.log", tie_to_parent=True)
    # Like the demo process itself under --keep: not a group leader, so only it may be signalled.
    plain = subprocess.Popen(SLEEPER)
    try:
        assert exec_done(leader.pid) and exec_done(plain.pid)
        target.adopt("operator", leader.pid, record.binary, record.log)
        target.adopt("demo", plain.pid, sys.executable, "(terminal)", group=False)
        assert {leader.pid, plain.pid} <= set(target.pids())

        target.stop(quiet=True)

        assert leader.wait(timeout=15) is not None and plain.wait(timeout=15) is not None
        assert not {leader.pid, plain.pid} & set(target.pids())
        assert not target.state_file.exists()
    finally:
        for proc in (leader, plain):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_process_never_signals_itself_when_it_stops_the_cluster(tmp_path: pathlib.Path) -> None:
    """``sandbox demo`` stops a kept cluster of the same name before it starts one: if it adopted itself
    earlier (a --keep demo), the stop must not kill the process doing it."""
    target = cluster.Cluster(tmp_path / "sandbox", name="self")
    target.directory.mkdir(parents=True)
    target.adopt_this_process("demo")
    target.stop(quiet=True)  # still here
    assert not target.state_file.exists()
