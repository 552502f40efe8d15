"""The push client's side of the handshake (docs/push.md, protocol 1) against an in-memory API and engines on
127.0.0.1: it serves each epoch once, only after the epoch is published, marks only what it sent, annotates
the error instead when a send failed, resumes after a restart from its own annotations, and ends every wait
with a typed error. A stand-in operator (``on_read_revision``) moves the revision's status as the real one
would, from the annotations the client wrote — never from timing."""

from __future__ import annotations

import base64
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from trainer_fakes import Call, FakeCore, FakeCustomObjects, FakeEngine, fleet, push_core_api, push_custom_api

from rolloutfleet.digest import digest_directory
from rolloutfleet.resources import labels
from rolloutfleet.trainer import kube, publish, push, sessions
from rolloutfleet.trainer.digest import RawTensor, digest_tensors
from rolloutfleet.trainer.errors import (
    ControlTokenMissing,
    InvalidRevision,
    InvalidTensors,
    PermissionDenied,
    PublishTimeout,
    PushProtocolError,
    PushSendFailed,
    PushSessionTimeout,
    PushUnsupported,
    RevisionConflict,
    SendFailure,
)
from rolloutfleet.trainer.senders import IpcSender, SimulatedSender, split_address

NS = "ns"
TOKEN = "s3cret"
VERIFIER = [("model.embed.weight", "BF16", (4, 2), bytes(range(16))), ("lm_head.weight", "F32", (2,), b"\1" * 8)]
DRAFT = [("model.fc.weight", "F16", (3,), b"\2" * 6)]

Status = dict[str, Any]


def push_status(epoch: int, *sessions_: tuple[str, FakeEngine, str, int], reason: str | None = None) -> Status:
    status: Status = {
        "phase": "Progressing",
        "push": {
            "protocol": 1,
            "epoch": epoch,
            "sessions": [
                {"pod": pod, "address": engine.address, "target": target, "epoch": e}
                for pod, engine, target, e in sessions_
            ],
        },
    }
    if reason:
        status["conditions"] = [{"type": "SessionsOpen", "status": "True", "reason": reason}]
    return status


READY: Status = {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "True"}], "updated": "2/2"}


class Operator:
    """Plays the operator: each rule is (annotations it waits for, status it then publishes), in order.

    The first rule has no condition (the status right after the create). A rule fires once, on the first
    read that sees its annotations, at most one rule per read (so two rules with one condition are two
    successive observations); ``None`` as a value means "absent".
    """

    def __init__(self, rules: list[tuple[dict[str, str | None], Status]]) -> None:
        self.rules = list(rules)
        self.fired: list[int] = []

    def __call__(self, obj: dict[str, Any]) -> None:
        annotations = obj["metadata"].get("annotations") or {}
        if len(self.fired) == len(self.rules):
            return
        want, status = self.rules[len(self.fired)]
        if any(annotations.get(k) != v for k, v in want.items()):
            return
        obj["status"] = status
        obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        self.fired.append(len(self.fired))


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeCustomObjects:
    return push_custom_api(
        monkeypatch, NS, fleet("pol", "/w", transfer="ipc"), fleet("solo", "/w", draft="none", transfer="ipc")
    )


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> FakeCore:
    return push_core_api(monkeypatch, NS, TOKEN, "pol", "solo")


@pytest.fixture
def calls() -> list[Call]:
    return []


@pytest.fixture
def engines(calls: list[Call]) -> Iterator[dict[str, FakeEngine]]:
    group = {"in_flight": 0, "max_in_flight": 0}
    made = {pod: FakeEngine(pod, calls, group) for pod in ("pol-0", "pol-1", "pol-2")}
    yield made
    for engine in made.values():
        engine.close()


def run_push(fleet_name: str = "pol", rev: int = 1, draft: Any = DRAFT, **kw: Any) -> push.PushResult:
    kw.setdefault("sender", SimulatedSender())
    kw.setdefault("progress", False)
    kw.setdefault("poll_interval", 0.01)
    # Generous: these bound a test that would hang, they never decide it (a loaded CI box is slow).
    kw.setdefault("session_timeout", 60)
    kw.setdefault("timeout", 120)
    return push.push_revision(fleet_name, rev, kw.pop("verifier", VERIFIER), draft, NS, api_client=object(), **kw)  # type: ignore[arg-type]


