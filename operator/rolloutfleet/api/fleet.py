"""The ``RolloutFleet`` custom resource: a fleet of vLLM GPU pods serving one policy (+ draft).

Imported by reconcile, resources, planning and ``crdgen``. Owns the spec/status vocabulary of a fleet;
the semantic rules that the schema cannot express live in ``validation``.
"""

from __future__ import annotations

import datetime
import enum
import re
from typing import Annotated, Any

import pydantic
from pydantic import ConfigDict, Field

from rolloutfleet.api import common, vllm_flags
from rolloutfleet.api.common import AbsolutePath, Condition, JsonDict, WireModel

KIND = "RolloutFleet"
PLURAL = "rolloutfleets"
SINGULAR = "rolloutfleet"
SHORT_NAMES = ["rfleet"]

# The fleet's name names its children (resources/labels.py): the StatefulSet `<name>`, whose pods carry the
# label `controller-revision-hash: <name>-<hash of up to 10 characters>` (a label value: at most 63), and
# the Services `<name>` and `<name>-engines` (DNS-1035 labels: a letter first, no dot, at most 63).
FLEET_NAME_MAX_LENGTH = 52
FLEET_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class DraftMethod(enum.StrEnum):
    """How the draft model proposes tokens (vLLM ``speculative_config.method``)."""

    NONE = "none"
    DRAFT_MODEL = "draft_model"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"


# MTP heads live inside the verifier checkpoint; every other method has weights of its own.
METHODS_WITH_OWN_WEIGHTS = frozenset({DraftMethod.DRAFT_MODEL, DraftMethod.EAGLE, DraftMethod.EAGLE3})
# EAGLE-style drafts share embed_tokens/lm_head with the verifier by reference.
METHODS_SHARING_VERIFIER_TENSORS = frozenset({DraftMethod.EAGLE, DraftMethod.EAGLE3, DraftMethod.MTP})


class DraftPolicy(enum.StrEnum):
    """Whether revisions update the draft."""

    CO_UPDATE = "coUpdate"
    FROZEN = "frozen"


class UpdateMode(enum.StrEnum):
    """How an engine takes new weights."""

    SLEEP = "sleep"
    INFLIGHT = "inflight"


class RolloutType(enum.StrEnum):
    """How pods of a fleet move to a revision relative to each other."""

    ALL_AT_ONCE = "AllAtOnce"
    ROLLING = "Rolling"


class PrefixCaching(enum.StrEnum):
    """Prefix caching under the parity profile."""

    DISABLED = "Disabled"
    RESET_ON_UPDATE = "ResetOnUpdate"


class LogprobsMode(enum.StrEnum):
    """vLLM ``--logprobs-mode``; RL needs the processed ones."""

    PROCESSED_LOGPROBS = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"
    RAW_LOGPROBS = "raw_logprobs"
    RAW_LOGITS = "raw_logits"


class VerifierSpec(WireModel):
    """The policy model the fleet serves at start-up (before any WeightRevision)."""

    path: AbsolutePath = Field(
        description="Absolute path of the initial checkpoint inside the weights volume: revision 0. "
        "Immutable once the fleet has served it (status.served set), so revision 0 names one checkpoint; "
        "serve other weights with a WeightRevision, start from another model with a new RolloutFleet. "
        "Keep it on the volume: restarted pods boot from it."
    )
    served_model_name: str = Field(
        default="policy",
        min_length=1,
        max_length=253,
        description="Name clients use in requests (vLLM --served-model-name).",
    )


class DraftSpec(WireModel):
    """The speculative-decoding draft model."""

    method: DraftMethod = Field(default=DraftMethod.NONE, description="Draft method; `none` disables speculation.")
    path: AbsolutePath | None = Field(
        default=None,
        description="Absolute path of the initial draft checkpoint (required unless method is none/mtp); "
        "part of revision 0, immutable (set or unset) once the fleet has served it, like verifier.path.",
    )
    num_speculative_tokens: int = Field(default=3, ge=1, le=16, description="Tokens proposed per step.")
    policy: DraftPolicy = Field(
        default=DraftPolicy.CO_UPDATE,
        description="coUpdate: every revision updates the draft after the verifier; frozen: never overwritten, "
        "restored from `path` after a level-2 sleep.",
    )
    digest: str | None = Field(
        default=None,
        max_length=71,
        pattern=r"^blake3:[0-9a-f]{64}$",
        description="Expected digest of a frozen draft (`rolloutfleet digest PATH`); recorded on first load if "
        "unset. Immutable (set or unset) once the fleet has served its draft.",
    )


