# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""Publish a WeightRevision from a training loop: digest, validate, create once, wait until Ready.

Called by trainers (``from rolloutfleet.trainer import publish_revision``), by the ``rolloutfleet
publish``/``status``/``wait`` commands (``rolloutfleet.trainer.cli``), by ``examples/trainer_loop.py``, and
by ``rolloutfleet.trainer.push``, which creates pushed revisions through ``create_revision``. It talks to
the API server with the official kubernetes client (synchronous; ``async_publish_revision`` runs it on a
worker thread) and imports neither kopf nor the operator's handlers, so a trainer process can import it
cheaply.

API access is ``rolloutfleet.trainer.kube``, waiting ``rolloutfleet.trainer.wait``, progress lines
``rolloutfleet.trainer.progress``. This module owns the public functions and the order that keeps a failed
publish from leaving anything behind: every check — the fleet, the permissions to read, the checkpoint
files and their digests, the semantic validation shared with the operator, idempotency against what is
already published — runs before the single create call, and nothing is ever deleted afterwards (a
revision the operator may already act on is the operator's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client

from rolloutfleet import digest as digest_mod
from rolloutfleet.api import common, validation
from rolloutfleet.api import revision as revision_api
from rolloutfleet.api.revision import WeightRevisionSpec
from rolloutfleet.trainer.errors import (
    CheckpointMissing,
    FleetNotFound,
    InvalidRevision,
    KubeApiError,
    PermissionDenied,
    PublishCancelled,
    PublishError,
    PublishTimeout,
    RevisionConflict,
    RevisionDeleted,
    RevisionFailed,
    RevisionNotFound,
    RevisionNotNewer,
)
from rolloutfleet.trainer.kube import (
    API_ERRORS,
    GROUP,
    REVISIONS,
    VERSION,
    custom_objects_api,
    list_revisions,
    make_api_client,
    read_fleet,
    read_revision,
    server_message,
    translate,
)
from rolloutfleet.trainer.progress import DigestProgress, ProgressFn, PublishProgress, TtyProgress, reporter
from rolloutfleet.trainer.wait import FAILED_PHASES, phase, poll_fleet_revision, ready, watch_revision

__all__ = [
    "CheckpointMissing",
    "FleetNotFound",
    "InvalidRevision",
    "KubeApiError",
    "PermissionDenied",
    "PublishCancelled",
    "PublishError",
    "PublishProgress",
    "PublishResult",
    "PublishTimeout",
    "RevisionConflict",
    "RevisionDeleted",
    "RevisionFailed",
    "RevisionNotFound",
    "RevisionNotNewer",
    "age",
    "async_publish_revision",
    "compute_digests",
    "custom_objects_api",
    "list_revisions",
    "make_api_client",
    "publish_revision",
    "read_fleet",
    "read_revision",
    "revision_name",
    "wait_for_fleet_revision",
    "wait_for_revision",
]

FLEET_LABEL = "rolloutfleet.io/fleet"
PUBLISHED_BY = "rolloutfleet.io/published-by"
_DEAD_PHASES = FAILED_PHASES  # published revisions that no longer compete for the fleet


@dataclasses.dataclass(frozen=True)
class PublishResult:
    """What a publish (or a wait) ended with; ``object`` is the WeightRevision as last read."""

    name: str
    namespace: str
    fleet: str
    revision: int
    created: bool
    verifier_digest: str | None
    draft_digest: str | None
    phase: str
    ready: bool
    object: dict[str, Any]


def revision_name(fleet: str, revision: int) -> str:
    """The default WeightRevision name: ``<fleet>-r<revision>``."""
    return f"{fleet}-r{revision}"


# ------------------------------------------------------------------------------------------------ digests


def digest_checkpoint(target: str, path: str, progress: Callable[[int, int], None] | None = None) -> str:
    """The digest of one checkpoint directory; CheckpointMissing names the bad file."""
    try:
        return digest_mod.digest_directory(path, progress=progress)
    except digest_mod.CheckpointError as exc:
        raise CheckpointMissing(target, exc.path, exc.reason) from None


def compute_digests(
    verifier_path: str, draft_path: str | None, progress: ProgressFn | None = None
) -> tuple[str, str | None]:
    """Digests of the verifier and (in parallel) the draft checkpoint; CheckpointMissing names a bad file."""
    tracker = DigestProgress(progress)
    if draft_path is None:
        return digest_checkpoint("verifier", verifier_path, tracker.part("verifier")), None
    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="digest") as pool:
        fut_v = pool.submit(digest_checkpoint, "verifier", verifier_path, tracker.part("verifier"))
        fut_d = pool.submit(digest_checkpoint, "draft", draft_path, tracker.part("draft"))
        # The verifier's error first: it is the one a user fixes first.
        return fut_v.result(), fut_d.result()


