"""``KubeHTTP``: the Kubernetes API's hot verbs (get, list, patch) and watches, on the event loop.

Used by ``adapters.kube.Kube`` only; reconcile never sees it. Why it exists (issue 18, profiled at 1,024
pods): a rollout writes a readiness gate per pod twice and lists the fleet's pods every pass, and through
the official client each request took a pool thread, urllib3 and the client's own request machinery —
about 1.3 ms of operator CPU per gate PATCH, with 16 threads fighting the event loop for the GIL. Here a
request is a coroutine on the event loop, on kept-alive connections, with the same credentials: through
``adapters.http11`` (the operator's own HTTP/1.1 client, ~2.5x cheaper per request than aiohttp's), or through
aiohttp when the configuration names a proxy (which http11 does not speak). Watches stream the same way.

Credentials and TLS come from the official client's ``Configuration`` (kubeconfig or in-cluster), read per
request through ``auth_settings()`` so a refreshed token (in-cluster: the projected ServiceAccount token
rotates; exec plugins) is used as soon as the client would use it. Everything the official client does
not need on the hot path (discovery, server-side apply, creates, deletes) stays with it.

At most ``limit`` requests are in flight (``ROLLOUTFLEET_KUBE_IN_FLIGHT``, 64 by default: ``adapters.kube``);
one the API server turns away with 429 (API Priority and Fairness) is waited out and sent again
(``THROTTLED_RETRIES``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import msgspec
from kubernetes import client as k8s_client

from rolloutfleet.adapters import http11

Manifest = dict[str, Any]

AUTH_SECONDS = 10.0  # how long the credentials' headers are reused (``KubeHTTP._auth_headers``)
# Connections to the API server are reused while idle for less than this: a new one costs a TLS handshake,
# and the API server keeps idle connections far longer (aiohttp, used before, kept them 15 s).
IDLE_SECONDS = 15.0
CONNECT_SECONDS = 30.0  # the TCP and TLS handshake's own bound (within the request's timeout)
JSON = "application/json"
# A write's answer as the object's metadata only (the API server's PartialObjectMetadata, which it serves
# for every kind and verb since Kubernetes 1.15), plain JSON where a server does not offer it: a gate write
# answers 2-3 KB instead of the whole pod, a fleet status write a few KB instead of a row per pod, which the
# API server encoded and the operator decrypted for nothing (issue 18).
METADATA_ONLY = f"{JSON};as=PartialObjectMetadata;g=meta.k8s.io;v=v1,{JSON}"


# A 429 Too Many Requests is the API server turning a request away before running it (API Priority and
# Fairness' queues are full, or its in-flight limit): safe to send again, a PATCH too, as client-go does. Each is
# waited out as its Retry-After says, ``THROTTLED_WAIT_SECONDS`` when it does not (client-go's wait too), at
# most ``THROTTLED_WAIT_MAX_SECONDS``, up to ``THROTTLED_RETRIES`` times within the request's own timeout.
THROTTLED_RETRIES = 5
THROTTLED_WAIT_SECONDS = 1.0
THROTTLED_WAIT_MAX_SECONDS = 10.0


def retry_after(value: str) -> float:
    """The seconds a 429's Retry-After asks for (delta-seconds; a date or nothing: ``THROTTLED_WAIT_SECONDS``)."""
    try:
        seconds = float(value.strip())
    except ValueError:
        return THROTTLED_WAIT_SECONDS
    return min(max(seconds, 0.0), THROTTLED_WAIT_MAX_SECONDS)