# Mount paths refused for the weights volume. A read-only volume mounted there would hide what the image
# or the runtime needs: `/` and the image's system directories hide Python and vLLM; /proc, /sys and /dev
# are kernel filesystems (and /dev/shm is the operator's tensor-parallel shared memory); /etc holds the
# hosts and resolv.conf files the kubelet manages; /run (= /var/run in most images) and /var hold the
# operator's control-token mount (resources/labels.py TOKEN_MOUNT_DIR), which cannot be created inside a
# read-only volume.
REFUSED_MOUNT_PATHS = ("/", "/var", "/usr", "/bin", "/sbin", "/lib", "/lib64")
REFUSED_MOUNT_TREES = ("/proc", "/sys", "/dev", "/etc", "/run", "/var/run")
MOUNT_PATH_RULES: list[pydantic.JsonValue] = [
    *common.PATH_RULES,
    {
        "rule": "!self.matches('^/((" + "|".join(p[1:] for p in REFUSED_MOUNT_PATHS[1:]) + ")/?)?$')",
        "message": "must not be " + ", ".join(REFUSED_MOUNT_PATHS) + ": the volume would hide the image's files",
    },
    {
        "rule": "!self.matches('^/(" + "|".join(p[1:] for p in REFUSED_MOUNT_TREES) + ")(/|$)')",
        "message": "must not be at or under " + ", ".join(REFUSED_MOUNT_TREES) + ": kernel and runtime "
        "filesystems, and the operator's own mounts",
    },
]
MountPath = Annotated[
    str,
    Field(
        pattern=common.ABSOLUTE_PATH_PATTERN,
        max_length=common.PATH_MAX_LENGTH,
        json_schema_extra={"x-kubernetes-validations": MOUNT_PATH_RULES},
    ),
]
# The engines receive the allowed roots ':'-separated (ROLLOUTFLEET_WEIGHT_ROOTS, resources/command.py):
# a ':' inside a root would split it into two, the second anywhere.
ROOT_SEPARATOR = ":"
ALLOWED_ROOT_RULES: list[pydantic.JsonValue] = [
    *common.PATH_RULES,
    {
        "rule": f"!self.contains('{ROOT_SEPARATOR}')",
        "message": f"must not contain '{ROOT_SEPARATOR}': the engines receive the roots '{ROOT_SEPARATOR}'-separated",
    },
]
AllowedRoot = Annotated[
    str,
    Field(
        pattern=common.ABSOLUTE_PATH_PATTERN,
        max_length=common.PATH_MAX_LENGTH,
        json_schema_extra={"x-kubernetes-validations": ALLOWED_ROOT_RULES},
    ),
]
WEIGHTS_VOLUME_RULES: list[pydantic.JsonValue] = [
    {
        # `r + '/'` against `mountPath + '/'`: at or under, whichever side has a trailing slash; segments
        # `.` and `..` are refused on both, so a prefix is a directory.
        "rule": "self.allowedRoots.all(r, (r + '/').startsWith("
        "self.mountPath.endsWith('/') ? self.mountPath : self.mountPath + '/'))",
        "message": "every allowedRoots entry must be mountPath or under it",
        "fieldPath": ".allowedRoots",
    },
]


class WeightsVolume(WireModel):
    """Where checkpoints live: a PVC mounted read-only into every pod."""

    model_config = ConfigDict(
        **WireModel.model_config, json_schema_extra={"x-kubernetes-validations": WEIGHTS_VOLUME_RULES}
    )

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=common.NAME_PATTERN,
        description="PersistentVolumeClaim holding the weights.",
    )
    mount_path: MountPath = Field(
        default="/weights",
        description="Where the volume is mounted in the pods; not /, nor a system directory "
        "(" + ", ".join((*REFUSED_MOUNT_PATHS[1:], *REFUSED_MOUNT_TREES)) + ").",
    )
    allowed_roots: list[AllowedRoot] = Field(
        min_length=1,
        max_length=16,
        description="Checkpoint paths of revisions must lie under one of these directories (each under mountPath).",
    )


