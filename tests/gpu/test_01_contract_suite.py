"""GPU tier (1): the engine contract suite (tests/contract) against the real vLLM of this session.

The same assertions CI runs against the simulator, unchanged, in a subprocess. The client feature-detects
vLLM 0.26's missing weight-version routes (404) and the contract fixture wakes by tag (a tag-less wake
after a weights-only wake kills a 0.26 engine), so every contract test must pass; the stamping test
skips itself where the engine has no weight versions. Outcomes and the full output go to the results dir.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

import gpu_support
import pytest

pytestmark = pytest.mark.gpu

STAMPING = {"test_weight_version_is_set_read_and_stamped"}


def run_contract(
    server: gpu_support.Server, weights: pathlib.Path, junit: pathlib.Path, log: pathlib.Path
) -> tuple[int, dict[str, dict[str, str]]]:
    """Run tests/contract against ``server``; returns (exit code, {test: {outcome, message}})."""
    here = pathlib.Path(__file__).resolve().parent
    env = {
        **os.environ,
        "ROLLOUTFLEET_CONTRACT_URL": server.url,
        "ROLLOUTFLEET_CONTRACT_TOKEN": server.token,
        "ROLLOUTFLEET_CONTRACT_WEIGHTS": str(weights),
        "PYTHONPATH": ":".join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "pytest", "tests/contract", "-m", "contract", "-rA", "-p", "no:cacheprovider"]
    cmd += ["--timeout", "60", "--junitxml", str(junit), "-o", "junit_family=xunit1"]
    proc = subprocess.run(cmd, cwd=gpu_support.REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    log.write_text(f"$ {' '.join(cmd)}\n(rc={proc.returncode})\n{proc.stdout}\n{proc.stderr}\n")
    outcomes: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "?")
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = ((node.get("message") or "") + "\n" + (node.text or ""))[-1500:]
        outcomes[name] = {"outcome": outcome, "message": message}
    return proc.returncode, outcomes


def test_contract_suite_on_real_vllm(
    server: gpu_support.Server,
    revisions: gpu_support.Revisions,
    results_dir: pathlib.Path,
    record: dict[str, Any],
    tmp_path: pathlib.Path,
) -> None:
    has_versions = gpu_support.route_status(server.url, server.token, "GET", "/weight_info") == 200
    record["engine_has_weight_version_routes"] = has_versions
    rc, outcomes = run_contract(server, revisions.root, tmp_path / "contract.xml", results_dir / "contract.log")
    record["contract"] = {"rc": rc, "tests": {k: v["outcome"] for k, v in outcomes.items()}}
    bad = {k for k, v in outcomes.items() if v["outcome"] in ("failed", "error")}
    record["contract_failures"] = {k: outcomes[k]["message"][-800:] for k in bad}
    assert outcomes, "the contract suite collected nothing"
    assert not bad, {k: outcomes[k]["message"][-600:] for k in bad}
    if not has_versions:
        assert all(outcomes[k]["outcome"] == "skipped" for k in STAMPING if k in outcomes)
