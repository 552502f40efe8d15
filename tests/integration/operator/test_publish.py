"""The trainer's publish API and commands on the real control plane, with the operator running and
simulated engines reading real checkpoints: publish -> Ready, failure with its reason, idempotency, the
403 path of a ServiceAccount without create rights, and local validation leaving nothing behind."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
from kubernetes import client
from operator_helpers import GROUP, VERSION, eventually, get_fleet
from publish_support import FLEET, checkpoints, fleet_body, live_fleet, read_only_client, revisions_of
from sim_harness import FollowerThread

from rolloutfleet import cli
from rolloutfleet.digest import digest_directory
from rolloutfleet.trainer.errors import (
    CheckpointMissing,
    FleetNotFound,
    InvalidRevision,
    PermissionDenied,
    RevisionConflict,
    RevisionFailed,
    RevisionNotNewer,
)
from rolloutfleet.trainer.publish import async_publish_revision, publish_revision

pytestmark = pytest.mark.integration
__all__ = ["live_fleet"]  # the fixture, imported from publish_support


def test_publish_ready_idempotent_async_and_commands(
    live_fleet: tuple[FollowerThread, pathlib.Path],
    k8s_api: client.ApiClient,
    namespace: str,
    kubeconfig_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, root = live_fleet
    api = client.CustomObjectsApi(k8s_api)
    step1 = root / "policy/step-1"
    seen: list[str] = []
    result = publish_revision(
        FLEET,
        1,
        step1 / "verifier",
        step1 / "draft",
        namespace=namespace,
        timeout=90,
        api_client=k8s_api,
        progress=lambda p: seen.append(p.stage),
    )
    assert result.created and result.ready and result.phase == "Succeeded"
    assert result.name == "pol-r1"
    assert result.verifier_digest == digest_directory(step1 / "verifier")
    assert result.draft_digest == digest_directory(step1 / "draft")
    assert {"digest", "created", "rollout"} <= set(seen)
    fleet = get_fleet(api, namespace, FLEET)
    assert fleet["status"]["currentRevision"] == 1
    stored = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", "pol-r1")
    assert stored["spec"]["verifier"]["digest"] == result.verifier_digest
    assert stored["spec"]["draft"]["digest"] == result.draft_digest

    # Same revision, same content: a no-op that returns the existing revision (even though 1 is current).
    again = publish_revision(FLEET, 1, step1 / "verifier", step1 / "draft", namespace=namespace, api_client=k8s_api)
    assert not again.created and again.ready and again.name == "pol-r1"
    # Same number, different content: refused, nothing written.
    with pytest.raises(RevisionConflict, match="verifier"):
        publish_revision(
            FLEET, 1, root / "policy/step-2/verifier", step1 / "draft", namespace=namespace, api_client=k8s_api
        )
    # Not newer than the fleet's current revision (and no revision 0 exists): refused locally.
    with pytest.raises(RevisionNotNewer, match="newer"):
        publish_revision(
            FLEET,
            0,
            root / "policy/step-0/verifier",
            root / "policy/step-0/draft",
            namespace=namespace,
            api_client=k8s_api,
        )
    assert [r["metadata"]["name"] for r in revisions_of(api, namespace)] == ["pol-r1"]

    # The async variant, for asyncio trainers.
    step2 = root / "policy/step-2"
    result2 = asyncio.run(
        async_publish_revision(
            FLEET, 2, step2 / "verifier", step2 / "draft", namespace=namespace, timeout=90, api_client=k8s_api
        )
    )
    assert result2.ready and result2.revision == 2

    # The commands: the status table (per-pod revisions follow the fleet's next pass) and wait.
    kube = ["--kubeconfig", str(kubeconfig_path), "-n", namespace]

    def table_at_2() -> str | None:
        capsys.readouterr()
        assert cli.main(["status", FLEET, *kube]) == 0
        out = capsys.readouterr().out
        pod_lines = [line.split() for line in out.splitlines() if line.startswith(f"{FLEET}-")]
        ok = len(pod_lines) == 2 and all(c[3:5] == ["2", "2"] and c[-2] == "2" for c in pod_lines)
        return out if ok else None

    out = eventually(table_at_2, timeout=30, what="status table at revision 2")
    assert "current revision 2" in out
    assert "Latest WeightRevision pol-r2 (revision 2): Succeeded 2/2" in out
    assert cli.main(["wait", "wrev/pol-r2", "--timeout", "30s", *kube]) == 0
    assert "Ready" in capsys.readouterr().out
    assert cli.main(["wait", "wrev/nope", "--timeout", "5s", *kube]) == 1
    assert cli.main(["wait", "pods/pol-0", *kube]) == 2


def test_failing_revision_raises_with_reason(
    live_fleet: tuple[FollowerThread, pathlib.Path],
    k8s_api: client.ApiClient,
    namespace: str,
    kubeconfig_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, root = live_fleet
    # digest=False: the publisher does not read the files, so the engines' load is the first to fail.
    missing = root / "policy/step-9/verifier"
    with pytest.raises(RevisionFailed) as info:
        publish_revision(
            FLEET,
            1,
            missing,
            root / "policy/step-1/draft",
            namespace=namespace,
            digest=False,
            timeout=120,
            api_client=k8s_api,
        )
    exc = info.value
    assert exc.phase in ("Failed", "RolledBack"), str(exc)
    assert exc.reason, str(exc)
    assert exc.pods and any(p.message for p in exc.pods), exc.detail()
    assert "pol-r1" in str(exc) and "\n" not in str(exc)
    # The fleet keeps serving what it served.
    assert (get_fleet(client.CustomObjectsApi(k8s_api), namespace, FLEET)["status"].get("currentRevision")) is None
    # `rolloutfleet wait` reports the same failure with exit code 1.
    capsys.readouterr()
    kube = ["--kubeconfig", str(kubeconfig_path), "-n", namespace]
    assert cli.main(["wait", "wrev/pol-r1", "--timeout", "10s", *kube]) == 1
    assert exc.phase in capsys.readouterr().err


@pytest.fixture
def bare_fleet(crds_installed: Any, k8s_api: client.ApiClient, namespace: str, tmp_path: pathlib.Path) -> pathlib.Path:
    """A fleet object without engines (local validation never needs them)."""
    root = checkpoints(tmp_path / "weights", range(0, 2))
    api = client.CustomObjectsApi(k8s_api)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", fleet_body(root))
    api.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "rolloutfleets", fleet_body(root, name="nodraft", draft=False)
    )
    return root


def test_forbidden_service_account_creates_nothing(
    bare_fleet: pathlib.Path,
    k8s_api: client.ApiClient,
    namespace: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = bare_fleet
    ro_api, ro_kubeconfig = read_only_client(k8s_api, namespace, tmp_path)
    step1 = root / "policy/step-1"
    try:
        with pytest.raises(PermissionDenied) as info:
            publish_revision(FLEET, 1, step1 / "verifier", step1 / "draft", namespace=namespace, api_client=ro_api)
    finally:
        ro_api.close()
    msg = str(info.value)
    assert "cannot create weightrevisions" in msg and "trainer-ro" in msg and "\n" not in msg
    capsys.readouterr()
    code = cli.main(
        [
            "publish",
            FLEET,
            "1",
            "--verifier",
            str(step1 / "verifier"),
            "--draft",
            str(step1 / "draft"),
            "--kubeconfig",
            str(ro_kubeconfig),
        ]
    )
    assert code == 1
    assert "permission denied" in capsys.readouterr().err
    assert revisions_of(client.CustomObjectsApi(k8s_api), namespace) == []


def test_local_validation_creates_nothing(bare_fleet: pathlib.Path, k8s_api: client.ApiClient, namespace: str) -> None:
    root = bare_fleet
    step1 = root / "policy/step-1"
    kw: dict[str, Any] = {"namespace": namespace, "api_client": k8s_api, "wait": False}
    with pytest.raises(FleetNotFound, match="nope"):
        publish_revision("nope", 1, step1 / "verifier", step1 / "draft", **kw)
    with pytest.raises(CheckpointMissing, match=r"no \*\.safetensors"):
        empty = root / "policy/empty"
        empty.mkdir()
        publish_revision(FLEET, 1, empty, step1 / "draft", **kw)
    with pytest.raises(CheckpointMissing, match=r"draft checkpoint .*step-7"):
        publish_revision(FLEET, 1, step1 / "verifier", root / "policy/step-7/draft", **kw)
    with pytest.raises(InvalidRevision, match="no draft"):
        publish_revision("nodraft", 1, step1 / "verifier", step1 / "draft", **kw)
    with pytest.raises(InvalidRevision, match="allowedRoots"):
        publish_revision(FLEET, 1, "/tmp/elsewhere", step1 / "draft", digest=False, **kw)
    assert revisions_of(client.CustomObjectsApi(k8s_api), namespace) == []
    # And a valid one, without waiting, is created exactly once.
    created = publish_revision(FLEET, 1, step1 / "verifier", step1 / "draft", **kw)
    assert created.created and created.phase in ("Pending", "Progressing", "Failed", "Succeeded")
    assert [r["metadata"]["name"] for r in revisions_of(client.CustomObjectsApi(k8s_api), namespace)] == ["pol-r1"]