class StepTimeouts(WireModel):
    """Per-step timeouts of the weight-update transaction, in seconds."""

    pause_seconds: int = Field(default=60, ge=1, le=86400, description="pause(keep) and resume.")
    sleep_seconds: int = Field(default=120, ge=1, le=86400, description="sleep(level 2).")
    wake_seconds: int = Field(default=300, ge=1, le=86400, description="Each wake_up (weights, kv_cache).")
    load_seconds: int = Field(default=1800, ge=1, le=86400, description="Each load (verifier, draft).")
    verify_seconds: int = Field(default=120, ge=1, le=86400, description="Digest verification and parity probe.")
    push_seconds: int = Field(
        default=120,
        ge=1,
        le=86400,
        description="Pushed revisions: how long an open weight-transfer session waits for the trainer to send "
        "(docs/push.md); then the session ends and its pod is repaired.",
    )


MAX_UNAVAILABLE_RULE: JsonDict = {
    "rule": "type(self) == int ? self >= 1 : self.matches('^([1-9][0-9]?|100)%$')",
    "message": "must be an integer >= 1 or a percentage between 1% and 100%",
}


# A Kubernetes quantity of bytes, binary or decimal suffix (the subset that makes sense for host memory).
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_QUANTITY_UNITS["Ti"] = 2**40


def quantity_bytes(value: str) -> int:
    """Bytes of a quantity matching ``QUANTITY_PATTERN`` (``"32Gi"`` → 34359738368); ValueError otherwise."""
    match = re.fullmatch(QUANTITY_PATTERN, value)
    if match is None:
        raise ValueError(f"not a byte quantity: {value!r}")
    unit = match.group(2) or ""
    return int(float(value[: len(value) - len(unit)]) * _QUANTITY_UNITS[unit])


class Staging(WireModel):
    """Staged updates (docs/staging.md): each engine reads and hashes the next revision into pinned host memory
    while it serves; pods pause only once every staged digest verified, and the pause holds only the commit."""

    enabled: bool = Field(
        default=False,
        description="Stage path revisions before any pod pauses. Off by default: the staged checkpoints live in "
        "pinned host memory, which counts against the pod's memory limit (size the pod first: docs/staging.md).",
    )
    host_memory_limit: str = Field(
        default="32Gi",
        pattern=QUANTITY_PATTERN,
        description="Host memory a pod may pin for one revision's verifier and draft (split evenly between its "
        "tensor-parallel workers, each of which stages whole checkpoints). A revision that needs more is loaded "
        "from the files as without staging, and the revision's status says so.",
    )

    @property
    def limit_bytes(self) -> int:
        return quantity_bytes(self.host_memory_limit)


class UpdateStrategy(WireModel):
    """How a revision is rolled across the fleet."""

    mode: UpdateMode = Field(
        default=UpdateMode.SLEEP,
        description="sleep: level-2 sleep, wake, load; inflight: pause(keep), load, resume.",
    )
    rollout: RolloutType = Field(
        default=RolloutType.ALL_AT_ONCE,
        description="AllAtOnce: no pod resumes on a revision before all verified it; "
        "Rolling: maxUnavailable at a time.",
    )
    max_unavailable: int | str = Field(
        default=1,
        description="Rolling: pods out of service at once (an integer or a percentage such as 25%).",
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [MAX_UNAVAILABLE_RULE],
        },
    )
    max_concurrent_loads: int | None = Field(
        default=None,
        ge=1,
        le=100000,
        description="Cap on pods loading at once (protects shared storage); unset: no cap.",
    )
    canary: int = Field(default=0, ge=0, le=100000, description="Pods updated (and parity-probed) before the rest.")
    max_retries: int = Field(default=2, ge=0, le=20, description="Retries of a failed step per pod before rollback.")
    timeouts: StepTimeouts = Field(default_factory=StepTimeouts, description="Per-step timeouts.")
    staging: Staging = Field(
        default_factory=Staging, description="Stage revisions in host memory while serving (docs/staging.md)."
    )


