"""``adapters.http11`` against a raw TCP server that answers byte for byte what each test scripts.

The engine client's other tests run it against the simulator (aiohttp's server) and tests/contract against
real vLLM (uvicorn); these pin what those servers never do on their own but a network or an engine may:
chunked and unframed bodies, interim answers, a connection closed while idle or mid-answer, an engine that
never answers, callers cancelled mid-call, the per-engine connection limit. Each says why the behaviour is
the one the operator needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from rolloutfleet.adapters.http11 import HTTP11, Lost, NotSent, Origin, _Connection, _expire, _Slots
from rolloutfleet.sandbox import certs

pytestmark = pytest.mark.both_loops  # the operator runs this code on uvloop (handlers/event_loop.py)

Answer = Callable[[bytes, bytes], bytes | None]  # (request head, request body) -> bytes to write; None: close


def ok(body: bytes = b'{"ok": true}', *, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


class ScriptedServer:
    """Answers each request with ``answer``; counts connections, requests, and connections open at once."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    @property
    def origin(self) -> Origin:
        return Origin("127.0.0.1", self.port, f"127.0.0.1:{self.port}".encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        self.writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append((head, body))
                answer = self.answer(head, body)
                if answer is None:
                    return
                writer.write(answer)
                await writer.drain()
        finally:
            self.open_now -= 1
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


@pytest.fixture
async def http() -> AsyncIterator[HTTP11]:
    transport = HTTP11(limit=64, limit_per_host=4)
    yield transport
    await transport.close()


async def serve(answer: Answer) -> ScriptedServer:
    server = ScriptedServer(answer)
    await server.start()
    return server


async def one_answer_server(answer: bytes) -> tuple[asyncio.Server, Origin]:
    """A server that reads one request head, writes ``answer`` and closes the connection."""

    async def serve_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    raw = await asyncio.start_server(serve_once, "127.0.0.1", 0)
    return raw, Origin("127.0.0.1", raw.sockets[0].getsockname()[1], b"h")


async def call(http: HTTP11, server: ScriptedServer, method: str = "GET", **kw: Any) -> Any:
    kw.setdefault("total", 5.0)
    kw.setdefault("connect", 2.0)
    return await http.request(method, server.origin, "/x", **kw)


async def test_request_carries_headers_body_and_host() -> None:
    """The engine's auth middleware reads the bearer token; FastAPI reads the JSON body by its length."""
    server = await serve(lambda head, body: ok())
    http = HTTP11()
    try:
        r = await http.request(
            "POST",
            server.origin,
            "/collective_rpc?a=1",
            headers={"Authorization": "Bearer t", "Content-Type": "application/json"},
            body=b'{"method": "m"}',
            total=5,
            connect=2,
        )
    finally:
        await http.close()
        await server.stop()
    head, body = server.requests[0]
    assert head.startswith(b"POST /collective_rpc?a=1 HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in head and b"\r\nAuthorization: Bearer t\r\n" in head
    assert b"\r\nContent-Length: 15\r\n" in head and body == b'{"method": "m"}'
    assert (r.status, r.content_type, r.body) == (200, "application/json", b'{"ok": true}')


async def test_a_post_without_body_says_so(http: HTTP11) -> None:
    """vLLM's POST /pause has no body; without Content-Length: 0 a server would wait for one."""
    server = await serve(lambda head, body: ok())
    await call(http, server, "POST")
    await server.stop()
    assert b"\r\nContent-Length: 0\r\n" in server.requests[0][0]


async def test_connections_are_kept_alive(http: HTTP11) -> None:
    """One connection per engine for calls in sequence: a new TCP handshake per call costs CPU on both ends."""
    server = await serve(lambda head, body: ok())
    for _ in range(5):
        assert (await call(http, server)).status == 200
    await server.stop()
    assert server.connections == 1 and len(server.requests) == 5


async def test_connection_close_is_honoured(http: HTTP11) -> None:
    server = await serve(lambda head, body: ok(extra=b"Connection: close\r\n"))
    for _ in range(3):
        await call(http, server)
    await server.stop()
    assert server.connections == 3


async def test_chunked_answer_with_trailers(http: HTTP11) -> None:
    """HTTP/1.1 servers may frame any answer in chunks (a streaming response, a proxy in between)."""
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json; charset=utf-8\r\n\r\n"
        b'4\r\n{"a"\r\n6;ext=1\r\n: 1234\r\n1\r\n}\r\n0\r\nX-Trailer: t\r\n\r\n'
    )
    server = await serve(lambda head, body: chunked)
    first = await call(http, server)
    second = await call(http, server)  # the framing left nothing behind: the connection is reused
    await server.stop()
    assert first.body == b'{"a": 1234}' and first.content_type == "application/json" and second == first
    assert server.connections == 1


async def test_answer_delimited_by_the_end_of_the_connection(http: HTTP11) -> None:
    """No length and not chunked: the body is what arrives until the server closes (HTTP/1.1 allows it)."""
    raw, origin = await one_answer_server(b"HTTP/1.1 200 OK\r\n\r\nall of it")
    r = await http.request("GET", origin, "/", total=5, connect=2)
    raw.close()
    assert (r.status, r.body) == (200, b"all of it")


async def test_head_and_no_content_answers_have_no_body(http: HTTP11) -> None:
    """A HEAD answer's Content-Length describes the GET's body, which is not sent: waiting for it would hang."""
    server = await serve(
        lambda head, body: (
            b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n"
            if head.startswith(b"HEAD")
            else b"HTTP/1.1 204 No Content\r\n\r\n"
        )
    )
    assert (await call(http, server, "HEAD")).body == b""
    assert (await call(http, server, "DELETE")).status == 204
    assert (await call(http, server, "HEAD")).status == 200
    await server.stop()
    assert server.connections == 1


async def test_interim_answer_is_skipped(http: HTTP11) -> None:
    server = await serve(lambda head, body: b"HTTP/1.1 100 Continue\r\n\r\n" + ok())
    assert (await call(http, server)).status == 200
    await server.stop()


async def test_refused_connection_is_not_sent(http: HTTP11) -> None:
    """NotSent lets the engine client retry even a state-changing call: the engine cannot have seen it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening
        with pytest.raises(NotSent, match=f"127.0.0.1:{port}"):
            await http.request("POST", Origin("127.0.0.1", port, b"h"), "/pause", total=5, connect=2)


async def test_connection_dropped_before_the_answer_is_lost(http: HTTP11) -> None:
    """The request was written: the engine may have acted on it, so this must not read as NotSent."""
    server = await serve(lambda head, body: None)
    with pytest.raises(Lost) as err:
        await call(http, server, "POST")
    await server.stop()
    assert not isinstance(err.value, NotSent)


async def test_connection_dropped_mid_body_is_lost(http: HTTP11) -> None:
    """A truncated JSON body must not be decoded as a shorter answer."""
    raw, origin = await one_answer_server(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"par')
    with pytest.raises(Lost, match="before a whole answer"):
        await http.request("GET", origin, "/", total=5, connect=2)
    raw.close()


async def test_idle_connection_closed_by_the_engine_is_replaced(http: HTTP11) -> None:
    """vLLM closes connections idle for 5 s; the next call must not fail because of it."""
    server = await serve(lambda head, body: ok())
    await call(http, server)
    for writer in server.writers:
        writer.close()  # the engine drops the idle connection
    await asyncio.sleep(0.05)
    assert (await call(http, server)).status == 200
    await server.stop()
    assert server.connections == 2


async def test_connections_idle_too_long_are_not_reused() -> None:
    """Reusing a connection just as the engine's keep-alive expires would lose a request (``Lost``)."""
    server = await serve(lambda head, body: ok())
    http = HTTP11(idle_s=0.05)
    try:
        await call(http, server)
        await asyncio.sleep(0.1)
        await call(http, server)
    finally:
        await http.close()
        await server.stop()
    assert server.connections == 2


async def test_no_answer_times_out_and_the_connection_is_not_reused(http: HTTP11) -> None:
    """A late answer on a reused connection would be read as the next call's answer."""
    calls = 0

    def slow_first(head: bytes, body: bytes) -> bytes | None:
        nonlocal calls
        calls += 1
        return b"" if calls == 1 else ok()  # the first call is never answered

    server = await serve(slow_first)
    with pytest.raises(TimeoutError):
        await call(http, server, total=0.2)
    assert (await call(http, server)).status == 200
    await server.stop()
    assert server.connections == 2


async def test_cancelled_call_closes_its_connection(http: HTTP11) -> None:
    server = await serve(lambda head, body: b"")
    task = asyncio.create_task(call(http, server))
    while not server.requests:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if server.open_now == 0:
            break
        await asyncio.sleep(0.01)
    await server.stop()
    assert server.open_now == 0


async def test_per_engine_connection_limit() -> None:
    """``limit_per_host`` keeps a fan-out of reads from opening a connection per call to one engine."""
    open_now = most = 0

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                await asyncio.sleep(0.02)
                writer.write(ok())
                await writer.drain()
        finally:
            open_now -= 1
            writer.close()

    raw = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = raw.sockets[0].getsockname()[1]
    http = HTTP11(limit=64, limit_per_host=2)
    try:
        origin = Origin("127.0.0.1", port, b"h")
        answers = await asyncio.gather(*(http.request("GET", origin, "/", total=5, connect=2) for _ in range(12)))
    finally:
        await http.close()
        raw.close()
    assert all(a.status == 200 for a in answers) and most == 2


async def test_a_waiter_cancelled_in_the_queue_does_not_leak_a_slot() -> None:
    """Slots handed to a waiter that was cancelled meanwhile pass on: otherwise the engine's calls would
    eventually all wait forever."""
    server = await serve(lambda head, body: ok())
    http = HTTP11(limit=1, limit_per_host=1)
    try:
        first = asyncio.create_task(call(http, server))
        queued = asyncio.create_task(call(http, server))
        await asyncio.sleep(0)
        queued.cancel()
        await first
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert (await call(http, server)).status == 200
        assert http._hosts == {}  # nothing left behind per engine
    finally:
        await http.close()
        await server.stop()


async def test_a_call_waiting_for_a_slot_past_its_total_times_out_and_leaks_no_slot() -> None:
    """``total`` bounds the wait for a connection slot too: a call queued behind an engine that does not
    answer must not wait longer than its caller allowed, and its place in the queue must not stay taken."""
    server = await serve(lambda head, body: b"" if b"/hang" in head else ok())
    http = HTTP11(limit=1, limit_per_host=1)
    try:
        hanging = asyncio.create_task(http.request("GET", server.origin, "/hang", total=5, connect=2))
        while not server.requests:
            await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):
            await call(http, server, total=0.1)
        hanging.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hanging
        assert (await call(http, server, total=2)).status == 200  # the slot of neither call was kept
        assert http._hosts == {} and http._all.taken == 0 and not http._all.waiters
    finally:
        await http.close()
        await server.stop()


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def close(self) -> None:
        self.closed = True


