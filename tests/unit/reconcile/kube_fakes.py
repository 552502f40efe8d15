"""``FakeKube``: an in-memory stand-in for ``rolloutfleet.adapters.kube.Kube`` (no API server, no threads).

Used by the reconcile unit tests (``reconcile_fakes``). It has the adapter's async methods with the API
server's semantics that the reconcilers rely on: server-side apply creates or replaces the fields given
and bumps ``metadata.generation`` when the spec changes; ``get`` answers None when absent; ``list`` filters
by namespace and an equality label selector; ``create`` answers None on a conflict (409);
``patch_status`` is a JSON merge patch (RFC 7386) of the status subresource, with an optional
``resource_version`` precondition (409 when it is stale); every object is deep-copied in and out, since
callers mutate what they get. ``requests`` and ``on_request`` count the operator's calls like the adapter;
``calls`` records them in order and ``before_call`` lets a test act at an exact point of a pass (e.g. a
fleet reconcile landing between a pass's read and its write). Pods follow the kubelet's readiness rule:
``Ready`` is ``ContainersReady`` and every readiness gate of the spec True (``patch_pod_condition`` sets
a gate, as the adapter's strategic-merge patch does). Writes made as a user would (``kubectl
apply``/``delete``, the kubelet updating pods) go through ``apply_user``/``delete_user``/``add_pod``/
``set_pod``/``delete_pod`` and are neither counted nor hooked.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import itertools
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from rolloutfleet.adapters.kube import KubeError

# Discovery of core/v1 pods for the fake API servers on loopback (test_executor_kube, test_kube_watch). One
# list for all of them: the dynamic client caches discovery in a file named after host:port, so a server that
# served fewer resources on a port reused later would leave, e.g., no pods/status for the next one.
POD_RESOURCES = {
    "kind": "APIResourceList",
    "groupVersion": "v1",
    "resources": [
        {
            "name": "pods",
            "singularName": "pod",
            "namespaced": True,
            "kind": "Pod",
            "verbs": ["get", "list", "watch", "patch"],
        },
        {"name": "pods/status", "singularName": "", "namespaced": True, "kind": "Pod", "verbs": ["get", "patch"]},
    ],
}

Manifest = dict[str, Any]
Key = tuple[str, str, str, str]  # (apiVersion, kind, namespace, name)
Manifests = list[Manifest]  # named here: inside FakeKube, ``list`` is the method
Events = list[dict[str, Any]]
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@dataclasses.dataclass(frozen=True)
class FakeCall:
    """One call of the operator to the fake, in the order it was made."""

    verb: str  # apply | get | list | create | patch_status | delete | event
    kind: str
    namespace: str | None
    name: str | None
    body: Manifest | None = None  # what was written (a copy), for writes


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def matches_selector(obj_labels: dict[str, str], selector: str) -> bool:
    """An equality-based label selector: ``k=v``, ``k==v``, ``k!=v`` or a bare ``k`` (exists), comma-joined."""
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            if obj_labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if obj_labels.get(key.strip()) != value.strip():
                return False
        elif term not in obj_labels:
            return False
    return True


class FakeKube:
    """The objects of one fake cluster, keyed by (apiVersion, kind, namespace, name)."""

    def __init__(self) -> None:
        self.objects: dict[Key, Manifest] = {}
        self.events: Events = []
        self.calls: list[FakeCall] = []
        self.requests = 0
        self.on_request: Callable[[str], None] | None = None
        self.before_call: Callable[[FakeCall], Awaitable[None]] | None = None
        self.closed = False
        self._rv = itertools.count(1)
        self._clock = itertools.count(0)

    # --- the adapter's surface ---------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True

    async def apply(self, manifest: Manifest) -> Manifest:
        """Server-side apply: create, or replace the fields given (status is the subresource's: kept)."""
        meta = manifest["metadata"]
        await self._call("patch", FakeCall("apply", manifest["kind"], meta.get("namespace"), meta["name"], manifest))
        return self._store(manifest)

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        await self._call("get", FakeCall("get", kind, namespace, name))
        obj = self.objects.get((api_version, kind, namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str = "") -> Manifests:
        await self._call("list", FakeCall("list", kind, namespace, None))
        return self.find(api_version, kind, namespace, label_selector)

    async def create(self, manifest: Manifest) -> Manifest | None:
        meta = manifest["metadata"]
        await self._call(
            "create", FakeCall("create", manifest["kind"], meta.get("namespace"), meta.get("name"), manifest)
        )
        return self._create(manifest)

    async def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        status: Manifest,
        *,
        resource_version: str | None = None,
    ) -> str | None:
        """Merge-patch ``status``; 404 when absent, 409 when ``resource_version`` is given and stale; the
        object's resourceVersion after it (bumped only by a change, as the API server does)."""
        await self._call("patch", FakeCall("patch_status", kind, namespace, name, {"status": status}))
        key = (api_version, kind, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise KubeError(404, f'{kind.lower()}s "{name}" not found')
        if resource_version is not None and resource_version != obj["metadata"]["resourceVersion"]:
            raise KubeError(
                409,
                f'Operation cannot be fulfilled on {kind.lower()}s "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
            )
        new_status = merge_patch(obj.get("status") or {}, copy.deepcopy(status))
        # Like the API server's list-map validation (x-kubernetes-list-map-keys): a key twice is a 422. The
        # per-pod lists are atomic on the server (api.common.PER_POD_LIST_EXTRA) and still checked here: the
        # operator's writers must never name a pod twice.
        for field, key in (("pods", "name"), ("failures", "name"), ("timings", "step"), ("conditions", "type")):
            keys = [e.get(key) for e in new_status.get(field) or [] if isinstance(e, dict)]
            if len(keys) != len(set(keys)):
                raise KubeError(422, f"status.{field}: Duplicate value for {key}")
        if new_status != (obj.get("status") or {}):
            obj["status"] = new_status
            obj["metadata"]["resourceVersion"] = str(next(self._rv))
        return str(obj["metadata"]["resourceVersion"])

    async def patch_labels(
        self, api_version: str, kind: str, namespace: str, name: str, labels: dict[str, str]
    ) -> Manifest:
        """Merge labels into metadata.labels (a metadata change: no generation bump)."""
        await self._call("patch", FakeCall("patch", kind, namespace, name, {"metadata": {"labels": labels}}))
        obj = self.objects.get((api_version, kind, namespace, name))
        if obj is None:
            raise KubeError(404, f'{kind.lower()}s "{name}" not found')
        merged = {**(obj["metadata"].get("labels") or {}), **labels}
        if merged != obj["metadata"].get("labels"):
            obj["metadata"]["labels"] = merged
            obj["metadata"]["resourceVersion"] = str(next(self._rv))
        return copy.deepcopy(obj)

    async def patch_pod_condition(
        self, namespace: str, name: str, condition: Manifest, *, uid: str | None = None
    ) -> None:
        """Strategic-merge one pod condition (conditions merge by ``type``); the kubelet recomputes Ready.

        A ``uid`` other than the pod's is refused with 409, as the API server refuses a patch whose
        metadata.uid names another object (a precondition)."""
        await self._call(
            "patch", FakeCall("patch_status", "Pod", namespace, name, {"status": {"conditions": [condition]}})
        )
        obj = self.objects.get(("v1", "Pod", namespace, name))
        if obj is None:
            raise KubeError(404, f'pods "{name}" not found')
        if uid is not None and obj["metadata"].get("uid") != uid:
            raise KubeError(
                409,
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {obj['metadata'].get('uid')}",
            )
        before = copy.deepcopy(obj.get("status"))
        _set_condition(obj, copy.deepcopy(condition))
        _kubelet_ready(obj)
        if obj.get("status") != before:
            obj["metadata"]["resourceVersion"] = str(next(self._rv))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        await self._call("delete", FakeCall("delete", kind, namespace, name))
        self.objects.pop((api_version, kind, namespace, name), None)

    async def event(self, involved: Manifest, type_: str, reason: str, message: str) -> None:
        """Record the event (the adapter posts a core/v1 Event through ``create``: one request). The involved
        object needs what the adapter's Event needs of it: apiVersion, kind and metadata."""
        meta = involved["metadata"]
        api_version, kind = involved["apiVersion"], involved["kind"]  # KeyError, as in the adapter
        await self._call("create", FakeCall("event", "Event", meta.get("namespace"), meta.get("name")))
        self.events.append(
            {
                "apiVersion": api_version,
                "kind": kind,
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "type": type_,
                "reason": reason,
                "message": message[:1024],
            }
        )

    # --- reads for tests (not counted) --------------------------------------------------------------

    def find(self, api_version: str, kind: str, namespace: str | None, label_selector: str = "") -> Manifests:
        """Objects of a kind (in a namespace; all when None) whose labels match, sorted by name."""
        out = [
            copy.deepcopy(obj)
            for (av, k, ns, _), obj in sorted(self.objects.items())
            if av == api_version
            and k == kind
            and (namespace is None or ns == namespace)
            and matches_selector(obj["metadata"].get("labels") or {}, label_selector)
        ]
        return out

    def peek(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        """A copy of one stored object, without counting a request."""
        obj = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def pod_ready(self, namespace: str, name: str) -> bool:
        """The pod's Ready condition as the kubelet computed it."""
        obj = self.objects[("v1", "Pod", namespace, name)]
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in obj["status"]["conditions"])

    def events_for(self, name: str, reason: str | None = None) -> Events:
        return [e for e in self.events if e["name"] == name and (reason is None or e["reason"] == reason)]

    # --- writes as a user, a controller or the kubelet would make them ------------------------------

    def apply_user(self, manifest: Manifest) -> Manifest:
        """``kubectl apply``: create, or update spec/labels/annotations (generation bumps on a spec change)."""
        return self._store(manifest)

    def delete_user(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """``kubectl delete`` (no finalizers here: the object is gone at once)."""
        self.objects.pop((api_version, kind, namespace, name), None)

    def add_pod(
        self,
        namespace: str,
        name: str,
        ip: str | None,
        phase: str = "Running",
        ready: bool = True,
        labels: dict[str, str] | None = None,
        readiness_gates: tuple[str, ...] = (),
    ) -> Manifest:
        """A pod as the kubelet reports it: phase, IP, ContainersReady (``ready``) and Ready.

        Like the kubelet, Ready is ContainersReady and every readiness gate of the spec True (gates start
        unset, i.e. not True).
        """
        spec: Manifest = {"containers": [{"name": "engine"}]}
        if readiness_gates:
            spec["readinessGates"] = [{"conditionType": g} for g in readiness_gates]
        pod: Manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": spec,
            "status": _pod_status(phase, ip, ready),
        }
        _kubelet_ready(pod)
        self._create(pod, exist_ok=False)
        return self.peek("v1", "Pod", namespace, name) or pod

    def set_pod(
        self,
        namespace: str,
        name: str,
        *,
        ip: str | None = None,
        phase: str | None = None,
        ready: bool | None = None,
        deleting: bool | None = None,
        restarted: bool = False,
    ) -> Manifest:
        """Change what the kubelet reports of a pod (fields left None are kept). ``restarted``: its container
        restarted (the kubelet counts it in ``containerStatuses[].restartCount``)."""
        obj = self.objects[("v1", "Pod", namespace, name)]
        status = obj.setdefault("status", {})
        if ip is not None:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        if phase is not None:
            status["phase"] = phase
        if ready is not None:
            _set_condition(obj, {"type": "ContainersReady", "status": "True" if ready else "False"})
        if restarted:
            statuses = status.setdefault("containerStatuses", [{"name": "engine", "restartCount": 0}])
            statuses[0]["restartCount"] = int(statuses[0].get("restartCount", 0)) + 1
        if deleting is not None:
            if deleting:
                obj["metadata"]["deletionTimestamp"] = self._now()
            else:
                obj["metadata"].pop("deletionTimestamp", None)
        _kubelet_ready(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        return copy.deepcopy(obj)

    def delete_pod(self, namespace: str, name: str) -> None:
        self.delete_user("v1", "Pod", namespace, name)

    # --- internals -----------------------------------------------------------------------------------

    async def _call(self, verb: str, call: FakeCall) -> None:
        self.requests += 1
        if self.on_request is not None:
            self.on_request(verb)
        if call.body is not None:
            call = dataclasses.replace(call, body=copy.deepcopy(call.body))
        self.calls.append(call)
        hook = self.before_call
        if hook is not None:
            await hook(call)
        await asyncio.sleep(0)  # the real adapter awaits a thread: other tasks run meanwhile

    def _now(self) -> str:
        # One second per stamp: creation order is total and stable (the API server has second resolution).
        stamp = EPOCH + datetime.timedelta(seconds=next(self._clock))
        return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _create(self, manifest: Manifest, *, exist_ok: bool = True) -> Manifest | None:
        obj = copy.deepcopy(manifest)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            meta["name"] = f"{meta.get('generateName', 'object-')}{uuid.uuid4().hex[:5]}"
        key = (obj["apiVersion"], obj["kind"], meta.get("namespace") or "", meta["name"])
        if key in self.objects:
            if exist_ok:
                return None
            raise KubeError(409, f'{obj["kind"].lower()}s "{meta["name"]}" already exists')
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=self._now(),
            resourceVersion=str(next(self._rv)),
            generation=1,
        )
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def _store(self, manifest: Manifest) -> Manifest:
        """Create or update by apply semantics: metadata labels/annotations merge, other fields replace."""
        meta = manifest["metadata"]
        key = (manifest["apiVersion"], manifest["kind"], meta.get("namespace") or "", meta["name"])
        old = self.objects.get(key)
        if old is None:
            body = {k: v for k, v in manifest.items() if k != "status"}
            created = self._create(body)
            assert created is not None
            return created
        new = copy.deepcopy(old)
        for field, value in manifest.items():
            if field in ("apiVersion", "kind", "status"):
                continue  # status belongs to the status subresource
            if field == "metadata":
                for part in ("labels", "annotations"):
                    if part in value:
                        new["metadata"][part] = {**(new["metadata"].get(part) or {}), **copy.deepcopy(value[part])}
                if "ownerReferences" in value:
                    new["metadata"]["ownerReferences"] = copy.deepcopy(value["ownerReferences"])
                continue
            new[field] = copy.deepcopy(value)
        if new != old:
            if new.get("spec") != old.get("spec"):
                new["metadata"]["generation"] = int(old["metadata"].get("generation") or 1) + 1
            new["metadata"]["resourceVersion"] = str(next(self._rv))
            self.objects[key] = new
        return copy.deepcopy(new)


def _set_condition(pod: Manifest, condition: Manifest) -> None:
    status = pod.setdefault("status", {})
    conds = [c for c in status.get("conditions") or [] if c.get("type") != condition["type"]]
    status["conditions"] = [*conds, condition]


def _kubelet_ready(pod: Manifest) -> None:
    """Ready = ContainersReady and every readiness gate True (kubelet's rule)."""
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    gates = [g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []]
    ready = conds.get("ContainersReady") == "True" and all(conds.get(g) == "True" for g in gates)
    if conds.get("Ready") != ("True" if ready else "False"):
        _set_condition(pod, {"type": "Ready", "status": "True" if ready else "False"})


def _pod_status(phase: str, ip: str | None, ready: bool) -> Manifest:
    status: Manifest = {
        "phase": phase,
        "conditions": [{"type": "ContainersReady", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return status
