"""``WatchedList``: one list of objects (a fleet's pods) kept current by a watch, so reads cost nothing.

Used by ``adapters.kube.Kube.list`` for pods listed by a label selector (every revision pass and every
fleet-status write lists the fleet's pods). Why (issue 18, profiled at 1,024 pods): each of those lists
made the API server encode, and the operator decode, every pod again — a quarter of the operator's CPU
during a rollout (two lists per second of progress). A watch delivers only what changed: about four
events per pod per revision (its gate closed, not Ready, gate open, Ready).

Not kopf's machinery (an index fed by kopf's per-object handlers measured slower: every pod event went
through its handler pipeline, and the index trailed the API server): one stream per (namespace, selector),
decoded line by line, kept in a dict by name. ``Kube.list`` serves from it only while the watch is open
(``current``); before the first list, after a dropped stream or an expired resourceVersion (410 Gone), or
when the operator may not watch (403: an older chart), reads are real lists again, and the next list
seeds the watch anew. A list nobody read for ``IDLE_SECONDS`` (a deleted fleet) stops its watch.

What it holds of each pod is :func:`pod_projection`: its metadata without ``managedFields``, its status, and
of its spec only the readiness gates and the node. The rest (every container's command line, environment
and probes, the volumes, the field managers: about nine tenths of a 23 KB pod) is never read by the operator,
and at 4,096 pods those copies were most of its memory (bench/results/rollout_overhead.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rolloutfleet.adapters.kube_http import KubeHTTP, KubeHTTPError

Manifest = dict[str, Any]
log = logging.getLogger(__name__)
IDLE_SECONDS = 600.0  # a list not read this long stops being watched
WATCH_SECONDS = 290  # the API server ends each watch after this; it is re-opened from the last version


# The only parts of a pod's spec anything in the operator reads (planning.pod_readiness: the readiness gates;
# the node is kept for messages and debugging). A reader of another spec field must add it here:
# tests/unit/reconcile/test_kube_watch.py checks every pod reader on projected and full pods alike.
POD_SPEC_KEPT = ("readinessGates", "nodeName")


class _PodSpec(msgspec.Struct, rename="camel"):
    """``POD_SPEC_KEPT``, as the watch decodes them (the rest of the spec is skipped, not decoded)."""

    readiness_gates: Any = msgspec.UNSET
    node_name: Any = msgspec.UNSET


class _Metadata(msgspec.Struct, rename="camel"):
    """Every field of a Kubernetes ObjectMeta but ``managedFields`` (half of a pod's bytes)."""

    name: Any = msgspec.UNSET
    generate_name: Any = msgspec.UNSET
    namespace: Any = msgspec.UNSET
    self_link: Any = msgspec.UNSET
    uid: Any = msgspec.UNSET
    resource_version: Any = msgspec.UNSET
    generation: Any = msgspec.UNSET
    creation_timestamp: Any = msgspec.UNSET
    deletion_timestamp: Any = msgspec.UNSET
    deletion_grace_period_seconds: Any = msgspec.UNSET
    labels: Any = msgspec.UNSET
    annotations: Any = msgspec.UNSET
    owner_references: Any = msgspec.UNSET
    finalizers: Any = msgspec.UNSET


class _Object(msgspec.Struct, rename="camel"):
    """A watched pod as :func:`pod_projection` keeps it (or an ERROR event's Status, with its message)."""

    api_version: Any = msgspec.UNSET
    kind: Any = msgspec.UNSET
    metadata: _Metadata | msgspec.UnsetType = msgspec.UNSET
    spec: _PodSpec | msgspec.UnsetType = msgspec.UNSET
    status: Any = msgspec.UNSET
    message: Any = msgspec.UNSET


class _Event(msgspec.Struct):
    type: str
    object: _Object


_EVENTS = msgspec.json.Decoder(_Event)


def decode_pod_event(line: bytes) -> Manifest:
    """One line of a pod watch, decoded only as far as :func:`pod_projection` keeps it (msgspec skips the
    rest without building it: 7x faster than ``json.loads`` of the whole pod, measured on a pod like ours).
    Absent fields stay absent, so the event reads exactly like the projection of the full one."""
    try:
        event = _EVENTS.decode(line)
    except msgspec.ValidationError as exc:  # e.g. no "type": not a watch event
        raise ValueError(f"not a watch event: {exc}") from exc
    obj = msgspec.to_builtins(event.object)
    obj.setdefault("metadata", {})
    return {"type": event.type, "object": obj}


def pod_projection(obj: Manifest) -> Manifest:
    """What a watched list keeps of a pod: everything but its metadata's managedFields and most of its spec."""
    kept = {key: value for key, value in obj.items() if key not in ("metadata", "spec")}
    kept["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    spec = obj.get("spec") or {}
    kept["spec"] = {k: spec[k] for k in POD_SPEC_KEPT if k in spec}
    return kept


class WatchedList:
    """The pods at ``path`` matching ``selector``, by name, as :func:`pod_projection` keeps them; see the
    module docstring."""

    def __init__(self, http: KubeHTTP, path: str, selector: str, *, on_request: Callable[[str], None]) -> None:
        self.http, self.path, self.selector = http, path, selector
        self._on_request = on_request
        self.items: dict[str, Manifest] = {}
        self.version = ""
        self.open = False  # the watch stream is established: every change since ``version`` arrives
        self.forbidden = False  # 403 on watch: serve real lists for good
        self.last_read = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    @property
    def current(self) -> bool:
        """Whether a read may be served from here (the watch is open and nothing it said is lost)."""
        return self.open and self._task is not None and not self._task.done()

    def read(self) -> list[Manifest]:
        self.last_read = time.monotonic()
        return list(self.items.values())

    def idle(self) -> bool:
        return time.monotonic() - self.last_read > IDLE_SECONDS

    def seed(self, listing: Manifest) -> None:
        """A fresh list's answer: the objects and the version to watch from; (re)starts the watch."""
        self.items = {str(o["metadata"]["name"]): pod_projection(o) for o in listing.get("items") or []}
        self.version = str((listing.get("metadata") or {}).get("resourceVersion") or "")
        self.last_read = time.monotonic()
        if self.forbidden or not self.version:
            return
        self.stop()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name=f"watch {self.path}")

    def stop(self) -> None:
        self.open = False
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        task, self._task = self._task, None
        self.open = False
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        """Follow the stream until it fails; then reads fall back to lists (which seed it again)."""
        ended: list[bool] = []  # an ERROR event: the watch cannot go on

        def event(decoded: Any) -> bool:  # each event, from inside the connection's reads (``KubeHTTP.watch``)
            if self._apply(checked(decoded)):
                return True
            ended.append(True)
            return False

        try:
            while True:
                self._on_request("watch")
                params = {
                    "watch": "true",
                    "resourceVersion": self.version,
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": str(WATCH_SECONDS),
                }
                if self.selector:
                    params["labelSelector"] = self.selector
                await self.http.watch(
                    self.path,
                    params=params,
                    timeout=WATCH_SECONDS + 30,
                    on_event=event,
                    on_open=self._opened,
                    decode=decode_pod_event,
                )
                if ended:
                    return
                # The server ended the watch (its timeout): open the next one from the last version.
        except KubeHTTPError as exc:
            if exc.status == 403:
                self.forbidden = True
                log.warning("cannot watch %s (%s): listing it at every read instead", self.path, exc)
            else:
                log.info("watch of %s ended: %s", self.path, exc)
        except (ValueError, KeyError, TypeError) as exc:  # a line that is not a watch event
            log.warning("watch of %s: unreadable event: %s", self.path, exc)
        finally:
            self.open = False

    def _opened(self) -> None:
        self.open = True

    def _apply(self, event: Manifest) -> bool:
        """One watch event into ``items``; False when the watch cannot go on (an ERROR event: 410 Gone)."""
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            log.info("watch of %s: %s", self.path, obj.get("message"))
            return False
        self.version = str(obj["metadata"].get("resourceVersion") or self.version)
        if kind == "BOOKMARK":
            return True
        name = str(obj["metadata"]["name"])
        if kind == "DELETED":
            self.items.pop(name, None)
        else:  # ADDED, MODIFIED: decoded as the projection already (``decode_pod_event``)
            self.items[name] = obj
        return True


def checked(event: Any) -> Manifest:
    """One decoded line of a watch stream, checked to be an event."""
    if not isinstance(event, dict) or "type" not in event or not isinstance(event.get("object"), dict):
        raise ValueError(f"not a watch event: {str(event)[:200]}")
    return event
