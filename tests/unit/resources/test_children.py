"""Golden tests of the manifests a fleet renders, and the parity flags in the engine command.

Regenerate the golden files after an intended change with ``ROLLOUTFLEET_UPDATE_GOLDEN=1`` and review
the diff like code.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest
import yaml

from rolloutfleet.api import validation, vllm_flags
from rolloutfleet.api.fleet import RolloutFleetSpec
from rolloutfleet.resources import children, command

GOLDEN = pathlib.Path(__file__).parent / "golden"
OWNER = children.Owner(name="policy", namespace="rl", uid="0b7c6f1e-uid")

FLEETS: dict[str, dict[str, Any]] = {
    "minimal": {
        "image": "vllm-rolloutfleet:0.33.0",
        "verifier": {"path": "/weights/policy/step-0"},
        "weights": {"claimName": "ckpt", "allowedRoots": ["/weights/policy"]},
    },
    "eagle-coupdate": {
        "image": "vllm-rolloutfleet:0.33.0",
        "replicas": 8,
        "verifier": {"path": "/weights/policy/step-0/verifier", "servedModelName": "policy-7b"},
        "draft": {"method": "eagle", "path": "/weights/policy/step-0/draft", "numSpeculativeTokens": 4},
        "weights": {"claimName": "ckpt", "allowedRoots": ["/weights/policy"]},
        "updateStrategy": {"rollout": "Rolling", "maxUnavailable": "25%"},
        "network": {"clientPodSelector": {"app": "trainer"}, "clientNamespaceSelector": {"team": "rl"}},
    },
    "tp4-frozen-custom-parity": {
        "image": "vllm-rolloutfleet:0.33.0",
        "replicas": 2,
        "gpusPerPod": 4,
        "tensorParallelSize": 4,
        "verifier": {"path": "/ckpt/llama-70b/base"},
        "draft": {
            "method": "draft_model",
            "path": "/ckpt/llama-1b/draft",
            "policy": "frozen",
            "numSpeculativeTokens": 5,
        },
        "weights": {
            "claimName": "ckpt-70b",
            "mountPath": "/ckpt",
            "allowedRoots": ["/ckpt/llama-70b", "/ckpt/llama-1b"],
        },
        "updateStrategy": {"mode": "inflight"},
        "parity": {"prefixCaching": "ResetOnUpdate", "batchInvariant": True, "fp32LmHead": False},
        "extraArgs": ["--max-model-len=32768", "--gpu-memory-utilization", "0.85"],
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "resources": {"requests": {"cpu": 16, "memory": "256Gi"}},
        "scheduling": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "rl-rollouts",
        },
    },
}


def spec_of(name: str) -> RolloutFleetSpec:
    spec, errors = validation.parse_fleet_spec(FLEETS[name])
    assert spec is not None, errors
    assert validation.validate_fleet(spec) == []
    return spec


@pytest.mark.parametrize("name", sorted(FLEETS))
def test_golden_manifests(name: str) -> None:
    rendered = children.build_children(OWNER, spec_of(name), operator_namespace="rolloutfleet-system")
    text = yaml.safe_dump_all(rendered, sort_keys=True)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("ROLLOUTFLEET_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.read_text() == text, f"{path.name} differs; regenerate with ROLLOUTFLEET_UPDATE_GOLDEN=1 and review"


PARITY_SPELLINGS = [
    vllm_flags.LOGPROBS_MODE,
    vllm_flags.NO_ENABLE_PREFIX_CACHING,
    vllm_flags.ENABLE_PREFIX_CACHING,
    vllm_flags.NO_ASYNC_SCHEDULING,
    vllm_flags.ASYNC_SCHEDULING,
    vllm_flags.HF_OVERRIDES,
]


@pytest.mark.parametrize("name", sorted(FLEETS))
def test_each_parity_flag_exactly_once(name: str) -> None:
    spec = spec_of(name)
    args = [vllm_flags.flag_name(a) for a in command.engine_args(spec)]
    caching = [a for a in args if a in (vllm_flags.NO_ENABLE_PREFIX_CACHING, vllm_flags.ENABLE_PREFIX_CACHING)]
    scheduling = [a for a in args if a in (vllm_flags.NO_ASYNC_SCHEDULING, vllm_flags.ASYNC_SCHEDULING)]
    assert args.count(vllm_flags.LOGPROBS_MODE) == 1
    assert len(caching) == 1 and len(scheduling) == 1
    assert args.count(vllm_flags.HF_OVERRIDES) == (1 if spec.parity.fp32_lm_head else 0)
    for flag in (vllm_flags.PORT, vllm_flags.WORKER_EXTENSION_CLS, vllm_flags.MIDDLEWARE, vllm_flags.SERVED_MODEL_NAME):
        assert args.count(flag) == 1


def test_default_profile_renders_rl_parity() -> None:
    args = command.engine_args(spec_of("minimal"))
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--no-enable-prefix-caching" in args and "--no-async-scheduling" in args
    assert json.loads(args[args.index("--hf-overrides") + 1]) == {"head_dtype": "float32"}
    assert "--enable-sleep-mode" in args
    assert "--speculative-config" not in args


def test_profile_off_renders_no_parity_flags() -> None:
    raw = dict(FLEETS["minimal"], parity={"enabled": False}, extraArgs=["--enable-prefix-caching"])
    spec, _ = validation.parse_fleet_spec(raw)
    assert spec is not None
    args = command.engine_args(spec)
    assert [a for a in args if vllm_flags.flag_name(a) in PARITY_SPELLINGS] == ["--enable-prefix-caching"]


def test_speculative_config_and_draft_env() -> None:
    spec = spec_of("tp4-frozen-custom-parity")
    args = command.engine_args(spec)
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config == {"method": "draft_model", "model": "/ckpt/llama-1b/draft", "num_speculative_tokens": 5}
    env = {e["name"]: e["value"] for e in command.engine_env(spec)}
    assert env["ROLLOUTFLEET_DRAFT_POLICY"] == "frozen" and env["VLLM_BATCH_INVARIANT"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--enable-sleep-mode" not in args  # inflight mode never sleeps


def test_weights_only_changes_keep_the_pod_template() -> None:
    """A fleet's strategy knobs do not restart pods; image or engine args do."""
    base = children.build_statefulset(OWNER, spec_of("minimal"))
    tweaked_raw = dict(FLEETS["minimal"], updateStrategy={"maxConcurrentLoads": 3, "canary": 1, "maxRetries": 5})
    tweaked, _ = validation.parse_fleet_spec(tweaked_raw)
    assert tweaked is not None
    same = children.build_statefulset(OWNER, tweaked)
    assert same["spec"]["template"] == base["spec"]["template"]
    new_image, _ = validation.parse_fleet_spec(dict(FLEETS["minimal"], image="vllm-rolloutfleet:0.33.1"))
    assert new_image is not None
    assert children.build_statefulset(OWNER, new_image)["spec"]["template"] != base["spec"]["template"]