def annotations(api: FakeCustomObjects, name: str = "pol-r1") -> dict[str, str]:
    """The push annotations of a revision (the handshake's; not the published-by note)."""
    found = api.objects[("weightrevisions", NS, name)]["metadata"].get("annotations") or {}
    return {k: v for k, v in found.items() if k.startswith("push.rolloutfleet.io/")}


def test_verifier_then_draft_sessions_are_served_and_marked(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call]
) -> None:
    e0, e1 = engines["pol-0"], engines["pol-1"]
    api.on_read_revision = Operator(
        [
            (
                {},
                push_status(
                    1, ("pol-0", e0, "verifier", 1), ("pol-1", e1, "verifier", 1), reason="VerifierSessionsOpen"
                ),
            ),
            (
                {"push.rolloutfleet.io/verifier": "1"},
                push_status(2, ("pol-0", e0, "draft", 2), ("pol-1", e1, "draft", 2)),
            ),
            ({"push.rolloutfleet.io/draft": "2"}, READY),
        ]
    )
    lines: list[str] = []
    result = run_push(progress=lambda p: lines.append(p.message))
    assert result.ready and result.created and result.name == "pol-r1"
    assert result.served == {"verifier": (1,), "draft": (2,)} and result.sends == 4 and not result.send_failures
    # The revision pins the digests of exactly what was sent: the same digest the engines compute.
    (body,) = api.creates
    assert body["spec"]["verifier"] == {"push": {}, "digest": digest_tensors(VERIFIER)}
    assert body["spec"]["draft"] == {"push": {}, "digest": digest_tensors(DRAFT)}
    assert result.verifier_digest == digest_tensors(VERIFIER)
    # Each engine got the verifier, then the draft, with the fleet's token, in the simulator's format.
    assert sorted((c.pod, c.update_info["names"][0]) for c in calls) == [
        ("pol-0", "model.embed.weight"),
        ("pol-0", "model.fc.weight"),
        ("pol-1", "model.embed.weight"),
        ("pol-1", "model.fc.weight"),
    ]
    assert {c.authorization for c in calls} == {f"Bearer {TOKEN}"}
    first = next(c for c in calls if c.update_info["names"][0] == "model.embed.weight")
    assert first.update_info == {
        "names": ["model.embed.weight", "lm_head.weight"],
        "dtype_names": ["bfloat16", "float32"],  # torch's spelling, as vLLM takes it
        "shapes": [[4, 2], [2]],
        "simulated_payload_b64": [base64.b64encode(d).decode() for *_, d in VERIFIER],
    }
    # Marks, in order; each also retires any older error.
    assert api.patches == [
        ("pol-r1", {"push.rolloutfleet.io/verifier": "1", "push.rolloutfleet.io/error": None}),
        ("pol-r1", {"push.rolloutfleet.io/draft": "2", "push.rolloutfleet.io/error": None}),
    ]
    assert any("verifier epoch 1: sent 2 tensors" in line for line in lines)


def test_only_newer_published_epochs_are_served_once(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call]
) -> None:
    e0, e1 = engines["pol-0"], engines["pol-1"]
    api.on_read_revision = Operator(
        [
            # A session reported with epoch 2 while only epoch 1 is published: its set may be incomplete.
            ({}, push_status(1, ("pol-0", e0, "verifier", 1), ("pol-1", e1, "verifier", 2))),
            # After the mark, epoch 1 is still listed (the operator is finishing it) and epoch 2 is out.
            (
                {"push.rolloutfleet.io/verifier": "1"},
                push_status(2, ("pol-0", e0, "verifier", 1), ("pol-1", e1, "verifier", 2)),
            ),
            # pol-1 restarted: a new epoch for it alone, with the stale listing of older epochs beside it.
            (
                {"push.rolloutfleet.io/verifier": "2"},
                push_status(
                    3, ("pol-0", e0, "verifier", 2), ("pol-1", e1, "verifier", 2), ("pol-1", e1, "verifier", 3)
                ),
            ),
            ({"push.rolloutfleet.io/verifier": "3"}, READY),
        ]
    )
    result = run_push("solo", draft=None)
    assert result.served == {"verifier": (1, 2, 3)}
    assert [c.pod for c in calls] == ["pol-0", "pol-1", "pol-1"]
    assert [a["push.rolloutfleet.io/verifier"] for _, a in api.patches] == ["1", "2", "3"]


