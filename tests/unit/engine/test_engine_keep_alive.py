"""How long the operator keeps a connection to an engine idle: a second under the engines' own keep-alive.

vLLM's server closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds (5 by default). Reusing one
just as the server closes it loses the call in flight (outcome unknown: the engine is read again), so the
operator stops reusing a second before; a fleet that raises the engines' keep-alive in spec.env keeps its
connections through waits longer than 4 s (a Rolling fleet's pods waiting for their turn, an AllAtOnce fleet's
barrier), one TCP connection less per pod and revision on both ends (bench/results/rollout_overhead.md).
"""

from __future__ import annotations

import asyncio

import pytest

from rolloutfleet.adapters.http11 import HTTP11, Origin
from rolloutfleet.api.fleet import RolloutFleetSpec
from rolloutfleet.reconcile.revision import engine_idle_seconds
from rolloutfleet.sim import server

pytestmark = pytest.mark.unit

BASE = {
    "replicas": 2,
    "image": "rolloutfleet-worker:test",
    "verifier": {"path": "/weights/p/step-0/verifier"},
    "weights": {"claimName": "ckpt", "mountPath": "/weights", "allowedRoots": ["/weights/p"]},
}


def _spec(keep_alive: str | None) -> RolloutFleetSpec:
    env = [] if keep_alive is None else [{"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": keep_alive}]
    return RolloutFleetSpec.model_validate({**BASE, "env": env})


@pytest.mark.parametrize(("keep_alive", "idle"), [(None, 4.0), ("60", 59.0), ("2", 1.0), ("1", 0.5), ("x", 4.0)])
def test_idle_is_a_second_under_the_engines_keep_alive(keep_alive: str | None, idle: float) -> None:
    # ("x" is refused by validation; the pool never sees it, and would fall back to vLLM's default)
    assert engine_idle_seconds(_spec(keep_alive)) == idle


def test_the_simulated_engine_keeps_connections_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert server.keep_alive_seconds() == 5.0
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "60")
    assert server.keep_alive_seconds() == 60.0


async def test_connections_are_counted_and_a_new_idle_limit_applies_to_kept_ones() -> None:
    """The count is what ``rolloutfleet_engine_connections_opened_total`` exports; a fleet whose keep-alive
    changed has its pool's limit changed in place (the pool outlives passes), and it must apply at once."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    raw = await asyncio.start_server(answer, "127.0.0.1", 0)
    origin = Origin("127.0.0.1", raw.sockets[0].getsockname()[1], b"h")
    opened = 0

    def count() -> None:
        nonlocal opened
        opened += 1

    http = HTTP11(idle_s=30, on_connect=count)
    try:
        for _ in range(3):
            await http.request("GET", origin, "/", total=5, connect=2)
        assert opened == 1  # kept alive and reused
        http.idle_s = 0.0  # any idle time is longer than the new limit: not reused
        await http.request("GET", origin, "/", total=5, connect=2)
        assert opened == 2
    finally:
        await http.close()
        raw.close()
