"""``planning.pod_readiness.incarnation``: which engine process a pod runs, as the pod shows it.

The fleet status drops what it read of an engine once its pod's incarnation changed, and a fleet at rest reads
its engines again only then (docs/rollouts.md, "A fleet at rest"): so every restart and every replacement must
change it, and nothing else the kubelet reports may.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.planning import pod_readiness

pytestmark = pytest.mark.unit


def _pod(uid: str = "u-1", restarts: tuple[int, ...] = (0,)) -> dict[str, Any]:
    return {
        "metadata": {"name": "policy-0", "uid": uid},
        "status": {
            "phase": "Running",
            "podIP": "127.1.0.1",
            "containerStatuses": [{"name": f"c{i}", "restartCount": n, "ready": True} for i, n in enumerate(restarts)],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_a_restart_or_a_replacement_changes_the_incarnation() -> None:
    base = pod_readiness.incarnation(_pod())
    assert pod_readiness.incarnation(_pod(restarts=(1,))) != base  # the kubelet restarted the container
    assert pod_readiness.incarnation(_pod(uid="u-2")) != base  # recreated under the same name
    two = pod_readiness.incarnation(_pod(restarts=(0, 0)))
    assert pod_readiness.incarnation(_pod(restarts=(0, 1))) != two  # a sidecar's restart counts too


def test_readiness_and_probe_changes_leave_the_incarnation_alone() -> None:
    pod = _pod()
    flapped = copy.deepcopy(pod)
    flapped["status"]["containerStatuses"][0]["ready"] = False
    flapped["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    assert pod_readiness.incarnation(flapped) == pod_readiness.incarnation(pod)
    bare: dict[str, Any] = {"metadata": {"uid": "u-1"}, "status": {}}  # no container status yet
    assert pod_readiness.incarnation(bare) != pod_readiness.incarnation(_pod(restarts=(1,)))