def test_a_failed_send_is_annotated_not_marked_and_the_retry_is_served(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call]
) -> None:
    e0, e1 = engines["pol-0"], engines["pol-1"]
    e1.answers = [500]
    error = "verifier epoch 1: pol-1: HTTP 500: boom"
    ended: Status = {"phase": "Progressing", "push": {"protocol": 1, "epoch": 1, "sessions": []}}
    api.on_read_revision = Operator(
        [
            ({}, push_status(1, ("pol-0", e0, "verifier", 1), ("pol-1", e1, "verifier", 1))),
            # The operator ends the unmarked sessions: pol-0's is still listed on the next read ...
            ({"push.rolloutfleet.io/error": error}, push_status(1, ("pol-0", e0, "verifier", 1))),
            # ... so the error must still be there on this one (else this rule never fires), then all are gone.
            ({"push.rolloutfleet.io/error": error}, ended),
            # The trainer retired its error (it would end the retry's sessions too); the operator retries pol-1.
            ({"push.rolloutfleet.io/error": None}, push_status(2, ("pol-1", e1, "verifier", 2))),
            ({"push.rolloutfleet.io/verifier": "2"}, READY),
        ]
    )
    result = run_push("solo", draft=None)
    assert result.ready and result.served == {"verifier": (2,)}
    assert result.send_failures == (SendFailure("pol-1", e1.address, "verifier", 1, "HTTP 500: boom"),)
    # Epoch 1 was never marked: its sends failed.
    assert api.patches == [
        ("solo-r1", {"push.rolloutfleet.io/error": error}),
        ("solo-r1", {"push.rolloutfleet.io/error": None}),
        ("solo-r1", {"push.rolloutfleet.io/verifier": "2", "push.rolloutfleet.io/error": None}),
    ]
    assert annotations(api, "solo-r1") == {"push.rolloutfleet.io/verifier": "2"}
    assert sorted(c.pod for c in calls) == ["pol-0", "pol-1", "pol-1"]  # epoch 1 to both, epoch 2 to pol-1


def test_failed_sends_then_a_failed_revision_raise_push_send_failed(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine]
) -> None:
    e0 = engines["pol-0"]
    e0.answers = [500]
    failed = {"phase": "RolledBack", "reason": "PushFailed", "message": "pol-0: verifier session failed"}
    api.on_read_revision = Operator(
        [
            ({}, push_status(1, ("pol-0", e0, "verifier", 1))),
            ({"push.rolloutfleet.io/error": "verifier epoch 1: pol-0: HTTP 500: boom"}, failed),
        ]
    )
    with pytest.raises(
        PushSendFailed, match=r"last: verifier epoch 1: pol-0 .*HTTP 500: boom.*then RolledBack"
    ) as info:
        run_push("solo", draft=None)
    assert info.value.revision_failure is not None and info.value.revision_failure.reason == "PushFailed"
    assert [f.pod for f in info.value.failures] == ["pol-0"]


def test_fail_fast_raises_after_annotating(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine]
) -> None:
    e0, e1 = engines["pol-0"], engines["pol-1"]
    e0.answers = [404]  # not an engine's update route (or no session): a failure all the same
    api.on_read_revision = Operator([({}, push_status(4, ("pol-0", e0, "verifier", 4), ("pol-1", e1, "verifier", 4)))])
    with pytest.raises(PushSendFailed) as info:
        run_push("solo", draft=None, fail_fast=True)
    assert [f.pod for f in info.value.failures] == ["pol-0"]
    assert annotations(api, "solo-r1") == {"push.rolloutfleet.io/error": "verifier epoch 4: pol-0: HTTP 404: boom"}


def test_a_send_that_outlives_its_timeout_fails(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine]
) -> None:
    e0 = engines["pol-0"]
    release = threading.Event()
    e0.answers = [release]
    api.on_read_revision = Operator([({}, push_status(1, ("pol-0", e0, "verifier", 1)))])
    try:
        with pytest.raises(PushSendFailed, match=r"no answer within 0\.2s"):
            run_push("solo", draft=None, fail_fast=True, send_timeout=0.2)
    finally:
        release.set()


