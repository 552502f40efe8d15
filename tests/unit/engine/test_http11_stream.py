"""``HTTP11.stream``: a long answer read line by line, as the operator reads its pod watch (``KubeHTTP.watch``).

Against a raw TCP server that writes scripted pieces with pauses between them, as the API server writes a
watch: one chunk per event, events whenever pods change, a line cut across TCP reads. Each test says why the
behaviour is the one the pod watch needs: the operator serves its pod reads from what the watch delivered,
so a line lost, doubled or handed over late is a decision on a wrong pod.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from rolloutfleet.adapters.http11 import HTTP11, Lost, NotSent, Origin

pytestmark = pytest.mark.both_loops  # the operator runs this code on uvloop (handlers/event_loop.py)

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


Script = Sequence[bytes | float]  # bytes to write, or seconds to wait before the next piece


class StreamServer:
    """Reads one request head per connection, then plays ``script`` on it; keeps the heads it read."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.closed_by_peer = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> StreamServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def origin(self) -> Origin:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return Origin("127.0.0.1", port, f"127.0.0.1:{port}".encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.heads.append(await reader.readuntil(b"\r\n\r\n"))
        peer = asyncio.ensure_future(reader.read())  # b"" once the client closes its end
        peer.add_done_callback(lambda _: self.closed_by_peer.set())
        try:
            for piece in self.script:
                if isinstance(piece, float):
                    await asyncio.wait([peer], timeout=piece)
                else:
                    writer.write(piece)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def http() -> AsyncIterator[HTTP11]:
    transport = HTTP11()
    yield transport
    await transport.close()


async def test_each_line_is_handed_over_once_whole_as_it_arrives(http: HTTP11) -> None:
    """A watch event is one line; the API server writes each in a chunk of its own, but TCP may cut a chunk
    (and so a line) anywhere, or bring several at once. The handler sees each line once, whole, in order,
    before the answer ends (the pod watch applies events as they come); blank lines (a keep-alive) are not
    events. The status is told before the first line: a watch is established from its headers on."""
    seen: list[tuple[str, object]] = []
    first, second = b'{"type": "ADDED", "n": 1}\n', b'{"type": "MODIFIED", "n": 2}\n'
    cut = chunk(first + second)
    script = [HEAD, 0.05, cut[:9], 0.05, cut[9:30], 0.05, cut[30:], chunk(b"\n"), chunk(b'{"n": 3}\n{"n": 4}\n'), END]
    async with StreamServer(script) as server:
        answer = await http.stream(
            server.origin,
            "/api/v1/pods?watch=true",
            on_line=lambda line: seen.append(("line", line)) is None,
            on_status=lambda status: seen.append(("status", status)),
            idle=5,
            connect=2,
        )
    assert seen == [
        ("status", 200),
        ("line", first),
        ("line", second),
        ("line", b'{"n": 3}\n'),
        ("line", b'{"n": 4}\n'),
    ]
    assert (answer.status, answer.body) == (200, b"")
    assert server.heads[0].startswith(b"GET /api/v1/pods?watch=true HTTP/1.1\r\n")


async def test_a_handler_that_stops_ends_the_answer_and_its_connection(http: HTTP11) -> None:
    """An ERROR event (410 Gone: the version expired) ends the pod watch; what follows it on the stream must
    not be applied, and the connection, mid-answer, can never carry another request."""
    seen: list[bytes] = []
    script = [HEAD, chunk(b"a\n"), chunk(b"stop\n"), chunk(b"after\n"), 5.0, END]
    async with StreamServer(script) as server:
        answer = await http.stream(
            server.origin,
            "/w",
            on_line=lambda line: seen.append(line) is None and line != b"stop\n",
            idle=5,
            connect=2,
        )
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)
    assert seen == [b"a\n", b"stop\n"] and answer.status == 200


