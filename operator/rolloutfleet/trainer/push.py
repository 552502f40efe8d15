# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""Push a revision's weights from the trainer: the trainer's side of the push handshake (docs/push.md).

Called by trainers once per training step (``from rolloutfleet.trainer import push_revision``) and by
``examples/trainer_push.py``. Like ``publish_revision`` it creates one WeightRevision and waits until it
is Ready, but its sources are ``{push: {}, digest}``: the operator opens a weight-transfer session on each
engine, and this client sends the tensors into them. It owns the loop of protocol 1:

1. digest the tensors it will send (``rolloutfleet.trainer.digest``, on their GPU), then create the
   revision through ``rolloutfleet.trainer.publish.create_revision`` (same validation, idempotency and
   errors as a publish; nothing is created when a check fails);
2. read the revision until Ready: for every target's sessions of an epoch newer than the last it served
   (``rolloutfleet.trainer.sessions``), post the tensors to each listed engine (``rolloutfleet.trainer.
   senders``, several at once, with the fleet's control token), then mark the epoch served, or annotate
   the error when a send failed (never marking an epoch whose sends failed);
3. end with the revision Ready (PushResult), failed (RevisionFailed, or PushSendFailed when its own sends
   failed), or at a deadline: ``timeout`` for the whole call (PublishTimeout) or ``session_timeout``
   without anything to serve and no change in the revision's status (PushSessionTimeout).

Idempotent like a publish: called again with the same tensors (a restarted trainer), it reuses the
revision and resumes after the epochs its annotations record. The revision is read by polling (one GET
per ``poll_interval``), which bounds how late a session is served; the operator's ``pushSeconds`` must
leave room for that and for the send.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from typing import Any

from kubernetes import client

from rolloutfleet.trainer.digest import TensorProvider, TensorSource, digest_tensors
from rolloutfleet.trainer.errors import (
    KubeApiError,
    PermissionDenied,
    PublishCancelled,
    PublishTimeout,
    PushProtocolError,
    PushSendFailed,
    PushSessionTimeout,
    PushUnsupported,
    RevisionDeleted,
    SendFailure,
)
from rolloutfleet.trainer.kube import (
    annotate_revision,
    core_api,
    custom_objects_api,
    make_api_client,
    read_control_token,
    read_revision,
)
from rolloutfleet.trainer.progress import DigestProgress, ProgressFn, PublishProgress, TtyProgress, reporter, size
from rolloutfleet.trainer.publish import (
    PublishResult,
    abspath,
    build_spec,
    create_revision,
    digest_checkpoint,
    result_of,
    revision_name,
)
from rolloutfleet.trainer.senders import IpcSender, Prepared, Sender, deliver
from rolloutfleet.trainer.sessions import (
    ERROR_ANNOTATION,
    TARGETS,
    Group,
    Session,
    error,
    error_of,
    error_retired,
    mark,
    pending,
    push_status,
    rendezvous,
    rendezvous_epoch,
    served_epochs,
    whole_group,
)
from rolloutfleet.trainer.wait import FAILED_PHASES, failure_of, phase, ready, rollout_progress

__all__ = ["PushResult", "async_push_revision", "push_revision"]

_READ_RETRIES = 5  # consecutive failed reads of the revision tolerated (a flaky API server) before giving up
_ANNOTATE_TRIES = 3


@dataclasses.dataclass(frozen=True)
class PushResult(PublishResult):
    """What a push ended with: the PublishResult fields, and what this call sent.

    ``served``: per target, the epochs this call served and marked; ``sends``: successful sends (one per
    pod and epoch); ``send_failures``: sends that failed (their epochs were annotated, not marked) before
    the operator's retries succeeded.
    """

    served: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    sends: int = 0
    send_failures: tuple[SendFailure, ...] = ()


def push_revision(
    fleet: str,
    revision: int,
    verifier: TensorProvider,
    draft: TensorProvider | str | os.PathLike[str] | None = None,
    namespace: str = "default",
    *,
    sender: Sender | None = None,
    timeout: float = 1800,
    session_timeout: float = 600,
    send_timeout: float = 300,
    concurrency: int = 8,
    poll_interval: float = 0.5,
    verifier_digest: str | None = None,
    draft_digest: str | None = None,
    gpu_digest: bool = True,
    fail_fast: bool = False,
    api_client: client.ApiClient | None = None,
    progress: ProgressFn | bool | None = None,
    name: str | None = None,
    cancel: threading.Event | None = None,
) -> PushResult:
    """Push ``revision`` of ``fleet`` from the trainer's tensors; return once every engine serves it.

    ``verifier``: the tensors to send (a ``state_dict()``, ``(name, tensor)`` pairs, or a callable such as
    ``model.named_parameters``; see ``rolloutfleet.trainer.digest``), named as vLLM's ``load_weights``
    expects (the checkpoint's names). ``draft``: the draft's tensors, a checkpoint directory (a path
    source: the engines read it; digested here unless ``draft_digest`` is given), or None for a fleet
    without a co-updated draft. The tensors must not
    change until the call returns: the digest is computed once, first, and every session gets the same.

    ``sender``: how tensors reach an engine (default ``IpcSender``: vLLM on the trainer's GPUs;
    ``SimulatedSender`` for the engine simulator). ``verifier_digest``/``draft_digest``: digests computed
    earlier (else computed here, on the tensors' GPU unless ``gpu_digest=False``).

    Deadlines: ``timeout`` for the whole call (PublishTimeout); ``session_timeout`` without a session to
    serve while the revision's status does not change (PushSessionTimeout: the operator is not moving);
    ``send_timeout`` per engine call (it returns once the engine loaded the tensors). Every one leaves
    the revision in place. ``fail_fast`` raises PushSendFailed at the first failed send, once its error
    is annotated; by default the client goes on serving the operator's retries, and raises PushSendFailed
    only if the revision then fails. ``cancel`` (set by the async variant) stops before the create, or
    stops serving. Errors are those of ``publish_revision`` plus the ``PushError`` family.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    start = time.monotonic()
    name = name or revision_name(fleet, revision)
    sender = sender if sender is not None else IpcSender()
    vsource = TensorSource(verifier, "verifier")
    dsource: TensorSource | None = None
    draft_wire: dict[str, Any] | None = None
    if isinstance(draft, (str, os.PathLike)):
        draft_wire = {"path": abspath(draft)}
    elif draft is not None:
        dsource = TensorSource(draft, "draft")
        draft_wire = {"push": {}}
    if draft_wire is not None and draft_digest is not None:
        draft_wire["digest"] = draft_digest
    verifier_wire: dict[str, Any] = {"push": {}}
    if verifier_digest is not None:
        verifier_wire["digest"] = verifier_digest
    spec = build_spec(fleet, revision, verifier_wire, draft_wire)
    pending_digests = frozenset(
        f"spec.{target}.digest"
        for target, wire in (("verifier", verifier_wire), ("draft", draft_wire))
        if wire is not None and "push" in wire and "digest" not in wire
    )
    api = api_client or make_api_client()
    report = reporter(progress)
    custom, core = custom_objects_api(api), core_api(api)
    token: list[str] = []

    def prepare(spec: Any, fleet_obj: dict[str, Any]) -> None:
        # After validation, before the create: nothing exists yet if any of this fails.
        _check_backend(fleet_obj, sender, namespace)
        for source in (vsource, dsource):
            if source is not None:
                sender.check(source.items(), source.target)
        token.append(read_control_token(core, namespace, fleet))
        tracker = DigestProgress(report)
        if spec.verifier.digest is None:
            spec.verifier.digest = digest_tensors(vsource, gpu=gpu_digest, progress=tracker.part("verifier tensors"))
        if spec.draft is not None and spec.draft.digest is None:
            if dsource is not None:
                spec.draft.digest = digest_tensors(dsource, gpu=gpu_digest, progress=tracker.part("draft tensors"))
            elif spec.draft.path is not None:
                spec.draft.digest = digest_checkpoint("draft", spec.draft.path, tracker.part("draft"))

    try:
        obj, created = create_revision(
            custom,
            spec,
            name,
            namespace,
            report,
            cancel,
            prepare=prepare,
            pending=pending_digests,
            published_by="rolloutfleet-push",
        )
        handshake = _Handshake(
            custom=custom,
            namespace=namespace,
            name=str(obj["metadata"]["name"]),
            sources={"verifier": vsource, "draft": dsource},
            sender=sender,
            token=token[0],
            report=report,
            deadline=start + timeout,
            timeout=timeout,
            session_timeout=session_timeout,
            send_timeout=send_timeout,
            concurrency=concurrency,
            poll_interval=poll_interval,
            fail_fast=fail_fast,
            cancel=cancel,
        )
        final = handshake.run(obj)
        base = result_of(final, namespace, created)
        return PushResult(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(PublishResult)},
            served={t: tuple(e) for t, e in handshake.served_ok.items() if e},
            sends=handshake.sends,
            send_failures=tuple(handshake.failures),
        )
    finally:
        if isinstance(report, TtyProgress):
            report.close()
        if api_client is None:
            api.close()


def _check_backend(fleet_obj: dict[str, Any], sender: Sender, namespace: str) -> None:
    transfer = (fleet_obj.get("spec") or {}).get("weightTransfer") or {}
    backend = transfer.get("backend")
    if backend and sender.backends is not None and backend not in sender.backends:
        fleet = (fleet_obj.get("metadata") or {}).get("name")
        raise PushUnsupported(
            f"RolloutFleet {namespace}/{fleet} receives pushed weights over {backend}; the {sender.name} sender "
            f'feeds {", ".join(sorted(sender.backends))} (docs/push.md, "Senders")'
        )
    sender.configure(transfer)


@dataclasses.dataclass
class _Handshake:
    """One push's loop over the revision: serve new sessions, mark or annotate, until a final state."""

    custom: Any
    namespace: str
    name: str
    sources: dict[str, TensorSource | None]
    sender: Sender
    token: str
    report: ProgressFn | None
    deadline: float
    timeout: float
    session_timeout: float
    send_timeout: float
    concurrency: int
    poll_interval: float
    fail_fast: bool
    cancel: threading.Event | None
    served: dict[str, int] = dataclasses.field(default_factory=dict)  # highest epoch handled, per target
    served_ok: dict[str, list[int]] = dataclasses.field(default_factory=lambda: {t: [] for t in TARGETS})
    failures: list[SendFailure] = dataclasses.field(default_factory=list)
    sends: int = 0
    _last_line: str = ""
    _error: tuple[str, int, str] | None = None  # (target, epoch, text) of the error annotation we wrote
    _joined: int | None = None  # NCCL: the group epoch whose rendezvous this trainer published
    _asked_new: int | None = None  # NCCL: the formed group (of another rank 0) it asked to replace

    def run(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.served = served_epochs(obj)  # resume after what an earlier call (or process) handled
        self._error = error_of(obj)  # an earlier call's error, to retire like our own
        # A rendezvous an earlier trainer process wrote is not this one's: only the sender knows its group.
        published = rendezvous_epoch(obj)
        self._joined = published if published is not None and published == self.sender.group_epoch else None
        quiet_since, last_status = time.monotonic(), obj.get("status")
        current: dict[str, Any] | None = obj
        while True:
            if current is None:
                current = self._read()
            if ready(current):
                self._say("rollout", rollout_progress(current).message)
                return current
            if phase(current) in FAILED_PHASES:
                failure = failure_of(current)
                if self.failures:
                    raise PushSendFailed(self.name, self.namespace, self.failures, failure) from failure
                raise failure
            self._retire_error(current)
            status = push_status(current)
            group = status.group if status is not None else None
            if group is not None and self._joined != group.epoch and self._asked_new != group.epoch:
                self._join(group)
                quiet_since, current = time.monotonic(), None
                continue
            work = pending(status, self.served)
            for target in TARGETS:
                if not whole_group(status, work[target]):
                    work[target] = []  # NCCL: one broadcast for the whole group, once every member listens
            if any(work.values()):
                for target in TARGETS:
                    if work[target]:
                        self._serve(target, work[target])
                quiet_since, current = time.monotonic(), None
                continue
            if current.get("status") != last_status:
                quiet_since, last_status = time.monotonic(), current.get("status")
            self._say("rollout", rollout_progress(current).message)
            self._check_deadlines(current, quiet_since)
            now = time.monotonic()
            time.sleep(max(0.0, min(self.poll_interval, self.deadline - now, quiet_since + self.session_timeout - now)))
            current = None

    def _check_deadlines(self, obj: dict[str, Any], quiet_since: float) -> None:
        now = time.monotonic()
        status = obj.get("status") or {}
        if self.cancel is not None and self.cancel.is_set():
            raise PublishCancelled(f"stopped serving WeightRevision {self.namespace}/{self.name} (cancelled)")
        if now >= self.deadline:
            raise PublishTimeout(self.name, self.namespace, self.timeout, status.get("phase"), status.get("updated"))
        if now - quiet_since >= self.session_timeout:
            open_status = push_status(obj)
            detail = f"sessions open: {open_status.open_reason}" if open_status and open_status.open_reason else ""
            served = ", ".join(f"{t} epoch {e}" for t, e in self.served.items() if e)
            detail = "; ".join(x for x in (detail, f"served {served}" if served else "nothing served yet") if x)
            raise PushSessionTimeout(self.name, self.namespace, self.session_timeout, status.get("phase"), detail)

    def _read(self) -> dict[str, Any]:
        for attempt in range(_READ_RETRIES):
            try:
                obj = read_revision(self.custom, self.namespace, self.name)
            except PermissionDenied:
                raise
            except KubeApiError:
                if attempt == _READ_RETRIES - 1 or time.monotonic() >= self.deadline:
                    raise
                time.sleep(min(self.poll_interval * 2**attempt, 5.0))
                continue
            if obj is None:
                raise RevisionDeleted(self.name, self.namespace)
            return obj
        raise AssertionError("unreachable")

    def _join(self, group: Group) -> None:
        """NCCL: say the operator may use ``group``: this sender is its rank 0 already, or becomes it (a group
        nobody joined yet), or, for a group formed around another trainer process, ask for a new one."""
        if self.sender.group_epoch == group.epoch:
            self._annotate(rendezvous(group.epoch, self.sender.rendezvous_address()))
            self._joined = group.epoch
            self._say("push", f"{self.name}: transfer group {group.epoch}: rank 0 already")
            return
        if group.formed:
            if self._asked_new != group.epoch:
                self._annotate(rendezvous(None, self.sender.rendezvous_address()))
                self._asked_new = group.epoch
                self._say("push", f"{self.name}: transfer group {group.epoch} has another rank 0: asking for a new one")
            return
        address = self.sender.join_group(group.epoch, group.world_size)
        self._annotate(rendezvous(group.epoch, address))
        self._joined = group.epoch
        self._say("push", f"{self.name}: transfer group {group.epoch} ({group.world_size} ranks): rank 0 at {address}")

    def _retire_error(self, obj: dict[str, Any]) -> None:
        """Remove our error annotation once the sessions it was about are gone (see ``sessions``)."""
        if self._error is None:
            return
        target, epoch, text = self._error
        if not error_retired(push_status(obj), target, epoch):
            return
        if ((obj.get("metadata") or {}).get("annotations") or {}).get(ERROR_ANNOTATION) == text:
            self._annotate({ERROR_ANNOTATION: None})
        self._error = None

    def _serve(self, target: str, sessions: list[Session]) -> None:
        """Send ``target``'s tensors to every session listed (one or more epochs), then mark or annotate."""
        epoch = max(s.epoch for s in sessions)
        pods = ", ".join(s.pod for s in sessions)
        source = self.sources.get(target)
        if source is None:
            why = f"the trainer has no {target} tensors: this revision's {target} is not pushed"
            self._annotate(
                error(target, epoch, [SendFailure(s.pod, s.address, target, s.epoch, why) for s in sessions])
            )
            raise PushProtocolError(f"WeightRevision {self.namespace}/{self.name}: {target} sessions opened, but {why}")
        self._say("push", f"{self.name}: {target} epoch {epoch}: sending to {pods}")
        started = time.monotonic()
        try:
            prepared = self.sender.prepare(source.items(), target)
        except Exception as exc:
            # The sessions are open and waiting: say why they will get nothing, then stop.
            message = f"preparing the tensors failed: {exc}"
            self._annotate(
                error(target, epoch, [SendFailure(s.pod, s.address, target, s.epoch, message) for s in sessions])
            )
            raise
        try:
            failures = self._send_all(target, sessions, prepared)
        finally:
            count, nbytes = prepared.tensors, prepared.nbytes
            self.sender.release(prepared)  # every call has returned: what the handles point into may go
        self.served[target] = max(self.served.get(target, 0), epoch)
        seconds = time.monotonic() - started
        if failures:
            self.failures += failures
            written = error(target, epoch, failures)
            self._annotate(written)
            self._error = (target, epoch, str(written[ERROR_ANNOTATION]))
            self._say("push", f"{self.name}: {target} epoch {epoch}: {len(failures)} of {len(sessions)} sends failed")
            if self.fail_fast:
                raise PushSendFailed(self.name, self.namespace, self.failures)
            return
        self._annotate(mark(target, epoch))
        self._error = None  # the mark removed it
        self.served_ok[target].append(epoch)
        self.sends += len(sessions)
        self._say(
            "push",
            f"{self.name}: {target} epoch {epoch}: sent {count} tensors ({size(nbytes)}) to {len(sessions)} "
            f"pods in {seconds:.1f}s, marked",
        )

    def _send_all(self, target: str, sessions: list[Session], prepared: Prepared) -> list[SendFailure]:
        addresses = [s.address for s in sessions]
        errors = deliver(self.sender, addresses, self.token, prepared, self.send_timeout, self.concurrency)
        return [
            SendFailure(s.pod, s.address, target, s.epoch, why) for s, why in zip(sessions, errors, strict=True) if why
        ]

    def _annotate(self, annotations: dict[str, str | None]) -> None:
        for attempt in range(_ANNOTATE_TRIES):
            try:
                annotate_revision(self.custom, self.namespace, self.name, annotations)
                return
            except PermissionDenied:
                raise
            except KubeApiError:
                if attempt == _ANNOTATE_TRIES - 1:
                    raise
                time.sleep(0.5 * 2**attempt)

    def _say(self, stage: str, message: str) -> None:
        if self.report is not None and message != self._last_line:
            self._last_line = message
            self.report(PublishProgress(stage, 0, 0, message))


async def async_push_revision(
    fleet: str,
    revision: int,
    verifier: TensorProvider,
    draft: TensorProvider | str | os.PathLike[str] | None = None,
    namespace: str = "default",
    *,
    sender: Sender | None = None,
    timeout: float = 1800,  # noqa: ASYNC109 - the handshake's deadline, run on the worker thread
    session_timeout: float = 600,
    send_timeout: float = 300,
    concurrency: int = 8,
    poll_interval: float = 0.5,
    verifier_digest: str | None = None,
    draft_digest: str | None = None,
    gpu_digest: bool = True,
    fail_fast: bool = False,
    api_client: client.ApiClient | None = None,
    progress: ProgressFn | bool | None = None,
    name: str | None = None,
) -> PushResult:
    """``push_revision`` on a worker thread, for asyncio trainers.

    Cancelling the awaiting task stops the worker at its next check: before the create nothing is
    created; afterwards it stops serving (a send in flight finishes first; sessions it leaves unserved
    end at the operator's deadline). Keep the tensors unchanged until it returns.
    """
    cancel = threading.Event()
    try:
        return await asyncio.to_thread(
            push_revision,
            fleet,
            revision,
            verifier,
            draft,
            namespace,
            sender=sender,
            timeout=timeout,
            session_timeout=session_timeout,
            send_timeout=send_timeout,
            concurrency=concurrency,
            poll_interval=poll_interval,
            verifier_digest=verifier_digest,
            draft_digest=draft_digest,
            gpu_digest=gpu_digest,
            fail_fast=fail_fast,
            api_client=api_client,
            progress=progress,
            name=name,
            cancel=cancel,
        )
    except asyncio.CancelledError:
        cancel.set()
        raise
