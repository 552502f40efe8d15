"""The ``WeightRevision`` custom resource: one set of policy weights for one fleet.

Imported by reconcile, planning and ``crdgen``. Owns the spec/status vocabulary of a revision rollout:
phases, per-pod progress, step timings and conditions.
"""

from __future__ import annotations

import datetime
import enum
from typing import Annotated

import pydantic
from pydantic import ConfigDict, Field

from rolloutfleet.api import common
from rolloutfleet.api.common import AbsolutePath, Condition, JsonDict, LocalObjectReference, WireModel
from rolloutfleet.api.fleet import RolloutType, UpdateMode

KIND = "WeightRevision"
PLURAL = "weightrevisions"
SINGULAR = "weightrevision"
SHORT_NAMES = ["wrev"]

DIGEST_PATTERN = r"^blake3:[0-9a-f]{64}$"
IMMUTABLE_RULE: JsonDict = {"rule": "self == oldSelf", "message": "is immutable"}
# A source is immutable: one revision number names one set of checkpoints, so a change is a new revision.
SOURCE_IMMUTABLE_RULE: JsonDict = {
    "rule": "self == oldSelf",
    "message": "is immutable: a revision's weights never change under its number; publish a new revision",
}
# A training step or a millisecond timestamp fits; 2^62 (accepted before) would block every later revision.
MAX_REVISION = 10**15
TOKEN_ID_MAX = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
Logprob = Annotated[float, Field(le=0.0, allow_inf_nan=False)]


class PushSource(WireModel):
    """The trainer sends these weights into weight-transfer sessions the operator opens (docs/push.md)."""


SOURCE_RULES: list[pydantic.JsonValue] = [
    {"rule": "has(self.path) != has(self.push)", "message": "set exactly one of path and push"},
    {
        "rule": "!has(self.push) || has(self.digest)",
        "message": "a pushed source needs the digest the trainer computed over the tensors it sends",
        "fieldPath": ".digest",
    },
]


class WeightSource(WireModel):
    """Where one model's weights come from: a checkpoint directory (``path``) or the trainer (``push``)."""

    model_config = ConfigDict(**WireModel.model_config, json_schema_extra={"x-kubernetes-validations": SOURCE_RULES})

    path: AbsolutePath | None = Field(
        default=None, description="Absolute checkpoint directory under one of the fleet's allowedRoots."
    )
    push: PushSource | None = Field(
        default=None,
        description="Sent by the trainer through vLLM's weight-transfer sessions; needs `digest` and a fleet "
        "with `weightTransfer`.",
    )
    digest: str | None = Field(
        default=None,
        max_length=71,
        pattern=DIGEST_PATTERN,
        description="Expected digest (`rolloutfleet digest PATH`, or the trainer's over the tensors it sends); "
        "when set, every engine must report exactly it. Required with push.",
    )

    @property
    def pushed(self) -> bool:
        """The trainer sends these weights (no path to read)."""
        return self.push is not None


class ParityProbe(WireModel):
    """A check computed by the trainer: processed logprobs of a fixed token sequence."""

    prompt_token_ids: list[TokenId] = Field(
        min_length=1, max_length=4096, description="Prompt token ids (vocabulary indices, 0..2^31-1)."
    )
    expected_logprobs: list[Logprob] = Field(
        min_length=1,
        max_length=4096,
        description="Expected processed logprob of each greedy output token (finite, <= 0).",
    )
    tolerance: float = Field(
        default=0.02, ge=0.0, le=10.0, allow_inf_nan=False, description="Maximum absolute difference allowed."
    )


class StrategyOverride(WireModel):
    """Per-revision override of the fleet's update strategy (unset fields keep the fleet's)."""

    mode: UpdateMode | None = Field(default=None, description="sleep or inflight.")
    rollout: RolloutType | None = Field(default=None, description="AllAtOnce or Rolling.")
    max_unavailable: int | str | None = Field(
        default=None,
        description="Rolling: pods out of service at once.",
        json_schema_extra={"x-kubernetes-int-or-string": True},
    )
    max_concurrent_loads: int | None = Field(default=None, ge=1, le=100000, description="Cap on parallel loads.")
    canary: int | None = Field(default=None, ge=0, le=100000, description="Pods updated and probed first.")


# Field rules do not run when the field is absent on either side: adding or removing an optional source
# is caught here.
SPEC_RULES: list[pydantic.JsonValue] = [
    {
        "rule": f"has(self.{field}) == has(oldSelf.{field})",
        "message": f"{field} cannot be added or removed: a revision's weights never change under its number; "
        "publish a new revision",
        "fieldPath": f".{field}",
    }
    for field in ("draft", "parityProbe")
]


