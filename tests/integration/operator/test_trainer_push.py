"""examples/trainer_push.py end to end: two training steps on CPU, each pushed (no checkpoint written) to a
fleet of simulated engines on the real control plane through the operator's weight-transfer sessions;
completions are stamped with the last revision.

The fleet starts from checkpoints of the example's own model (``TinyLM``): an engine takes pushed tensors
only under the names and shapes of its model, as vLLM's ``load_weights`` does.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import GROUP, REPO, VERSION, eventually, fleet_manifest, get_fleet, run_example, weights_volume
from sim_harness import FollowerThread

pytestmark = pytest.mark.integration

FLEET = "tiny"


def initial_checkpoints(root: pathlib.Path) -> None:
    """The example's models at step 0, as the fleet's initial weights."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import torch
        from trainer_loop import TinyLM, save_checkpoint

        torch.manual_seed(0)
        save_checkpoint(TinyLM(hidden=32), root / "policy" / "step-0" / "verifier")
        save_checkpoint(TinyLM(hidden=16), root / "policy" / "step-0" / "draft")
    finally:
        sys.path.remove(str(REPO / "examples"))


@pytest.fixture
def push_fleet(
    operator_process: Any, k8s_api: client.ApiClient, namespace: str, tmp_path: pathlib.Path
) -> Iterator[pathlib.Path]:
    pytest.importorskip("torch")
    root = tmp_path / "weights"
    initial_checkpoints(root)
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, FLEET)
    api = client.CustomObjectsApi(k8s_api)
    body = fleet_manifest(
        FLEET,
        2,
        verifier={"path": str(root / "policy/step-0/verifier")},
        draft={"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
        weights={"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
        weightTransfer={"backend": "ipc"},
        updateStrategy={"maxRetries": 1, "timeouts": {"wakeSeconds": 5, "pushSeconds": 60}},
    )
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", body)
        eventually(
            lambda: (get_fleet(api, namespace, FLEET).get("status") or {}).get("readyReplicas") == 2,
            timeout=90,
            what="2 engines ready",
        )
        yield root
    finally:
        follower.stop()


def test_trainer_push_two_steps(
    push_fleet: pathlib.Path, k8s_api: client.ApiClient, namespace: str, kubeconfig_path: pathlib.Path
) -> None:
    lines = run_example(
        "trainer_push.py",
        *("--simulated", "--kubeconfig", str(kubeconfig_path), "--namespace", namespace, "--fleet", FLEET),
        *("--steps", "2", "--timeout", "120"),
        timeout=300,
    )
    assert len(lines) == 2 and "completion stamped ['2']" in lines[-1], lines
    status = get_fleet(client.CustomObjectsApi(k8s_api), namespace, FLEET)["status"]
    assert status["currentRevision"] == 2 and status["served"]["verifierPushed"]
    # Nothing was written to the weights volume: the revisions came from the trainer's memory.
    assert sorted(p.name for p in (push_fleet / "policy").iterdir()) == ["step-0"]