class ParityProfile(WireModel):
    """Engine settings that keep rollout logprobs consistent with the trainer's (on by default)."""

    enabled: bool = Field(default=True, description="Apply the profile; when false, none of it is enforced.")
    logprobs_mode: LogprobsMode = Field(default=LogprobsMode.PROCESSED_LOGPROBS, description="vLLM --logprobs-mode.")
    prefix_caching: PrefixCaching = Field(
        default=PrefixCaching.DISABLED,
        description="Disabled, or ResetOnUpdate: caching on and reset on every weight update.",
    )
    fp32_lm_head: bool = Field(
        default=True, description="Run the lm_head in fp32 like the trainer (hf-overrides head_dtype)."
    )
    async_scheduling: bool = Field(
        default=False, description="vLLM async scheduling; off for deterministic RL rollouts."
    )
    batch_invariant: bool = Field(default=False, description="Set VLLM_BATCH_INVARIANT=1 (deterministic, slower).")


ENV_NAME_RULES: list[pydantic.JsonValue] = [
    {
        "rule": f"!self.startsWith('{vllm_flags.OPERATOR_ENV_PREFIX}')"
        + "".join(f" || self.startsWith('{prefix}')" for prefix in vllm_flags.USER_ENV_PREFIXES)
        + "".join(f" || self == '{name}'" for name in sorted(vllm_flags.USER_ENV_NAMES)),
        "message": f"{vllm_flags.OPERATOR_ENV_PREFIX}* variables are reserved for the operator, except the "
        "loader's " + ", ".join((*(f"{p}*" for p in vllm_flags.USER_ENV_PREFIXES), *sorted(vllm_flags.USER_ENV_NAMES))),
    },
    {
        "rule": "!(self in [" + ", ".join(f"'{name}'" for name in sorted(vllm_flags.REFUSED_ENV)) + "])",
        "message": " ".join(f"{name} {why}." for name, why in sorted(vllm_flags.REFUSED_ENV.items())),
    },
]


# vLLM reads its keep-alive with int() at start, and the operator keeps its engine connections by it
# (``vllm_flags.valid_keep_alive`` is the same check).
ENV_VALUE_RULES: list[pydantic.JsonValue] = [
    {
        "rule": f"self.name != '{vllm_flags.ENV_HTTP_KEEP_ALIVE}' || (has(self.value) && "
        f"self.value.matches('^[0-9]{{1,4}}$') && int(self.value) >= 1 && "
        f"int(self.value) <= {vllm_flags.HTTP_KEEP_ALIVE_MAX})",
        "message": f"{vllm_flags.ENV_HTTP_KEEP_ALIVE} must be whole seconds from 1 to {vllm_flags.HTTP_KEEP_ALIVE_MAX}",
        "fieldPath": ".value",
    }
]


class EnvVar(WireModel):
    """A plain environment variable for the engine container."""

    model_config = ConfigDict(**WireModel.model_config, json_schema_extra={"x-kubernetes-validations": ENV_VALUE_RULES})

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Variable name; not one the operator sets or that opens the engine up.",
        json_schema_extra={"x-kubernetes-validations": ENV_NAME_RULES},
    )
    value: str = Field(default="", max_length=32768, description="Variable value.")


class Toleration(WireModel):
    """A Kubernetes toleration (same fields as core/v1)."""

    key: str | None = Field(default=None, max_length=316, description="Taint key; empty matches all keys.")
    operator: str | None = Field(default=None, max_length=16, description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=253, description="Taint value for Equal.")
    effect: str | None = Field(default=None, max_length=32, description="NoSchedule, PreferNoSchedule or NoExecute.")
    toleration_seconds: int | None = Field(default=None, description="How long a NoExecute taint is tolerated.")


