"""``KubeHTTP``'s credentials: read through the configuration's refresh hook, reused for ``AUTH_SECONDS``.

Why (issue 18): with a kubeconfig, the kubernetes client's hook reloads the credentials and resets the
configuration at every ``auth_settings()`` call (its proxy lookup walks the environment): 2 % of the
operator's CPU at 1,024 pods when called per request. What must hold: the headers carry the token, a
refreshed token is used within ``AUTH_SECONDS``, and nothing is read per request in between.
"""

from __future__ import annotations

import pytest
from kubernetes import client as k8s_client

from rolloutfleet.adapters import kube_http
from rolloutfleet.adapters.kube_http import KubeHTTP


def test_the_token_is_read_once_per_interval_and_a_refresh_is_picked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    configuration = k8s_client.Configuration()
    configuration.host = "http://127.0.0.1:1"
    configuration.api_key = {"authorization": "one"}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    reads: list[int] = []

    def refresh(config: k8s_client.Configuration) -> None:  # the hook kubeconfig loading installs
        reads.append(1)

    configuration.refresh_api_key_hook = refresh  # type: ignore[assignment]
    monkeypatch.setattr(kube_http, "AUTH_SECONDS", 3600.0)  # no interval ends during the loop below
    http = KubeHTTP(configuration, limit=1)
    assert http._headers(None)["authorization"] == "Bearer one"
    for _ in range(50):
        assert http._headers("application/json")["authorization"] == "Bearer one"
    assert len(reads) == 1
    configuration.api_key = {"authorization": "two"}  # the token was renewed
    monkeypatch.setattr(kube_http, "AUTH_SECONDS", 0.0)  # the interval is over
    assert http._headers(None)["authorization"] == "Bearer two"
    assert len(reads) == 2
