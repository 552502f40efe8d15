"""examples/trainer_loop.py end to end: three training steps on CPU, each checkpoint published to a fleet
of simulated engines on the real control plane; the fleet ends on revision 3 and completions are stamped
with it."""

from __future__ import annotations

import json
import pathlib
import urllib.request
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import GROUP, VERSION, eventually, get_fleet, run_example
from publish_support import FLEET, live_fleet
from sim_harness import FollowerThread

pytestmark = pytest.mark.integration
__all__ = ["live_fleet"]  # the fixture, imported from publish_support


def test_trainer_loop_three_steps(
    live_fleet: tuple[FollowerThread, pathlib.Path],
    k8s_api: client.ApiClient,
    namespace: str,
    kubeconfig_path: pathlib.Path,
) -> None:
    _, root = live_fleet
    api = client.CustomObjectsApi(k8s_api)
    pods = eventually(
        lambda: [p for p in get_fleet(api, namespace, FLEET)["status"].get("pods", []) if p.get("ip")],
        timeout=30,
        what="pod IPs in the fleet status",
    )
    engine_url = f"http://{pods[-1]['ip']}:8000"
    lines = run_example(
        "trainer_loop.py",
        *("--kubeconfig", str(kubeconfig_path), "--namespace", namespace, "--fleet", FLEET),
        *("--weights-root", str(root / "policy"), "--steps", "3", "--engine-url", engine_url, "--timeout", "120"),
        timeout=400,
    )
    assert len(lines) == 3, lines
    assert "completion stamped ['3']" in lines[-1]
    assert get_fleet(api, namespace, FLEET)["status"]["currentRevision"] == 3
    final = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", f"{FLEET}-r3")
    assert final["status"]["phase"] == "Succeeded"
    assert (root / "policy" / FLEET / "step-3" / "verifier" / "model.safetensors").is_file()
    # Every pod, not just the one the example asked, serves revision 3 (the stamp is set per engine).
    for pod in pods:
        out = _complete(f"http://{pod['ip']}:8000")
        assert {str(s["version"]) for s in out["choices"][0]["weight_versions"]} == {"3"}, out


def _complete(url: str) -> dict[str, Any]:
    body = json.dumps({"model": "policy", "prompt": "hi", "max_tokens": 4, "return_weight_versions": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result