async def test_an_answer_just_after_the_deadline_is_dropped_with_the_connection() -> None:
    """The deadline's timer and the answer's bytes can land in the same turn of the loop, the timer first:
    the answer must go nowhere (not into the timed-out call's future, which is done, and not to the next
    call: the caller closes the connection) rather than raise inside the protocol."""
    conn = _Connection()
    transport = _Transport()
    conn.connection_made(transport)
    waiter = conn.send(b"GET / HTTP/1.1\r\n\r\n", head=False)
    _expire(waiter)
    conn.data_received(ok())  # raised InvalidStateError when the parser set the done future's result
    with pytest.raises(TimeoutError):
        await waiter
    conn.close()
    assert transport.closed and not conn.reusable


async def test_garbage_answer_is_lost(http: HTTP11) -> None:
    server = await serve(lambda head, body: b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(Lost, match=r"not an HTTP/1\.x answer"):
        await call(http, server)
    await server.stop()


async def test_header_injection_is_refused(http: HTTP11) -> None:
    """A token read from a Secret with a line break in it must not add headers of its own."""
    server = await serve(lambda head, body: ok())
    with pytest.raises(ValueError, match="line break"):
        await call(http, server, headers={"Authorization": "Bearer x\r\nX-Admin: 1"})
    await server.stop()
    assert server.requests == []


def test_origins_are_http_or_https_with_a_context() -> None:
    """Engines are dialled in plain HTTP; https only where the caller verifies the server (the API server)."""
    http = HTTP11()
    assert http.origin("http://10.1.2.3:8000") == Origin("10.1.2.3", 8000, b"10.1.2.3:8000")
    with pytest.raises(ValueError, match="expected http://host:port"):
        http.origin("https://10.1.2.3:8000")
    with pytest.raises(ValueError, match="expected http://host:port"):
        http.origin("http://10.1.2.3:8000/prefix")  # a path belongs to the request, not the origin
    context = ssl.create_default_context()
    tls = http.origin("https://127.0.0.1:6443", tls=context)
    assert (tls.port, tls.tls) == (6443, context)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    # The sandbox's own CA and API-server certificate (names 127.0.0.1); the service IP is only written into
    # the certificate, never dialled.
    return certs.ensure_pki(tmp_path_factory.mktemp("pki"), "10.0.0.1")


async def tls_server(pki: certs.Pki) -> tuple[asyncio.Server, int, list[bytes]]:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            while True:
                heads.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(ok())
                await writer.drain()
        writer.close()

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1], heads


