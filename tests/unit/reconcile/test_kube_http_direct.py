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

import pytest
from kubernetes import client as k8s_client

from rolloutfleet.adapters import kube
from rolloutfleet.adapters.kube_http import METADATA_ONLY, KubeHTTP, KubeHTTPError
from rolloutfleet.sandbox import certs

pytestmark = pytest.mark.both_loops  # the operator runs this code on uvloop (handlers/event_loop.py)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.ensure_pki(tmp_path_factory.mktemp("pki"), "10.0.0.1")  # the IP is never dialled


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
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-Length")),
                    0,
                )
                seen.append((head, await reader.readexactly(length) if length else b""))
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