def test_sends_are_bounded_by_concurrency(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call]
) -> None:
    sessions_ = [(pod, e, "verifier", 1) for pod, e in engines.items()]
    api.on_read_revision = Operator([({}, push_status(1, *sessions_)), ({"push.rolloutfleet.io/verifier": "1"}, READY)])
    run_push("solo", draft=None, concurrency=1)
    assert len(calls) == 3 and engines["pol-0"].group["max_in_flight"] == 1


def test_no_sessions_within_the_session_timeout(api: FakeCustomObjects, core: FakeCore) -> None:
    with pytest.raises(PushSessionTimeout, match=r"no weight-transfer session to serve for 0\.2s .*nothing served yet"):
        run_push(session_timeout=0.2)
    assert len(api.creates) == 1  # left in place for the operator


def test_the_whole_call_has_a_deadline(api: FakeCustomObjects, core: FakeCore) -> None:
    with pytest.raises(PublishTimeout, match=r"not Ready after 0\.2s"):
        run_push(timeout=0.2, session_timeout=60)


def test_token_problems_create_nothing(api: FakeCustomObjects, core: FakeCore) -> None:
    del core.secrets[(NS, "pol-control-token")]
    with pytest.raises(ControlTokenMissing, match="ns/pol-control-token: not found"):
        run_push()
    core.secrets[(NS, "pol-control-token")] = {"other": "x"}
    with pytest.raises(ControlTokenMissing, match="no 'token' key"):
        run_push()
    core.deny = True
    with pytest.raises(PermissionDenied, match="cannot get secrets in namespace ns as trainer"):
        run_push()
    assert api.creates == []


def test_the_token_secret_is_the_operators() -> None:
    assert kube.token_secret_name("pol") == labels.token_secret_name("pol")
    assert kube.TOKEN_KEY == labels.TOKEN_KEY


def test_invalid_revisions_are_refused_before_hashing(api: FakeCustomObjects, core: FakeCore) -> None:
    reads: list[int] = []

    def tensors() -> list[tuple[str, str, tuple[int, ...], bytes]]:
        reads.append(1)
        return VERIFIER

    api.objects[("rolloutfleets", NS, "pol")]["spec"].pop("weightTransfer")
    with pytest.raises(InvalidRevision, match=r"spec.verifier.push: the fleet has no spec.weightTransfer"):
        run_push(verifier=tensors)
    with pytest.raises(InvalidRevision, match=r"spec\.draft"):
        run_push("solo", verifier=tensors, draft=DRAFT)  # a fleet without a draft model
    assert reads == [] and api.creates == []
    api.objects[("rolloutfleets", NS, "pol")]["spec"]["weightTransfer"] = {"backend": "ipc"}
    # More pods than the revision's status can list sessions for (docs/push.md): the operator would refuse it.
    replicas = api.objects[("rolloutfleets", NS, "pol")]["spec"].get("replicas")
    api.objects[("rolloutfleets", NS, "pol")]["spec"]["replicas"] = 20_000
    with pytest.raises(InvalidRevision, match=r"spec.verifier.push: the fleet has 20000 pods"):
        run_push(verifier=tensors)
    assert reads == [] and api.creates == []
    api.objects[("rolloutfleets", NS, "pol")]["spec"]["replicas"] = replicas
    with pytest.raises(InvalidTensors, match="draft tensors: tensor 'x' appears twice"):
        run_push(draft=[("x", "F32", (1,), b"\0" * 4)] * 2)


def test_a_sender_must_feed_the_fleets_backend(api: FakeCustomObjects, core: FakeCore) -> None:
    class NcclOnly(SimulatedSender):
        name = "nccl-only"
        backends = frozenset({"nccl"})

    with pytest.raises(PushUnsupported, match="over ipc; the nccl-only sender feeds nccl"):
        run_push(sender=NcclOnly())
    assert api.creates == []
    assert IpcSender.backends == {"ipc"} and SimulatedSender.backends is None