# ----------------------------------------------------------------------------------------- local checking


def _revision_number(obj: dict[str, Any]) -> int | None:
    value = (obj.get("spec") or {}).get("revision")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _difference(existing: dict[str, Any], wanted: WeightRevisionSpec) -> str | None:
    """Why ``existing`` is not the same revision content as ``wanted`` (None: the same)."""
    spec = existing.get("spec") or {}
    have_fleet = (spec.get("fleetRef") or {}).get("name")
    if have_fleet != wanted.fleet_ref.name:
        return f"it is for RolloutFleet {have_fleet!r}"
    if _revision_number(existing) != wanted.revision:
        return f"it is revision {_revision_number(existing)}"
    for target, want in (("verifier", wanted.verifier), ("draft", wanted.draft)):
        have = spec.get(target)
        if (have is None) != (want is None):
            return f"{target} {'missing' if have is None else 'present'} in the existing one"
        if have is None or want is None:
            continue
        if (have.get("push") is not None) != (want.push is not None):
            return f"{target} {'pushed' if have.get('push') is not None else 'read from a path'} in the existing one"
        if have.get("path") != want.path:
            return f"{target} path {have.get('path')} != {want.path}"
        if have.get("digest") and want.digest and have.get("digest") != want.digest:
            return f"{target} digest {have.get('digest')} != {want.digest}"
    return None


def build_spec(fleet: str, revision: int, verifier: dict[str, Any], draft: dict[str, Any] | None) -> WeightRevisionSpec:
    """The spec of a new revision from its sources (wire form: ``{"path": ...}`` or ``{"push": {}}``).

    Raises InvalidRevision for what the schema refuses; the fleet's rules come later (``create_revision``).
    """
    if isinstance(revision, bool) or not isinstance(revision, int):
        raise InvalidRevision([f"spec.revision: must be an integer, got {revision!r}"], fleet=fleet)
    raw: dict[str, Any] = {"fleetRef": {"name": fleet}, "revision": revision, "verifier": verifier}
    if draft is not None:
        raw["draft"] = draft
    spec, errors = validation.parse_revision_spec(raw)
    if spec is None:
        raise InvalidRevision([str(e) for e in errors], fleet=fleet, revision=revision)
    return spec


def _check_against_fleet(
    spec: WeightRevisionSpec,
    fleet_obj: dict[str, Any],
    revisions: list[dict[str, Any]],
    pending: frozenset[str] = frozenset(),
) -> None:
    """Every rule the operator would refuse the revision for, without touching anything.

    ``pending``: field paths the caller fills in after this check (a pushed source's digest, computed
    over the tensors only once the revision is known to be acceptable), so their absence is no error.
    """
    fleet_spec, parse_errors = validation.parse_fleet_spec(fleet_obj.get("spec") or {})
    if fleet_spec is None:
        raise InvalidRevision(
            [f"the RolloutFleet is invalid: {validation.summary(parse_errors)}"],
            fleet=spec.fleet_ref.name,
            revision=spec.revision,
        )
    current = (fleet_obj.get("status") or {}).get("currentRevision")
    current = current if isinstance(current, int) else None
    errors = [
        e for e in validation.validate_revision(spec, fleet_spec, current_revision=current) if e.path not in pending
    ]
    stale = [e for e in errors if e.path == "spec.revision"]
    others = [str(e) for e in errors if e.path != "spec.revision"]
    if others:
        raise InvalidRevision(others, fleet=spec.fleet_ref.name, revision=spec.revision)
    if stale:
        raise RevisionNotNewer([str(e) for e in stale], fleet=spec.fleet_ref.name, revision=spec.revision)
    # A revision older than one already published and still live would be superseded at once.
    newer = [
        r
        for r in revisions
        if (n := _revision_number(r)) is not None and n > spec.revision and phase(r) not in _DEAD_PHASES
    ]
    if newer:
        top = max(newer, key=lambda r: _revision_number(r) or 0)
        raise RevisionNotNewer(
            [
                f"spec.revision: must be newer than revision {_revision_number(top)} already published "
                f"({top['metadata']['name']}, {phase(top)})"
            ],
            fleet=spec.fleet_ref.name,
            revision=spec.revision,
        )


