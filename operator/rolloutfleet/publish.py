# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""Publish a WeightRevision from a training loop: digest, validate, create once, wait until Ready.

Called by trainers (``from rolloutfleet.publish import publish_revision``), by the ``rolloutfleet
publish``/``wait`` commands and by ``examples/trainer_loop.py``. It talks to the API server with the
official kubernetes client (synchronous; ``async_publish_revision`` runs it on a worker thread) and imports
neither kopf nor the operator's handlers, so a trainer process can import it cheaply.

It owns the order that keeps a failed publish from leaving anything behind: every check — the fleet, the
permissions to read, the checkpoint files and their digests, the semantic validation shared with the
operator, idempotency against what is already published — runs before the single create call, and
nothing is ever deleted afterwards (a revision the operator may already act on is the operator's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO, cast

import urllib3
from kubernetes import client, config, watch

from rolloutfleet import digest as digest_mod
from rolloutfleet.api import common, validation
from rolloutfleet.api import fleet as fleet_api
from rolloutfleet.api import revision as revision_api
from rolloutfleet.api.revision import Phase, WeightRevisionSpec
from rolloutfleet.trainer_errors import (
    CheckpointMissing,
    FleetNotFound,
    InvalidRevision,
    KubeApiError,
    PermissionDenied,
    PodFailure,
    PublishCancelled,
    PublishError,
    PublishTimeout,
    RevisionConflict,
    RevisionDeleted,
    RevisionFailed,
    RevisionNotFound,
    RevisionNotNewer,
)

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

GROUP, VERSION = common.GROUP, common.VERSION
FLEETS, REVISIONS = fleet_api.PLURAL, revision_api.PLURAL
FLEET_LABEL = "rolloutfleet.io/fleet"
PUBLISHED_BY = "rolloutfleet.io/published-by"
FAILED_PHASES = frozenset({Phase.FAILED.value, Phase.ROLLED_BACK.value, Phase.SUPERSEDED.value})
_DEAD_PHASES = FAILED_PHASES  # published revisions that no longer compete for the fleet
_WATCH_WINDOW = 60.0  # seconds per watch request; a cancellable wait uses a shorter one
_CANCELLABLE_WINDOW = 5.0


@dataclasses.dataclass(frozen=True)
class PublishProgress:
    """One progress report: ``stage`` is ``digest`` (bytes), ``created``/``exists`` or ``rollout`` (pods)."""

    stage: str
    done: int
    total: int
    message: str


ProgressFn = Callable[[PublishProgress], None]


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


def make_api_client(kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None) -> client.ApiClient:
    """A client for ``kubeconfig`` (default: ``$KUBECONFIG`` or ``~/.kube/config``), or in-cluster config.

    Inside a pod without ``KUBECONFIG`` (a trainer Job), the pod's ServiceAccount is used.
    """
    if kubeconfig is None and "KUBECONFIG" not in os.environ and "KUBERNETES_SERVICE_HOST" in os.environ:
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    try:
        api: client.ApiClient = config.new_client_from_config(
            config_file=None if kubeconfig is None else os.fspath(kubeconfig), context=context, persist_config=False
        )
    except (config.ConfigException, OSError) as exc:
        raise KubeApiError("loading the kubeconfig", str(exc)) from exc
    return api


# --------------------------------------------------------------------------------------------- API access


def custom_objects_api(api_client: client.ApiClient) -> Any:
    """The CustomObjectsApi used for every call (a seam for unit tests)."""
    return client.CustomObjectsApi(api_client)


def _server_message(exc: client.ApiException) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            parsed = json.loads(body)
        except (TypeError, ValueError):
            return str(body)
        if isinstance(parsed, dict) and parsed.get("message"):
            return str(parsed["message"])
    return str(getattr(exc, "reason", "") or exc)


def _translate(exc: Exception, verb: str, resource: str, namespace: str) -> PublishError:
    if isinstance(exc, client.ApiException):
        status = int(exc.status or 0)
        detail = _server_message(exc)
        if status in (401, 403):
            return PermissionDenied(verb, resource, namespace, detail, status=status)
        return KubeApiError(f"{verb} {resource} in {namespace}", detail, status or None)
    return KubeApiError(f"{verb} {resource} in {namespace}", f"{type(exc).__name__}: {exc}")


_API_ERRORS = (client.ApiException, urllib3.exceptions.HTTPError, OSError)


def read_fleet(custom: Any, namespace: str, fleet: str) -> dict[str, Any]:
    try:
        return cast(dict[str, Any], custom.get_namespaced_custom_object(GROUP, VERSION, namespace, FLEETS, fleet))
    except client.ApiException as exc:
        if exc.status == 404:
            crd_missing = "could not find the requested resource" in _server_message(exc)
            raise FleetNotFound(fleet, namespace, crd_missing=crd_missing) from None
        raise _translate(exc, "get", FLEETS, namespace) from None
    except _API_ERRORS as exc:
        raise _translate(exc, "get", FLEETS, namespace) from None


def read_revision(custom: Any, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return cast(dict[str, Any], custom.get_namespaced_custom_object(GROUP, VERSION, namespace, REVISIONS, name))
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise _translate(exc, "get", REVISIONS, namespace) from None
    except _API_ERRORS as exc:
        raise _translate(exc, "get", REVISIONS, namespace) from None


def list_revisions(custom: Any, namespace: str) -> list[dict[str, Any]]:
    try:
        out = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, REVISIONS)
    except _API_ERRORS as exc:
        raise _translate(exc, "list", REVISIONS, namespace) from None
    return list(cast(dict[str, Any], out).get("items") or [])


# ------------------------------------------------------------------------------------------------ digests


class _DigestProgress:
    """Sums the byte progress of the verifier and draft digests running in parallel."""

    def __init__(self, report: ProgressFn | None) -> None:
        self.report, self.lock = report, threading.Lock()
        self.parts: dict[str, tuple[int, int]] = {}

    def part(self, target: str) -> Callable[[int, int], None]:
        def update(done: int, total: int) -> None:
            if self.report is None:
                return
            with self.lock:
                self.parts[target] = (done, total)
                done_all = sum(d for d, _ in self.parts.values())
                total_all = sum(t for _, t in self.parts.values())
            self.report(PublishProgress("digest", done_all, total_all, f"digest {', '.join(sorted(self.parts))}"))

        return update


def _digest_one(target: str, path: str, progress: Callable[[int, int], None]) -> str:
    try:
        return digest_mod.digest_directory(path, progress=progress)
    except digest_mod.CheckpointError as exc:
        raise CheckpointMissing(target, exc.path, exc.reason) from None


def compute_digests(
    verifier_path: str, draft_path: str | None, progress: ProgressFn | None = None
) -> tuple[str, str | None]:
    """Digests of the verifier and (in parallel) the draft checkpoint; CheckpointMissing names a bad file."""
    tracker = _DigestProgress(progress)
    if draft_path is None:
        return _digest_one("verifier", verifier_path, tracker.part("verifier")), None
    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="digest") as pool:
        fut_v = pool.submit(_digest_one, "verifier", verifier_path, tracker.part("verifier"))
        fut_d = pool.submit(_digest_one, "draft", draft_path, tracker.part("draft"))
        # The verifier's error first: it is the one a user fixes first.
        return fut_v.result(), fut_d.result()


