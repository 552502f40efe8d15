"""``rolloutfleet run`` as a subprocess against a kubeconfig that names an unreachable API server: for the tests
of what the operator checks before kopf starts (``handlers.commands.run``)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping

COMMAND = (sys.executable, "-m", "rolloutfleet.cli", "run", "--standalone", "--liveness", "")


def environment(tmp_path: pathlib.Path, extra: Mapping[str, str], drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment with a kubeconfig of its own (and ``drop`` removed): credentials that parse,
    for a server nothing listens on."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", *drop)}
    return {**base, "KUBECONFIG": str(kubeconfig), **extra}


def refused_line(tmp_path: pathlib.Path, extra: Mapping[str, str], drop: tuple[str, ...] = ()) -> str:
    """Run the operator with ``extra`` in its environment; the one line it exits with (status 2) before kopf."""
    out = subprocess.run(
        COMMAND, env=environment(tmp_path, extra, drop), capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]
