"""``GET /rolloutfleet/observe`` of ControlAuthMiddleware on a real Starlette app shaped like vLLM's routes.

Why it exists (issue 18): the operator's read of an engine was five requests (admission, ``/is_paused``,
``/is_sleeping``, ``/weight_info``, the ``rolloutfleet_state`` RPC); at 1,024 pods those requests were most
of its CPU. The middleware answers them in one body by calling the app's own routes in process, so what
each part says must be exactly what the route says on its own: status, body, and a failure of one route
must not hide the others. The same assertions run against real vLLM in the contract suite (GPU tier).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from control_token import AUTH
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rolloutfleet_worker import admission, auth, observation

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("token_file")]


class FakeVllm:
    """vLLM's dev routes, as far as an observation reads them; records what reached each."""

    def __init__(self, *, versioned: bool = True, broken_state: bool = False) -> None:
        self.versioned, self.broken_state = versioned, broken_state
        self.seen: list[tuple[str, str | None, Any]] = []
        self.paused = True
        self.in_flight = 0
        self.most_at_once = 0

    async def _enter(self, request: Request, body: Any = None) -> None:
        self.seen.append((request.url.path, request.headers.get("authorization"), body))
        self.in_flight += 1
        self.most_at_once = max(self.most_at_once, self.in_flight)
        await asyncio.sleep(0.01)  # long enough for the reads to overlap if they are sent together
        self.in_flight -= 1

    async def is_paused(self, request: Request) -> Response:
        await self._enter(request)
        return JSONResponse({"is_paused": self.paused})

    async def is_sleeping(self, request: Request) -> Response:
        await self._enter(request)
        return JSONResponse({"is_sleeping": False})

    async def weight_info(self, request: Request) -> Response:
        await self._enter(request)
        return JSONResponse({"weight_version": "rev-7"})

    async def collective_rpc(self, request: Request) -> Response:
        body = await request.json()
        await self._enter(request, body)
        if self.broken_state:
            raise RuntimeError("worker died")
        if body.get("method") != "rolloutfleet_state":
            return PlainTextResponse("Internal Server Error", status_code=500)
        return JSONResponse({"results": [{"ok": True, "rank": 0}]})

    def app(self) -> Starlette:
        routes = [
            Route("/is_paused", self.is_paused, methods=["GET"]),
            Route("/is_sleeping", self.is_sleeping, methods=["GET"]),
            Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
        ]
        if self.versioned:  # vLLM 0.26 has no weight-version routes: FastAPI answers 404
            routes.append(Route("/weight_info", self.weight_info, methods=["GET"]))
        app = Starlette(routes=routes)
        app.add_middleware(auth.ControlAuthMiddleware)  # what vLLM's --middleware does
        return app


@pytest.fixture
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeVllm, httpx.AsyncClient]]:
    vllm = FakeVllm(**getattr(request, "param", {}))
    transport = httpx.ASGITransport(app=vllm.app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        yield vllm, client


async def test_one_request_carries_each_route_s_own_answer(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    vllm, client = engine
    r = await client.get(observation.OBSERVE_PATH, headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["routes"] == {
        "is_paused": {"status": 200, "body": {"is_paused": True}},
        "is_sleeping": {"status": 200, "body": {"is_sleeping": False}},
        "weight_info": {"status": 200, "body": {"weight_version": "rev-7"}},
        "state": {"status": 200, "body": {"results": [{"ok": True, "rank": 0}]}},
    }
    assert body["admission"]["admitted"] is False and isinstance(body["admission"]["instance"], str)
    # The reads reached vLLM's routes with the caller's token (vLLM's own checks see what was sent), the
    # RPC with the state method, all four at once (one read is as slow as the slowest route, not the sum).
    assert sorted(p for p, _, _ in vllm.seen) == ["/collective_rpc", "/is_paused", "/is_sleeping", "/weight_info"]
    assert {h for _, h, _ in vllm.seen} == {AUTH["Authorization"]}
    assert [b for p, _, b in vllm.seen if p == "/collective_rpc"] == [observation.STATE_RPC]
    assert vllm.most_at_once == 4


@pytest.mark.parametrize("engine", [{"versioned": False}], indirect=True)
async def test_a_route_the_release_lacks_answers_its_404_inside(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    _, client = engine
    body = (await client.get(observation.OBSERVE_PATH, headers=AUTH)).json()
    assert body["routes"]["weight_info"]["status"] == 404
    assert body["routes"]["is_paused"]["status"] == 200  # the others are unaffected


@pytest.mark.parametrize("engine", [{"broken_state": True}], indirect=True)
async def test_a_route_that_raises_reads_as_vllm_s_plain_500(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    _, client = engine
    r = await client.get(observation.OBSERVE_PATH, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["routes"]["state"] == {"status": 500, "body": "Internal Server Error"}
    assert r.json()["routes"]["is_paused"]["status"] == 200


async def test_the_observation_needs_the_token_and_reaches_nothing_without_it(
    engine: tuple[FakeVllm, httpx.AsyncClient],
) -> None:
    vllm, client = engine
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = await client.get(observation.OBSERVE_PATH, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert (await client.post(observation.OBSERVE_PATH, headers=AUTH)).status_code == 405
    assert vllm.seen == []
    assert not auth.is_open(observation.OBSERVE_PATH)


async def test_the_admission_is_this_process_s(engine: tuple[FakeVllm, httpx.AsyncClient]) -> None:
    """The same ``instance`` as the readiness probe names, and an admit shows at the next observation."""
    _, client = engine
    ready = (await client.get(admission.READY_PATH)).json()
    first = (await client.get(observation.OBSERVE_PATH, headers=AUTH)).json()["admission"]
    assert first == ready
    r = await client.post(admission.ADMIT_PATH, headers=AUTH, json={"revision": 4, "instance": ready["instance"]})
    assert r.status_code == 200
    second = (await client.get(observation.OBSERVE_PATH, headers=AUTH)).json()["admission"]
    assert second["admitted"] is True and second["revision"] == 4 and second["instance"] == ready["instance"]
