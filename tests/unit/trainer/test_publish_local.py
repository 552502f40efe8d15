"""The publish API's local checks and typed errors, against an in-memory API: every failure before the
create leaves nothing behind, idempotency, conflicts, 403s, waiting outcomes, and the command helpers."""

from __future__ import annotations

import asyncio
import pathlib
import threading
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from trainer_fakes import FakeCustomObjects, api_error, fleet, revision

from rolloutfleet.digest import digest_directory
from rolloutfleet.trainer import progress, publish
from rolloutfleet.trainer.errors import (
    CheckpointMissing,
    FleetNotFound,
    InvalidRevision,
    KubeApiError,
    PermissionDenied,
    PublishCancelled,
    PublishTimeout,
    RevisionConflict,
    RevisionFailed,
    RevisionNotNewer,
)

NS = "ns"


def ckpt(directory: pathlib.Path, seed: int, tensors: int = 2) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file(
        {f"w.{i}": rng.standard_normal((4, 4)).astype(np.float32) for i in range(tensors)},
        str(directory / "model.safetensors"),
    )
    return directory


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    for rev in (1, 2):
        ckpt(tmp_path / f"policy/step-{rev}/verifier", 10 + rev)
        ckpt(tmp_path / f"policy/step-{rev}/draft", 20 + rev)
    return tmp_path


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch, root: pathlib.Path) -> FakeCustomObjects:
    fake = FakeCustomObjects()
    fake.add("rolloutfleets", NS, fleet("pol", str(root)))
    fake.add("rolloutfleets", NS, fleet("nodraft", str(root), draft="none"))
    monkeypatch.setattr(publish, "custom_objects_api", lambda _api: fake)
    return fake


def pub(root: pathlib.Path, fleet_name: str = "pol", rev: int = 1, **kw: Any) -> publish.PublishResult:
    kw.setdefault("wait", False)
    kw.setdefault("progress", False)
    verifier = kw.pop("verifier", root / f"policy/step-{rev}/verifier")
    draft = kw.pop("draft", root / f"policy/step-{rev}/draft")
    return publish.publish_revision(fleet_name, rev, verifier, draft, namespace=NS, api_client=object(), **kw)  # type: ignore[arg-type]


def test_creates_with_digests_labels_and_default_name(api: FakeCustomObjects, root: pathlib.Path) -> None:
    stages: list[publish.PublishProgress] = []
    result = pub(root, progress=stages.append)
    assert result.created and result.name == "pol-r1" and result.phase == "Pending" and not result.ready
    (body,) = api.creates
    assert body["metadata"]["labels"] == {"rolloutfleet.io/fleet": "pol"}
    assert body["spec"]["verifier"] == {
        "path": str(root / "policy/step-1/verifier"),
        "digest": digest_directory(root / "policy/step-1/verifier"),
    }
    assert body["spec"]["draft"]["digest"] == digest_directory(root / "policy/step-1/draft")
    digest_reports = [s for s in stages if s.stage == "digest"]
    assert digest_reports and digest_reports[-1].done == digest_reports[-1].total > 0
    assert any(s.stage == "created" for s in stages)


def test_same_content_is_a_noop_even_when_current(api: FakeCustomObjects, root: pathlib.Path) -> None:
    pub(root)
    api.objects[("rolloutfleets", NS, "pol")]["status"] = {"currentRevision": 1}
    again = pub(root)
    assert not again.created and again.name == "pol-r1"
    assert len(api.creates) == 1
    # Published earlier by kubectl under another name and without digests: still the same revision.
    api.add(
        "weightrevisions",
        NS,
        revision(
            "step-2",
            "pol",
            2,
            str(root / "policy/step-2/verifier"),
            str(root / "policy/step-2/draft"),
            phase="Progressing",
        ),
    )
    same = pub(root, rev=2)
    assert not same.created and same.name == "step-2"


def test_same_number_different_content_conflicts(api: FakeCustomObjects, root: pathlib.Path) -> None:
    pub(root)
    with pytest.raises(RevisionConflict, match="verifier path"):
        pub(root, verifier=root / "policy/step-2/verifier")
    # Same path, different bytes now on disk: the digest tells.
    ckpt(root / "policy/step-1/verifier", 99)
    with pytest.raises(RevisionConflict, match="verifier digest"):
        pub(root)
    with pytest.raises(RevisionConflict, match="draft missing"):
        api.add("weightrevisions", NS, revision("pol-r2", "pol", 2, str(root / "policy/step-2/verifier")))
        pub(root, rev=2)
    assert len(api.creates) == 1