class Scheduling(WireModel):
    """Where engine pods may run."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Taints the pods tolerate.")
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="A core/v1 Affinity, passed through unchanged.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: str | None = Field(default=None, max_length=253, description="PriorityClass of the pods.")


class Resources(WireModel):
    """Extra container resources (GPUs come from gpusPerPod)."""

    requests: dict[str, int | str] = Field(default_factory=dict, description="e.g. cpu: 8, memory: 64Gi.")
    limits: dict[str, int | str] = Field(default_factory=dict, description="e.g. memory: 128Gi.")


class NetworkAccess(WireModel):
    """Who may reach the engine port (the operator always may)."""

    client_pod_selector: dict[str, str] = Field(
        default_factory=lambda: {"rolloutfleet.io/client": "true"},
        description="matchLabels of pods (in clientNamespaces) allowed to send generation traffic.",
    )
    client_namespace_selector: dict[str, str] | None = Field(
        default=None, description="matchLabels of namespaces of clients; unset: the fleet's namespace only."
    )


SPEC_RULES: list[pydantic.JsonValue] = [
    {
        "rule": "self.draft.method in ['none', 'mtp'] || has(self.draft.path)",
        "message": "draft.path is required for draft methods with weights of their own",
        "fieldPath": ".draft.path",
    },
    {
        "rule": "self.gpusPerPod % self.tensorParallelSize == 0",
        "message": "gpusPerPod must be a multiple of tensorParallelSize",
        "fieldPath": ".tensorParallelSize",
    },
]


class TransferBackend(enum.StrEnum):
    """vLLM's weight-transfer backends (``--weight-transfer-config``)."""

    IPC = "ipc"  # CUDA IPC handles: the trainer on the same host (and GPU set) as the engine
    NCCL = "nccl"  # a NCCL group: trainer rank 0, engines' workers the other ranks


class NcclTransfer(WireModel):
    """NCCL backend options."""

    port: int = Field(
        default=29600, ge=1024, le=65535, description="The trainer's rendezvous port (engines connect to it)."
    )
    packed: bool = Field(
        default=False,
        description="vLLM's packed broadcast (fewer, larger collectives), set at the group's init: needs engines "
        "of vLLM >= 0.28 (0.26 refuses it there and takes packing per update from the trainer). Trainer and "
        "engines must agree, or the broadcast hangs.",
    )


class WeightTransfer(WireModel):
    """How the trainer pushes weights into the engines (docs/push.md); required for push revisions."""

    backend: TransferBackend = Field(description="ipc (trainer on the same host) or nccl.")
    nccl: NcclTransfer | None = Field(default=None, description="NCCL options (backend nccl only).")


MAX_REPLICAS = 100_000  # spec.replicas' bound (the schema's maximum)


class RolloutFleetSpec(WireModel):
    """Desired state of a fleet."""

    model_config = ConfigDict(**WireModel.model_config, json_schema_extra={"x-kubernetes-validations": SPEC_RULES})

    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="Number of engine pods.")
    image: str = Field(
        min_length=1, max_length=1024, description="vLLM image carrying the rolloutfleet worker extension."
    )
    gpus_per_pod: int = Field(default=1, ge=1, le=64, description="nvidia.com/gpu per pod.")
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="vLLM --tensor-parallel-size.")
    port: int = Field(default=8000, ge=1024, le=65535, description="Engine HTTP port.")
    verifier: VerifierSpec = Field(description="The policy model served at start-up.")
    draft: DraftSpec = Field(default_factory=DraftSpec, description="Speculative-decoding draft.")
    weights: WeightsVolume = Field(description="The weights volume and the roots revisions may use.")
    update_strategy: UpdateStrategy = Field(default_factory=UpdateStrategy, description="How revisions roll.")
    parity: ParityProfile = Field(default_factory=ParityProfile, description="The RL parity profile.")
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Extra vLLM arguments; must not contradict the parity profile.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment variables, one entry per name.",
        # A map keyed by name: the API server refuses a duplicate on the fleet itself, instead of the
        # StatefulSet apply failing later ("duplicate entries for key").
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    resources: Resources = Field(default_factory=Resources, description="Extra container resources.")
    weight_transfer: WeightTransfer | None = Field(
        default=None,
        description="Pushed revisions: vLLM's weight-transfer backend the engines start with (docs/push.md). "
        "Unset: revisions come from checkpoint paths only.",
    )
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Node selection and priority.")
    network: NetworkAccess = Field(default_factory=NetworkAccess, description="NetworkPolicy client selection.")
    startup_timeout_seconds: int = Field(
        default=3600, ge=60, le=86400, description="Budget of the startup probe (model load at start)."
    )


