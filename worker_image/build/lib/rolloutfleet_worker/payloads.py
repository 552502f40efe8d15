"""The wire payloads of the extension's RPCs: results, state reports, and the error vocabulary.

Imported by ``rolloutfleet_worker.extension`` (every RPC returns one of these) and ``rolloutfleet_worker.push``
(a session's state). worker_image/README.md is the reference the operator's client
(``rolloutfleet.adapters.engine_wire``) and the engine simulator follow; a change here changes the
contract. Pure typing: no torch, no vLLM.
"""

from __future__ import annotations

from typing import Literal, TypedDict

ErrorCode = Literal[
    "invalid_target",
    "invalid_path",
    "invalid_revision",
    "invalid_epoch",
    "io",
    "order",
    "frozen",
    "no_draft",
    "load_failed",
    "incomplete",
    "internal",
    # push sessions (docs/push.md)
    "busy",  # a weight-transfer session is open: nothing else may change the weights
    "destroyed",  # a failed session left the target unusable until the engine restarts
    "no_transfer",  # vLLM runs without --weight-transfer-config: no session can be opened
    "failed",  # an update into the session raised (or vLLM's side was never committed)
    "abandoned",  # the operator gave the session up (the trainer did not send in time)
    "no_session",  # push_end without an open session
    "invalid_group",  # push_group with a malformed membership
    # staged updates (docs/staging.md)
    "not_staged",  # a staged load without a finished stage of that revision and path
    "staged_mismatch",  # the bytes that reached the GPU do not hash to the staged digest
]
Target = Literal["verifier", "draft"]
DraftPolicy = Literal["coUpdate", "frozen"]


class ErrorBody(TypedDict):
    code: ErrorCode
    message: str


class Failure(TypedDict):
    ok: Literal[False]
    error: ErrorBody


class LoadResult(TypedDict):
    ok: Literal[True]
    target: Target
    revision: int | None
    path: str
    digest: str
    bytes: int
    seconds: float
    tensors: int
    skipped: list[str]
    staged: bool  # committed from the staging area (pinned host memory) instead of read from the files


class PushBeginResult(TypedDict):
    ok: Literal[True]
    target: Target
    revision: int
    epoch: int


class PushEndResult(TypedDict):
    """A verified session: shaped like a load's result (``path`` null) plus the session's epoch."""

    ok: Literal[True]
    target: Target
    revision: int
    epoch: int
    path: None
    digest: str  # of exactly the tensors received (docs/digest.md)
    bytes: int  # received
    seconds: float  # from push_begin to push_end
    tensors: int  # received
    skipped: list[str]  # received draft tensors shared with the verifier: hashed, not applied


class PreflightResult(TypedDict):
    ok: Literal[True]
    target: Target
    path: str
    tensors: int  # in the checkpoint, shared ones included
    bytes: int  # what a load would read and hash


class VerifierState(TypedDict):
    revision: int | None
    digest: str | None
    path: str | None
    verified: bool
    destroyed: bool  # a failed session left it unusable (sticky until the process restarts)


class DraftState(VerifierState):
    policy: DraftPolicy


class SessionState(TypedDict):
    """An open weight-transfer session (``rolloutfleet_state().session``)."""

    target: Target
    revision: int
    epoch: int
    age_s: float  # since push_begin
    tensors: int  # received so far
    bytes: int
    error: str | None  # an update into it raised: vLLM ended its side, push_end will fail it


class GroupState(TypedDict):
    """The NCCL transfer group this process joined (``rolloutfleet_push_group``)."""

    epoch: int
    rank_offset: int
    world_size: int


class PushGroupResult(TypedDict):
    ok: Literal[True]
    epoch: int


StagePhase = Literal["staging", "staged", "failed", "over_budget"]


class StagedTarget(TypedDict):
    """One checkpoint of a stage (docs/staging.md)."""

    path: str
    digest: str | None  # of the staged bytes, every tensor of the checkpoint (docs/digest.md); None until staged
    bytes: int  # the checkpoint's tensor bytes
    tensors: int
    committed: bool  # loaded into the model from this stage


class StageState(TypedDict):
    """The staging area (``rolloutfleet_state().staged``): the next revision's checkpoints in pinned host memory.

    ``staging``: reader threads are filling it while the engine serves; ``staged``: every byte is in host
    memory and hashed, a staged load may commit it; ``failed``: the checkpoint could not be staged (``error``
    says why, with the load's codes), nothing is held; ``over_budget``: the checkpoints need more than
    ``limit_bytes``, nothing was allocated and loads read the files as without staging.
    """

    revision: int
    phase: StagePhase
    verifier: StagedTarget
    draft: StagedTarget | None
    bytes_total: int
    bytes_done: int
    limit_bytes: int | None
    seconds: float  # staging time so far (final once staged or failed)
    error: ErrorBody | None


class StageResult(TypedDict):
    ok: Literal[True]
    stage: StageState


class UnstageResult(TypedDict):
    ok: Literal[True]
    released_bytes: int


class StateResult(TypedDict):
    ok: Literal[True]
    resident: bool
    mapped: bool  # weights' memory is mapped (False while asleep): waking mapped weights is not harmless
    verifier: VerifierState
    draft: DraftState | None
    draft_method: str | None
    shared_tensors: list[str]
    rank: int
    session: SessionState | None
    group: GroupState | None  # None until the operator records a join; a new process has none
    staged: StageState | None  # None: nothing staged (never, released after its commit, or unstaged)


def fail(code: ErrorCode, message: str) -> Failure:
    return Failure(ok=False, error=ErrorBody(code=code, message=message))