def test_a_restarted_trainer_resumes_after_its_marks(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call]
) -> None:
    e0 = engines["pol-0"]
    api.add(
        "weightrevisions",
        NS,
        {
            "metadata": {"name": "pol-r1", "annotations": {"push.rolloutfleet.io/verifier": "3"}},
            "spec": {
                "fleetRef": {"name": "pol"},
                "revision": 1,
                "verifier": {"push": {}, "digest": digest_tensors(VERIFIER)},
                "draft": {"push": {}, "digest": digest_tensors(DRAFT)},
            },
            "status": push_status(4, ("pol-0", e0, "verifier", 3), ("pol-0", e0, "draft", 4)),
        },
    )
    api.on_read_revision = Operator([({"push.rolloutfleet.io/draft": "4"}, READY)])
    result = run_push()
    assert not result.created and result.ready
    assert [(c.pod, c.update_info["names"]) for c in calls] == [("pol-0", ["model.fc.weight"])]
    # Other tensors under the same number: a conflict, nothing sent.
    with pytest.raises(RevisionConflict, match="verifier digest"):
        run_push(verifier=[("model.embed.weight", "BF16", (4, 2), bytes(16)), *VERIFIER[1:]])


def test_a_restarted_trainer_retires_the_error_an_earlier_process_wrote(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call]
) -> None:
    e0 = engines["pol-0"]
    error = "verifier epoch 2: pol-0: HTTP 500: boom"
    api.add(
        "weightrevisions",
        NS,
        {
            "metadata": {"name": "solo-r1", "annotations": {"push.rolloutfleet.io/error": error}},
            "spec": {
                "fleetRef": {"name": "solo"},
                "revision": 1,
                "verifier": {"push": {}, "digest": digest_tensors(VERIFIER)},
            },
            "status": push_status(2, ("pol-0", e0, "verifier", 2)),  # still ending the failed epoch
        },
    )
    api.on_read_revision = Operator(
        [
            ({"push.rolloutfleet.io/error": error}, push_status(2)),  # ended
            ({"push.rolloutfleet.io/error": None}, push_status(3, ("pol-0", e0, "verifier", 3))),
            ({"push.rolloutfleet.io/verifier": "3"}, READY),
        ]
    )
    result = run_push("solo", draft=None)
    assert result.served == {"verifier": (3,)} and len(calls) == 1  # epoch 2 was never sent again
    assert api.patches[0] == ("solo-r1", {"push.rolloutfleet.io/error": None})


def test_a_draft_from_a_checkpoint(
    api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine], calls: list[Call], tmp_path: pathlib.Path
) -> None:
    api.objects[("rolloutfleets", NS, "pol")]["spec"]["weights"]["allowedRoots"] = [str(tmp_path)]
    (tmp_path / "draft").mkdir()
    save_file({"fc": np.ones((2, 2), dtype=np.float32)}, str(tmp_path / "draft" / "m.safetensors"))
    e0 = engines["pol-0"]
    api.on_read_revision = Operator(
        [({}, push_status(1, ("pol-0", e0, "verifier", 1))), ({"push.rolloutfleet.io/verifier": "1"}, READY)]
    )
    run_push(draft=tmp_path / "draft")
    assert api.creates[0]["spec"]["draft"] == {
        "path": str(tmp_path / "draft"),
        "digest": digest_directory(tmp_path / "draft"),
    }
    assert len(calls) == 1
    # Draft sessions for a draft the engines read from a path: the operator and the trainer disagree.
    api.on_read_revision = Operator([({}, push_status(2, ("pol-0", e0, "draft", 2)))])
    with pytest.raises(PushProtocolError, match="draft sessions opened, but the trainer has no draft tensors"):
        run_push(rev=2, draft=tmp_path / "draft")
    assert annotations(api, "pol-r2")["push.rolloutfleet.io/error"].startswith(
        "draft epoch 2: pol-0: the trainer has no"
    )


def test_another_protocol_is_refused(api: FakeCustomObjects, core: FakeCore) -> None:
    api.on_read_revision = Operator([({}, {"push": {"protocol": 2, "epoch": 1, "sessions": []}})])
    with pytest.raises(PushProtocolError, match="protocol 2, this client speaks 1"):
        run_push()


