"""HTTP/1.1 over kept-alive connections: the transport of every engine call and of the Kubernetes API's hot verbs.

Called by ``adapters.engine`` (``EnginePool`` owns one ``HTTP11``; ``EngineClient._sent`` sends through it) and
``adapters.kube_http`` (``KubeHTTP.request``: gets, lists and patches, over TLS). It owns the connections: at
most ``limit_per_host`` per server and ``limit`` in all, kept open between calls and dropped after ``idle_s``
unused.

Why not aiohttp (which the operator used before, and still uses for proxied API servers): a call
here is a small JSON request answered by a JSON body, and aiohttp's general client spent ~350 µs of the
operator's CPU on each against ~135 µs for this module on the same loopback server (issue 18: an engine call
is 5 per pod per revision, a readiness-gate patch 2, together the largest share of the operator's CPU at
1,024 pods). What this module does not do, because neither the engines' control routes nor the API server's
hot verbs need it: proxies, redirects, cookies, compression (nothing asks for it, so servers answer
identity), HTTP/2 (no ALPN is offered: servers answer HTTP/1.1).

What the caller may rely on, the same as with aiohttp:

- ``NotSent``: no connection could be made (TLS handshake included); the server cannot have received the
  request.
- ``Lost``: the connection broke (or the answer made no sense) after the request was written; the server
  may have acted on it. A kept-alive connection the server closed while idle is noticed before reuse
  (``connection_lost``) and a fresh one is made; ``idle_s`` must stay below the server's keep-alive (vLLM's
  is 5 s), so that a connection is not reused just as the server closes it.
- ``TimeoutError``: no whole answer within ``total`` seconds (waiting for a connection slot included). The
  connection is closed, never reused: a late answer on it would be taken for the next request's. No
  connection within ``connect`` seconds is ``NotSent``.

``HTTP11.stream`` reads a long answer line by line (the Kubernetes API's watches, ``adapters.kube_http``): each
line goes to the caller's handler from inside the connection's ``data_received``, with no task woken per line.
With the kubelet's readiness rule a pod makes about four watch events per revision, each arriving on its own;
read through aiohttp's stream reader, one cost 44-65 µs of CPU against 29-30 µs handed over this way (a loopback
TLS server sending a fleet pod's event every millisecond, bench/results/rollout_overhead.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import ssl
import time
import urllib.parse
from collections.abc import Callable
from typing import Final, cast

USER_AGENT: Final = b"rolloutfleet-operator"
MAX_HEAD_BYTES: Final = 64 * 1024  # an engine's or the API server's answer headers are under a kilobyte
# vLLM's HTTP server closes a connection idle for 5 s (uvicorn's keep-alive default, vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE): reuse only connections idle for less, with a margin for the network.
IDLE_S: Final = 4.0
_NO_BODY_STATUSES: Final = frozenset({204, 304})

# A streamed answer's line (``HTTP11.stream``, its newline included); False: read no further.
LineHandler = Callable[[bytes], bool]


class NotSent(ConnectionError):  # noqa: N818 - read as "the request was not sent"
    """No connection to the server: nothing was sent."""


class Lost(ConnectionError):  # noqa: N818 - read as "the connection was lost"
    """The connection broke, or the answer was not HTTP, after the request was (maybe) received."""


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    """A whole answer: status, the media type of ``Content-Type`` (lower case, no parameters), the body."""

    status: int
    reason: str
    content_type: str
    body: bytes
    retry_after: str = ""  # the Retry-After header as sent (the API server's 429s: ``adapters.kube_http``)

    def text(self) -> str:
        # The engines and the API server answer JSON and text in UTF-8.
        return self.body.decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where a server listens, parsed once per base URL; ``tls`` for ``https`` (with the name the server's
    certificate must hold, ``None`` for the host)."""

    host: str
    port: int
    host_header: bytes
    tls: ssl.SSLContext | None = None
    server_hostname: str | None = None


