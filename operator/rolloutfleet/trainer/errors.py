"""Typed errors of the trainer-facing API (publish and push), each with a one-line human message.

Raised by ``rolloutfleet.trainer.publish`` and ``rolloutfleet.trainer.push`` (and their helpers) and caught
by the ``publish``/``wait`` commands (which print ``str(exc)`` and exit 1) and by training loops that want
to react to one kind (retry on ``KubeApiError``, stop on ``RevisionFailed``). Every class derives from
``PublishError``, so ``except PublishError`` catches them all; the push-only ones also from ``PushError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PublishError(Exception):
    """Base of every publish error; ``str(exc)`` is one line meant for a human."""


class FleetNotFound(PublishError):  # noqa: N818 - names of the documented API
    """The RolloutFleet does not exist in the namespace (or its CRD is not installed)."""

    def __init__(self, fleet: str, namespace: str, *, crd_missing: bool = False) -> None:
        self.fleet, self.namespace, self.crd_missing = fleet, namespace, crd_missing
        if crd_missing:
            msg = (
                f"RolloutFleet {namespace}/{fleet} not found: the rolloutfleet.io CRDs are not installed "
                "on this cluster"
            )
        else:
            msg = f"RolloutFleet {namespace}/{fleet} not found"
        super().__init__(msg)


class CheckpointMissing(PublishError):  # noqa: N818 - names of the documented API
    """A checkpoint directory or file cannot be digested: missing, empty, unreadable or corrupt."""

    def __init__(self, target: str, path: str, reason: str) -> None:
        self.target, self.path, self.reason = target, path, reason
        super().__init__(f"{target} checkpoint {path}: {reason}")


class InvalidRevision(PublishError):  # noqa: N818 - names of the documented API
    """The revision breaks a rule of its fleet (paths outside allowedRoots, a draft the fleet lacks, ...)."""

    def __init__(self, errors: Sequence[str], *, fleet: str = "", revision: int | None = None) -> None:
        self.errors = list(errors)
        self.fleet, self.revision = fleet, revision
        what = f"revision {revision} of RolloutFleet {fleet}" if fleet else "revision"
        super().__init__(f"invalid {what}: {'; '.join(self.errors)}")


class RevisionNotNewer(InvalidRevision):
    """The revision number is not newer than what the fleet serves or what is already published."""


class PermissionDenied(PublishError):  # noqa: N818 - names of the documented API
    """The API server refused a request (403, or 401 for rejected credentials)."""

    def __init__(self, verb: str, resource: str, namespace: str, detail: str = "", *, status: int = 403) -> None:
        self.verb, self.resource, self.namespace, self.detail, self.status = verb, resource, namespace, detail, status
        if status == 401:
            msg = f"unauthorized: the API server rejected the credentials (cannot {verb} {resource})"
        else:
            msg = f"permission denied: cannot {verb} {resource} in namespace {namespace}"
            user = _user_from_detail(detail)
            if user:
                msg += f" as {user}"
        super().__init__(msg)


def _user_from_detail(detail: str) -> str:
    # The API server's 403 message: 'weightrevisions.rolloutfleet.io is forbidden: User "x" cannot ...'
    marker = 'User "'
    start = detail.find(marker)
    if start < 0:
        return ""
    end = detail.find('"', start + len(marker))
    return detail[start + len(marker) : end] if end > 0 else ""


class RevisionConflict(PublishError):  # noqa: N818 - names of the documented API
    """A WeightRevision with this number (or name) already exists with different content."""

    def __init__(self, name: str, namespace: str, difference: str) -> None:
        self.name, self.namespace, self.difference = name, namespace, difference
        super().__init__(
            f"WeightRevision {namespace}/{name} already exists with different content ({difference}); "
            "publish a new revision number"
        )


@dataclass(frozen=True)
class PodFailure:
    """One pod's part in a failed rollout, from the WeightRevision's status.pods."""

    name: str
    step: str
    attempts: int
    message: str | None

    def __str__(self) -> str:
        tail = f": {self.message}" if self.message else ""
        return f"{self.name} (step {self.step}, attempts {self.attempts}){tail}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


class RevisionFailed(PublishError):  # noqa: N818 - names of the documented API
    """The rollout ended without every pod serving the revision: Failed, RolledBack or Superseded."""

    def __init__(
        self,
        name: str,
        namespace: str,
        phase: str,
        reason: str | None,
        message: str | None,
        pods: Sequence[PodFailure] = (),
    ) -> None:
        self.name, self.namespace, self.phase = name, namespace, phase
        self.reason, self.message, self.pods = reason, message, list(pods)
        text = f"WeightRevision {namespace}/{name} {phase}"
        if reason and reason != phase:
            text += f" ({reason})"
        if message:
            text += f": {_clip(' '.join(message.split()), 300)}"
        failing = [p for p in self.pods if p.message]
        if failing:
            text += f" [{len(failing)} of {len(self.pods)} pods report an error]"
        super().__init__(text)

    def detail(self) -> str:
        """Several lines: the summary, then one line per pod."""
        return "\n".join([str(self), *(f"  {p}" for p in self.pods)])


class RevisionNotFound(PublishError):  # noqa: N818 - names of the documented API
    """The WeightRevision to wait for does not exist."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.namespace = name, namespace
        super().__init__(f"WeightRevision {namespace}/{name} not found")


