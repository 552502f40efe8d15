"""``KubeHTTP.request`` over the operator's own HTTP/1.1 client (``adapters.http11``), against a TLS server.

The integration tier runs every request against a real kube-apiserver; this pins, without one, what the
switch from aiohttp must not have changed: the configuration's CA verifies the server, the token and the
content type are sent, a path prefix of the server URL (an API server behind a gateway) and the query are
kept, and an error answer becomes ``KubeHTTPError`` with the API server's own message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import ssl
from collections.abc import Callable

import pytest
from kubernetes import client as k8s_client

from rolloutfleet.adapters import kube, kube_http
from rolloutfleet.adapters.kube_http import METADATA_ONLY, KubeHTTP, KubeHTTPError
from rolloutfleet.sandbox import certs

pytestmark = pytest.mark.both_loops  # the operator runs this code on uvloop (handlers/event_loop.py)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.ensure_pki(tmp_path_factory.mktemp("pki"), "10.0.0.1")  # the IP is never dialled


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off a connection: its head and its body (as long as its Content-Length says)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-Length")),
        0,
    )
    return head, (await reader.readexactly(length) if length else b"")


def answer(status: int, body: object) -> bytes:
    raw = json.dumps(body).encode()
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        len(raw),
        raw,
    )


async def test_requests_keep_credentials_prefix_query_and_errors(pki: certs.Pki, tmp_path: pathlib.Path) -> None:
    seen: list[tuple[bytes, bytes]] = []
    answers = [
        answer(200, {"kind": "PodList", "items": []}),
        answer(404, {"kind": "Status", "message": 'pods "p-9" not found', "code": 404}),
        answer(200, {"kind": "PartialObjectMetadata", "metadata": {"name": "p-8"}}),
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            while answers:
                seen.append(await read_request(reader))
                writer.write(answers.pop(0))
                await writer.drain()
        writer.close()

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    configuration = k8s_client.Configuration()
    configuration.host = f"https://127.0.0.1:{port}/gateway/cluster-1"
    configuration.ssl_ca_cert = str(pki.ca_cert)
    configuration.api_key = {"authorization": "tok"}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    opened: list[int] = []
    http = KubeHTTP(configuration, limit=2, on_connect=lambda: opened.append(1))
    try:
        listed = await http.request("GET", "/api/v1/namespaces/ns/pods", params={"labelSelector": "a=b"}, timeout=5)
        with pytest.raises(KubeHTTPError) as err:
            await http.request(
                "PATCH",
                "/api/v1/namespaces/ns/pods/p-9/status",
                body={"status": {}},
                content_type="application/strategic-merge-patch+json",
                timeout=5,
            )
        unread = await http.request(
            "PATCH",
            "/api/v1/namespaces/ns/pods/p-8/status",
            body={"status": {}},
            content_type="application/strategic-merge-patch+json",
            timeout=5,
            decode=False,
        )
    finally:
        await http.close()
        server.close()
    assert listed == {"kind": "PodList", "items": []}
    assert (err.value.status, str(err.value)) == (404, 'pods "p-9" not found')
    assert unread is None
    # One TLS connection for the three (rolloutfleet_kube_connections_opened_total counts them: each new one is a
    # handshake on both ends).
    assert len(opened) == 1
    (get_head, _), (patch_head, patch_body), (unread_head, _) = seen
    # A write whose answer nobody reads asks for the object's metadata only (the whole pod, or a fleet status
    # with a row per pod, encoded by the API server and decrypted here for nothing), plain JSON as the
    # fallback; a read asks for the object.
    assert b"\r\nAccept: application/json\r\n" in patch_head
    assert b"\r\nAccept: " + METADATA_ONLY.encode() + b"\r\n" in unread_head
    assert METADATA_ONLY.endswith(",application/json")
    assert get_head.startswith(b"GET /gateway/cluster-1/api/v1/namespaces/ns/pods?labelSelector=a%3Db HTTP/1.1\r\n")
    assert b"\r\nauthorization: Bearer tok\r\n" in get_head and b"\r\nAccept: application/json\r\n" in get_head
    assert get_head.count(b"Accept:") == 1 and get_head.count(b"User-Agent:") == 1
    assert b"\r\nContent-Type: application/strategic-merge-patch+json\r\n" in patch_head
    assert json.loads(patch_body) == {"status": {}}


async def test_an_unreachable_api_server_is_status_zero(tmp_path: pathlib.Path) -> None:
    """Status 0 is what the callers read as "no answer" (retries, the watch's backoff)."""
    configuration = k8s_client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # discard port: nothing listens
    http = KubeHTTP(configuration, limit=1)
    try:
        with pytest.raises(KubeHTTPError) as err:
            await http.request("GET", "/api", timeout=5)
    finally:
        await http.close()
    assert err.value.status == 0 and "cannot connect to 127.0.0.1:9" in str(err.value)


def test_the_requests_in_flight_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ROLLOUTFLEET_KUBE_IN_FLIGHT`` (docs/install.md): unset, 64 (more than the client's 16 threads: the
    gate writes after an AllAtOnce barrier waited on the limit, not on the API server); a bad value stops the
    operator at start with the variable named, rather than running with a limit nobody asked for."""
    monkeypatch.delenv(kube.IN_FLIGHT_ENV, raising=False)
    assert kube.in_flight_from_environment() == kube.KUBE_IN_FLIGHT == 64
    monkeypatch.setenv(kube.IN_FLIGHT_ENV, "16")
    assert kube.in_flight_from_environment() == 16
    for bad in ("0", "-3", "lots", "5000"):
        monkeypatch.setenv(kube.IN_FLIGHT_ENV, bad)
        with pytest.raises(ValueError, match=kube.IN_FLIGHT_ENV):
            kube.in_flight_from_environment()


def throttled(retry_after: str | None) -> bytes:
    """The API server's answer when API Priority and Fairness (or its in-flight limit) turns a request away."""
    raw = json.dumps({"kind": "Status", "message": "Too many requests, please try again later.", "code": 429}).encode()
    extra = b"" if retry_after is None else b"Retry-After: %s\r\n" % retry_after.encode()
    return b"HTTP/1.1 429 Too Many Requests\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        extra,
        len(raw),
        raw,
    )


