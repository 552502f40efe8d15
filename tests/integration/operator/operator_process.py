"""Run ``rolloutfleet run`` as a real subprocess for integration tests (start, SIGTERM/SIGKILL, logs)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]


@dataclasses.dataclass
class OperatorProcess:
    """A running ``rolloutfleet run``; ``log()`` returns what it printed so far."""

    proc: subprocess.Popen[bytes]
    log_path: pathlib.Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_operator(
    kubeconfig: pathlib.Path, log_path: pathlib.Path, extra_env: dict[str, str] | None = None
) -> OperatorProcess:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), ROLLOUTFLEET_RESYNC_SECONDS="2", PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    sink = log_path.open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutfleet.cli",
            "run",
            "--all-namespaces",
            "--standalone",
            "--metrics-port",
            "0",
            "--liveness",
            "",
        ],
        env=env,
        stdout=sink,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    return OperatorProcess(proc, log_path)


def stop_operator(op: OperatorProcess, sig: int = signal.SIGTERM) -> None:
    if op.proc.poll() is None:
        os.killpg(op.proc.pid, sig)
        try:
            op.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(op.proc.pid, signal.SIGKILL)
            op.proc.wait(timeout=10)
