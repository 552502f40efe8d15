"""Start ``rolloutfleet run`` as a child process against a local cluster (sandbox demo, tests, benches).

Called by ``sandbox.demo``, the integration fixtures and ``bench/``. The child watches every namespace,
runs standalone (no peering), logs to a file, and lives in its own session so it can be killed as a group.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys


def start(
    kubeconfig: pathlib.Path,
    log_path: pathlib.Path,
    *,
    env: dict[str, str] | None = None,
    metrics_port: int = 0,
) -> subprocess.Popen[bytes]:
    """The operator as a subprocess; fast resync settings unless ``env`` overrides them."""
    child_env = dict(
        os.environ,
        KUBECONFIG=str(kubeconfig),
        ROLLOUTFLEET_RESYNC_SECONDS="2",
        ROLLOUTFLEET_IDLE_SECONDS="1",
        PYTHONUNBUFFERED="1",
    )
    child_env.update(env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "rolloutfleet.cli", "run", "--all-namespaces", "--standalone"]
    command += ["--metrics-port", str(metrics_port), "--liveness", ""]
    with log_path.open("ab") as sink:  # the child keeps its own descriptor
        return subprocess.Popen(
            command,
            env=child_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