def _same_number(revisions: list[dict[str, Any]], fleet: str, revision: int, name: str) -> dict[str, Any] | None:
    for r in revisions:
        if r.get("metadata", {}).get("name") == name:
            return r
    for r in revisions:
        if ((r.get("spec") or {}).get("fleetRef") or {}).get("name") == fleet and _revision_number(r) == revision:
            return r
    return None


def abspath(path: str | os.PathLike[str]) -> str:
    """An absolute checkpoint path, as the revision stores it."""
    # Not Path.resolve(): symlinks must stay as given (the engines may see the volume under another path).
    return os.path.abspath(os.fspath(path))  # noqa: PTH100


# ------------------------------------------------------------------------------------------------ waiting


def wait_for_revision(
    name: str,
    namespace: str = "default",
    timeout: float = 1800,
    api_client: client.ApiClient | None = None,
    progress: ProgressFn | bool | None = None,
    *,
    cancel: threading.Event | None = None,
) -> dict[str, Any]:
    """Watch WeightRevision ``name`` until Ready; return it, or raise RevisionFailed / PublishTimeout.

    The same test as ``kubectl wait --for=condition=Ready wrev/NAME``, plus failure detection: Failed,
    RolledBack and Superseded end the wait with the reason and the per-pod detail.
    """
    api = api_client or make_api_client()
    report = reporter(progress)
    try:
        deadline = time.monotonic() + timeout
        return watch_revision(custom_objects_api(api), namespace, name, deadline, timeout, report, cancel)
    finally:
        if isinstance(report, TtyProgress):
            report.close()
        if api_client is None:
            api.close()


def wait_for_fleet_revision(
    fleet: str,
    min_revision: int,
    namespace: str = "default",
    timeout: float = 1800,
    api_client: client.ApiClient | None = None,
    *,
    interval: float = 1.0,
) -> int:
    """Wait until the fleet's ``currentRevision`` is at least ``min_revision``; return it.

    The staleness bound of asynchronous RL: unlike waiting on one WeightRevision, it is satisfied by any
    newer one (a revision superseded by a newer one still counts as "at least").
    """
    api = api_client or make_api_client()
    try:
        return poll_fleet_revision(custom_objects_api(api), fleet, min_revision, namespace, timeout, interval)
    finally:
        if api_client is None:
            api.close()


# ---------------------------------------------------------------------------------------------- publishing


