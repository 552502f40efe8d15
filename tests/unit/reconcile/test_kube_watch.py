"""``Kube.list`` of a fleet's pods, kept by a watch (``adapters.kube_watch``), against a fake API server.

Why (issue 18): every revision pass and every fleet-status write listed all of a fleet's pods; at 1,024
pods those lists were a quarter of the operator's CPU during a rollout. After the first list the pods come
from a watch. What must hold: a read from the watch is what a list would say (changes and deletions
included); whenever the watch cannot vouch for that (not open yet, ended by a 410, or forbidden), reads
are real lists again, never a stale copy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from kube_fakes import POD_RESOURCES
from kubernetes import client as k8s_client

from rolloutfleet.adapters.kube import Kube

SELECTOR = "rolloutfleet.io/fleet=policy"


def pod(name: str, version: int, ip: str = "127.1.0.1") -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(version)}, "status": {"podIP": ip}}


class FakeAPIServer:
    """Discovery, a pod list at version 10, and watches fed from ``events`` (``watch_status`` refuses them)."""

    def __init__(self) -> None:
        self.pods = [pod("policy-0", 9), pod("policy-1", 10)]
        self.lists = 0
        self.watches: list[dict[str, str]] = []
        self.watch_status = 200
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if request.path == "/apis":
            return web.json_response({"kind": "APIGroupList", "groups": []})
        if request.path == "/api/v1":
            return web.json_response(POD_RESOURCES)
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0"})
        assert request.path == "/api/v1/namespaces/ns/pods" and request.query["labelSelector"] == SELECTOR
        if request.query.get("watch") != "true":
            self.lists += 1
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": self.pods})
        self.watches.append(dict(request.query))
        if self.watch_status != 200:
            return web.json_response({"kind": "Status", "message": "forbidden"}, status=self.watch_status)
        resp = web.StreamResponse()
        await resp.prepare(request)
        while (event := await self.events.get()) is not None:
            await resp.write(json.dumps(event).encode() + b"\n")
        return resp


@pytest.fixture
async def server() -> AsyncIterator[tuple[FakeAPIServer, Kube]]:
    fake = FakeAPIServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.05)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    configuration = k8s_client.Configuration()
    configuration.host = f"http://127.0.0.1:{runner.addresses[0][1]}"
    kube = Kube(k8s_client.ApiClient(configuration))
    yield fake, kube
    await kube.aclose()
    fake.events.put_nowait(None)
    await runner.cleanup()


async def names(kube: Kube) -> dict[str, str]:
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in await kube.list("v1", "Pod", "ns", SELECTOR)}


async def until(predicate: Any) -> None:
    for _ in range(500):  # bounds a test that would hang; never decides the outcome
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_after_one_list_the_pods_come_from_the_watch(server: tuple[FakeAPIServer, Kube]) -> None:
    fake, kube = server
    assert await names(kube) == {"policy-0": "127.1.0.1", "policy-1": "127.1.0.1"}
    await until(lambda: fake.watches and kube._watched[("ns", SELECTOR)].current)
    assert fake.watches[0]["resourceVersion"] == "10"  # from the list: no change between them is lost
    fake.events.put_nowait({"type": "MODIFIED", "object": pod("policy-1", 11, ip="127.1.0.9")})
    fake.events.put_nowait({"type": "DELETED", "object": pod("policy-0", 12)})
    fake.events.put_nowait({"type": "ADDED", "object": pod("policy-2", 13)})
    await until(lambda: kube._watched[("ns", SELECTOR)].version == "13")
    assert await names(kube) == {"policy-1": "127.1.0.9", "policy-2": "127.1.0.1"}
    assert fake.lists == 1  # read twice, listed once


async def test_an_expired_watch_falls_back_to_a_list_that_seeds_it_again(server: tuple[FakeAPIServer, Kube]) -> None:
    fake, kube = server
    await names(kube)
    await until(lambda: kube._watched[("ns", SELECTOR)].current)
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
    fake.events.put_nowait({"type": "ERROR", "object": gone})
    await until(lambda: not kube._watched[("ns", SELECTOR)].current)
    fake.pods = [pod("policy-5", 20)]
    assert await names(kube) == {"policy-5": "127.1.0.1"}  # a real list, not what the watch last held
    assert fake.lists == 2
    await until(lambda: len(fake.watches) == 2)


async def test_a_forbidden_watch_leaves_every_read_a_list(server: tuple[FakeAPIServer, Kube]) -> None:
    """An operator installed with an older chart (pods: list only) stays correct, only slower."""
    fake, kube = server
    fake.watch_status = 403
    await names(kube)
    await until(lambda: kube._watched[("ns", SELECTOR)].forbidden)
    fake.pods = [pod("policy-7", 30)]
    assert await names(kube) == {"policy-7": "127.1.0.1"}
    assert await names(kube) == {"policy-7": "127.1.0.1"}
    assert fake.lists == 3 and len(fake.watches) == 1  # never asked to watch again


# -- what the watch keeps of a pod ------------------------------------------------------------------------


def full_pod(
    name: str, *, gate: str, ready: str, started: bool, waiting: str | None = None, pod_ready: str | None = None
) -> dict[str, Any]:
    """A pod as the API server sends it for a fleet: the operator's own template, a kubelet's status, and
    the field managers (the bulk of a real pod)."""
    from rolloutfleet.api.fleet import RolloutFleetSpec
    from rolloutfleet.resources import children

    spec = RolloutFleetSpec.model_validate(FLEET_SPEC)
    owner = children.Owner(name="policy", namespace="ns", uid="u-fleet")
    template = children.pod_template(owner, spec)
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {"startedAt": "2026-12-02T00:00:00Z"}}
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            **template["metadata"],
            "name": name,
            "namespace": "ns",
            "uid": f"u-{name}",
            "resourceVersion": "42",
            "labels": {**template["metadata"]["labels"], "controller-revision-hash": "policy-abc"},
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {"f:conditions": {}}}}] * 20,
        },
        "spec": {**template["spec"], "nodeName": "gpu-node-1"},
        "status": {
            "phase": "Running",
            "podIP": "127.1.0.7",
            "conditions": [
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": pod_ready or ("True" if ready == "True" and gate == "True" else "False")},
                {"type": "rolloutfleet.io/weights-ready", "status": gate},
            ],
            "containerStatuses": [{"name": "engine", "started": started, "ready": ready == "True", "state": state}],
        },
    }


FLEET_SPEC = {
    "replicas": 4,
    "image": "rolloutfleet-worker:test",
    "verifier": {"path": "/weights/p/step-0/verifier"},
    "draft": {"method": "draft_model", "path": "/weights/p/step-0/draft"},
    "weights": {"claimName": "ckpt", "mountPath": "/weights", "allowedRoots": ["/weights/p"]},
}

PODS = [
    full_pod("policy-0", gate="True", ready="True", started=True),
    full_pod("policy-1", gate="False", ready="True", started=True),
    full_pod("policy-2", gate="True", ready="False", started=False, waiting="CrashLoopBackOff"),
    # The gate just closed and the kubelet has not yet turned Ready False: only the spec's readiness gates
    # tell that this pod is out of the Service.
    full_pod("policy-3", gate="False", ready="True", started=True, pod_ready="True"),
]


def test_a_watched_pod_keeps_what_the_operator_reads_and_little_else() -> None:
    from rolloutfleet.adapters.kube_watch import pod_projection

    for full in PODS:
        kept = pod_projection(full)
        assert "managedFields" not in kept["metadata"] and "containers" not in kept["spec"]
        assert kept["status"] == full["status"] and kept["spec"]["readinessGates"] == full["spec"]["readinessGates"]
        assert len(json.dumps(kept)) < len(json.dumps(full)) / 3


def test_every_pod_reader_answers_the_same_on_watched_pods() -> None:
    # The watch serves projected pods, a fallback list full ones: every reader of pods in the operator must
    # not see the difference (a new reader of a dropped field fails here; add the field to POD_SPEC_KEPT).
    from rolloutfleet.adapters.kube_watch import pod_projection
    from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutFleetStatus
    from rolloutfleet.planning import fleet_status, pod_readiness
    from rolloutfleet.reconcile import revision

    kept = [pod_projection(p) for p in PODS]
    for full, projected in zip(PODS, kept, strict=True):
        for reader in (
            pod_readiness.gate_value,
            pod_readiness.containers_ready,
            pod_readiness.engine_up,
            pod_readiness.routed,
            fleet_status._pod_failing,
            fleet_status._pod_ready,
        ):
            assert reader(full) == reader(projected), reader.__name__
    full_view, kept_view = revision._pod_view(PODS), revision._pod_view(kept)
    assert (full_view.order, full_view.not_routed, full_view.starting) == (
        kept_view.order,
        kept_view.not_routed,
        kept_view.starting,
    )
    for name, body in kept_view.bodies.items():  # what the pass takes from a body: address and identity
        assert body["status"]["podIP"] == full_view.bodies[name]["status"]["podIP"]
        assert body["metadata"]["uid"] == full_view.bodies[name]["metadata"]["uid"]
    spec = RolloutFleetSpec.model_validate(FLEET_SPEC)
    sts = {"status": {"updateRevision": "policy-abc", "replicas": 4}}
    assert fleet_status.observed(RolloutFleetStatus(), spec, "policy", 1, sts, PODS) == fleet_status.observed(
        RolloutFleetStatus(), spec, "policy", 1, sts, kept
    )


def test_a_watch_line_decodes_to_the_projection_of_the_whole_event() -> None:
    """The watch decodes only what it keeps (``decode_pod_event``, msgspec): the result must be exactly the
    projection of the fully decoded line, for pods, bookmarks and the 410 ERROR the fallback relies on. A
    field the projection keeps but the decoder would drop (a new ObjectMeta field) fails here."""
    from rolloutfleet.adapters.kube_watch import decode_pod_event, pod_projection

    full = {
        **PODS[0],
        "metadata": {
            **PODS[0]["metadata"],
            "generateName": "policy-",
            "selfLink": "/api/v1/namespaces/ns/pods/policy-0",
            "generation": 1,
            "creationTimestamp": "2026-12-02T00:00:00Z",
            "deletionTimestamp": "2026-12-02T00:01:00Z",
            "deletionGracePeriodSeconds": 30,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "policy", "uid": "u"}],
            "finalizers": ["example.com/keep"],
            "annotations": {"a": "b"},
        },
    }
    for pod_ in [full, *PODS]:
        line = json.dumps({"type": "MODIFIED", "object": pod_}).encode()
        assert decode_pod_event(line) == {"type": "MODIFIED", "object": pod_projection(pod_)}
    bookmark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "77"}, "spec": {"containers": None}}
    assert decode_pod_event(json.dumps({"type": "BOOKMARK", "object": bookmark}).encode())["object"]["metadata"] == {
        "resourceVersion": "77"
    }
    gone = {"kind": "Status", "metadata": {}, "status": "Failure", "message": "too old", "code": 410}
    event = decode_pod_event(json.dumps({"type": "ERROR", "object": gone}).encode())
    assert event["type"] == "ERROR" and event["object"]["message"] == "too old"
    for bad in (b'{"object": {}}', b"[1, 2]", b"not json"):
        with pytest.raises(ValueError):  # the watch treats it as unreadable and falls back to lists
            decode_pod_event(bad)
