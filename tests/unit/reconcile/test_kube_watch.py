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