def engine_workers(spec: RolloutFleetSpec) -> int:
    """Ranks one engine brings to a NCCL group: its tensor x pipeline parallel workers (vLLM's worker rank
    is ``rank_offset + its rank``)."""
    pipeline = 1
    args = list(spec.extra_args)
    for i, arg in enumerate(args):
        if vllm_flags.flag_name(arg) != "--pipeline-parallel-size":
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "1")
        pipeline = int(value) if value.isdigit() else 1
    return spec.tensor_parallel_size * max(1, pipeline)


def sleep_mode_enabled(spec: RolloutFleetSpec) -> bool:
    """Whether the fleet's engines start with vLLM's sleep mode (``--enable-sleep-mode``).

    Only a fleet whose update mode is ``sleep`` starts them so; an engine started without it cannot sleep,
    so a revision may ask for ``mode: sleep`` only on such a fleet.
    """
    return spec.update_strategy.mode == UpdateMode.SLEEP


class PodState(WireModel):
    """What one engine pod serves, as last observed."""

    name: str = Field(description="Pod name.")
    ip: str | None = Field(default=None, description="Pod IP.")
    phase: str = Field(default="Pending", description="Pod phase.")
    ready: bool = Field(default=False, description="Pod Ready condition.")
    revision: int | None = Field(
        default=None, description="Verifier revision the engine holds (unset: initial/unknown)."
    )
    draft_revision: int | None = Field(default=None, description="Draft revision the engine holds.")
    step: str | None = Field(default=None, description="Update step in progress, if any.")
    weight_version: str | None = Field(default=None, description="Weight version stamped on outputs.")


class CommonPodState(WireModel):
    """The state the pods left out of a large fleet's ``status.pods`` share (``RolloutFleetStatus.podsCommon``)."""

    pods: int = Field(ge=0, description="Pods in this state, none of them listed in status.pods.")
    phase: str = Field(default="Pending", description="Their pod phase.")
    ready: bool = Field(default=False, description="Their Ready condition.")
    revision: int | None = Field(default=None, description="Verifier revision they hold (unset: initial/unknown).")
    draft_revision: int | None = Field(default=None, description="Draft revision they hold.")
    step: str | None = Field(default=None, description="Update step in progress, if any.")
    weight_version: str | None = Field(default=None, description="Weight version stamped on their outputs.")


class ServedWeights(WireModel):
    """What the fleet serves, recorded when a revision completes; steady state and rollbacks use it, so
    deleting WeightRevision objects never changes what is served."""

    revision: int = Field(ge=0, description="Revision the fleet serves: 0 for the initial weights.")
    name: str | None = Field(
        default=None, max_length=253, description="The WeightRevision object that brought it (unset for 0)."
    )
    verifier_path: str | None = Field(
        default=None,
        max_length=common.PATH_MAX_LENGTH,
        description="Verifier checkpoint served (unset when the trainer pushed it).",
    )
    verifier_pushed: bool = Field(default=False, description="The trainer pushed the verifier (no path to re-read).")
    verifier_digest: str | None = Field(default=None, max_length=71, description="Its digest, if known.")
    draft_path: str | None = Field(
        default=None, max_length=common.PATH_MAX_LENGTH, description="Draft checkpoint served, if any."
    )
    draft_pushed: bool = Field(default=False, description="The trainer pushed the draft.")
    draft_digest: str | None = Field(default=None, max_length=71, description="Its digest, if known.")
    since: datetime.datetime | None = Field(default=None, description="When the fleet started serving it.")