def publish_revision(
    fleet: str,
    revision: int,
    verifier_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str] | None = None,
    namespace: str = "default",
    digest: bool = True,
    wait: bool = True,
    timeout: float = 1800,
    api_client: client.ApiClient | None = None,
    progress: ProgressFn | bool | None = None,
    *,
    name: str | None = None,
    cancel: threading.Event | None = None,
) -> PublishResult:
    """Publish ``revision`` of ``fleet``: the one call a training loop makes after writing a checkpoint.

    1. Reads the fleet (FleetNotFound, PermissionDenied) and the fleet's published revisions.
    2. If a WeightRevision with this number (or ``name``) exists: same content → no-op (returns it, and
       waits for it if ``wait``); different content → RevisionConflict.
    3. Otherwise validates exactly like the operator (paths under allowedRoots, a draft the fleet takes,
       revision newer than the fleet's current one and than any live published one): InvalidRevision /
       RevisionNotNewer.
    4. With ``digest`` (default), digests the verifier and draft directories in parallel (the value each
       engine must report after loading them); a missing, empty, unreadable or corrupt checkpoint raises
       CheckpointMissing naming the file. Without it the files are not read here (a publisher without the
       volume mounted) and the engines' load is the first check.
    5. Creates the WeightRevision ``<fleet>-r<revision>`` — the only write. Nothing is created when any
       earlier step fails, and nothing is ever deleted afterwards.
    6. With ``wait``, watches it until the Ready condition is True (at most ``timeout`` seconds, counted
       from here); Failed, RolledBack or Superseded raise RevisionFailed with the reason and per-pod
       detail; a timeout raises PublishTimeout and leaves the revision to the operator.

    ``progress``: None shows a progress line on a terminal's stderr, False shows nothing, a callable gets
    ``PublishProgress`` reports (from worker threads during digests). ``cancel`` (set by the async
    variant) stops before the create, or stops waiting.
    """
    if isinstance(revision, bool) or not isinstance(revision, int):
        raise InvalidRevision([f"spec.revision: must be an integer, got {revision!r}"], fleet=fleet)
    name = name or revision_name(fleet, revision)
    dpath = None if draft_path is None else {"path": abspath(draft_path)}
    spec = build_spec(fleet, revision, {"path": abspath(verifier_path)}, dpath)
    api = api_client or make_api_client()
    report = reporter(progress)
    try:
        custom = custom_objects_api(api)
        return _publish(custom, spec, name, namespace, digest, wait, timeout, report, cancel)
    finally:
        if isinstance(report, TtyProgress):
            report.close()
        if api_client is None:
            api.close()


Prepare = Callable[[WeightRevisionSpec, dict[str, Any]], None]
"""``prepare(spec, fleet_object)``: the last checks and the digests, after validation, before the create."""


def create_revision(
    custom: Any,
    spec: WeightRevisionSpec,
    name: str,
    namespace: str,
    report: ProgressFn | None,
    cancel: threading.Event | None,
    *,
    prepare: Prepare | None = None,
    pending: frozenset[str] = frozenset(),
    published_by: str = "rolloutfleet-publish",
) -> tuple[dict[str, Any], bool]:
    """Steps 1-5 of ``publish_revision`` for any spec; return the WeightRevision and whether it was created.

    Reads the fleet and its revisions; reuses a revision with this number and the same content (else
    RevisionConflict); validates a new one like the operator (``pending`` field paths excepted); runs
    ``prepare`` (which may fill the spec's digests, and raise: nothing is created then); creates it.
    ``rolloutfleet.trainer.push`` calls it with a ``prepare`` that digests the tensors it will send.
    ``published_by`` is the value of the ``rolloutfleet.io/published-by`` annotation on a new revision.
    """
    fleet = spec.fleet_ref.name
    fleet_obj = read_fleet(custom, namespace, fleet)
    revisions = list_revisions(custom, namespace)
    existing = _same_number(revisions, fleet, spec.revision, name)
    if existing is None:
        _check_against_fleet(spec, fleet_obj, revisions, pending)
    if prepare is not None:
        prepare(spec, fleet_obj)
    if existing is not None:
        obj = _reuse(existing, spec, namespace)
        if report is not None:
            report(PublishProgress("exists", 0, 0, f"{obj['metadata']['name']}: already published ({phase(obj)})"))
        return obj, False
    if cancel is not None and cancel.is_set():
        raise PublishCancelled(f"publish of revision {spec.revision} cancelled before anything was created")
    obj, created = _create(custom, spec, name, namespace, published_by)
    if report is not None and created:
        report(PublishProgress("created", 0, 0, f"{name}: created"))
    return obj, created


