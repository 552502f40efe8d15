"""An in-memory stand-in for the kubernetes CustomObjectsApi calls the publish API makes."""

from __future__ import annotations

import copy
import json
from typing import Any

from kubernetes import client


def api_error(status: int, message: str) -> client.ApiException:
    exc = client.ApiException(status=status, reason="x")
    exc.body = json.dumps({"kind": "Status", "message": message, "code": status})
    return exc


class FakeCustomObjects:
    """Fleets and WeightRevisions by (plural, namespace, name); ``deny`` maps a verb to a 403."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.deny: set[tuple[str, str]] = set()  # (verb, plural)
        self.creates: list[dict[str, Any]] = []
        self.calls: list[str] = []
        self.on_create_status: dict[str, Any] | None = None  # status the "operator" sets at once

    def add(self, plural: str, namespace: str, obj: dict[str, Any]) -> None:
        obj.setdefault("metadata", {}).setdefault("namespace", namespace)
        obj["metadata"].setdefault("resourceVersion", "1")
        self.objects[(plural, namespace, obj["metadata"]["name"])] = obj

    def _check(self, verb: str, plural: str, namespace: str) -> None:
        self.calls.append(f"{verb} {plural}")
        if (verb, plural) in self.deny:
            raise api_error(
                403,
                f'{plural}.rolloutfleet.io is forbidden: User "system:serviceaccount:{namespace}:ro" cannot '
                f'{verb} resource "{plural}" in API group "rolloutfleet.io" in the namespace "{namespace}"',
            )

    def get_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str, name: str) -> Any:
        self._check("get", plural, ns)
        try:
            return copy.deepcopy(self.objects[(plural, ns, name)])
        except KeyError:
            raise api_error(404, f'{plural}.rolloutfleet.io "{name}" not found') from None

    def list_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str, **kw: Any) -> Any:
        self._check("list", plural, ns)
        items = [copy.deepcopy(o) for (p, n, _), o in self.objects.items() if p == plural and n == ns]
        return {"items": items, "metadata": {"resourceVersion": "1"}}

    def create_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, body: dict[str, Any]
    ) -> Any:
        self._check("create", plural, ns)
        name = body["metadata"]["name"]
        if (plural, ns, name) in self.objects:
            raise api_error(409, f'{plural}.rolloutfleet.io "{name}" already exists')
        obj = copy.deepcopy(body)
        obj["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
        if self.on_create_status is not None:
            obj["status"] = copy.deepcopy(self.on_create_status)
        self.add(plural, ns, obj)
        self.creates.append(obj)
        return copy.deepcopy(obj)


def fleet(
    name: str = "pol", root: str = "/w", *, draft: str = "draft_model", current: int | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 2,
        "image": "vllm:x",
        "verifier": {"path": f"{root}/policy/step-0/verifier"},
        "draft": {"method": draft} if draft == "none" else {"method": draft, "path": f"{root}/policy/step-0/draft"},
        "weights": {"claimName": "ckpt", "mountPath": root, "allowedRoots": [f"{root}/policy"]},
    }
    status: dict[str, Any] = {} if current is None else {"currentRevision": current}
    return {"metadata": {"name": name}, "spec": spec, "status": status}


def revision(
    name: str,
    fleet_name: str,
    number: int,
    verifier: str,
    draft: str | None = None,
    phase: str = "Succeeded",
    **kw: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"fleetRef": {"name": fleet_name}, "revision": number, "verifier": {"path": verifier}}
    if draft:
        spec["draft"] = {"path": draft}
    for key, value in kw.items():
        spec[key] = value
    return {"metadata": {"name": name}, "spec": spec, "status": {"phase": phase}}