class RolloutFleetStatus(WireModel):
    """Observed state of a fleet."""

    observed_generation: int | None = Field(default=None, description="metadata.generation last reconciled.")
    replicas: int = Field(default=0, description="Pods that exist.")
    ready_replicas: int = Field(default=0, description="Pods Ready.")
    updated_replicas: int = Field(default=0, description="Pods on the current pod template.")
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    current_revision: int | None = Field(
        default=None, description="Revision every pod serves (unset: initial weights)."
    )
    target_revision: int | None = Field(default=None, description="Revision being rolled out, if any.")
    frozen_draft_digest: str | None = Field(default=None, description="Digest recorded for a frozen draft.")
    served: ServedWeights | None = Field(
        default=None,
        description="What the fleet serves, recorded when a revision completes; steady state and rollbacks "
        "use it, so deleting WeightRevision objects never changes what is served.",
    )
    pods: list[PodState] = Field(
        default_factory=list,
        description=f"Per-pod state: every pod of a fleet of up to {common.MAX_POD_ENTRIES} pods. A larger fleet lists "
        "only the pods whose state differs from podsCommon, the pods not Ready first, at most "
        f"{common.MAX_POD_ENTRIES} of them (podsTruncated counts the others).",
        json_schema_extra=common.PER_POD_LIST_EXTRA,
    )
    pods_common: CommonPodState | None = Field(
        default=None,
        description=f"A fleet of more than {common.MAX_POD_ENTRIES} pods: the state most of its pods share, and "
        "how many; these pods are not listed in pods.",
    )
    pods_truncated: int | None = Field(
        default=None,
        description="Pods whose state differs from podsCommon but that pods has no room for (unset: none).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Available, Progressing, Degraded; PushWithinLimit on a fleet with weightTransfer (whether a "
        "pushed revision can list every pod).",
        json_schema_extra=common.CONDITIONS_LIST_EXTRA,
    )


_ONCE_SERVED = "!has(oldSelf.status) || !has(oldSelf.status.served) || "


def _unchanged(field: str) -> str:
    """CEL: an optional spec field is set on both sides with one value, or unset on both."""
    new, old = f"self.spec.{field}", f"oldSelf.spec.{field}"
    return f"(has({new}) == has({old}) && (!has({new}) || {new} == {old}))"


# Rules at the root, where CEL sees metadata.name (and, for transition rules, the stored status).
FLEET_RULES: list[pydantic.JsonValue] = [
    {
        "rule": f"self.metadata.name.size() <= {FLEET_NAME_MAX_LENGTH}",
        "message": f"metadata.name must be at most {FLEET_NAME_MAX_LENGTH} characters: the StatefulSet's pods carry "
        "the label controller-revision-hash=<name>-<hash>, at most 63 characters",
    },
    {
        "rule": f"self.metadata.name.matches('{FLEET_NAME_PATTERN}')",
        "message": "metadata.name must be a DNS-1035 label (a lower-case letter first, then letters, digits "
        "and '-', no '.'): the fleet's Services are named after it",
    },
    {
        "rule": _ONCE_SERVED + "self.spec.verifier.path == oldSelf.spec.verifier.path",
        "message": "is immutable once the fleet has served it (status.served is set): it is revision 0; "
        "publish a WeightRevision to serve other weights, or create a new RolloutFleet",
        "fieldPath": ".spec.verifier.path",
    },
    {
        "rule": _ONCE_SERVED + _unchanged("draft.path"),
        "message": "is immutable (set or unset) once the fleet has served it (status.served is set): it is "
        "revision 0's draft; create a new RolloutFleet to change it",
        "fieldPath": ".spec.draft.path",
    },
    {
        "rule": _ONCE_SERVED + _unchanged("draft.digest"),
        "message": "is immutable (set or unset) once the fleet has served its draft (status.served is set)",
        "fieldPath": ".spec.draft.digest",
    },
]


class RolloutFleet(WireModel):
    """A fleet of vLLM GPU pods that serve one policy and move between WeightRevisions."""

    model_config = ConfigDict(**WireModel.model_config, json_schema_extra={"x-kubernetes-validations": FLEET_RULES})

    spec: RolloutFleetSpec
    status: RolloutFleetStatus | None = None


PRINTER_COLUMNS = [
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Revision", "type": "integer", "jsonPath": ".status.currentRevision"},
    {"name": "Target", "type": "integer", "jsonPath": ".status.targetRevision"},
    {"name": "Available", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Available')].status"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
