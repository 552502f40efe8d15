"""``rolloutfleet run`` without cluster credentials exits at once with one clear line.

kopf alone logs the login failure and retries its startup every minute, forever: an operator container
started without a kubeconfig or a ServiceAccount token never exited and never crash-looped (found
building the operator image). The operator checks for credentials before it starts kopf.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def _run(tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return subprocess.run(
        [sys.executable, "-m", "rolloutfleet.cli", "run", "--standalone", "--liveness", ""],
        env={**base, "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_no_credentials_at_all(tmp_path: pathlib.Path) -> None:
    out = _run(tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("rolloutfleet run: no cluster credentials")
    assert "KUBECONFIG" in lines[0]


def test_a_kubeconfig_that_is_not_there(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nowhere" / "kubeconfig"
    out = _run(tmp_path, KUBECONFIG=str(missing))
    assert out.returncode == 2
    assert str(missing) in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