async def serve(
    pki: certs.Pki, answers: list[bytes], seen: list[bytes], on_throttle: Callable[[float], None] | None = None
) -> tuple[asyncio.Server, KubeHTTP]:
    """A TLS server answering ``answers`` in turn (one per request, the last one for ever), and a client to it."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            while True:
                seen.append((await read_request(reader))[0])
                writer.write(answers.pop(0) if len(answers) > 1 else answers[0])
                await writer.drain()

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    configuration = k8s_client.Configuration()
    configuration.host = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    configuration.ssl_ca_cert = str(pki.ca_cert)
    return server, KubeHTTP(configuration, limit=2, on_throttle=on_throttle)


async def test_a_throttled_request_waits_as_told_and_goes_again(pki: certs.Pki) -> None:
    """429 is the API server turning a request away before running it (API Priority and Fairness' queues are
    full, or its in-flight limit): safe to send again, a PATCH too, as client-go does. With 64 of the operator's
    requests in flight a busy control plane answers so; a gate write given up on the first 429 would leave the
    pod out of the Service until the pass's next sync. Each wait is counted (rolloutfleet_kube_throttled_total)."""
    seen: list[bytes] = []
    waits: list[float] = []
    server, http = await serve(
        pki, [throttled("0"), throttled(None), answer(200, {"kind": "Pod"})], seen, on_throttle=waits.append
    )
    try:
        patched = await http.request(
            "PATCH",
            "/api/v1/namespaces/ns/pods/p-1/status",
            body={"status": {}},
            content_type="application/strategic-merge-patch+json",
            timeout=10,
        )
    finally:
        await http.close()
        server.close()
    assert patched == {"kind": "Pod"}
    assert len(seen) == 3 and all(head.startswith(b"PATCH /api/v1/namespaces/ns/pods/p-1/status ") for head in seen)
    assert waits == [0.0, kube_http.THROTTLED_WAIT_SECONDS]  # as told; 1 s when the answer does not say


@pytest.mark.parametrize(
    ("retry_after", "requests"),
    [("30", 1), ("0", kube_http.THROTTLED_RETRIES + 1)],
    ids=["the wait outlasts the timeout", "one 429 more than the retries"],
)
async def test_throttling_that_outlasts_the_request_is_its_error(
    pki: certs.Pki, retry_after: str, requests: int
) -> None:
    """A 429 whose wait would end past the request's own timeout, or one more than ``THROTTLED_RETRIES``, is the
    caller's error with the server's message (the pass logs it and its next sync writes the gate again)."""
    seen: list[bytes] = []
    server, http = await serve(pki, [throttled(retry_after)], seen)
    try:
        with pytest.raises(KubeHTTPError) as err:
            await http.request("GET", "/api/v1/namespaces/ns/pods", timeout=5)
    finally:
        await http.close()
        server.close()
    assert err.value.status == 429 and "Too many requests" in str(err.value) and len(seen) == requests


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("3", 3.0), (" 0 ", 0.0), ("", 1.0), ("Wed, 21 Oct 2026 07:28:00 GMT", 1.0), ("-4", 0.0), ("3600", 10.0)],
)
def test_retry_after_is_read_as_seconds_with_a_default_and_a_cap(header: str, seconds: float) -> None:
    """Retry-After in seconds, as the API server sends it; a date or nothing: 1 s, as client-go waits; never
    more than ``THROTTLED_WAIT_MAX_SECONDS`` (a request's timeout is 30 s: one wait must leave room to go again)."""
    assert kube_http.retry_after(header) == seconds