class RevisionDeleted(PublishError):  # noqa: N818 - names of the documented API
    """The WeightRevision was deleted while we waited for it."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.namespace = name, namespace
        super().__init__(f"WeightRevision {namespace}/{name} was deleted while waiting for it")


class PublishTimeout(PublishError, TimeoutError):  # noqa: N818 - names of the documented API
    """The revision did not become Ready in time; it is left in place and the operator keeps going."""

    def __init__(self, name: str, namespace: str, timeout: float, phase: str | None, updated: str | None) -> None:
        self.name, self.namespace, self.timeout, self.phase, self.updated = name, namespace, timeout, phase, updated
        super().__init__(
            f"WeightRevision {namespace}/{name} not Ready after {timeout:g}s "
            f"(phase {phase or 'Pending'}, {updated or '0/0'} pods updated); it was left in place"
        )


class PublishCancelled(PublishError):  # noqa: N818 - names of the documented API
    """The caller cancelled (async variant) before the WeightRevision was created; nothing was created."""


class KubeApiError(PublishError):
    """Any other failure talking to the API server (unreachable, 5xx, unexpected status)."""

    def __init__(self, action: str, detail: str, status: int | None = None) -> None:
        self.action, self.detail, self.status = action, detail, status
        code = f" ({status})" if status else ""
        super().__init__(f"{action} failed{code}: {' '.join(detail.split())}")


# ------------------------------------------------------------------------------------- pushed revisions


class PushError(PublishError):
    """Base of the errors only a pushed revision (``rolloutfleet.trainer.push``) raises."""


class InvalidTensors(PushError):  # noqa: N818 - names of the documented API
    """The tensors handed to the push client cannot be sent or digested (nothing was created)."""

    def __init__(self, target: str, reason: str) -> None:
        self.target, self.reason = target, reason
        super().__init__(f"{target} tensors: {reason}")


class PushUnsupported(PushError):  # noqa: N818 - names of the documented API
    """The fleet's weight transfer cannot be driven by this client or sender (nothing was created)."""


class ControlTokenMissing(PushError):  # noqa: N818 - names of the documented API
    """The fleet's control-token Secret (which the engines' ``/update_weights`` requires) is absent or empty."""

    def __init__(self, secret: str, namespace: str, reason: str) -> None:
        self.secret, self.namespace, self.reason = secret, namespace, reason
        super().__init__(f"control token Secret {namespace}/{secret}: {reason}")


class PushProtocolError(PushError):
    """The revision's ``status.push`` is not what this client speaks (protocol 1, docs/push.md)."""


class SendError(PushError):
    """One engine refused one send or did not answer it (raised by a sender; the push client records it)."""


@dataclass(frozen=True)
class SendFailure:
    """One engine that did not take the tensors of one session."""

    pod: str
    address: str
    target: str
    epoch: int
    message: str

    def __str__(self) -> str:
        return f"{self.pod} ({self.address}): {self.message}"


class PushSendFailed(PushError):  # noqa: N818 - names of the documented API
    """Sending tensors into open sessions failed; the revision was annotated with the error, not marked.

    ``failures`` lists every failed send of this call. ``revision_failure`` is set when the revision then
    ended Failed or RolledBack (the operator ended those sessions as failed and gave up retrying).
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        failures: Sequence[SendFailure],
        revision_failure: RevisionFailed | None = None,
    ) -> None:
        self.name, self.namespace = name, namespace
        self.failures, self.revision_failure = list(failures), revision_failure
        last = self.failures[-1] if self.failures else None
        text = f"WeightRevision {namespace}/{name}: sending tensors failed"
        if last is not None:
            text += f" ({len(self.failures)} sends; last: {last.target} epoch {last.epoch}: {_clip(str(last), 300)})"
        if revision_failure is not None:
            text += f"; then {revision_failure.phase}"
            if revision_failure.reason and revision_failure.reason != revision_failure.phase:
                text += f" ({revision_failure.reason})"
        super().__init__(text)


class PushSessionTimeout(PushError, TimeoutError):  # noqa: N818 - names of the documented API
    """No weight-transfer session to serve within the session deadline; the revision was left in place."""

    def __init__(self, name: str, namespace: str, seconds: float, phase: str | None, detail: str = "") -> None:
        self.name, self.namespace, self.seconds, self.phase, self.detail = name, namespace, seconds, phase, detail
        text = (
            f"WeightRevision {namespace}/{name}: no weight-transfer session to serve for {seconds:g}s "
            f"(phase {phase or 'Pending'}"
        )
        text += f", {detail})" if detail else ")"
        super().__init__(text + "; it was left in place")