class _Connection(asyncio.Protocol):
    """One TCP connection: writes a request, parses the answer as bytes arrive (Content-Length, chunked, or
    to the end of the connection), resolves the waiting call's future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buffer = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._head_request = False
        self._on_line: LineHandler | None = None  # a streamed answer (``HTTP11.stream``)
        self._on_status: Callable[[int], None] | None = None  # told the streamed answer's status
        self.last_data = 0.0  # when bytes last arrived (monotonic; a stream's idle bound reads it)
        self._reset()

    def _reset(self) -> None:
        self._status = 0
        self._reason = ""
        self._content_type = ""
        self._retry_after = ""
        self._keep_alive = True
        self._length: int | None = None  # bytes of body expected; None: chunked or to the end
        self._chunked = False
        self._in_body = False
        self._body = bytearray()
        self._chunk_left = -1  # chunked: bytes left of the current chunk (-1: a size line is next)
        self._trailers = False
        self._pending = bytearray()  # a streamed answer's bytes after its last whole line

    # asyncio.Protocol -------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # create_connection gives a Transport (uvloop's is one by its methods, not by subclassing asyncio's)
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        self._waiter = None
        if self._in_body and self._length is None and not self._chunked:
            waiter.set_result(self._response())  # an answer delimited by the end of the connection
        else:
            waiter.set_exception(Lost(f"connection closed before a whole answer ({exc or 'EOF'})"))

    def eof_received(self) -> bool:
        self.closed = True  # not reusable from now on (connection_lost follows on the next loop turn)
        return False  # close our side too; connection_lost reports what was pending

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the connection cannot be trusted with a request
            self.close()
            return
        self._buffer += data
        if self._on_line is not None:
            self.last_data = time.monotonic()
        try:
            self._parse()
        except Exception as exc:  # Lost, or a streamed line's handler failing: the call's error either way
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
            self.close()

    # requests ---------------------------------------------------------------------------------------------

    def send(
        self,
        request: bytes,
        *,
        head: bool,
        on_line: LineHandler | None = None,
        on_status: Callable[[int], None] | None = None,
    ) -> asyncio.Future[Response]:
        """Write ``request``; the future resolves with the whole answer. ``on_line``: a 200 answer's body goes
        to it line by line as it arrives (it must be chunked), and the answer resolves with an empty body;
        ``on_status`` is told the answer's status as soon as its headers are read."""
        assert self.transport is not None and self._waiter is None  # the pool's invariant
        self._reset()
        self._head_request = head
        self._on_line, self._on_status = on_line, on_status
        self.last_data = time.monotonic()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._waiter

    @property
    def reusable(self) -> bool:
        return not self.closed and self._waiter is None and self._keep_alive and not self._buffer

    def close(self) -> None:
        self.closed = True
        if self._waiter is not None and self._waiter.done():  # answered by a timeout: bytes after it are no one's
            self._waiter = None
        if self.transport is not None:
            self.transport.close()

    # parsing ----------------------------------------------------------------------------------------------

    def _parse(self) -> None:
        while self._waiter is not None:
            if not self._in_body:
                if not self._parse_head():
                    return
                continue
            if not self._parse_body():
                return
            waiter, self._waiter = self._waiter, None
            self.idle_since = time.monotonic()
            if not waiter.done():  # (done: the call's deadline passed just before; its caller closes this)
                waiter.set_result(self._response())

    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise Lost(f"answer headers longer than {MAX_HEAD_BYTES} bytes")
            return False
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[: end + 4]
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not code.isdigit() or len(code) != 3:
            raise Lost(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:  # an interim answer (we send no Expect; tolerated anyway): the real one follows
            return True
        self._status, self._reason = status, reason
        connection = ""
        length: str | None = None
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise Lost(f"malformed answer header: {line[:80]!r}")
            name = name.strip().lower()
            if name == "content-length":
                length = value.strip()
            elif name == "transfer-encoding":
                self._chunked = "chunked" in value.lower()
            elif name == "content-type":
                self._content_type = value.split(";", 1)[0].strip().lower()
            elif name == "connection":
                connection = value.strip().lower()
            elif name == "retry-after":
                self._retry_after = value.strip()
        self._keep_alive = connection != "close" and version != "HTTP/1.0"
        if self._head_request or status in _NO_BODY_STATUSES:
            self._length = 0
            self._chunked = False
        elif self._chunked:
            self._length = None
        elif length is not None:
            if not length.isdigit():
                raise Lost(f"bad Content-Length: {length[:40]!r}")
            self._length = int(length)
        else:
            self._length = None  # delimited by the end of the connection
            self._keep_alive = False
        if self._on_line is not None and status == 200 and not self._chunked:
            # (every streaming answer of the API server is chunked; another would be read whole, silently)
            raise Lost("a streamed answer that is not chunked")
        self._in_body = True
        if self._on_status is not None:
            self._on_status(status)
        return True

    def _parse_body(self) -> bool:
        """True once the body is whole (what follows it stays in the buffer: nothing, for a sane server)."""
        if self._chunked:
            return self._parse_chunks()
        if self._length is None:
            self._body += self._buffer
            self._buffer.clear()
            return False  # until connection_lost
        if len(self._buffer) < self._length:
            return False
        self._body = self._buffer[: self._length]
        del self._buffer[: self._length]
        return True

    def _parse_chunks(self) -> bool:
        while True:
            if self._trailers:  # after the last chunk: trailer lines up to an empty one
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    return False
                del self._buffer[: end + 2]
                if end == 0:
                    return True
                continue
            if self._chunk_left < 0:
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    if len(self._buffer) > MAX_HEAD_BYTES:
                        raise Lost("chunk size line too long")
                    return False
                size = bytes(self._buffer[:end]).split(b";", 1)[0].strip()
                del self._buffer[: end + 2]
                try:
                    self._chunk_left = int(size, 16)
                except ValueError as exc:
                    raise Lost(f"bad chunk size: {size[:20]!r}") from exc
                if self._chunk_left == 0:
                    self._trailers = True
                continue
            if len(self._buffer) < self._chunk_left + 2:
                return False
            if self._buffer[self._chunk_left : self._chunk_left + 2] != b"\r\n":
                raise Lost("chunk not followed by CRLF")
            data = self._buffer[: self._chunk_left]
            del self._buffer[: self._chunk_left + 2]
            self._chunk_left = -1
            if self._on_line is None or self._status != 200:
                self._body += data
                continue
            self._pending += data
            if not self._lines():
                return True  # stopped by the handler: the answer ends here (the caller closes)

    def _lines(self) -> bool:
        """Hand the whole lines of ``_pending`` to the stream's handler (blank ones skipped: a server's
        keep-alive); False once it asks for no more."""
        assert self._on_line is not None
        pending, start = self._pending, 0
        try:
            while (end := pending.find(b"\n", start)) >= 0:
                line = bytes(pending[start : end + 1])
                start = end + 1
                # (``isspace``, not ``strip``: the same test without copying a pod-sized line)
                if not line.isspace() and not self._on_line(line):
                    return False
        finally:
            del pending[:start]
        return True

    def _response(self) -> Response:
        return Response(self._status, self._reason, self._content_type, bytes(self._body), self._retry_after)


def _request_bytes(method: str, origin: Origin, target: str, headers: dict[str, str], body: bytes | None) -> bytes:
    head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"Host: ", origin.host_header, b"\r\n"]
    for name, value in headers.items():
        if "\n" in value or "\r" in value:  # a token with a line break would add headers of its own
            raise ValueError(f"header {name} holds a line break")
        head.append(f"{name}: {value}\r\n".encode("latin-1"))
    if body is not None or method in ("POST", "PUT", "PATCH"):
        head.append(b"Content-Length: %d\r\n" % (len(body) if body is not None else 0))
    if "User-Agent" not in headers:
        head.append(b"User-Agent: " + USER_AGENT + b"\r\n")
    if "Accept" not in headers:
        head.append(b"Accept: */*\r\n")
    head.append(b"\r\n")
    if body:
        head.append(body)
    return b"".join(head)


