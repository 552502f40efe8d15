"""``adapters.kube.Kube`` (the executor's Kubernetes side) against a tiny fake API server on loopback.

The adapter must never wait for ever on the API server (every request, discovery included, has a
timeout) and must hand reconcile only ``KubeError``s, whatever the client raised inside (a 404 on a
patch, a timeout, a kind the server does not serve), so kopf's error mapping sees one vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from kube_fakes import POD_RESOURCES
from kubernetes import client as k8s_client

from rolloutfleet.adapters.kube import Kube, KubeError


class FakeAPIServer:
    """Discovery of core/v1 pods; ``hang`` makes every pod request wait until the test ends."""

    def __init__(self) -> None:
        self.hang = False
        self.released = asyncio.Event()
        self.requests: list[tuple[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path))
        if request.path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if request.path == "/apis":
            return web.json_response({"kind": "APIGroupList", "groups": []})
        if request.path == "/api/v1":
            return web.json_response(POD_RESOURCES)
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0"})
        if self.hang:
            await self.released.wait()
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
        return web.json_response({**status, "message": 'pods "p" not found'}, status=404)


@pytest.fixture
async def server() -> AsyncIterator[tuple[FakeAPIServer, str]]:
    fake = FakeAPIServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.05)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield fake, f"http://127.0.0.1:{port}"
    fake.released.set()
    await runner.cleanup()


def kube_for(url: str, **kwargs: Any) -> Kube:
    configuration = k8s_client.Configuration()
    configuration.host = url
    return Kube(k8s_client.ApiClient(configuration), **kwargs)


async def test_a_patch_of_a_missing_object_is_a_kube_error_404(server: tuple[FakeAPIServer, str]) -> None:
    """The dynamic client raises its own ``NotFoundError``; reconcile maps only ``KubeError``."""
    _, url = server
    kube = kube_for(url)
    try:
        with pytest.raises(KubeError) as err:
            await kube.patch_status("v1", "Pod", "ns", "p", {"phase": "Running"})
        assert err.value.status == 404 and "not found" in str(err.value)
        assert await kube.get("v1", "Pod", "ns", "p") is None  # get still answers "absent"
    finally:
        await kube.aclose()


async def test_a_kind_the_server_does_not_serve_is_a_kube_error_404(
    server: tuple[FakeAPIServer, str],
) -> None:
    _, url = server
    kube = kube_for(url)
    try:
        with pytest.raises(KubeError) as err:
            await kube.list("rolloutfleet.io/v1alpha1", "WeightRevision", "ns")
        assert err.value.status == 404
    finally:
        await kube.aclose()


@pytest.mark.timeout(30)  # guards against the defect itself: without a request timeout this never returns
async def test_a_hung_api_server_times_out_instead_of_holding_a_thread_for_ever(
    server: tuple[FakeAPIServer, str],
) -> None:
    fake, url = server
    kube = kube_for(url, request_timeout=0.2, list_timeout=0.3)
    assert await kube.get("v1", "Pod", "ns", "p") is None  # discovery done while the server answers
    fake.hang = True
    try:
        for call in (
            kube.get("v1", "Pod", "ns", "p"),
            kube.list("v1", "Pod", "ns"),
            kube.patch_status("v1", "Pod", "ns", "p", {"phase": "Running"}),
            kube.delete("v1", "Pod", "ns", "p"),
        ):
            with pytest.raises(KubeError) as err:
                await call
            assert err.value.status == 0  # no answer was received
    finally:
        fake.released.set()
        await kube.aclose()