def test_fleet_not_found_and_crd_missing(
    api: FakeCustomObjects, root: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FleetNotFound, match="ns/nope not found"):
        pub(root, fleet_name="nope")

    def no_crd(*a: Any, **k: Any) -> Any:
        raise api_error(404, "the server could not find the requested resource")

    monkeypatch.setattr(api, "get_namespaced_custom_object", no_crd)
    with pytest.raises(FleetNotFound, match="CRDs are not installed"):
        pub(root)
    assert api.creates == []


def _missing(r: pathlib.Path) -> pathlib.Path:
    return r / "policy/missing"


def _empty(r: pathlib.Path) -> pathlib.Path:
    (r / "policy/empty").mkdir()
    return r / "policy/empty"


def _corrupt(r: pathlib.Path) -> pathlib.Path:
    (r / "policy/bad").mkdir()
    (r / "policy/bad/model.safetensors").write_bytes(b"\x05")
    return r / "policy/bad"


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (_missing, r"verifier checkpoint .*policy/missing: not a directory"),
        (_empty, r"no \*\.safetensors files"),
        (_corrupt, r"policy/bad/model\.safetensors: truncated"),
    ],
    ids=["missing", "empty", "corrupt-file"],
)
def test_bad_checkpoints_name_the_path(api: FakeCustomObjects, root: pathlib.Path, setup: Any, match: str) -> None:
    with pytest.raises(CheckpointMissing, match=match) as info:
        pub(root, verifier=setup(root))
    assert info.value.target == "verifier"
    assert api.creates == []