def _expire(waiter: asyncio.Future[Response]) -> None:
    """A call's deadline passed before its whole answer (``HTTP11.request`` closes the connection)."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Slots:
    """A counting limit whose waiters are served in arrival order (``asyncio.Semaphore`` without the object
    per server: ``HTTP11`` keeps one only while the server has calls in flight or waiting)."""

    __slots__ = ("taken", "waiters")

    def __init__(self) -> None:
        self.taken = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def free(self, limit: int) -> bool:
        """A slot may be taken now without waiting (nobody waits before it)."""
        return self.taken < limit and not self.waiters


class HTTP11:
    """Connections to many servers (module docstring). ``close()`` drops them all."""

    def __init__(
        self,
        *,
        limit: int = 512,
        limit_per_host: int = 4,
        idle_s: float = IDLE_S,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        if limit < 1 or limit_per_host < 1:
            raise ValueError("limit and limit_per_host must be at least 1")
        self._limit = limit
        self._limit_per_host = limit_per_host
        self.idle_s = idle_s  # may change while in use (``EnginePool.idle_s``): read at each reuse and sweep
        self._on_connect = on_connect  # called for each connection made (the metrics' count of them)
        self._all = _Slots()
        self._hosts: dict[tuple[str, int], _Slots] = {}
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._swept = 0.0
        self._closed = False

    def origin(self, base_url: str, *, tls: ssl.SSLContext | None = None, server_hostname: str | None = None) -> Origin:
        """``http://10.1.2.3:8000`` parsed (cached: the same few thousand engines are asked again and again);
        ``https://…`` only with ``tls``, the context that verifies the server (and holds a client
        certificate, if any)."""
        found = self._origins.get(base_url)
        if found is None:
            parts = urllib.parse.urlsplit(base_url)
            scheme = "https" if tls is not None else "http"
            if parts.scheme != scheme or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"expected {scheme}://host:port, not {base_url!r}")
            port = parts.port or (443 if tls is not None else 80)
            host_header = (parts.netloc or f"{parts.hostname}:{port}").encode("idna")
            found = Origin(parts.hostname, port, host_header, tls, server_hostname)
            if len(self._origins) > 65_536:  # pods come and go with new IPs: keep the cache bounded
                self._origins.clear()
            self._origins[base_url] = found
        return found

    async def request(
        self,
        method: str,
        origin: Origin,
        target: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        total: float,
        connect: float,
    ) -> Response:
        """One call; ``target`` is the path with its query string. Raises ``NotSent``, ``Lost`` or
        ``TimeoutError`` (module docstring)."""
        if self._closed:
            raise RuntimeError("HTTP11 is closed")
        request = _request_bytes(method, origin, target, headers or {}, body)
        key = (origin.host, origin.port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total
        # ``total`` bounds the call as a whole, but an ``asyncio.timeout`` around it (a Timeout object, its
        # rescheduling and its exit per call) was ~4 % of the event loop's samples in a 1,024-pod Rolling
        # revision (py-spy; issue 18). The usual call takes a free slot and a kept-alive connection without
        # waiting: only the answer is waited for, under one timer on its future; a wait for a slot or a new
        # connection keeps its own ``asyncio.timeout_at`` with the same deadline.
        if not self._take_now(key):
            async with asyncio.timeout_at(deadline):
                await self._take(key)
        try:
            conn = self._kept(key)
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._connect(origin, connect)
            waiter = conn.send(request, head=method == "HEAD")
            timer = loop.call_at(deadline, _expire, waiter)
            try:
                response = await waiter
            except BaseException:
                conn.close()  # an answer may still arrive: it must not be read as the next call's
                raise
            finally:
                timer.cancel()
            self._release_connection(key, conn)
            return response
        finally:
            self._give(key)

    async def stream(
        self,
        origin: Origin,
        target: str,
        *,
        on_line: LineHandler,
        on_status: Callable[[int], None] | None = None,
        headers: dict[str, str] | None = None,
        idle: float,
        connect: float,
    ) -> Response:
        """``GET target`` on a connection of its own (a stream must never wait for a slot of the pool, nor
        hold one), its 200 answer's lines handed to ``on_line`` as they arrive, until the server ends the
        answer (or ``on_line`` returns False); ``on_status`` is told the status once the headers are read (a
        watch is established then, before its first line). Returns the answer: an empty body after a 200, the
        whole body otherwise (the caller reads the error). Raises as ``request`` does, ``TimeoutError`` when no
        bytes came for ``idle`` seconds, or what ``on_line`` raised. The connection is closed after, never
        reused."""
        if self._closed:
            raise RuntimeError("HTTP11 is closed")
        request = _request_bytes("GET", origin, target, headers or {}, None)
        loop = asyncio.get_running_loop()
        conn = await self._connect(origin, connect, counted=False)
        waiter = conn.send(request, head=False, on_line=on_line, on_status=on_status)
        timer: asyncio.TimerHandle

        def check() -> None:  # one timer per idle period, not one per arrival
            nonlocal timer
            quiet = time.monotonic() - conn.last_data
            if quiet >= idle:
                _expire(waiter)
            else:
                timer = loop.call_later(idle - quiet, check)

        timer = loop.call_later(idle, check)
        try:
            return await waiter
        finally:
            timer.cancel()
            conn.close()

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        # Let the transports' close callbacks run before the loop may end.
        await asyncio.sleep(0)

    # connections ------------------------------------------------------------------------------------------

    def _kept(self, key: tuple[str, int]) -> _Connection | None:
        """The connection to ``key`` used last, if it may be used again (the others idle longer are closed)."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, connect: float, *, counted: bool = True) -> _Connection:
        """A new connection; ``counted``: told to ``on_connect`` (the metrics count the requests' connections,
        not the streams')."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect):
                _, protocol = await loop.create_connection(
                    _Connection,
                    origin.host,
                    origin.port,
                    ssl=origin.tls,
                    # (asyncio refuses a server name without TLS)
                    server_hostname=(origin.server_hostname or origin.host) if origin.tls is not None else None,
                )
        except TimeoutError as exc:  # (an OSError too: told apart for its message)
            # NotSent, not a timeout of the call: nothing reached the server, so a load is not "of unknown
            # outcome" (aiohttp reported this as a timeout, and a load's next attempt waited for a read).
            raise NotSent(f"no connection to {origin.host}:{origin.port} within {connect:g}s") from exc
        except OSError as exc:
            raise NotSent(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        if counted and self._on_connect is not None:
            self._on_connect()
        return protocol

    def _release_connection(self, key: tuple[str, int], conn: _Connection) -> None:
        if not conn.reusable or self._closed:
            conn.close()
            return
        idle = self._idle.setdefault(key, [])
        idle.append(conn)
        if len(idle) > self._limit_per_host:
            idle.pop(0).close()
        self._sweep(conn.idle_since)

    def _sweep(self, now: float) -> None:
        """Close connections idle too long; at most once per ``idle_s`` of calls (not per call)."""
        if now - self._swept < self.idle_s:
            return
        self._swept = now
        for key in list(self._idle):
            kept = [c for c in self._idle[key] if c.reusable and now - c.idle_since < self.idle_s]
            for conn in self._idle[key]:
                if conn not in kept:
                    conn.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]

    # slots ------------------------------------------------------------------------------------------------

    def _take_now(self, key: tuple[str, int]) -> bool:
        """Both slots (the server's and the pool's) taken if free with nobody waiting; False: ``_take``."""
        host = self._hosts.get(key)
        if not ((host is None or host.free(self._limit_per_host)) and self._all.free(self._limit)):
            return False
        if host is None:
            host = self._hosts[key] = _Slots()
        host.taken += 1
        self._all.taken += 1
        return True

    async def _take(self, key: tuple[str, int]) -> None:
        host = self._hosts.get(key)
        if host is None:
            host = self._hosts[key] = _Slots()
        await self._acquire(host, self._limit_per_host)
        try:
            await self._acquire(self._all, self._limit)
        except BaseException:
            self._release(host)
            self._forget(key, host)
            raise

    def _give(self, key: tuple[str, int]) -> None:
        self._release(self._all)
        host = self._hosts[key]
        self._release(host)
        self._forget(key, host)

    def _forget(self, key: tuple[str, int], host: _Slots) -> None:
        if host.taken == 0 and not host.waiters:
            del self._hosts[key]

    @staticmethod
    async def _acquire(slots: _Slots, limit: int) -> None:
        if slots.free(limit):
            slots.taken += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slots.waiters.append(waiter)
        try:
            await waiter  # resolved by _release, which hands its slot over (taken stays counted)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                HTTP11._release(slots)  # the slot was handed over just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # _release may have dropped it already
                    slots.waiters.remove(waiter)
            raise

    @staticmethod
    def _release(slots: _Slots) -> None:
        while slots.waiters:
            waiter = slots.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the waiter
                return
        slots.taken -= 1
