"""The one table of vLLM command-line flags and environment variables the operator renders.

Imported by ``resources`` (to render the engine command) and ``validation`` (to refuse extra args and
env that override the operator or contradict the parity profile). vLLM renames flags between releases:
change them here, nowhere else. Names follow vLLM 0.33 (``vllm serve --help``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

PORT = "--port"
SERVED_MODEL_NAME = "--served-model-name"
TENSOR_PARALLEL_SIZE = "--tensor-parallel-size"
WORKER_EXTENSION_CLS = "--worker-extension-cls"
MIDDLEWARE = "--middleware"
ENABLE_SLEEP_MODE = "--enable-sleep-mode"
SPECULATIVE_CONFIG = "--speculative-config"
LOGPROBS_MODE = "--logprobs-mode"
ENABLE_PREFIX_CACHING = "--enable-prefix-caching"
NO_ENABLE_PREFIX_CACHING = "--no-enable-prefix-caching"
ASYNC_SCHEDULING = "--async-scheduling"
NO_ASYNC_SCHEDULING = "--no-async-scheduling"
HF_OVERRIDES = "--hf-overrides"
MODEL = "--model"
API_KEY = "--api-key"
CONFIG = "--config"
WEIGHT_TRANSFER_CONFIG = "--weight-transfer-config"

ENV_DEV_MODE = "VLLM_SERVER_DEV_MODE"
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
ENV_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ENV_API_KEY = "VLLM_API_KEY"
# vLLM unpickles the CUDA IPC handles a trainer sends over HTTP only with this set (IPC backend only).
ENV_INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"

WORKER_EXTENSION = "rolloutfleet_worker.extension.RolloutFleetExtension"
AUTH_MIDDLEWARE = "rolloutfleet_worker.auth.ControlAuthMiddleware"

# Flags the operator always owns: an extra arg naming one of them is refused whatever the profile says,
# because the operator's own value would be silently duplicated or overridden.
# `--model` too: the model is the positional verifier path, and a second spelling would only confuse.
OPERATOR_OWNED = frozenset(
    {
        PORT,
        SERVED_MODEL_NAME,
        TENSOR_PARALLEL_SIZE,
        WORKER_EXTENSION_CLS,
        MIDDLEWARE,
        SPECULATIVE_CONFIG,
        ENABLE_SLEEP_MODE,
        MODEL,
        WEIGHT_TRANSFER_CONFIG,  # from spec.weightTransfer: the operator opens the sessions it configures
    }
)

# Flags refused whatever the spec says, with the reason shown to the user.
REFUSED: dict[str, str] = {
    API_KEY: "vLLM would then require a key on /v1, where the operator's parity probe sends generation "
    "requests without one; reach the engines through spec.network instead",
    CONFIG: "a config file can set the operator's own flags where validation cannot see them; "
    "list the flags in spec.extraArgs instead",
}

# vLLM's short aliases (``vllm/engine/arg_utils.py``), so ``-tp 2`` is read as --tensor-parallel-size.
SHORT_ALIASES: dict[str, str] = {
    "-tp": TENSOR_PARALLEL_SIZE,
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-q": "--quantization",
}

# vLLM's HTTP server closes a connection idle for this many seconds (its uvicorn's timeout_keep_alive; default
# 5). A fleet may raise it through spec.env: the operator then keeps its connections to the engines that much
# longer (``http_keep_alive_seconds``), instead of opening one again after each wait of more than 4 s.
ENV_HTTP_KEEP_ALIVE = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
HTTP_KEEP_ALIVE_DEFAULT = 5
HTTP_KEEP_ALIVE_MAX = 3600


def valid_keep_alive(raw: str) -> bool:
    """Whole seconds, 1 to ``HTTP_KEEP_ALIVE_MAX``, in ASCII digits (the CRD's CEL rule says the same)."""
    return re.fullmatch(r"[0-9]{1,4}", raw) is not None and 1 <= int(raw) <= HTTP_KEEP_ALIVE_MAX


def http_keep_alive_seconds(env: Mapping[str, str]) -> int:
    """The engines' keep-alive in seconds from the engine container's extra env (vLLM's default without it,
    or with a value validation refuses)."""
    raw = env.get(ENV_HTTP_KEEP_ALIVE)
    return int(raw) if raw is not None and valid_keep_alive(raw) else HTTP_KEEP_ALIVE_DEFAULT


# Environment the operator sets itself or that opens the engine up; refused in spec.env.
OPERATOR_ENV_PREFIX = "ROLLOUTFLEET_"
# The worker's loader knobs (worker_image/README.md): users tune them through spec.env (docs/install.md),
# the operator never sets them. Every other ROLLOUTFLEET_* name is the operator's (e.g. the control token
# file, the draft policy, ROLLOUTFLEET_WEIGHT_ROOTS, which confines loads to the allowed roots).
USER_ENV_PREFIXES = ("ROLLOUTFLEET_LOAD_",)
USER_ENV_NAMES = frozenset({"ROLLOUTFLEET_HASH_THREADS"})
REFUSED_ENV: dict[str, str] = {
    ENV_DEV_MODE: "is set by the operator from the spec (the control routes need it)",
    ENV_RUNTIME_LORA: "is refused: it opens /v1/load_lora_adapter and /v1/unload_lora_adapter, which stay "
    "unauthenticated (every /v1 route is open to clients); load adapters at start with --lora-modules",
    ENV_API_KEY: "is refused: it is vLLM's --api-key, and the operator's parity probe calls /v1 without a key",
    ENV_INSECURE_SERIALIZATION: "is set by the operator for spec.weightTransfer.backend ipc only (it lets "
    "vLLM unpickle what a control route receives)",
}


@dataclasses.dataclass(frozen=True)
class ParityFlag:
    """A flag the parity profile pins, and the extra-arg spellings that would contradict it."""

    name: str
    contradicted_by: frozenset[str]
    why: str


# Every flag the parity profile controls, with the spellings of the opposite setting.
PARITY_FLAGS: tuple[ParityFlag, ...] = (
    ParityFlag(LOGPROBS_MODE, frozenset({LOGPROBS_MODE}), "RL consumes processed logprobs; the profile sets the mode"),
    ParityFlag(
        NO_ENABLE_PREFIX_CACHING,
        frozenset({ENABLE_PREFIX_CACHING, NO_ENABLE_PREFIX_CACHING}),
        "prefix caching is set by spec.parity.prefixCaching (a cache must never serve KV of old weights)",
    ),
    ParityFlag(
        NO_ASYNC_SCHEDULING,
        frozenset({ASYNC_SCHEDULING, NO_ASYNC_SCHEDULING}),
        "async scheduling is set by spec.parity.asyncScheduling",
    ),
    ParityFlag(HF_OVERRIDES, frozenset({HF_OVERRIDES}), "the profile sets hf-overrides (fp32 lm_head)"),
)


def flag_name(arg: str) -> str:
    """The flag an argument names as vLLM's parser reads it; values (and negative numbers) unchanged.

    vLLM's ``FlexibleArgumentParser`` takes ``--a_b`` for ``--a-b``, ``--a=v``, ``--json-arg.key=v`` for
    one key of a JSON flag, and the short aliases above: ``--tensor_parallel_size=2`` and ``-tp=2`` both
    come back as ``--tensor-parallel-size``.
    """
    if not arg.startswith("-") or _is_number(arg):
        return arg
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].split(".", 1)[0].replace("_", "-")
    if name in SHORT_ALIASES:
        return SHORT_ALIASES[name]
    for alias, long in SHORT_ALIASES.items():  # a one-letter option with its value attached: -qfp8
        if len(alias) == 2 and name.startswith(alias):
            return long
    return name


def names_flag(arg: str, flag: str) -> bool:
    """Whether vLLM would read ``arg`` as ``flag`` (a long flag), or as its ``--no-`` negation.

    Besides the spellings ``flag_name`` folds, argparse accepts a unique prefix (``--tensor-parallel``).
    Whether a prefix is unique depends on every flag of the vLLM in the image, so any prefix is taken as
    naming the flag: a prefix that is ambiguous fails vLLM's own parsing anyway, so refusing it here only
    moves the error earlier.
    """
    name = flag_name(arg)
    if not name.startswith("-") or len(name) < 2:
        return False
    if not name.startswith("--"):
        return any(long == flag and alias.startswith(name) for alias, long in SHORT_ALIASES.items())
    spellings = (flag, "--no-" + flag[2:])
    return len(name) > 2 and any(spelling.startswith(name) for spelling in spellings)


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True