async def test_an_error_answer_is_read_whole_and_no_line_is_handed_over(http: HTTP11) -> None:
    """A 403 (an older chart's RBAC) or 410 on the watch's request: the caller reads the Status message from
    the body; none of it is an event."""
    body = b'{"kind": "Status", "message": "pods is forbidden"}'
    script = [b"HTTP/1.1 403 Forbidden\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]
    seen: list[bytes] = []
    statuses: list[int] = []
    async with StreamServer(script) as server:
        answer = await http.stream(
            server.origin,
            "/w",
            on_line=lambda line: seen.append(line) is None,
            on_status=statuses.append,
            idle=5,
            connect=2,
        )
    assert (answer.status, answer.body, seen, statuses) == (403, body, [], [403])


async def test_what_the_handler_raises_ends_the_stream_with_it(http: HTTP11) -> None:
    """A line that is not a watch event (the decoder raises): the pod watch logs it and falls back to lists;
    it must not be swallowed by the connection, nor leave the call waiting."""
    script = [HEAD, chunk(b"not json\n"), 5.0, END]

    def refuse(line: bytes) -> bool:
        raise ValueError(f"not a watch event: {line!r}")

    async with StreamServer(script) as server:
        with pytest.raises(ValueError, match="not a watch event"):
            await asyncio.wait_for(http.stream(server.origin, "/w", on_line=refuse, idle=5, connect=2), 3)


async def test_idle_bounds_the_quiet_between_bytes_not_the_whole_answer(http: HTTP11) -> None:
    """A watch lasts minutes (the API server ends it after its timeout) with events at any pace: only a
    stream silent for longer than ``idle`` (no event, no bookmark) is taken for a dead connection."""
    lively = [HEAD, *(piece for _ in range(6) for piece in (0.1, chunk(b"x\n"))), END]
    seen: list[bytes] = []
    async with StreamServer(lively) as server:
        answer = await http.stream(
            server.origin, "/w", on_line=lambda line: seen.append(line) is None, idle=0.3, connect=2
        )
    assert answer.status == 200 and len(seen) == 6  # 0.6 s in all, never 0.3 s quiet
    async with StreamServer([HEAD, chunk(b"x\n"), 5.0, END]) as server:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(http.stream(server.origin, "/w", on_line=lambda line: True, idle=0.3, connect=2), 3)


async def test_a_stream_that_is_not_chunked_is_refused(http: HTTP11) -> None:
    """Every streamed answer of the API server is chunked; a 200 delimited otherwise would be buffered whole
    and its events handed over only at its end, minutes late: refused instead of read silently so."""
    script = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nx\n"]
    async with StreamServer(script) as server:
        with pytest.raises(Lost, match="not chunked"):
            await http.stream(server.origin, "/w", on_line=lambda line: True, idle=5, connect=2)


async def test_no_server_is_not_sent(http: HTTP11) -> None:
    """Nothing listening: the watch falls back to lists as on any failure, told apart from a lost stream."""
    async with StreamServer([]) as server:
        origin = server.origin
    with pytest.raises(NotSent):
        await http.stream(origin, "/w", on_line=lambda line: True, idle=5, connect=2)


async def test_a_cancelled_stream_closes_its_connection(http: HTTP11) -> None:
    """A fleet deleted or its list idle: the pod watch's task is cancelled, and the server must see the
    connection go (no stream left open per fleet ever watched)."""
    first = asyncio.Event()
    async with StreamServer([HEAD, chunk(b"x\n"), 30.0, END]) as server:
        task = asyncio.ensure_future(
            http.stream(server.origin, "/w", on_line=lambda line: first.set() is None, idle=60, connect=2)
        )
        await asyncio.wait_for(first.wait(), 5)  # the stream is established and reading
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)


async def test_a_streams_connection_is_not_counted_with_the_requests() -> None:
    """``rolloutfleet_kube_connections_opened_total`` counts the TLS handshakes of the operator's requests
    (what a revision pays when its connections went idle); a watch's connection lasts minutes and is not one."""
    opened: list[None] = []
    http = HTTP11(on_connect=lambda: opened.append(None))
    try:
        async with StreamServer([HEAD, chunk(b"x\n"), END]) as server:
            await http.stream(server.origin, "/w", on_line=lambda line: True, idle=5, connect=2)
    finally:
        await http.close()
    assert opened == []
