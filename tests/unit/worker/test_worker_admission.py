"""Admission routes of ControlAuthMiddleware on a real Starlette app, added the way vLLM's ``--middleware`` does.

Why they exist (worker_image/README.md, "Admission"): a restarted engine container comes back on its
initial checkpoint while the pod's readiness gate is still True; the readiness probe on
``/rolloutfleet/ready`` keeps it out of the Service until the operator admitted this very process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from control_token import AUTH, TOKEN
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rolloutfleet_worker import admission, auth

pytestmark = pytest.mark.unit

READY, ADMIT, WITHDRAW = admission.READY_PATH, admission.ADMIT_PATH, admission.WITHDRAW_PATH


def plain(body: dict[str, Any]) -> dict[str, Any]:
    """An admission answer without its ``instance`` (random per process; tested on its own)."""
    assert isinstance(body.pop("instance"), str)
    return body


class WallClock:
    def __init__(self) -> None:
        self.now = 1_760_000_000.0

    def __call__(self) -> float:
        return self.now


class Inner:
    """vLLM behind the middleware: records what reached it; has no /rolloutfleet routes (it would 404)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def ok(self, request: Request) -> JSONResponse:
        self.seen.append(request.url.path)
        return JSONResponse({"path": request.url.path})


@pytest.fixture
def inner() -> Inner:
    return Inner()


@pytest.fixture
def clock() -> WallClock:
    return WallClock()


def _app(inner: Inner, clock: WallClock) -> Starlette:
    app = Starlette(routes=[Route(p, inner.ok, methods=["GET", "POST"]) for p in ("/health", "/pause")])
    app.add_middleware(auth.ControlAuthMiddleware, wall_clock=clock)  # what vLLM does, plus a test clock
    return app


@pytest.fixture
async def client(token_file: Path, inner: Inner, clock: WallClock) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(inner, clock))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        yield c


async def test_a_new_process_is_not_ready_and_the_probe_needs_no_token(client: httpx.AsyncClient, inner: Inner) -> None:
    """kubelet probes carry no token: the route must answer without one, and say "not yet" (503)."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):
        r = await client.get(READY, headers=headers)
        assert r.status_code == 503 and plain(r.json()) == {"admitted": False}
        assert r.headers["cache-control"] == "no-store"
    assert (await client.get("/health")).status_code == 200  # liveness and startup probes are unchanged
    assert inner.seen == ["/health"]  # readiness never reached vLLM (no engine call)
    assert auth.is_open(READY) and not auth.is_open(ADMIT) and not auth.is_open(WITHDRAW)


@pytest.mark.parametrize("route", [ADMIT, WITHDRAW])
async def test_admission_changes_need_the_token(client: httpx.AsyncClient, inner: Inner, route: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic x"}):
        r = await client.post(route, headers=headers, json={"revision": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
    assert (await client.get(READY)).status_code == 503
    assert inner.seen == []


async def test_admit_then_withdraw(client: httpx.AsyncClient, inner: Inner, clock: WallClock) -> None:
    r = await client.post(ADMIT, headers=AUTH, json={"revision": 7})
    assert r.status_code == 200
    assert plain(r.json()) == {"admitted": True, "revision": 7, "since": clock.now}
    ready = await client.get(READY)
    assert ready.status_code == 200 and ready.json() == r.json()
    assert TOKEN not in ready.text
    head = await client.head(READY)
    assert head.status_code == 200 and head.content == b""
    # A retried admit keeps its start; another revision is a new admission.
    clock.now += 10
    assert (await client.post(ADMIT, headers=AUTH, json={"revision": 7})).json()["since"] == clock.now - 10
    again = await client.post(ADMIT, headers=AUTH, json={"revision": None})
    assert plain(again.json()) == {"admitted": True, "revision": None, "since": clock.now}
    w = await client.post(WITHDRAW, headers=AUTH)
    assert w.status_code == 200 and plain(w.json()) == {"admitted": False}
    assert (await client.get(READY)).status_code == 503
    assert plain((await client.post(WITHDRAW, headers=AUTH, json={})).json()) == {"admitted": False}  # idempotent
    assert inner.seen == []  # handled by the middleware: vLLM would have answered 404


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b"[]", b"{}", b'{"revision": "3"}', b'{"revision": true}', b'{"revision": -1}'],
    ids=["empty", "not-json", "list", "no-revision", "string", "bool", "negative"],
)
async def test_admit_refuses_a_malformed_body(client: httpx.AsyncClient, content: bytes) -> None:
    """The operator says which revision it verified; a body that does not say it admits nothing."""
    r = await client.post(ADMIT, headers={**AUTH, "content-type": "application/json"}, content=content)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert (await client.get(READY)).status_code == 503


async def test_oversized_body_and_wrong_methods(client: httpx.AsyncClient) -> None:
    big = b'{"revision": 1, "pad": "' + b"x" * admission.MAX_BODY_BYTES + b'"}'
    assert (await client.post(ADMIT, headers=AUTH, content=big)).status_code == 413
    r = await client.get(ADMIT, headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert (await client.get(ADMIT)).status_code == 401  # the token is checked before anything else
    r = await client.post(READY)
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    assert (await client.get(READY)).status_code == 503


async def test_a_restarted_process_starts_unadmitted(token_file: Path, inner: Inner, clock: WallClock) -> None:
    """Admission lives in the API server's memory: a new middleware (a new process) knows nothing of it."""
    for expected in (200, 503):
        transport = httpx.ASGITransport(app=_app(inner, clock))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
            if expected == 200:
                assert (await c.post(ADMIT, headers=AUTH, json={"revision": 1})).status_code == 200
            assert (await c.get(READY)).status_code == expected