class WeightRevisionSpec(WireModel):
    """Desired weights for a fleet; everything but ``strategy`` is immutable."""

    model_config = ConfigDict(**WireModel.model_config, json_schema_extra={"x-kubernetes-validations": SPEC_RULES})

    fleet_ref: LocalObjectReference = Field(
        description="The RolloutFleet (same namespace) this revision is for; immutable.",
        json_schema_extra={"x-kubernetes-validations": [IMMUTABLE_RULE]},
    )
    revision: int = Field(
        ge=0,
        le=MAX_REVISION,
        description="Monotonic revision number, e.g. the training step (at most 10^15); immutable.",
        json_schema_extra={"x-kubernetes-validations": [IMMUTABLE_RULE]},
    )
    verifier: WeightSource = Field(
        description="Verifier (policy) checkpoint; immutable.",
        json_schema_extra={"x-kubernetes-validations": [SOURCE_IMMUTABLE_RULE]},
    )
    draft: WeightSource | None = Field(
        default=None,
        description="Draft checkpoint; required when the fleet co-updates a draft with its own weights; immutable.",
        json_schema_extra={"x-kubernetes-validations": [SOURCE_IMMUTABLE_RULE]},
    )
    parity_probe: ParityProbe | None = Field(
        default=None,
        description="Optional parity check on canary pods; immutable (it is computed for these weights).",
        json_schema_extra={"x-kubernetes-validations": [SOURCE_IMMUTABLE_RULE]},
    )
    allow_older: bool = Field(
        default=False,
        description="Deliberate rollback: roll this revision even when its number is not newer than what the "
        "fleet serves; the fleet then serves this number, and later revisions must be newer than it. Immutable.",
        json_schema_extra={"x-kubernetes-validations": [IMMUTABLE_RULE]},
    )
    strategy: StrategyOverride | None = Field(
        default=None, description="Optional override of the fleet's strategy (how to roll; may change)."
    )


class Phase(enum.StrEnum):
    """Where a revision stands (derived each reconcile from observed engines, never a cursor)."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUPERSEDED = "Superseded"
    ROLLED_BACK = "RolledBack"


class PodProgress(WireModel):
    """One pod's progress through the transaction."""

    name: str = Field(description="Pod name.")
    step: str = Field(default="Pending", description="Current or last step.")
    verifier_digest: str | None = Field(default=None, description="Digest the engine reports for the verifier.")
    draft_digest: str | None = Field(default=None, description="Digest the engine reports for the draft.")
    attempts: int = Field(default=0, description="Failed attempts so far.")
    message: str | None = Field(default=None, description="Last error, if any.")
    staging: str | None = Field(
        default=None,
        description="Staged updates (docs/staging.md): Staging, Staged, Committed, or Fallback (loaded from the "
        "files: the checkpoints exceed the staging limit).",
    )


class StagingStatus(WireModel):
    """How the revision's bytes reached the pods when the fleet stages (docs/staging.md)."""

    pods_staged: int = Field(default=0, description="Pods that staged the revision in host memory.")
    pods_fallback: int = Field(
        default=0, description="Pods that load it from the files instead: the checkpoints exceed the staging limit."
    )
    message: str = Field(default="", description="Why pods fall back, if any do.")


class PodFailure(WireModel):
    """Why one pod could not complete the revision (kept after a rollback)."""

    name: str = Field(description="Pod name.")
    step: str = Field(description="The step that failed last.")
    reason: str = Field(description="CamelCase reason, e.g. ExtensionIo or StepTimeout.")
    message: str = Field(default="", description="The engine's or the operator's message.")
    attempts: int = Field(default=0, description="Failed attempts before the decision.")


class ParityProbeResult(WireModel):
    """The parity probe's verdict on the canary pods."""

    passed: bool = Field(description="Every canary matched the expected logprobs within the tolerance.")
    max_abs_diff: float | None = Field(default=None, description="Largest absolute difference seen.")
    tolerance: float = Field(description="The tolerance applied.")
    pods: list[str] = Field(default_factory=list, description="Canary pods probed.")
    message: str = Field(default="", description="Details (the first mismatch, or an engine error).")


class StepTiming(WireModel):
    """Duration statistics of one transaction step across pods."""

    step: str = Field(description="Step name.")
    count: int = Field(default=0, description="Pods that completed it.")
    median_seconds: float = Field(default=0.0, description="Median duration.")
    max_seconds: float = Field(default=0.0, description="Maximum duration.")


PUSH_PROTOCOL = 1
# The trainer's marks on a pushed revision (docs/push.md, "Handshake"): the epoch it sent into, per target,
# or why it could not send.
PUSHED_ANNOTATION_PREFIX = "push.rolloutfleet.io/"
PUSH_ERROR_ANNOTATION = PUSHED_ANNOTATION_PREFIX + "error"
# NCCL: where the trainer (rank 0) waits for the group's other ranks, "<group epoch>@<host>:<port>"; a trainer
# that is not rank 0 of the group shown (a new process) writes "new@<host>:<port>" to ask for a new group.
RENDEZVOUS_ANNOTATION = PUSHED_ANNOTATION_PREFIX + "rendezvous"


