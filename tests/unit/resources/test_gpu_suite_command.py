"""The GPU suite starts vLLM from the command line the operator renders, for every variant it runs.

The GPU tier (tests/gpu, on the lent H200 only) is the proof that every flag the operator puts in a
StatefulSet works on real vLLM; that holds only while the suite's servers run the rendered command. These
checks run in CI: each server variant the suite starts (the session's, the bf16-head one of the parity
test, EAGLE-3, the IPC push backend) must be a spec the operator's own model accepts, and the command
must differ from the StatefulSet's container only by the loopback rewrite (port value, ``--host``) and
the token file's local path.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from rolloutfleet.resources import children, command

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "gpu"))
import gpu_support

pytestmark = pytest.mark.unit

VARIANTS = {
    "session": {},
    "bf16-head": {"head_dtype": None},
    "eagle3": {"spec_method": "eagle3"},
    "ipc-push": {"transfer_backend": "ipc"},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_suite_runs_the_rendered_container(variant: str, tmp_path: pathlib.Path) -> None:
    verifier, draft = str(tmp_path / "rev" / "verifier_a"), str(tmp_path / "rev" / "draft_a")
    spec = gpu_support.fleet_spec(verifier, draft, gpu_memory_utilization=0.2, **VARIANTS[variant])
    token = tmp_path / "token"
    cmd, env = gpu_support.serve_command(spec, 4242, token)

    owner = children.Owner(name="gpu-suite", namespace="default", uid="00000000-0000-0000-0000-000000000000")
    container = children.build_statefulset(owner, spec)["spec"]["template"]["spec"]["containers"][0]
    assert cmd[-2:] == ["--host", "127.0.0.1"]
    served = cmd[cmd.index("serve") + 1 : -2]
    expected = list(container["args"])
    expected[expected.index("--port") + 1] = "4242"
    assert served == expected
    rendered = {e["name"]: e["value"] for e in container["env"]}
    assert env == {**rendered, command.ENV_TOKEN_FILE: str(token)}


def test_the_variants_reach_the_flags_they_exist_for(tmp_path: pathlib.Path) -> None:
    # Without these the variants would run the session's server under another name.
    def served(**kwargs: object) -> str:
        spec = gpu_support.fleet_spec(str(tmp_path / "v"), str(tmp_path / "d"), gpu_memory_utilization=0.2, **kwargs)
        return " ".join(gpu_support.serve_command(spec, 1, tmp_path / "t")[0])

    assert '"head_dtype":"float32"' in served() and "head_dtype" not in served(head_dtype=None)
    assert '"method":"eagle3"' in served(spec_method="eagle3")
    assert '--weight-transfer-config {"backend":"ipc"}' in served(transfer_backend="ipc")
    assert "--enable-sleep-mode" in served()
