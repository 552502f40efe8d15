"""Run ``rolloutfleet run`` as a real subprocess for integration tests (start, SIGTERM/SIGKILL, logs)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess

from rolloutfleet.sandbox import operator_process as sandbox_operator


@dataclasses.dataclass
class OperatorProcess:
    """A running ``rolloutfleet run``; ``log()`` returns what it printed so far."""

    proc: subprocess.Popen[bytes]
    log_path: pathlib.Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_operator(
    kubeconfig: pathlib.Path,
    log_path: pathlib.Path,
    extra_env: dict[str, str] | None = None,
    namespaces: list[str] | None = None,
) -> OperatorProcess:
    env = {"ROLLOUTFLEET_IDLE_SECONDS": "5", **(extra_env or {})}
    return OperatorProcess(sandbox_operator.start(kubeconfig, log_path, env=env, namespaces=namespaces), log_path)


def stop_operator(op: OperatorProcess, sig: int = signal.SIGTERM) -> None:
    if op.proc.poll() is None:
        os.killpg(op.proc.pid, sig)
        try:
            op.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(op.proc.pid, signal.SIGKILL)
            op.proc.wait(timeout=10)