class KubeHTTPError(RuntimeError):
    """A request that failed; ``status`` is the HTTP status, 0 when none was received."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def ssl_context(configuration: k8s_client.Configuration) -> ssl.SSLContext | bool:
    """The TLS settings the official client would use: CA, client certificate, verification."""
    if not configuration.host.startswith("https"):
        return False
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif configuration.assert_hostname is False:
        context.check_hostname = False
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    return context


class KubeHTTP:
    """One session to one API server; ``limit`` connections at most (each kept alive)."""

    def __init__(
        self,
        configuration: k8s_client.Configuration,
        *,
        limit: int,
        on_connect: Callable[[], None] | None = None,
        on_throttle: Callable[[float], None] | None = None,
    ) -> None:
        """``on_connect``, ``on_throttle``: metrics hooks, called for each connection opened to the API server
        and for each 429 waited out (with the seconds waited)."""
        self.configuration = configuration
        self.base = configuration.host.rstrip("/")
        self._ssl = ssl_context(configuration)
        self._limit = limit
        # Requests wait for one of ``limit`` slots *before* their timeout starts: a burst of 4,096 gate
        # writes queued inside aiohttp's pool timed out there (each one's 30 s ran while it waited its turn).
        self._slots = asyncio.Semaphore(limit)
        self._session: aiohttp.ClientSession | None = None  # requests through a proxy only
        # Watches through a proxy: each holds a connection for minutes.
        self._streams: aiohttp.ClientSession | None = None
        # The slots above bound the requests; the pool only keeps their connections.
        self._http = http11.HTTP11(limit=limit, limit_per_host=limit, idle_s=IDLE_SECONDS, on_connect=on_connect)
        parts = urllib.parse.urlsplit(self.base)
        self._prefix = parts.path.rstrip("/")  # a path the API server is served under (e.g. behind a gateway)
        self._origin = self._http.origin(
            f"{parts.scheme}://{parts.netloc}",
            tls=self._ssl if isinstance(self._ssl, ssl.SSLContext) else None,
            server_hostname=self._route()["server_hostname"],
        )
        self._auth: tuple[float, dict[str, str]] | None = None  # (read at, headers): see ``_auth_headers``
        self.on_throttle = on_throttle

    def _headers(self, content_type: str | None, accept: str = JSON) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": "rolloutfleet-operator"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        headers.update(self._auth_headers())
        return headers

    def _auth_headers(self) -> dict[str, str]:
        """The credentials' headers, read again every ``AUTH_SECONDS``.

        ``auth_settings()`` refreshes an expiring token through the configuration's hook, as the client does;
        with a kubeconfig that hook reloads the credentials and resets the configuration (its proxy lookup
        walks the environment) at every call: 2 % of the operator's CPU at 1,024 pods when called per request
        (issue 18). Tokens live for many minutes and are renewed well before they expire, so reading them
        again every few seconds keeps the client's refresh behaviour.
        """
        now = time.monotonic()
        if self._auth is not None and now - self._auth[0] < AUTH_SECONDS:
            return self._auth[1]
        settings = cast(dict[str, dict[str, Any]], self.configuration.auth_settings())
        headers = {
            str(setting["key"]): str(setting["value"])
            for setting in settings.values()
            if setting.get("in") == "header" and setting.get("value")
        }
        self._auth = (now, headers)
        return headers

    def _route(self) -> dict[str, Any]:
        """How requests reach the server: the configuration's proxy and TLS server name, if any."""
        return {
            "proxy": self.configuration.proxy or None,
            "server_hostname": getattr(self.configuration, "tls_server_name", None) or None,
        }

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, ssl=self._ssl)
            # Proxies come from the configuration only (as with the official client), not the environment.
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: float,  # noqa: ASYNC109 - the request's own bound, passed to aiohttp
        decode: bool = True,
        metadata_only: bool = False,
    ) -> Any:
        """One request; the decoded JSON answer (None with ``decode=False``: a write whose answer nobody
        reads), or ``KubeHTTPError``. ``metadata_only`` (implied by ``decode=False``): the server is asked to
        answer with the object's metadata only (``METADATA_ONLY``)."""
        # msgspec: the same JSON as the json module, several times faster on objects with a row per pod (the
        # fleet status read at every fleet-status write: 2.3 % of the operator's CPU at 1,024 pods, issue 18).
        data = None if body is None else msgspec.json.encode(body)
        accept = METADATA_ONLY if metadata_only or not decode else JSON
        headers = self._headers(content_type if data is not None else None, accept)
        deadline: float | None = None
        for attempt in range(THROTTLED_RETRIES + 1):
            async with self._slots:  # not held while a 429 is waited out: other requests go meanwhile
                if deadline is None:  # from the first slot on, as before (see ``_slots``)
                    deadline = time.monotonic() + timeout
                left = max(deadline - time.monotonic(), 0.001)
                raw, status, reason, wait_header = await self._exchange(method, path, params, data, headers, left)
            if status != 429 or attempt == THROTTLED_RETRIES:
                break
            wait = retry_after(wait_header)
            if time.monotonic() + wait >= deadline:
                break
            if self.on_throttle is not None:
                self.on_throttle(wait)
            await asyncio.sleep(wait)
        if not 200 <= status < 300:
            raise KubeHTTPError(status, _message(raw.decode("utf-8", "replace"), reason))
        if not decode:
            return None
        return msgspec.json.decode(raw) if raw else None

    async def _exchange(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None,
        data: bytes | None,
        headers: dict[str, str],
        timeout: float,  # noqa: ASYNC109 - the request's own bound, passed to the client
    ) -> tuple[bytes, int, str, str]:
        """The answer's body, status, reason and Retry-After: through http11, or aiohttp when a proxy is
        configured."""
        try:
            if not self.configuration.proxy:
                target = self._prefix + path + ("?" + urllib.parse.urlencode(params) if params else "")
                resp = await self._http.request(
                    method,
                    self._origin,
                    target,
                    headers=headers,
                    body=data,
                    total=timeout,
                    connect=min(timeout, CONNECT_SECONDS),
                )
                return resp.body, resp.status, resp.reason, resp.retry_after
            async with self._open().request(
                method,
                self.base + path,
                params=params,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                **self._route(),
            ) as answer:
                # Read to the end either way: the connection goes back to the pool.
                return await answer.read(), answer.status, answer.reason or "", answer.headers.get("Retry-After", "")
        except TimeoutError as exc:
            raise KubeHTTPError(0, f"no answer in {timeout:g}s: {method} {path}") from exc
        except (http11.NotSent, http11.Lost, aiohttp.ClientError) as exc:
            raise KubeHTTPError(0, f"{type(exc).__name__}: {exc}") from exc

    async def watch(
        self,
        path: str,
        *,
        params: dict[str, str],
        timeout: float,  # noqa: ASYNC109 - the wait for each line
        on_event: Callable[[Any], bool],
        on_open: Callable[[], None] | None = None,
        decode: Callable[[bytes], Any] = json.loads,
    ) -> None:
        """A watch: each line of the answer, decoded, to ``on_event`` until the server ends it (or
        ``on_event`` returns False); ``KubeHTTPError`` on failure, and what ``decode`` or ``on_event`` raised.

        ``timeout`` bounds the wait for each line (the server sends bookmarks well within it); ``on_open``
        is called once the server accepted the watch (every change from then on will be delivered);
        ``decode`` turns a line into the event (``adapters.kube_watch`` decodes only what it keeps). Through
        ``http11.HTTP11.stream`` (each line handled as it arrives, no task woken per event), or aiohttp when
        a proxy is configured."""
        if not self.configuration.proxy:
            target = self._prefix + path + "?" + urllib.parse.urlencode(params)

            def status(code: int) -> None:
                if code == 200 and on_open is not None:
                    on_open()

            try:
                answer = await self._http.stream(
                    self._origin,
                    target,
                    on_line=lambda raw: on_event(decode(raw)),
                    on_status=status,
                    headers=self._headers(None),
                    idle=timeout,
                    connect=CONNECT_SECONDS,
                )
            except TimeoutError as exc:
                raise KubeHTTPError(0, f"watch {path}: nothing in {timeout:g}s") from exc
            except (http11.NotSent, http11.Lost) as exc:
                raise KubeHTTPError(0, f"watch {path}: {type(exc).__name__}: {exc}") from exc
            if answer.status != 200:
                raise KubeHTTPError(answer.status, _message(answer.text(), answer.reason))
            return
        async for event in self._aiohttp_watch(path, params, timeout, on_open, decode):
            if not on_event(event):
                return

    async def _aiohttp_watch(
        self,
        path: str,
        params: dict[str, str],
        timeout: float,  # noqa: ASYNC109 - the wait for each line, passed to aiohttp
        on_open: Callable[[], None] | None,
        decode: Callable[[bytes], Any],
    ) -> AsyncIterator[Any]:
        """``watch`` through a proxy (aiohttp speaks it; http11 does not)."""
        if self._streams is None:
            # Unbounded, apart from the requests' pool: a watch per fleet must never wait for a connection.
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl)
            self._streams = aiohttp.ClientSession(connector=connector, trust_env=False, read_bufsize=2**20)
        try:
            async with self._streams.get(
                self.base + path,
                params=params,
                headers=self._headers(None),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout),
                **self._route(),
            ) as resp:
                if resp.status != 200:
                    raise KubeHTTPError(resp.status, _message(await resp.text(), resp.reason or ""))
                if on_open is not None:
                    on_open()
                while line := await resp.content.readline():
                    if line.strip():
                        yield decode(line)
        except TimeoutError as exc:
            raise KubeHTTPError(0, f"watch {path}: nothing in {timeout:g}s") from exc
        except aiohttp.ClientError as exc:
            raise KubeHTTPError(0, f"watch {path}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        for session in (self._session, self._streams):
            if session is not None:
                await session.close()
        self._session = self._streams = None
        await self._http.close()

    def close_soon(self) -> None:
        """``close`` from synchronous code: scheduled on the running loop, if any (else nothing is open)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.create_task(self.close())  # noqa: RUF006 - the loop keeps it until the session is closed


def _message(text: str, reason: str) -> str:
    """The API server's ``Status.message``, else the HTTP reason."""
    try:
        return str(json.loads(text).get("message") or reason)
    except (ValueError, AttributeError):
        return reason or text[:200]