def test_unreadable_file(api: FakeCustomObjects, root: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = pathlib.Path.open

    def deny(self: pathlib.Path, *a: Any, **k: Any) -> Any:
        if self.name == "model.safetensors" and "step-1/draft" in str(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "open", deny)
    with pytest.raises(CheckpointMissing, match=r"draft checkpoint .*step-1/draft/model\.safetensors: unreadable"):
        pub(root)
    assert api.creates == []


def test_semantic_rules_refuse_before_any_digest(api: FakeCustomObjects, root: pathlib.Path) -> None:
    with pytest.raises(InvalidRevision, match=r"spec\.draft: the fleet has no draft"):
        pub(root, fleet_name="nodraft")
    with pytest.raises(InvalidRevision, match=r"spec\.draft: is required"):
        pub(root, draft=None)
    with pytest.raises(InvalidRevision, match="allowedRoots"):
        pub(root, verifier="/elsewhere/v", digest=False)
    with pytest.raises(InvalidRevision, match="revision"):
        pub(root, rev=-1)
    assert api.creates == []


def test_not_newer_than_current_or_live_published(api: FakeCustomObjects, root: pathlib.Path) -> None:
    api.objects[("rolloutfleets", NS, "pol")]["status"] = {"currentRevision": 5}
    with pytest.raises(RevisionNotNewer, match=r"current revision \(5\)"):
        pub(root, rev=5)
    api.objects[("rolloutfleets", NS, "pol")]["status"] = {}
    api.add("weightrevisions", NS, revision("pol-r7", "pol", 7, "/x", phase="Progressing"))
    with pytest.raises(RevisionNotNewer, match=r"revision 7 already published \(pol-r7, Progressing\)"):
        pub(root, rev=2)
    # A failed newer one does not block (it never became the fleet's revision).
    api.objects[("weightrevisions", NS, "pol-r7")]["status"]["phase"] = "Failed"
    assert pub(root, rev=2).created


def test_forbidden_create_and_list(api: FakeCustomObjects, root: pathlib.Path) -> None:
    api.deny.add(("create", "weightrevisions"))
    with pytest.raises(PermissionDenied) as info:
        pub(root)
    msg = str(info.value)
    assert msg == "permission denied: cannot create weightrevisions in namespace ns as system:serviceaccount:ns:ro"
    api.deny = {("list", "weightrevisions")}
    with pytest.raises(PermissionDenied, match="cannot list weightrevisions"):
        pub(root)
    api.deny = {("get", "rolloutfleets")}
    with pytest.raises(PermissionDenied, match="cannot get rolloutfleets"):
        pub(root)
    assert api.creates == []


def test_create_race_and_server_refusals(
    api: FakeCustomObjects, root: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_create = api.create_namespaced_custom_object

    def racing(*a: Any, **k: Any) -> Any:
        real_create(*a, **k)  # another publisher got there first with the same content
        raise api_error(409, "already exists")

    monkeypatch.setattr(api, "create_namespaced_custom_object", racing)
    assert not pub(root).created

    def refused(*a: Any, **k: Any) -> Any:
        raise api_error(422, "spec.revision: Invalid value: is immutable")

    monkeypatch.setattr(api, "create_namespaced_custom_object", refused)
    with pytest.raises(InvalidRevision, match="immutable"):
        pub(root, rev=2)

    def broken(*a: Any, **k: Any) -> Any:
        raise api_error(500, "etcd down")

    monkeypatch.setattr(api, "create_namespaced_custom_object", broken)
    with pytest.raises(KubeApiError, match=r"create weightrevisions in ns failed \(500\): etcd down"):
        pub(root, rev=2)


def test_wait_ready_and_failed_with_pod_detail(api: FakeCustomObjects, root: pathlib.Path) -> None:
    api.on_create_status = {
        "phase": "Succeeded",
        "updated": "2/2",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    result = pub(root, wait=True)
    assert result.ready and result.phase == "Succeeded"
    api.on_create_status = {
        "phase": "RolledBack",
        "reason": "RolledBack",
        "message": "rolling back to the previous revision: pol-0: LoadVerifier: no such directory '/x'; "
        "pol-1: LoadVerifier: no such directory '/x'",
        "pods": [{"name": "pol-0", "step": "Done"}, {"name": "pol-1", "step": "Done"}],
    }
    with pytest.raises(RevisionFailed) as info:
        pub(root, rev=2, wait=True)
    exc = info.value
    assert exc.phase == "RolledBack" and exc.name == "pol-r2"
    assert [(p.name, p.message) for p in exc.pods] == [
        ("pol-0", "LoadVerifier: no such directory '/x'"),
        ("pol-1", "LoadVerifier: no such directory '/x'"),
    ]
    assert "\n" not in str(exc) and "pol-0" in exc.detail().splitlines()[1]


def test_wait_timeout_leaves_the_revision(
    api: FakeCustomObjects, root: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.on_create_status = {"phase": "Progressing", "updated": "1/2"}
    with pytest.raises(PublishTimeout, match=r"not Ready after 0s \(phase Progressing, 1/2 pods updated\)"):
        pub(root, wait=True, timeout=0)
    assert len(api.creates) == 1 and ("weightrevisions", NS, "pol-r1") in api.objects


def test_cancel_before_create_creates_nothing(api: FakeCustomObjects, root: pathlib.Path) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(PublishCancelled):
        pub(root, cancel=cancel)
    assert api.creates == []


def test_async_variant(api: FakeCustomObjects, root: pathlib.Path) -> None:
    result = asyncio.run(
        publish.async_publish_revision(
            "pol",
            1,
            root / "policy/step-1/verifier",
            root / "policy/step-1/draft",
            namespace=NS,
            wait=False,
            api_client=object(),
            progress=False,  # type: ignore[arg-type]
        )
    )
    assert result.created and result.name == "pol-r1"


def test_age() -> None:
    import datetime

    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
    assert publish.age(None) == "-"
    assert publish.age("2026-01-01T11:59:15Z", now) == "45s"
    assert publish.age("2026-01-01T11:50:00Z", now) == "10m"
    assert publish.age("2026-01-01T06:00:00Z", now) == "6h"
    assert publish.age("2025-12-25T12:00:00Z", now) == "7d"


def test_wait_for_fleet_revision(api: FakeCustomObjects) -> None:
    api.objects[("rolloutfleets", NS, "pol")]["status"] = {"currentRevision": 4}
    assert publish.wait_for_fleet_revision("pol", 3, NS, api_client=object()) == 4  # type: ignore[arg-type]
    with pytest.raises(PublishTimeout, match=r"pol \(revision >= 5\)"):
        publish.wait_for_fleet_revision("pol", 5, NS, timeout=0.05, api_client=object(), interval=0.01)  # type: ignore[arg-type]


def test_tty_progress_line() -> None:
    import io

    stream = io.StringIO()
    bar = progress.TtyProgress(stream)
    bar(publish.PublishProgress("digest", 50, 100, "digest draft, verifier"))
    bar(publish.PublishProgress("digest", 100, 100, "digest draft, verifier"))
    bar(publish.PublishProgress("created", 0, 0, "pol-r1: created"))
    bar(publish.PublishProgress("rollout", 1, 2, "pol-r1: Progressing 1/2 (LoadVerifier 1)"))
    bar.close()
    text = stream.getvalue()
    assert "digest draft, verifier: 100 B/100 B (100%)" in text
    assert text.endswith("\x1b[2Kpol-r1: Progressing 1/2 (LoadVerifier 1)\n")
