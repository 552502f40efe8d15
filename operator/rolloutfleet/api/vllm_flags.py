"""The one table of vLLM command-line flags and environment variables the operator renders.

Imported by ``resources`` (to render the engine command) and ``validation`` (to refuse extra args that
contradict the parity profile). vLLM renames flags between releases: change them here, nowhere else.
Names follow vLLM 0.33 (``vllm serve --help``).
"""

from __future__ import annotations

import dataclasses

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

ENV_DEV_MODE = "VLLM_SERVER_DEV_MODE"
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"

WORKER_EXTENSION = "rolloutfleet_worker.extension.RolloutFleetExtension"
AUTH_MIDDLEWARE = "rolloutfleet_worker.auth.ControlAuthMiddleware"

# Flags the operator always owns: an extra arg naming one of them is refused whatever the profile says,
# because the operator's own value would be silently duplicated or overridden.
OPERATOR_OWNED = frozenset(
    {PORT, SERVED_MODEL_NAME, TENSOR_PARALLEL_SIZE, WORKER_EXTENSION_CLS, MIDDLEWARE, SPECULATIVE_CONFIG}
)


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
    """The flag part of an argument: ``--a=b`` → ``--a``; positional values come back unchanged."""
    return arg.split("=", 1)[0] if arg.startswith("--") else arg
