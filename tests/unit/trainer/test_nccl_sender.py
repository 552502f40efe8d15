"""The NCCL sender (rank 0 of the fleet's transfer group) and the collective delivery, with a fake transport.

What the real transport does — vLLM's rank 0 over NCCL into real engines — is proven on the GPU
(scripts/gpu/push_proof.py --backend nccl, docs/gpu.md). Here the fake stands where NCCL would, so the rules
the sender owns can fail: the group is formed off the caller's thread (vLLM's rank 0 blocks until every
engine joined, and the engines only join after the trainer published where), every engine's
``/update_weights`` runs at once with the broadcast (a receiver left waiting for a later turn would hang the
broadcast forever), a broadcast that does not complete leaves the group unusable until a new one is formed,
and an engine that refuses the update stops the wait at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from trainer_fakes import Call, FakeCore, FakeCustomObjects, FakeEngine, fleet, push_core_api, push_custom_api

from rolloutfleet.trainer import push
from rolloutfleet.trainer.digest import RawTensor
from rolloutfleet.trainer.errors import InvalidTensors, PushUnsupported, SendError
from rolloutfleet.trainer.senders import NcclSender, Prepared, deliver
from rolloutfleet.trainer.sessions import MARKS, RENDEZVOUS_ANNOTATION

NS = "ns"
TOKEN = "s3cret"
VERIFIER = [("model.embed.weight", "BF16", (4, 2), bytes(range(16))), ("lm_head.weight", "F32", (2,), b"\1" * 8)]
DRAFT = [("model.fc.weight", "F16", (3,), b"\2" * 6)]


class FakeNccl:
    """Stands where NCCL would: a group forms once ``joined`` is set; a broadcast completes, as NCCL's, only
    once every receiver takes part (``receivers()`` true: the engines' posts are in flight), then "delivers"
    by setting its round's event of ``deliveries`` (what those posts wait on); or it hangs (``hang``), like
    NCCL with a receiver gone."""

    def __init__(self) -> None:
        self.joined = threading.Event()
        self.deliveries = [threading.Event() for _ in range(4)]  # set by the 1st, 2nd... broadcast
        self.received = self.deliveries[0]
        self.hang = False
        self.join_error: Exception | None = None
        self.receivers: Callable[[], bool] = lambda: True
        self.groups: list[tuple[str, int, int]] = []
        self.broadcasts: list[tuple[Any, list[str], bool]] = []

    def current_device(self) -> int:
        return 0

    def open_group(self, host: str, port: int, world_size: int, device: int) -> Any:
        self.groups.append((host, port, world_size))
        if not self.joined.wait(10):
            raise TimeoutError("no engine joined")
        if self.join_error is not None:
            raise self.join_error
        return f"comm-{len(self.groups)}"

    def broadcast(self, group: Any, tensors: Sequence[tuple[str, Any]], packed: bool, device: int) -> None:
        self.broadcasts.append((group, [name for name, _ in tensors], packed))
        if self.hang:
            threading.Event().wait(30)  # a receiver that never takes its bytes; the sender gives up first
            return
        deadline = time.monotonic() + 10
        while not self.receivers() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.deliveries[len(self.broadcasts) - 1].set()


class HostNcclSender(NcclSender):
    """The NCCL sender taking raw bytes: CI has no GPU, and what is checked here is not the tensors' kind."""

    def check(self, items: Sequence[tuple[str, Any]], target: str = "tensors") -> None:
        pass

    def update_info(self, items: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
        info = {
            "names": [name for name, _ in items],
            "dtype_names": ["uint8"] * len(items),
            "shapes": [[len(v.data)] for _, v in items],
        }
        if self.packed:
            info["packed"] = True
        return info, list(items)


def raw(specs: Sequence[tuple[str, str, tuple[int, ...], bytes]]) -> list[tuple[str, RawTensor]]:
    return [(name, RawTensor(dtype, shape, data)) for name, dtype, shape, data in specs]


def prepared(sender: NcclSender, specs: Sequence[tuple[str, str, tuple[int, ...], bytes]] = VERIFIER) -> Prepared:
    return sender.prepare(raw(specs), "verifier")


@pytest.fixture
def calls() -> list[Call]:
    return []


@pytest.fixture
def engines(calls: list[Call]) -> Iterator[list[FakeEngine]]:
    group = {"in_flight": 0, "max_in_flight": 0}
    made = [FakeEngine(f"pol-{i}", calls, group) for i in range(3)]
    yield made
    for engine in made:
        engine.close()


def test_join_returns_the_address_at_once_and_forms_the_group_behind_it() -> None:
    # vLLM's rank 0 returns only once every engine joined, and the engines join only once the operator read
    # the address: a join that waited for the group would never return.
    fake = FakeNccl()
    sender = NcclSender("127.0.0.1", transport=fake)
    started = time.monotonic()
    address = sender.join_group(3, 5)
    assert time.monotonic() - started < 1.0
    assert address == f"127.0.0.1:{sender.port}" and sender.group_epoch == 3
    deadline = time.monotonic() + 5
    while not fake.groups and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.groups == [("127.0.0.1", sender.port, 5)]
    fake.joined.set()


def test_each_new_group_gets_a_new_port_unless_one_was_fixed() -> None:
    # The previous group's rendezvous store may still hold its port while the new group forms.
    fake = FakeNccl()
    fake.joined.set()
    sender = NcclSender("127.0.0.1", transport=fake)
    first = sender.join_group(1, 2)
    second = sender.join_group(2, 2)
    assert first != second
    fixed = NcclSender("127.0.0.1", 29611, transport=fake)
    assert fixed.join_group(1, 2) == fixed.join_group(2, 2) == "127.0.0.1:29611"
    assert NcclSender("::1", 29611, transport=fake).rendezvous_address() == "[::1]:29611"
    with pytest.raises(ValueError, match="wildcard"):
        NcclSender("0.0.0.0", transport=fake)


def test_every_engine_is_posted_at_once_with_the_broadcast_beside_them(
    engines: list[FakeEngine], calls: list[Call]
) -> None:
    # Each engine's /update_weights returns only once the broadcast gave it the bytes; with the client's
    # concurrency (1 here) applied, the second engine would not be called before the first returned, and the
    # first would never return.
    fake = FakeNccl()
    fake.joined.set()
    sender = HostNcclSender("127.0.0.1", transport=fake)
    sender.join_group(1, 4)
    fake.receivers = lambda: engines[0].group["in_flight"] == 3
    for engine in engines:
        engine.answers.append(fake.received)
    ready = prepared(sender)
    errors = deliver(sender, [e.address for e in engines], TOKEN, ready, timeout=20, concurrency=1)
    assert errors == [None, None, None]
    assert engines[0].group["max_in_flight"] == 3
    assert fake.broadcasts == [("comm-1", ["model.embed.weight", "lm_head.weight"], False)]
    # The engines get names, dtypes and shapes only: the bytes came by the broadcast.
    assert all(set(c.update_info) == {"names", "dtype_names", "shapes"} for c in calls) and len(calls) == 3


def test_a_broadcast_that_does_not_complete_fails_and_leaves_the_group_unusable() -> None:
    # NCCL waits for a dead receiver forever: the sender gives up at its timeout, and a later broadcast on
    # that group would only hang again (the receivers that took part are out of step), until a new group.
    fake = FakeNccl()
    fake.joined.set()
    fake.hang = True
    sender = HostNcclSender("127.0.0.1", transport=fake)
    sender.join_group(1, 2)
    with pytest.raises(SendError, match="did not complete: no completion in time"):
        sender.broadcast(prepared(sender), 0.3, threading.Event())
    started = time.monotonic()
    with pytest.raises(SendError, match="transfer group 1 is unusable"):
        sender.broadcast(prepared(sender), 10, threading.Event())
    assert time.monotonic() - started < 1.0 and len(fake.broadcasts) == 1
    fake.hang = False
    sender.join_group(2, 2)  # the operator formed a new group (after restarting the stuck engines)
    sender.broadcast(prepared(sender), 10, threading.Event())
    assert [b[0] for b in fake.broadcasts] == ["comm-1", "comm-2"]


def test_an_engine_that_refuses_the_update_stops_the_wait_at_once(engines: list[FakeEngine]) -> None:
    fake = FakeNccl()
    fake.joined.set()
    fake.hang = True  # the refusing engine never receives: the broadcast cannot complete
    sender = HostNcclSender("127.0.0.1", transport=fake)
    sender.join_group(1, 2)
    cancel = threading.Event()
    cancel.set()
    started = time.monotonic()
    with pytest.raises(SendError, match="a receiving engine refused the update"):
        sender.broadcast(prepared(sender), 20, cancel)
    assert time.monotonic() - started < 2.0
    # Through deliver: the refusing engine says why; the other engine answers at once, but its answer cannot
    # count (the broadcast never completed), so it gets the broadcast's reason.
    sender.join_group(2, 2)
    engines[0].answers.append(500)
    errors = deliver(sender, [engines[0].address, engines[1].address], TOKEN, prepared(sender), 20, 8)
    assert errors[0] == "HTTP 500: boom"
    assert errors[1] is not None and "refused the update" in errors[1]


def test_a_group_that_never_formed_fails_the_send_with_its_reason() -> None:
    fake = FakeNccl()
    fake.join_error = RuntimeError("NCCL error: unhandled system error")
    fake.joined.set()
    sender = HostNcclSender("127.0.0.1", transport=fake)
    with pytest.raises(SendError, match="no NCCL transfer group"):
        sender.broadcast(prepared(sender), 1, threading.Event())
    sender.join_group(4, 2)
    with pytest.raises(SendError, match="forming transfer group 4 failed: RuntimeError: NCCL error"):
        sender.broadcast(prepared(sender), 5, threading.Event())


def test_packing_follows_the_fleet_and_a_conflict_is_refused() -> None:
    # vLLM >= 0.28 engines take `packed` at the group's init (from the fleet): the trainer must agree.
    fake = FakeNccl()
    follows = NcclSender("127.0.0.1", transport=fake)
    follows.configure({"backend": "nccl", "nccl": {"packed": True}})
    assert follows.packed is True
    plain = NcclSender("127.0.0.1", transport=fake)
    plain.configure({"backend": "nccl"})
    assert plain.packed is False
    with pytest.raises(PushUnsupported, match="packed is true"):
        NcclSender("127.0.0.1", packed=False, transport=fake).configure({"backend": "nccl", "nccl": {"packed": True}})
    # vLLM 0.26 reads packing per update: the flag travels in update_info when set, and only then.
    packed = HostNcclSender("127.0.0.1", packed=True, transport=fake)
    assert b'"packed":true' in prepared(packed).body
    assert b"packed" not in prepared(HostNcclSender("127.0.0.1", packed=False, transport=fake)).body


def test_only_gpu_tensors_are_broadcast() -> None:
    sender = NcclSender("127.0.0.1", transport=FakeNccl())
    with pytest.raises(InvalidTensors, match="torch tensors on a GPU, this one is raw bytes"):
        sender.check(raw(VERIFIER), "verifier")
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidTensors, match="this one is on cpu"):
        sender.check([("w", torch.zeros(2))], "verifier")


# -- the push client with a NCCL sender: group, rendezvous, one collective send per target -----------------


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeCustomObjects:
    return push_custom_api(monkeypatch, NS, fleet("pol", "/w", transfer="nccl"))


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> FakeCore:
    return push_core_api(monkeypatch, NS, TOKEN, "pol")


def test_the_push_client_joins_the_group_then_feeds_each_target_by_one_broadcast(
    api: FakeCustomObjects, core: FakeCore, engines: list[FakeEngine], calls: list[Call]
) -> None:
    fake = FakeNccl()
    fake.joined.set()
    sender = HostNcclSender("127.0.0.1", transport=fake)
    pods = engines[:2]
    group = {"epoch": 7, "worldSize": 3, "ranks": [{"pod": e.pod, "rankOffset": i + 1} for i, e in enumerate(pods)]}

    def status(target: str | None, epoch: int, formed: bool) -> dict[str, Any]:
        sessions = [{"pod": e.pod, "address": e.address, "target": target, "epoch": epoch} for e in pods]
        return {
            "phase": "Progressing",
            "push": {
                "protocol": 1,
                "epoch": epoch,
                "sessions": sessions if target else [],
                "group": group | {"formed": formed},
            },
        }

    fake.receivers = lambda: pods[0].group["in_flight"] == 2
    for engine in pods:  # each engine's two posts wait for a broadcast
        engine.answers += fake.deliveries[:2]
    rules: list[tuple[dict[str, str | None], dict[str, Any]]] = [
        ({}, status(None, 0, False)),
        ({RENDEZVOUS_ANNOTATION: f"7@127.0.0.1:{sender.port}"}, status("verifier", 1, True)),
        ({MARKS["verifier"]: "1"}, status("draft", 2, True)),
        (
            {MARKS["draft"]: "2"},
            {"phase": "Succeeded", "conditions": [{"type": "Ready", "status": "True"}], "updated": "2/2"},
        ),
    ]
    fired: list[int] = []

    def operator(obj: dict[str, Any]) -> None:
        annotations = obj["metadata"].get("annotations") or {}
        if len(fired) == len(rules):
            return
        want, new_status = rules[len(fired)]
        if all(annotations.get(k) == v for k, v in want.items()):
            obj["status"] = new_status
            fired.append(len(fired))

    api.on_read_revision = operator
    result = push.push_revision(
        "pol",
        1,
        raw(VERIFIER),
        raw(DRAFT),
        NS,
        api_client=object(),  # type: ignore[arg-type]
        sender=sender,
        progress=False,
        poll_interval=0.01,
        session_timeout=60,
        timeout=120,
        concurrency=1,
    )
    assert result.revision == 1 and fired == [0, 1, 2, 3]
    assert fake.groups == [("127.0.0.1", sender.port, 3)]
    assert [(g, names) for g, names, _ in fake.broadcasts] == [
        ("comm-1", ["model.embed.weight", "lm_head.weight"]),
        ("comm-1", ["model.fc.weight"]),
    ]
    assert sorted(c.pod for c in calls) == ["pol-0", "pol-0", "pol-1", "pol-1"]
    assert pods[0].group["max_in_flight"] == 2  # both engines at once, although concurrency=1