# ----------------------------------------------------------------------------------------- local checking


def _revision_number(obj: dict[str, Any]) -> int | None:
    value = (obj.get("spec") or {}).get("revision")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _phase(obj: dict[str, Any]) -> str:
    return str((obj.get("status") or {}).get("phase") or Phase.PENDING.value)


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
        if have.get("path") != want.path:
            return f"{target} path {have.get('path')} != {want.path}"
        if have.get("digest") and want.digest and have.get("digest") != want.digest:
            return f"{target} digest {have.get('digest')} != {want.digest}"
    return None


def _build_spec(fleet: str, revision: int, verifier_path: str, draft_path: str | None) -> WeightRevisionSpec:
    raw: dict[str, Any] = {"fleetRef": {"name": fleet}, "revision": revision, "verifier": {"path": verifier_path}}
    if draft_path is not None:
        raw["draft"] = {"path": draft_path}
    spec, errors = validation.parse_revision_spec(raw)
    if spec is None:
        raise InvalidRevision([str(e) for e in errors], fleet=fleet, revision=revision)
    return spec


def _check_against_fleet(spec: WeightRevisionSpec, fleet_obj: dict[str, Any], revisions: list[dict[str, Any]]) -> None:
    """Every rule the operator would refuse the revision for, without touching anything."""
    fleet_spec, parse_errors = validation.parse_fleet_spec(fleet_obj.get("spec") or {})
    if fleet_spec is None:
        raise InvalidRevision(
            [f"the RolloutFleet is invalid: {validation.summary(parse_errors)}"],
            fleet=spec.fleet_ref.name,
            revision=spec.revision,
        )
    current = (fleet_obj.get("status") or {}).get("currentRevision")
    current = current if isinstance(current, int) else None
    errors = validation.validate_revision(spec, fleet_spec, current_revision=current)
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
        if (n := _revision_number(r)) is not None and n > spec.revision and _phase(r) not in _DEAD_PHASES
    ]
    if newer:
        top = max(newer, key=lambda r: _revision_number(r) or 0)
        raise RevisionNotNewer(
            [
                f"spec.revision: must be newer than revision {_revision_number(top)} already published "
                f"({top['metadata']['name']}, {_phase(top)})"
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


def _abspath(path: str | os.PathLike[str]) -> str:
    # Not Path.resolve(): symlinks must stay as given (the engines may see the volume under another path).
    return os.path.abspath(os.fspath(path))  # noqa: PTH100


# ------------------------------------------------------------------------------------------------ waiting


def _ready(obj: dict[str, Any]) -> bool:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _pod_messages(message: str | None, names: list[str]) -> dict[str, str]:
    """Per-pod parts of a status message such as ``"...: pol-0: LoadVerifier: ...; pol-1: ..."``.

    After a rollback the operator's status.pods[] describe the rollback's own progress (messages cleared)
    and the per-pod failure survives only in status.message; this recovers it for RevisionFailed.pods.
    """
    if not message or not names:
        return {}
    starts: list[tuple[int, str]] = []
    for name in names:
        token = f"{name}: "
        at = message.find(token)
        while at >= 0:
            if at == 0 or message[max(0, at - 2) : at] in (": ", "; "):
                starts.append((at, name))
                break
            at = message.find(token, at + 1)
    starts.sort()
    out: dict[str, str] = {}
    for i, (at, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(message)
        out[name] = message[at + len(name) + 2 : end].rstrip().rstrip(";").strip()
    return out


def _failure(obj: dict[str, Any]) -> RevisionFailed:
    status = obj.get("status") or {}
    meta = obj.get("metadata") or {}
    raw_pods = [p for p in status.get("pods") or [] if isinstance(p, dict)]
    recovered = _pod_messages(status.get("message"), [str(p.get("name")) for p in raw_pods])
    pods = [
        PodFailure(
            name=str(p.get("name")),
            step=str(p.get("step") or "Pending"),
            attempts=int(p.get("attempts") or 0),
            message=p.get("message") or recovered.get(str(p.get("name"))),
        )
        for p in raw_pods
    ]
    pods.sort(key=lambda p: (p.message is None, p.name))
    return RevisionFailed(
        str(meta.get("name")),
        str(meta.get("namespace")),
        _phase(obj),
        status.get("reason"),
        status.get("message"),
        pods,
    )


def _rollout_progress(obj: dict[str, Any]) -> PublishProgress:
    status = obj.get("status") or {}
    name = (obj.get("metadata") or {}).get("name")
    done, total = int(status.get("podsUpdated") or 0), int(status.get("podsTotal") or 0)
    steps: dict[str, int] = {}
    for p in status.get("pods") or []:
        steps[str(p.get("step") or "Pending")] = steps.get(str(p.get("step") or "Pending"), 0) + 1
    busy = ", ".join(f"{k} {v}" for k, v in sorted(steps.items()) if k not in ("Done", "Pending"))
    return PublishProgress(
        "rollout", done, total, f"{name}: {_phase(obj)} {done}/{total}" + (f" ({busy})" if busy else "")
    )


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
    report = _reporter(progress)
    try:
        return _wait(custom_objects_api(api), namespace, name, time.monotonic() + timeout, timeout, report, cancel)
    finally:
        if isinstance(report, _TtyProgress):
            report.close()
        if api_client is None:
            api.close()


def _wait(
    custom: Any,
    namespace: str,
    name: str,
    deadline: float,
    timeout: float,
    report: ProgressFn | None,
    cancel: threading.Event | None,
) -> dict[str, Any]:
    window = _CANCELLABLE_WINDOW if cancel is not None else _WATCH_WINDOW
    last: dict[str, Any] | None = None
    last_msg = ""

    def settle(obj: dict[str, Any]) -> bool:
        nonlocal last, last_msg
        last = obj
        if report is not None:
            prog = _rollout_progress(obj)
            if prog.message != last_msg:
                last_msg = prog.message
                report(prog)
        if _ready(obj):
            return True
        if _phase(obj) in FAILED_PHASES:
            raise _failure(obj)
        return False

    watcher = watch.Watch()
    first = True
    while True:
        obj = read_revision(custom, namespace, name)
        if obj is None:
            raise RevisionNotFound(name, namespace) if first else RevisionDeleted(name, namespace)
        first = False
        if settle(obj):
            return obj
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = obj.get("status") or {}
            raise PublishTimeout(name, namespace, timeout, status.get("phase"), status.get("updated"))
        if cancel is not None and cancel.is_set():
            raise PublishCancelled(f"stopped waiting for WeightRevision {namespace}/{name} (cancelled)")
        seconds = max(1, int(min(remaining, window)))
        try:
            for event in watcher.stream(
                custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                REVISIONS,
                field_selector=f"metadata.name={name}",
                resource_version=(obj.get("metadata") or {}).get("resourceVersion"),
                timeout_seconds=seconds,
                _request_timeout=seconds + 15,
            ):
                if event.get("type") == "DELETED":
                    raise RevisionDeleted(name, namespace)
                raw = event.get("raw_object") or event.get("object")
                if isinstance(raw, dict) and settle(raw):
                    watcher.stop()
                    return raw
                if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                    watcher.stop()
                    break
        except client.ApiException as exc:
            if exc.status != 410:  # 410 Gone: our resourceVersion expired; re-read and watch again
                raise _translate(exc, "watch", REVISIONS, namespace) from None
        except (urllib3.exceptions.HTTPError, OSError):
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # a dropped watch: re-read and resume


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
    custom = custom_objects_api(api)
    deadline = time.monotonic() + timeout
    try:
        while True:
            current = (read_fleet(custom, namespace, fleet).get("status") or {}).get("currentRevision")
            if isinstance(current, int) and current >= min_revision:
                return current
            if time.monotonic() >= deadline:
                raise PublishTimeout(f"{fleet} (revision >= {min_revision})", namespace, timeout, None, None)
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    finally:
        if api_client is None:
            api.close()


# ----------------------------------------------------------------------------------------------- progress


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class _TtyProgress:
    """Rewrites one stderr line: digest bytes, then the rollout's pods; a newline when the text kind changes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.last, self.stage, self.start = stream, 0.0, "", time.monotonic()

    def __call__(self, p: PublishProgress) -> None:
        now = time.monotonic()
        if p.stage == "digest":
            if now - self.last < 0.1 and p.done < p.total:
                return
            rate = p.done / max(now - self.start, 1e-9)
            pct = 100.0 * p.done / p.total if p.total else 100.0
            text = f"{p.message}: {_size(p.done)}/{_size(p.total)} ({pct:.0f}%) {_size(rate)}/s"
        else:
            text = p.message
        if self.stage and self.stage != p.stage:
            self.stream.write("\n")
        self.stage, self.last = p.stage, now
        self.stream.write(f"\r\x1b[2K{text}")
        self.stream.flush()

    def close(self) -> None:
        if self.stage:
            self.stream.write("\n")
            self.stream.flush()
            self.stage = ""


def _reporter(progress: ProgressFn | bool | None) -> ProgressFn | None:
    """None: a progress line on a terminal's stderr, nothing otherwise; False: nothing; a callable: it."""
    if progress is None:
        return _TtyProgress(sys.stderr) if sys.stderr.isatty() else None
    if progress is True:
        return _TtyProgress(sys.stderr)
    if progress is False:
        return None
    return progress


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
    vpath = _abspath(verifier_path)
    dpath = None if draft_path is None else _abspath(draft_path)
    spec = _build_spec(fleet, revision, vpath, dpath)
    api = api_client or make_api_client()
    report = _reporter(progress)
    try:
        custom = custom_objects_api(api)
        return _publish(custom, spec, name, namespace, digest, wait, timeout, report, cancel)
    finally:
        if isinstance(report, _TtyProgress):
            report.close()
        if api_client is None:
            api.close()


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
    fleet = spec.fleet_ref.name
    fleet_obj = read_fleet(custom, namespace, fleet)
    revisions = list_revisions(custom, namespace)
    existing = _same_number(revisions, fleet, spec.revision, name)
    if existing is None:
        _check_against_fleet(spec, fleet_obj, revisions)
    if digest:
        vdigest, ddigest = compute_digests(spec.verifier.path, spec.draft.path if spec.draft else None, report)
        spec.verifier.digest = vdigest
        if spec.draft is not None:
            spec.draft.digest = ddigest
    created = False
    if existing is not None:
        obj = _reuse(existing, spec, namespace)
        if report is not None:
            report(PublishProgress("exists", 0, 0, f"{obj['metadata']['name']}: already published ({_phase(obj)})"))
    else:
        if cancel is not None and cancel.is_set():
            raise PublishCancelled(f"publish of revision {spec.revision} cancelled before anything was created")
        obj, created = _create(custom, spec, name, namespace)
        if report is not None and created:
            report(PublishProgress("created", 0, 0, f"{name}: created"))
    name = str(obj["metadata"]["name"])
    if wait:
        remaining = timeout - (time.monotonic() - start)
        obj = _wait(custom, namespace, name, time.monotonic() + max(0.0, remaining), timeout, report, cancel)
    return _result(obj, namespace, created)


def _reuse(existing: dict[str, Any], spec: WeightRevisionSpec, namespace: str) -> dict[str, Any]:
    diff = _difference(existing, spec)
    if diff is not None:
        raise RevisionConflict(str(existing["metadata"]["name"]), namespace, diff)
    return existing


def _create(custom: Any, spec: WeightRevisionSpec, name: str, namespace: str) -> tuple[dict[str, Any], bool]:
    body = {
        "apiVersion": common.API_VERSION,
        "kind": revision_api.KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {FLEET_LABEL: spec.fleet_ref.name},
            "annotations": {PUBLISHED_BY: "rolloutfleet-publish"},
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
            raise InvalidRevision([_server_message(exc)], fleet=spec.fleet_ref.name, revision=spec.revision) from None
        raise _translate(exc, "create", REVISIONS, namespace) from None
    except _API_ERRORS as exc:
        # The request may or may not have reached the server: say so rather than guess.
        raise _translate(exc, "create", REVISIONS, namespace) from None


def _result(obj: dict[str, Any], namespace: str, created: bool) -> PublishResult:
    spec = obj.get("spec") or {}
    return PublishResult(
        name=str(obj["metadata"]["name"]),
        namespace=namespace,
        fleet=str((spec.get("fleetRef") or {}).get("name")),
        revision=int(spec.get("revision") or 0),
        created=created,
        verifier_digest=(spec.get("verifier") or {}).get("digest"),
        draft_digest=(spec.get("draft") or {}).get("digest"),
        phase=_phase(obj),
        ready=_ready(obj),
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
