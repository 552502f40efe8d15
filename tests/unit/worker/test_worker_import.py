"""The worker package imports where vLLM (and torch) cannot, and only adds prefixed names to the Worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rolloutfleet_worker.extension import RolloutFleetExtension

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_imports_without_vllm_torch_or_the_operator() -> None:
    # The worker image ships no operator package (worker_image/Dockerfile checks it on the built image):
    # everything vLLM loads must import with `rolloutfleet` absent, as well as torch and vLLM.
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['safetensors'] = None\n"
        "sys.modules['rolloutfleet'] = None\n"
        "import rolloutfleet_worker, rolloutfleet_worker.extension, rolloutfleet_worker.auth\n"
        "import rolloutfleet_worker.observation, rolloutfleet_digest\n"
        "assert 'vllm' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    env_path = f"{ROOT / 'worker_image'}:{ROOT / 'digest'}"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_extension_adds_only_prefixed_names() -> None:
    added = {n for n in vars(RolloutFleetExtension) if not (n.startswith("__") and n.endswith("__"))}
    assert added == {
        "rolloutfleet_load",
        "rolloutfleet_restore_draft",
        "rolloutfleet_state",
        "rolloutfleet_preflight",
        "rolloutfleet_push_begin",
        "rolloutfleet_push_end",
        "rolloutfleet_push_group",
        "rolloutfleet_stage",
        "rolloutfleet_unstage",
    }