def test_children_are_owned_and_labelled() -> None:
    for manifest in children.build_children(OWNER, spec_of("minimal"), None):
        meta = manifest["metadata"]
        assert meta["ownerReferences"][0]["uid"] == OWNER.uid and meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"]["rolloutfleet.io/fleet"] == "policy"
        assert "rolloutfleet.io/spec-hash" in meta["annotations"]


def test_weight_transfer_backend_reaches_the_engine() -> None:
    # Pushed revisions need vLLM started with the backend (the session routes refuse otherwise), and IPC
    # needs vLLM to unpickle the CUDA IPC handles it receives; a fleet without pushes gets neither.
    from rolloutfleet.resources import command

    ipc, errors = validation.parse_fleet_spec({**FLEETS["minimal"], "weightTransfer": {"backend": "ipc"}})
    assert ipc is not None, errors
    args = command.engine_args(ipc)
    assert args[args.index("--weight-transfer-config") + 1] == '{"backend":"ipc"}'
    assert {"name": "VLLM_ALLOW_INSECURE_SERIALIZATION", "value": "1"} in command.engine_env(ipc)
    plain = spec_of("minimal")
    assert "--weight-transfer-config" not in command.engine_args(plain)
    assert all(e["name"] != "VLLM_ALLOW_INSECURE_SERIALIZATION" for e in command.engine_env(plain))