def _publish(
    custom: Any,
    spec: WeightRevisionSpec,
    name: str,
    namespace: str,
    digest: bool,
    wait: bool,
    timeout: float,
    report: ProgressFn | None,
    cancel: threading.Event | None,
) -> PublishResult:
    start = time.monotonic()

    def digests(spec: WeightRevisionSpec, _fleet: dict[str, Any]) -> None:
        assert spec.verifier.path is not None  # publish_revision builds path sources only
        vdigest, ddigest = compute_digests(spec.verifier.path, spec.draft.path if spec.draft else None, report)
        spec.verifier.digest = vdigest
        if spec.draft is not None:
            spec.draft.digest = ddigest

    obj, created = create_revision(custom, spec, name, namespace, report, cancel, prepare=digests if digest else None)
    name = str(obj["metadata"]["name"])
    if wait:
        remaining = timeout - (time.monotonic() - start)
        obj = watch_revision(custom, namespace, name, time.monotonic() + max(0.0, remaining), timeout, report, cancel)
    return result_of(obj, namespace, created)


def _reuse(existing: dict[str, Any], spec: WeightRevisionSpec, namespace: str) -> dict[str, Any]:
    diff = _difference(existing, spec)
    if diff is not None:
        raise RevisionConflict(str(existing["metadata"]["name"]), namespace, diff)
    return existing


def _create(
    custom: Any, spec: WeightRevisionSpec, name: str, namespace: str, published_by: str
) -> tuple[dict[str, Any], bool]:
    body = {
        "apiVersion": common.API_VERSION,
        "kind": revision_api.KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {FLEET_LABEL: spec.fleet_ref.name},
            "annotations": {PUBLISHED_BY: published_by},
        },
        "spec": spec.to_wire(),
    }
    try:
        obj = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, REVISIONS, body)
        return cast(dict[str, Any], obj), True
    except client.ApiException as exc:
        if exc.status == 409:  # a concurrent publisher won the race: same content is fine
            existing = read_revision(custom, namespace, name)
            if existing is not None:
                return _reuse(existing, spec, namespace), False
        if exc.status == 422:  # the schema or a CEL rule refused it (nothing was stored)
            raise InvalidRevision([server_message(exc)], fleet=spec.fleet_ref.name, revision=spec.revision) from None
        raise translate(exc, "create", REVISIONS, namespace) from None
    except API_ERRORS as exc:
        # The request may or may not have reached the server: say so rather than guess.
        raise translate(exc, "create", REVISIONS, namespace) from None


def result_of(obj: dict[str, Any], namespace: str, created: bool) -> PublishResult:
    """The PublishResult of a WeightRevision object as last read."""
    spec = obj.get("spec") or {}
    return PublishResult(
        name=str(obj["metadata"]["name"]),
        namespace=namespace,
        fleet=str((spec.get("fleetRef") or {}).get("name")),
        revision=int(spec.get("revision") or 0),
        created=created,
        verifier_digest=(spec.get("verifier") or {}).get("digest"),
        draft_digest=(spec.get("draft") or {}).get("digest"),
        phase=phase(obj),
        ready=ready(obj),
        object=obj,
    )


async def async_publish_revision(
    fleet: str,
    revision: int,
    verifier_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str] | None = None,
    namespace: str = "default",
    digest: bool = True,
    wait: bool = True,
    timeout: float = 1800,  # noqa: ASYNC109 - the rollout wait, run on the worker thread
    api_client: client.ApiClient | None = None,
    progress: ProgressFn | bool | None = None,
    *,
    name: str | None = None,
) -> PublishResult:
    """``publish_revision`` on a worker thread, for asyncio trainers (async RL: keep generating meanwhile).

    Cancelling the awaiting task stops the worker at its next check: before the create nothing is
    created; while waiting it stops watching (the revision stays, the operator carries on).
    """
    cancel = threading.Event()
    try:
        return await asyncio.to_thread(
            publish_revision,
            fleet,
            revision,
            verifier_path,
            draft_path,
            namespace,
            digest,
            wait,
            timeout,
            api_client,
            progress,
            name=name,
            cancel=cancel,
        )
    except asyncio.CancelledError:
        cancel.set()
        raise


def age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    """A kubectl-style age (``45s``, ``3m``, ``2h``, ``4d``) of an RFC 3339 timestamp; ``-`` if unknown."""
    if not timestamp:
        return "-"
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    seconds = max(0, int(((now or datetime.datetime.now(datetime.UTC)) - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 2 * 3600:
        return f"{seconds // 60}m"
    if seconds < 2 * 86400:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"