async def test_async_variant(api: FakeCustomObjects, core: FakeCore, engines: dict[str, FakeEngine]) -> None:
    e0 = engines["pol-0"]
    api.on_read_revision = Operator(
        [({}, push_status(1, ("pol-0", e0, "verifier", 1))), ({"push.rolloutfleet.io/verifier": "1"}, READY)]
    )
    result = await push.async_push_revision(
        "solo",
        1,
        VERIFIER,
        None,
        NS,
        sender=SimulatedSender(),
        progress=False,
        poll_interval=0.01,
        api_client=object(),  # type: ignore[arg-type]
    )
    assert result.ready and result.served == {"verifier": (1,)}


# ----------------------------------------------------------------------------------- the handshake as data


def _obj(status: Status, annotations_: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "r", "annotations": annotations_ or {}}, "status": status}


def test_push_status_skips_what_cannot_be_served() -> None:
    raw = {
        "push": {
            "protocol": 1,
            "sessions": [
                {"pod": "a", "address": "10.0.0.1:8000", "target": "verifier", "epoch": 2},
                {"pod": "b", "address": "10.0.0.2:8000", "target": "lm", "epoch": 2},
                {"pod": "c", "target": "verifier", "epoch": 2},
                {"pod": "d", "address": "x:1", "target": "draft", "epoch": True},
                "junk",
            ],
        },
        "conditions": [{"type": "SessionsOpen", "status": "True", "reason": "VerifierSessionsOpen"}],
    }
    status = sessions.push_status(_obj(raw))
    assert status == sessions.PushStatus(
        2, (sessions.Session(2, "verifier", "a", "10.0.0.1:8000"),), "VerifierSessionsOpen"
    )
    assert sessions.push_status(_obj({"phase": "Pending"})) is None


def test_an_error_is_retired_once_its_sessions_are_gone() -> None:
    listed = (sessions.Session(2, "verifier", "a", "h:1"), sessions.Session(3, "draft", "a", "h:1"))
    open_ = sessions.PushStatus(3, listed)
    assert not sessions.error_retired(open_, "verifier", 2)
    assert sessions.error_retired(open_, "verifier", 1)  # only newer sessions of it are left
    assert not sessions.error_retired(open_, "draft", 3) and sessions.error_retired(open_, "draft", 2)
    assert sessions.error_retired(None, "verifier", 9)


def test_served_epochs_from_marks_and_errors() -> None:
    assert sessions.served_epochs(_obj({})) == {"verifier": 0, "draft": 0}
    marked = {"push.rolloutfleet.io/verifier": "7", "push.rolloutfleet.io/draft": "bogus"}
    assert sessions.served_epochs(_obj({}, marked)) == {"verifier": 7, "draft": 0}
    failed = {**marked, "push.rolloutfleet.io/error": "draft epoch 9: p: HTTP 500"}
    assert sessions.served_epochs(_obj({}, failed)) == {"verifier": 7, "draft": 9}


def test_error_annotation_is_bounded() -> None:
    failures = [SendFailure(f"pod-{i}", "a:1", "verifier", 3, "x" * 100) for i in range(50)]
    text = sessions.error("verifier", 3, failures)[sessions.ERROR_ANNOTATION]
    assert text is not None and len(text) == sessions.ERROR_MAX_CHARS and text.startswith("verifier epoch 3: pod-0: x")


@pytest.mark.parametrize(
    ("address", "parsed"), [("10.1.2.3:8000", ("10.1.2.3", 8000)), ("[fd00::1]:80", ("fd00::1", 80))]
)
def test_split_address(address: str, parsed: tuple[str, int]) -> None:
    assert split_address(address) == parsed
    with pytest.raises(ValueError, match="not host:port"):
        split_address("10.1.2.3")


def test_the_package_exports_what_it_lists() -> None:
    import rolloutfleet.trainer as trainer

    assert set(trainer.__all__) == set(trainer._EXPORTS)
    for name in trainer.__all__:
        assert getattr(trainer, name) is not None
    assert trainer.publish_revision is publish.publish_revision
    assert isinstance(RawTensor("F32", (1,), b"\0" * 4), trainer.RawTensor)


def test_what_the_sender_cannot_send_is_refused_before_the_create(api: FakeCustomObjects, core: FakeCore) -> None:
    with pytest.raises(InvalidTensors, match=r"verifier tensors: model\.embed\.weight: CUDA IPC .* is raw bytes"):
        run_push(sender=IpcSender())
    assert api.creates == []
