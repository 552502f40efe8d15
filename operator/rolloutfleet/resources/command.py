"""Render the vLLM command line and environment of an engine from a fleet spec.

Called by ``children.build_statefulset``. Flag spellings come from ``api.vllm_flags`` only. The parity
profile's flags appear exactly once each; extra args are appended last (validation has already refused
any that would contradict the profile or an operator-owned flag).
"""

from __future__ import annotations

import json

from rolloutfleet.api import fleet
from rolloutfleet.api import vllm_flags as flags
from rolloutfleet.api.fleet import DraftMethod, PrefixCaching, RolloutFleetSpec
from rolloutfleet.resources import labels

# Env the worker extension reads (see worker_image/rolloutfleet_worker).
ENV_DRAFT_POLICY = "ROLLOUTFLEET_DRAFT_POLICY"
ENV_DRAFT_PATH = "ROLLOUTFLEET_DRAFT_PATH"
ENV_TOKEN_FILE = "ROLLOUTFLEET_CONTROL_TOKEN_FILE"  # noqa: S105 - a variable name, not a secret
# The directories the extension may load from (':'-separated, the pods are Linux): the engine enforces the
# fleet's allowedRoots itself, on the files it opens, so a token alone does not open the whole volume.
ENV_WEIGHT_ROOTS = "ROLLOUTFLEET_WEIGHT_ROOTS"


def speculative_config(spec: RolloutFleetSpec) -> dict[str, object] | None:
    """vLLM's ``--speculative-config`` payload, or None without a draft."""
    draft = spec.draft
    if draft.method == DraftMethod.NONE:
        return None
    config: dict[str, object] = {"method": draft.method.value, "num_speculative_tokens": draft.num_speculative_tokens}
    if draft.path is not None:
        config["model"] = draft.path
    return config


def weight_transfer_config(spec: RolloutFleetSpec) -> dict[str, object] | None:
    """vLLM's ``--weight-transfer-config`` payload, or None when the fleet takes no pushed revisions."""
    transfer = spec.weight_transfer
    if transfer is None:
        return None
    return {"backend": transfer.backend.value}


def parity_args(spec: RolloutFleetSpec) -> list[str]:
    """The RL parity profile's flags (empty when the profile is off)."""
    parity = spec.parity
    if not parity.enabled:
        return []
    args = [flags.LOGPROBS_MODE, parity.logprobs_mode.value]
    args.append(
        flags.NO_ENABLE_PREFIX_CACHING
        if parity.prefix_caching == PrefixCaching.DISABLED
        else flags.ENABLE_PREFIX_CACHING
    )
    args.append(flags.ASYNC_SCHEDULING if parity.async_scheduling else flags.NO_ASYNC_SCHEDULING)
    if parity.fp32_lm_head:
        args += [flags.HF_OVERRIDES, json.dumps({"head_dtype": "float32"}, separators=(",", ":"))]
    return args


def engine_args(spec: RolloutFleetSpec) -> list[str]:
    """Arguments after ``vllm serve``: the model path first, then flags."""
    args = [
        spec.verifier.path,
        flags.PORT,
        str(spec.port),
        flags.SERVED_MODEL_NAME,
        spec.verifier.served_model_name,
        flags.TENSOR_PARALLEL_SIZE,
        str(spec.tensor_parallel_size),
        flags.WORKER_EXTENSION_CLS,
        flags.WORKER_EXTENSION,
        flags.MIDDLEWARE,
        flags.AUTH_MIDDLEWARE,
    ]
    if fleet.sleep_mode_enabled(spec):
        args.append(flags.ENABLE_SLEEP_MODE)
    config = speculative_config(spec)
    if config is not None:
        args += [flags.SPECULATIVE_CONFIG, json.dumps(config, separators=(",", ":"), sort_keys=True)]
    transfer = weight_transfer_config(spec)
    if transfer is not None:
        args += [flags.WEIGHT_TRANSFER_CONFIG, json.dumps(transfer, separators=(",", ":"), sort_keys=True)]
    args += parity_args(spec)
    args += spec.extra_args
    return args


def weight_roots(spec: RolloutFleetSpec) -> list[str]:
    """Where engines may load from: the allowed roots, plus the initial checkpoints (revision 0 and a frozen
    draft live wherever the fleet spec says, and a rollback to them must load)."""
    roots = list(spec.weights.allowed_roots)
    for path in (spec.verifier.path, spec.draft.path):
        if path is not None and not any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots):
            roots.append(path)
    return roots


def engine_env(spec: RolloutFleetSpec) -> list[dict[str, str]]:
    """Container environment: dev-mode routes, token file, draft policy, parity env, then the user's."""
    env = [
        {"name": flags.ENV_DEV_MODE, "value": "1"},
        {"name": ENV_TOKEN_FILE, "value": f"{labels.TOKEN_MOUNT_DIR}/{labels.TOKEN_KEY}"},
        {"name": ENV_DRAFT_POLICY, "value": spec.draft.policy.value},
        {"name": ENV_WEIGHT_ROOTS, "value": ":".join(weight_roots(spec))},
    ]
    if spec.draft.path is not None:
        env.append({"name": ENV_DRAFT_PATH, "value": spec.draft.path})
    if spec.parity.enabled and spec.parity.batch_invariant:
        env.append({"name": flags.ENV_BATCH_INVARIANT, "value": "1"})
    if spec.weight_transfer is not None and spec.weight_transfer.backend == fleet.TransferBackend.IPC:
        env.append({"name": flags.ENV_INSECURE_SERIALIZATION, "value": "1"})
    env += [{"name": e.name, "value": e.value} for e in spec.env]
    return env
