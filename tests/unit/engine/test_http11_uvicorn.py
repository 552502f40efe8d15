"""``adapters.http11`` against uvicorn, the HTTP server vLLM's API server runs on (Starlette routes, as FastAPI's).

The operator's engine calls go through http11 to vLLM; the GPU tier proves the routes on vLLM itself, this
proves the HTTP underneath on every machine: each way uvicorn frames an answer the engines give (a JSON
body, text, a streamed body in chunks, no content, an error), HEAD, a request body, and uvicorn's
keep-alive, which vLLM sets to 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): a connection uvicorn closed while idle
must be replaced, not fail the next call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from rolloutfleet.adapters.http11 import HTTP11, Origin

pytestmark = pytest.mark.both_loops  # the operator runs this code on uvloop (handlers/event_loop.py)

KEEP_ALIVE_S = 1  # uvicorn's timeout_keep_alive in these tests (vLLM's default is 5)


async def as_json(request: Request) -> Response:
    return JSONResponse({"is_paused": False, "weights": {"revision": "r1"}})


async def as_text(request: Request) -> Response:
    return PlainTextResponse("vllm:num_requests_running 0\n" * 50)


async def streamed(request: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        for i in range(3):
            yield json.dumps({"part": i}).encode() + b"\n"

    return StreamingResponse(parts(), media_type="application/x-ndjson")


async def nothing(request: Request) -> Response:
    return Response(status_code=204)


async def echo(request: Request) -> Response:
    return JSONResponse({"got": await request.json()}, status_code=202)


async def refused(request: Request) -> Response:
    return JSONResponse({"error": "engine is paused"}, status_code=503)


@pytest.fixture
async def server() -> AsyncIterator[tuple[uvicorn.Server, Origin]]:
    app = Starlette(
        routes=[
            Route("/json", as_json, methods=["GET", "HEAD"]),
            Route("/text", as_text),
            Route("/stream", streamed),
            Route("/nothing", nothing, methods=["POST"]),
            Route("/echo", echo, methods=["POST"]),
            Route("/refused", refused, methods=["POST"]),
        ]
    )
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, timeout_keep_alive=KEEP_ALIVE_S, log_level="warning", lifespan="off"
    )
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield srv, Origin("127.0.0.1", port, f"127.0.0.1:{port}".encode())
    srv.should_exit = True
    await task


async def test_every_framing_uvicorn_uses(server: tuple[uvicorn.Server, Origin]) -> None:
    srv, origin = server
    http = HTTP11(idle_s=30)
    try:
        got = {
            (method, path): await http.request(method, origin, path, body=body, total=5, connect=2)
            for method, path, body in [
                ("GET", "/json", None),
                ("HEAD", "/json", None),
                ("GET", "/text", None),
                ("GET", "/stream", None),
                ("POST", "/nothing", None),
                ("POST", "/echo", b'{"a": 1}'),
                ("POST", "/refused", None),
            ]
        }
        connections = len(srv.server_state.connections)
    finally:
        await http.close()
    js = got["GET", "/json"]
    assert (js.status, js.content_type) == (200, "application/json")
    assert json.loads(js.body) == {"is_paused": False, "weights": {"revision": "r1"}}
    assert (got["HEAD", "/json"].status, got["HEAD", "/json"].body) == (200, b"")  # its length was the GET's
    assert got["GET", "/text"].body == b"vllm:num_requests_running 0\n" * 50
    parts = [json.loads(line) for line in got["GET", "/stream"].body.splitlines()]
    assert parts == [{"part": 0}, {"part": 1}, {"part": 2}]  # sent in chunks: no length known up front
    assert (got["POST", "/nothing"].status, got["POST", "/nothing"].body) == (204, b"")
    assert (got["POST", "/echo"].status, json.loads(got["POST", "/echo"].body)) == (202, {"got": {"a": 1}})
    refused_answer = got["POST", "/refused"]
    assert (refused_answer.status, json.loads(refused_answer.body)) == (503, {"error": "engine is paused"})
    assert connections == 1  # seven calls, one kept-alive connection


async def test_a_connection_uvicorn_closed_while_idle_is_replaced(server: tuple[uvicorn.Server, Origin]) -> None:
    """The operator's own limit (4 s) stays under vLLM's keep-alive; here the client's is set above uvicorn's so
    that uvicorn closes first, as it would for a client that waited too long: the next call still succeeds."""
    srv, origin = server
    http = HTTP11(idle_s=30)
    try:
        assert (await http.request("GET", origin, "/json", total=5, connect=2)).status == 200
        for _ in range(100):  # uvicorn closes the idle connection after KEEP_ALIVE_S
            await asyncio.sleep(0.05 * KEEP_ALIVE_S)
            if not srv.server_state.connections:
                break
        assert not srv.server_state.connections
        await asyncio.sleep(0.05)  # the close reaches the client
        assert (await http.request("GET", origin, "/json", total=5, connect=2)).status == 200
    finally:
        await http.close()
