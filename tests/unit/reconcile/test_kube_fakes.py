"""``FakeKube`` keeps the API server's semantics that the reconcile tests rely on (else they prove nothing)."""

from __future__ import annotations

from typing import Any

import pytest
from kube_fakes import FakeKube, matches_selector, merge_patch

from rolloutfleet.adapters.kube import KubeError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("target", "patch", "expected"),
    [  # RFC 7386 appendix A, the cases that matter to status patches
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),  # lists are replaced, never merged
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patch_follows_rfc_7386(target: dict[str, Any], patch: dict[str, Any], expected: dict[str, Any]) -> None:
    """Status writes are merge patches: a fake that merged lists would hide a clobbered ``status.pods``."""
    assert merge_patch(target, patch) == expected


@pytest.mark.parametrize(
    ("selector", "matches"),
    [("", True), ("a=1", True), ("a=1,b=2", True), ("a==1", True), ("a=2", False), ("a!=1", False), ("c", False)],
)
def test_label_selector(selector: str, matches: bool) -> None:
    assert matches_selector({"a": "1", "b": "2"}, selector) is matches


async def test_apply_bumps_generation_only_when_the_spec_changes() -> None:
    """Revisions and fleets report ``observedGeneration``; a fake that bumped it on every write would not."""
    kube = FakeKube()
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}, "spec": {"a": 1}}
    first = await kube.apply(body)
    again = await kube.apply(body)
    changed = await kube.apply({**body, "spec": {"a": 2}})
    assert (first["metadata"]["generation"], again["metadata"]["generation"]) == (1, 1)
    assert changed["metadata"]["generation"] == 2
    assert first["metadata"]["uid"] == changed["metadata"]["uid"]
    assert kube.requests == 3


async def test_patch_status_is_a_subresource_write_with_preconditions() -> None:
    kube = FakeKube()
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}, "spec": {}}
    stored = kube.apply_user(body)
    with pytest.raises(KubeError) as missing:
        await kube.patch_status("v1", "ConfigMap", "ns", "absent", {"a": 1})
    assert missing.value.status == 404
    await kube.patch_status(
        "v1", "ConfigMap", "ns", "x", {"a": 1}, resource_version=stored["metadata"]["resourceVersion"]
    )
    with pytest.raises(KubeError) as stale:
        await kube.patch_status(
            "v1", "ConfigMap", "ns", "x", {"a": 2}, resource_version=stored["metadata"]["resourceVersion"]
        )
    assert stale.value.status == 409
    assert (await kube.get("v1", "ConfigMap", "ns", "x"))["status"] == {"a": 1}
    after = kube.apply_user({**body, "spec": {"b": 1}, "status": {"ignored": True}})
    assert (after["spec"], after["status"]) == ({"b": 1}, {"a": 1})  # an apply never writes status


async def test_objects_are_copied_in_and_out() -> None:
    """Reconcilers mutate what they read; the stored object must not change with them."""
    kube = FakeKube()
    kube.add_pod("ns", "p-0", "127.2.0.1", labels={"app": "x"})
    pod = await kube.get("v1", "Pod", "ns", "p-0")
    assert pod is not None
    pod["status"]["phase"] = "Failed"
    listed = await kube.list("v1", "Pod", "ns", "app=x")
    assert [p["status"]["phase"] for p in listed] == ["Running"]
    assert await kube.create(pod) is None  # exists: 409 answers None, as the adapter does
