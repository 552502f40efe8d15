"""ControlAuthMiddleware on a real Starlette app, added the way vLLM's ``--middleware`` adds it."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from control_token import TOKEN
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rolloutfleet_worker import auth

pytestmark = pytest.mark.unit

OPEN = ["/health", "/ping", "/metrics", "/version", "/load", "/v1/models", "/v1/completions", "/tokenize"]
OPEN += ["/detokenize", "/invocations"]


async def _ok(request: Request) -> JSONResponse:
    return JSONResponse({"path": request.url.path})


def _app() -> Starlette:
    routes = [Route(p, _ok, methods=["GET", "POST"]) for p in [*auth.CONTROL_ROUTES, *OPEN, "/docs"]]
    app = Starlette(routes=routes)
    app.add_middleware(auth.ControlAuthMiddleware)  # exactly what vLLM does with --middleware
    return app


@pytest.fixture
async def client(token_file: Path) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        yield c


def test_required_routes_are_listed() -> None:
    required = {"/pause", "/resume", "/sleep", "/wake_up", "/collective_rpc", "/update_weight_version"}
    required |= {"/init_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update"}
    required |= {"/update_weights", "/finish_weight_update", "/reset_prefix_cache", "/server_info"}
    required |= {"/is_sleeping", "/is_paused", "/weight_info"}
    assert required <= set(auth.CONTROL_ROUTES)
    assert not any(auth.is_open(p) for p in auth.CONTROL_ROUTES)


@pytest.mark.parametrize("route", auth.CONTROL_ROUTES)
async def test_control_route_needs_the_token(client: httpx.AsyncClient, route: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic x"}):
        r = await client.post(route, headers=headers)
        assert r.status_code == 401, (route, headers)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "Unauthorized", "code": 401}}
    r = await client.post(route, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json() == {"path": route}
    r = await client.get(route, headers={"authorization": f"bearer {TOKEN}"})  # scheme is case-insensitive
    assert r.status_code == 200


@pytest.mark.parametrize("route", OPEN)
async def test_open_routes_unaffected(client: httpx.AsyncClient, route: str) -> None:
    assert (await client.get(route)).status_code == 200
    assert (await client.get(route, headers={"Authorization": "Bearer wrong"})).status_code == 200


@pytest.mark.parametrize("route", ["/docs", "/unknown", "/", "/v2/x", "//pause", "/v1/../pause", "/health/"])
async def test_unknown_routes_denied_by_default(client: httpx.AsyncClient, route: str) -> None:
    r = await client.get(route)
    assert r.status_code == 401


async def test_missing_token_file_fails_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(tmp_path / "absent"))
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        r = await c.post("/pause", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert (await c.get("/health")).status_code == 200
        (tmp_path / "absent").write_text(TOKEN)  # a late Secret mount recovers without a restart
        assert (await c.post("/pause", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200


async def test_empty_token_file_never_matches_empty_bearer(token_file: Path) -> None:
    token_file.write_text("\n")
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        assert (await c.post("/pause", headers={"Authorization": "Bearer "})).status_code == 503


async def _drive(scope: dict[str, Any], token_file: Path) -> tuple[list[dict[str, Any]], list[str]]:
    seen: list[str] = []
    sent: list[dict[str, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        sent.append(message)

    await auth.ControlAuthMiddleware(inner)(scope, receive, send)
    return sent, seen


async def test_lifespan_and_websockets(token_file: Path) -> None:
    sent, seen = await _drive({"type": "lifespan"}, token_file)
    assert seen == ["lifespan"] and sent == []
    sent, seen = await _drive({"type": "websocket", "path": "/collective_rpc", "headers": []}, token_file)
    assert seen == [] and sent == [{"type": "websocket.close", "code": 1008, "reason": "Unauthorized"}]
    hdr = [(b"authorization", f"Bearer {TOKEN}".encode())]
    sent, seen = await _drive({"type": "websocket", "path": "/collective_rpc", "headers": hdr}, token_file)
    assert seen == ["websocket"]
    sent, seen = await _drive({"type": "websocket", "path": "/v1/realtime", "headers": []}, token_file)
    assert seen == ["websocket"]


class Clock:
    """An injected monotonic clock: the tests move time, nothing sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def mounted_secret(directory: Path, token: str) -> Path:
    """A Secret volume as kubelet writes it: ``token -> ..data/token``, ``..data -> ..<timestamp>``."""
    directory.mkdir(parents=True, exist_ok=True)
    rotate_secret(directory, token)
    (directory / "token").symlink_to("..data/token")
    return directory / "token"


