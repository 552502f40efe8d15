"""In-memory stand-ins for what the trainer client talks to: the kubernetes API calls it makes
(CustomObjectsApi, CoreV1Api's Secret read) and, for pushes, engines on 127.0.0.1 that record every
``/update_weights`` call."""

from __future__ import annotations

import base64
import copy
import dataclasses
import http.server
import json
import threading
from collections.abc import Callable
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
        self.patches: list[tuple[str, dict[str, Any]]] = []  # (name, annotations) of each annotation patch
        # Called with the stored WeightRevision before each read of it: the test's stand-in operator.
        self.on_read_revision: Callable[[dict[str, Any]], None] | None = None

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
        stored = self.objects.get((plural, ns, name))
        if stored is not None and plural == "weightrevisions" and self.on_read_revision is not None:
            self.on_read_revision(stored)
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

    def patch_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, name: str, body: dict[str, Any]
    ) -> Any:
        """A JSON merge patch of metadata.annotations (the only patch the trainer client sends)."""
        self._check("patch", plural, ns)
        if set(body) != {"metadata"} or set(body["metadata"]) != {"annotations"}:
            raise AssertionError(f"unexpected patch {body}")
        try:
            obj = self.objects[(plural, ns, name)]
        except KeyError:
            raise api_error(404, f'{plural}.rolloutfleet.io "{name}" not found') from None
        annotations = obj["metadata"].setdefault("annotations", {})
        for key, value in body["metadata"]["annotations"].items():
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
        obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        self.patches.append((name, dict(body["metadata"]["annotations"])))
        return copy.deepcopy(obj)


@dataclasses.dataclass
class _Secret:
    data: dict[str, str] | None


class FakeCore:
    """``read_namespaced_secret`` over ``secrets[(namespace, name)] = {key: text}``; ``deny`` answers 403."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.deny = False

    def read_namespaced_secret(self, name: str, namespace: str) -> Any:
        if self.deny:
            raise api_error(403, f'secrets "{name}" is forbidden: User "trainer" cannot get resource "secrets"')
        try:
            data = self.secrets[(namespace, name)]
        except KeyError:
            raise api_error(404, f'secrets "{name}" not found') from None
        return _Secret({k: base64.b64encode(v.encode()).decode() for k, v in data.items()})


@dataclasses.dataclass
class Call:
    """One ``POST /update_weights`` an engine received."""

    pod: str
    authorization: str | None
    update_info: dict[str, Any]


class FakeEngine:
    """One engine's HTTP server on 127.0.0.1 that records ``/update_weights`` calls.

    ``answers`` is consumed one per call: an HTTP status (with ``{"error": {"message": "boom"}}`` for
    non-200), or a ``threading.Event`` the call waits on before answering 200 (a slow load). Empty: 200.
    ``in_flight``/``max_in_flight`` count concurrent calls across ``group`` (engines sharing a counter).
    """

    def __init__(self, pod: str, calls: list[Call], group: dict[str, int] | None = None) -> None:
        self.pod, self.calls = pod, calls
        self.answers: list[int | threading.Event] = []
        self.group = group if group is not None else {"in_flight": 0, "max_in_flight": 0}
        self.lock = threading.Lock()
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with engine.lock:
                    answer = engine.answers.pop(0) if engine.answers else 200
                    engine.group["in_flight"] += 1
                    engine.group["max_in_flight"] = max(engine.group["max_in_flight"], engine.group["in_flight"])
                try:
                    if isinstance(answer, threading.Event):
                        answer.wait(10)
                        answer = 200
                    if self.path == "/update_weights":
                        info = json.loads(body)["update_info"]
                        engine.calls.append(Call(engine.pod, self.headers.get("Authorization"), info))
                    else:
                        answer = 404
                    payload = b"{}" if answer == 200 else json.dumps({"error": {"message": "boom"}}).encode()
                    self.send_response(answer)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a send timeout): nothing to answer
                finally:
                    with engine.lock:
                        engine.group["in_flight"] -= 1

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fleet(
    name: str = "pol",
    root: str = "/w",
    *,
    draft: str = "draft_model",
    current: int | None = None,
    transfer: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 2,
        "image": "vllm:x",
        "verifier": {"path": f"{root}/policy/step-0/verifier"},
        "draft": {"method": draft} if draft == "none" else {"method": draft, "path": f"{root}/policy/step-0/draft"},
        "weights": {"claimName": "ckpt", "mountPath": root, "allowedRoots": [f"{root}/policy"]},
    }
    if transfer is not None:
        spec["weightTransfer"] = {"backend": transfer}
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


def push_custom_api(monkeypatch: Any, namespace: str, *fleets: dict[str, Any]) -> FakeCustomObjects:
    """A FakeCustomObjects holding ``fleets``, wired in as the push client's custom-objects API."""
    from rolloutfleet.trainer import push

    fake = FakeCustomObjects()
    for body in fleets:
        fake.add("rolloutfleets", namespace, body)
    monkeypatch.setattr(push, "custom_objects_api", lambda _api: fake)
    return fake


def push_core_api(monkeypatch: Any, namespace: str, token: str, *fleet_names: str) -> FakeCore:
    """A FakeCore with each fleet's control-token Secret, wired in as the push client's core API."""
    from rolloutfleet.trainer import push

    fake = FakeCore()
    for name in fleet_names:
        fake.secrets[(namespace, f"{name}-control-token")] = {"token": token}
    monkeypatch.setattr(push, "core_api", lambda _api: fake)
    return fake