def pushed_annotation(target: str) -> str:
    """The annotation the trainer sets to the highest epoch of ``target`` sessions it sent into."""
    return PUSHED_ANNOTATION_PREFIX + target


class PushSessionStatus(WireModel):
    """One open weight-transfer session the trainer must send into."""

    pod: str = Field(description="Pod name.")
    address: str = Field(description="host:port where the trainer calls /update_weights.")
    target: str = Field(description="verifier or draft.")
    epoch: int = Field(description="The set of sessions it was opened with.")


class PushGroupRank(WireModel):
    """One engine of a NCCL transfer group: its workers are ranks rankOffset .. rankOffset + worldSize - 1."""

    pod: str = Field(description="Pod name.")
    rank_offset: int = Field(ge=1, description="The rank of the engine's first worker (the trainer is rank 0).")
    world_size: int = Field(ge=1, description="The engine's workers (tensor x pipeline parallel).")


class PushGroupStatus(WireModel):
    """The NCCL transfer group the trainer must join as rank 0 (docs/push.md, "Transfer group")."""

    epoch: int = Field(ge=1, description="The group's number; a new group (pods changed) gets a higher one.")
    world_size: int = Field(ge=2, description="Ranks of the group: the trainer and every engine worker.")
    ranks: list[PushGroupRank] = Field(
        default_factory=list,
        description="Each engine's ranks, in pod ordinal order, one entry per pod.",
        json_schema_extra=common.PER_POD_LIST_EXTRA,
    )
    formed: bool = Field(
        default=False,
        description="Every engine joined it: a trainer that is not its rank 0 asks for a new group.",
    )


class PushStatus(WireModel):
    """The operator's side of the push handshake (docs/push.md)."""

    protocol: int = Field(default=PUSH_PROTOCOL, description="Handshake protocol version.")
    epoch: int = Field(default=0, description="The newest complete set of sessions the operator opened.")
    sessions: list[PushSessionStatus] = Field(
        default_factory=list,
        description="Open sessions waiting for the trainer (complete epochs only), one entry per pod.",
        json_schema_extra=common.PER_POD_LIST_EXTRA,
    )
    group: PushGroupStatus | None = Field(
        default=None, description="NCCL only: the transfer group the sessions belong to (the trainer is rank 0)."
    )


class WeightRevisionStatus(WireModel):
    """Observed state of a revision rollout."""

    observed_generation: int | None = Field(default=None, description="metadata.generation last reconciled.")
    phase: Phase = Field(
        default=Phase.PENDING, description="Pending, Progressing, Succeeded, Failed, Superseded, RolledBack."
    )
    pods_updated: int = Field(default=0, description="Pods serving this revision, verified.")
    pods_total: int = Field(default=0, description="Pods of the fleet.")
    updated: str = Field(default="0/0", description="podsUpdated/podsTotal, for printing.")
    reason: str | None = Field(default=None, description="Reason of the phase, if it is a failure.")
    message: str | None = Field(default=None, description="Details of the phase.")
    start_time: datetime.datetime | None = Field(default=None, description="When the rollout started.")
    completion_time: datetime.datetime | None = Field(default=None, description="When it ended.")
    pods: list[PodProgress] = Field(
        default_factory=list,
        description="Per-pod progress, one entry per pod.",
        json_schema_extra=common.PER_POD_LIST_EXTRA,
    )
    parity_probe: ParityProbeResult | None = Field(default=None, description="Result of the parity probe, if any.")
    push: PushStatus | None = Field(default=None, description="Pushed revisions: sessions open for the trainer.")
    staging: StagingStatus | None = Field(default=None, description="Staged updates: staged and fallen-back pods.")
    failures: list[PodFailure] = Field(
        default_factory=list,
        description="Per-pod failures that made the revision roll back or fail.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    timings: list[StepTiming] = Field(
        default_factory=list,
        description="Per-step timings.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["step"]},
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Verified.",
        json_schema_extra=common.CONDITIONS_LIST_EXTRA,
    )


class WeightRevision(WireModel):
    """One set of policy weights that a fleet moves to."""

    spec: WeightRevisionSpec
    status: WeightRevisionStatus | None = None


PRINTER_COLUMNS = [
    {"name": "Fleet", "type": "string", "jsonPath": ".spec.fleetRef.name"},
    {"name": "Revision", "type": "integer", "jsonPath": ".spec.revision"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Updated", "type": "string", "jsonPath": ".status.updated"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