def rotate_secret(directory: Path, token: str) -> None:
    """kubelet's update: a new timestamped directory, then an atomic swap of the ``..data`` link."""
    n = len(list(directory.glob("..2*")))
    fresh = directory / f"..2026_01_01_00_00_0{n}"
    fresh.mkdir()
    (fresh / "token").write_text(token + "\n")
    tmp = directory / "..data_tmp"
    tmp.symlink_to(fresh.name)
    os.replace(tmp, directory / "..data")


async def status(mw: auth.ControlAuthMiddleware, token: str) -> int:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/pause", "headers": [(b"authorization", f"Bearer {token}".encode())]}
    await mw(scope, receive, send)
    return int(sent[0]["status"])


async def test_a_rotated_token_works_at_once_and_the_old_one_for_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Replacing the Secret must not lock the operator out (it reads the new token when it changes), and an
    operator still holding the old token gets a bounded grace instead of a storm of 401s; after the grace
    a leaked old token is worthless."""
    caplog.set_level(logging.DEBUG)
    path = mounted_secret(tmp_path / "secret", "old-token-value")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    clock = Clock()
    mw = auth.ControlAuthMiddleware(_inner_ok, clock=clock)
    assert await status(mw, "old-token-value") == 200
    rotate_secret(tmp_path / "secret", "new-token-value")
    assert await status(mw, "new-token-value") == 200  # noticed at once: a refused token re-reads the file
    clock.now += auth.DEFAULT_GRACE_SECONDS - 1
    assert await status(mw, "old-token-value") == 200
    clock.now += 2
    assert await status(mw, "old-token-value") == 401
    assert await status(mw, "new-token-value") == 200
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "rotated" in logged and "token-value" not in logged  # rotation is logged, tokens never


async def test_a_rotation_is_noticed_without_a_refused_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is checked every few seconds, so the grace starts when the Secret changed, not when the
    operator first presents the new token: a leaked old token stops working on time."""
    path = mounted_secret(tmp_path / "secret", "old-token-value")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    monkeypatch.setenv(auth.GRACE_ENV, "60")
    clock = Clock()
    mw = auth.ControlAuthMiddleware(_inner_ok, clock=clock)
    assert await status(mw, "old-token-value") == 200
    rotate_secret(tmp_path / "secret", "new-token-value")
    clock.now += auth.CHECK_INTERVAL_SECONDS
    assert await status(mw, "old-token-value") == 200  # rotation seen here; within the 60 s grace
    clock.now += 61
    assert await status(mw, "old-token-value") == 401


async def test_no_grace_when_configured_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = mounted_secret(tmp_path / "secret", "old-token-value")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    monkeypatch.setenv(auth.GRACE_ENV, "0")
    mw = auth.ControlAuthMiddleware(_inner_ok, clock=Clock())
    assert await status(mw, "old-token-value") == 200
    rotate_secret(tmp_path / "secret", "new-token-value")
    assert await status(mw, "new-token-value") == 200
    assert await status(mw, "old-token-value") == 401


@pytest.mark.parametrize("damage", ["removed", "directory", "empty"])
async def test_a_token_file_that_becomes_unreadable_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A cached token must not outlive its Secret: once the file cannot be read, nothing is accepted."""
    path = tmp_path / "token"
    path.write_text("old-token-value")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(path))
    clock = Clock()
    mw = auth.ControlAuthMiddleware(_inner_ok, clock=clock)
    assert await status(mw, "old-token-value") == 200
    path.unlink()
    if damage == "directory":
        path.mkdir()
    elif damage == "empty":
        path.write_text("\n")
    clock.now += auth.CHECK_INTERVAL_SECONDS
    assert await status(mw, "old-token-value") == 503


async def _inner_ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