async def test_tls_with_the_servers_ca(pki: certs.Pki) -> None:
    """The API server's hot verbs go over TLS: verified against the configuration's CA, kept alive."""
    server, port, heads = await tls_server(pki)
    http = HTTP11()
    try:
        origin = http.origin(f"https://127.0.0.1:{port}", tls=ssl.create_default_context(cafile=str(pki.ca_cert)))
        for _ in range(3):
            assert (await http.request("GET", origin, "/api/v1/pods", total=5, connect=5)).status == 200
    finally:
        await http.close()
        server.close()
    assert len(heads) == 3 and heads[0].startswith(b"GET /api/v1/pods HTTP/1.1\r\n")


async def test_tls_with_an_unknown_ca_is_not_sent(pki: certs.Pki) -> None:
    """A server whose certificate does not verify gets nothing, the credentials least of all."""
    server, port, heads = await tls_server(pki)
    http = HTTP11()
    try:
        origin = http.origin(f"https://127.0.0.1:{port}", tls=ssl.create_default_context())
        with pytest.raises(NotSent, match="CERTIFICATE_VERIFY_FAILED"):
            await http.request("GET", origin, "/", headers={"Authorization": "Bearer x"}, total=5, connect=5)
    finally:
        await http.close()
        server.close()
    assert heads == []


async def test_a_slot_handed_to_a_waiter_cancelled_before_it_ran_passes_on() -> None:
    """The slot was handed over (the waiter's future resolved) and the waiting call was cancelled before it
    resumed: the slot must go to the next waiter or back to the count, not vanish with the cancelled call."""
    slots = _Slots()
    await HTTP11._acquire(slots, 1)
    waiting = asyncio.create_task(HTTP11._acquire(slots, 1))
    await asyncio.sleep(0)
    assert len(slots.waiters) == 1
    HTTP11._release(slots)  # hands the slot to the waiter...
    waiting.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert slots.taken == 0 and not slots.waiters


async def test_no_connection_in_time_is_not_sent(http: HTTP11) -> None:
    """A server that never completes the handshake (here: its accept queue is full, so Linux drops the SYN)
    received nothing: NotSent, which lets a load be sent again at once instead of waiting for a read."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):  # fill the accept queue; nobody accepts
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        try:
            with pytest.raises(NotSent, match=f"no connection to 127.0.0.1:{port} within 0.2s"):
                await http.request("POST", Origin("127.0.0.1", port, b"h"), "/load", total=5, connect=0.2)
        finally:
            for s in fillers:
                s.close()
