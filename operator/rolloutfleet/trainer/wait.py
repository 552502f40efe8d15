# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""Waiting on a published revision: watch it until Ready or failed, or poll a fleet's current revision.

Called by ``rolloutfleet.trainer.publish`` (``publish_revision(wait=True)``, ``wait_for_revision``,
``wait_for_fleet_revision``), which owns the API client, and by ``rolloutfleet.trainer.push`` (the phase,
Ready and failure tests while it serves sessions). Owns reading the operator's status the way a
trainer needs it: the Ready condition (as ``kubectl wait``), failure phases with per-pod detail, and
progress lines for the rollout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import urllib3
from kubernetes import client, watch

from rolloutfleet.api.revision import Phase
from rolloutfleet.trainer.errors import (
    PodFailure,
    PublishCancelled,
    PublishTimeout,
    RevisionDeleted,
    RevisionFailed,
    RevisionNotFound,
)
from rolloutfleet.trainer.kube import GROUP, REVISIONS, VERSION, read_fleet, read_revision, translate
from rolloutfleet.trainer.progress import ProgressFn, PublishProgress

FAILED_PHASES = frozenset({Phase.FAILED.value, Phase.ROLLED_BACK.value, Phase.SUPERSEDED.value})
_WATCH_WINDOW = 60.0  # seconds per watch request; a cancellable wait uses a shorter one
_CANCELLABLE_WINDOW = 5.0


def phase(obj: dict[str, Any]) -> str:
    return str((obj.get("status") or {}).get("phase") or Phase.PENDING.value)


def ready(obj: dict[str, Any]) -> bool:
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


def failure_of(obj: dict[str, Any]) -> RevisionFailed:
    """The RevisionFailed a revision in a failed phase ends a wait with (reason, message, per-pod detail)."""
    status = obj.get("status") or {}
    meta = obj.get("metadata") or {}
    raw_pods = [p for p in status.get("pods") or [] if isinstance(p, dict)]
    # status.failures keeps each failing pod's step and message past the rollback (a bounded sample when
    # many pods failed alike; status.message then summarises them all).
    failed = {str(f.get("name")): f for f in status.get("failures") or [] if isinstance(f, dict)}
    recovered = _pod_messages(status.get("message"), [str(p.get("name")) for p in raw_pods])
    pods = [
        PodFailure(
            name=name,
            step=str(f.get("step") or "Pending"),
            attempts=int(f.get("attempts") or 0),
            message=f.get("message") or None,
        )
        for name, f in failed.items()
    ]
    pods += [
        PodFailure(
            name=str(p.get("name")),
            step=str(p.get("step") or "Pending"),
            attempts=int(p.get("attempts") or 0),
            message=p.get("message") or recovered.get(str(p.get("name"))),
        )
        for p in raw_pods
        if str(p.get("name")) not in failed
    ]
    pods.sort(key=lambda p: (p.message is None, p.name))
    return RevisionFailed(
        str(meta.get("name")),
        str(meta.get("namespace")),
        phase(obj),
        status.get("reason"),
        status.get("message"),
        pods,
    )


def rollout_progress(obj: dict[str, Any]) -> PublishProgress:
    """The progress line of a rollout: phase, pods updated, and how many pods are at which step."""
    status = obj.get("status") or {}
    name = (obj.get("metadata") or {}).get("name")
    done, total = int(status.get("podsUpdated") or 0), int(status.get("podsTotal") or 0)
    steps: dict[str, int] = {}
    for p in status.get("pods") or []:
        steps[str(p.get("step") or "Pending")] = steps.get(str(p.get("step") or "Pending"), 0) + 1
    busy = ", ".join(f"{k} {v}" for k, v in sorted(steps.items()) if k not in ("Done", "Pending"))
    return PublishProgress(
        "rollout", done, total, f"{name}: {phase(obj)} {done}/{total}" + (f" ({busy})" if busy else "")
    )


def watch_revision(
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
            prog = rollout_progress(obj)
            if prog.message != last_msg:
                last_msg = prog.message
                report(prog)
        if ready(obj):
            return True
        if phase(obj) in FAILED_PHASES:
            raise failure_of(obj)
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
                raise translate(exc, "watch", REVISIONS, namespace) from None
        except (urllib3.exceptions.HTTPError, OSError):
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # a dropped watch: re-read and resume


def poll_fleet_revision(
    custom: Any, fleet: str, min_revision: int, namespace: str, timeout: float, interval: float
) -> int:
    """Poll the fleet until its ``currentRevision`` is at least ``min_revision``; return it."""
    deadline = time.monotonic() + timeout
    while True:
        current = (read_fleet(custom, namespace, fleet).get("status") or {}).get("currentRevision")
        if isinstance(current, int) and current >= min_revision:
            return current
        if time.monotonic() >= deadline:
            raise PublishTimeout(f"{fleet} (revision >= {min_revision})", namespace, timeout, None, None)
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