async def test_admit_without_a_configured_token_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inner: Inner, clock: WallClock
) -> None:
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(tmp_path / "absent"))
    transport = httpx.ASGITransport(app=_app(inner, clock))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        assert (await c.post(ADMIT, headers={"Authorization": "Bearer x"}, json={"revision": 1})).status_code == 503
        r = await c.get(READY)
        assert r.status_code == 503 and plain(r.json()) == {"admitted": False}


async def test_a_client_gone_before_its_body_changes_nothing(token_file: Path, clock: WallClock) -> None:
    mw = auth.ControlAuthMiddleware(Inner().ok, wall_clock=clock)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": ADMIT,
        "headers": [(b"authorization", AUTH["Authorization"].encode())],
    }
    await mw(scope, receive, send)
    assert sent == [] and not mw.admission.admitted


async def test_an_admit_for_another_process_is_refused(token_file: Path, inner: Inner, clock: WallClock) -> None:
    """The soak caught it: the operator looked at one engine process (its weights verified), the container
    restarted on its initial checkpoint at the same address, and the admit meant for the first process
    admitted the second. The admit names the process the operator looked at; another one refuses it."""
    first = httpx.ASGITransport(app=_app(inner, clock))
    async with httpx.AsyncClient(transport=first, base_url="http://engine") as c:
        looked_at = (await c.get(READY)).json()["instance"]
        assert (await c.post(ADMIT, headers=AUTH, json={"revision": 3, "instance": looked_at})).status_code == 200
    restarted = httpx.ASGITransport(app=_app(inner, clock))
    async with httpx.AsyncClient(transport=restarted, base_url="http://engine") as c:
        r = await c.post(ADMIT, headers=AUTH, json={"revision": 3, "instance": looked_at})
        assert r.status_code == 409 and r.json()["error"]["type"] == "Conflict"
        ready = await c.get(READY)
        assert ready.status_code == 503 and ready.json()["instance"] != looked_at
        bad = await c.post(ADMIT, headers=AUTH, json={"revision": 3, "instance": 7})
        assert bad.status_code == 400
