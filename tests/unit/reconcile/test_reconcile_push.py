"""Pushed revisions end to end in one process: ``FakeKube``, simulated engines over HTTP, real passes, and a
test trainer that follows the handshake of docs/push.md (it reads the sessions from the revision's status,
sends with the simulated transport, and marks the revision).

Orders are read from the engines' call logs: per pod, verifier session → verify → draft session → verify
→ resume; nothing serves a failed, partial or unverified session.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import pathlib
from typing import Any
from unittest import mock

import aiohttp
import pytest
from reconcile_fakes import TOKEN, Harness, call_name, harness, ok_calls
from safetensors.numpy import load_file

from rolloutfleet.adapters.engine import EnginePool
from rolloutfleet.adapters.engine_policy import EngineTimeouts, RetryPolicy
from rolloutfleet.api import common
from rolloutfleet.api.revision import RENDEZVOUS_ANNOTATION as RENDEZVOUS
from rolloutfleet.digest import digest_directory
from rolloutfleet.reconcile import push
from rolloutfleet.reconcile import revision as revision_reconcile
from rolloutfleet.sim.config import FaultKind, FaultRule

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]

PUSH_FLEET = {"weightTransfer": {"backend": "ipc"}}
TORCH_NAMES = {"float32": "float32"}  # numpy dtype name -> the torch spelling vLLM's update_info carries


def pushed_revision(h: Harness, name: str, revision: int, **extra: Any) -> dict[str, Any]:
    verifier, draft = h.checkpoint(revision)
    spec: dict[str, Any] = {
        "fleetRef": {"name": h.fleet},
        "revision": revision,
        "verifier": {"push": {}, "digest": digest_directory(verifier)},
        "draft": {"push": {}, "digest": digest_directory(draft)},
        **extra,
    }
    body = {
        "apiVersion": common.API_VERSION,
        "kind": "WeightRevision",
        "metadata": {"name": name, "namespace": h.namespace},
        "spec": spec,
    }
    return h.kube.apply_user(body)


def update_info(checkpoint: str, *, bad_shape: bool = False) -> dict[str, Any]:
    tensors = load_file(str(pathlib.Path(checkpoint) / "model.safetensors"))
    names = sorted(tensors)
    shapes = [list(tensors[n].shape) for n in names]
    if bad_shape:
        shapes[0] = [shapes[0][0] * shapes[0][1]]  # same bytes, another shape: vLLM's load fails
    return {
        "names": names,
        "dtype_names": [TORCH_NAMES[str(tensors[n].dtype)] for n in names],
        "shapes": shapes,
        "simulated_payload_b64": [base64.b64encode(tensors[n].tobytes()).decode() for n in names],
    }


class Trainer:
    """The trainer's side of the handshake, by hand (``rolloutfleet.trainer.push`` is the library one)."""

    def __init__(self, h: Harness, revision_name: str, revision: int) -> None:
        self.h, self.name = h, revision_name
        self.verifier, self.draft = h.checkpoint(revision)
        self.served: dict[str, int] = {}

    def sessions(self, target: str) -> list[dict[str, Any]]:
        push = self.h.revision_status(self.name).get("push") or {}
        return [s for s in push.get("sessions") or [] if s["target"] == target]

    async def send(self, target: str, *, bad_shape: bool = False) -> int:
        sessions = [s for s in self.sessions(target) if s["epoch"] > self.served.get(target, 0)]
        assert sessions, f"no {target} session is open: {self.h.revision_status(self.name).get('push')}"
        info = update_info(self.verifier if target == "verifier" else self.draft, bad_shape=bad_shape)
        async with aiohttp.ClientSession() as http:
            for s in sessions:
                async with http.post(
                    f"http://{s['address']}/update_weights",
                    json={"update_info": info},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ) as r:
                    assert (r.status == 200) != bad_shape, await r.text()
        epoch = max(s["epoch"] for s in sessions)
        self.mark(target, str(epoch))
        self.served[target] = epoch
        return len(sessions)

    def mark(self, target: str, value: str) -> None:
        body = self.h.kube.peek(common.API_VERSION, "WeightRevision", self.h.namespace, self.name)
        assert body is not None
        annotations = dict(body["metadata"].get("annotations") or {})
        annotations[f"push.rolloutfleet.io/{target}"] = value
        body["metadata"]["annotations"] = annotations
        self.h.kube.apply_user(body)


def session_calls(log: list[dict[str, Any]]) -> list[str]:
    keep = (
        "rolloutfleet_push_begin",
        "start_weight_update",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "rolloutfleet_push_end",
        "resume",
    )
    return [call_name(e) for e in ok_calls(log) if call_name(e).split(":")[0] in keep]


async def test_push_all_at_once_verifier_then_draft_then_resume_on_every_pod(tmp_path: pathlib.Path) -> None:
    """The transaction of docs/push.md, per pod in the engines' own logs: the draft session opens only once
    the verifier's session was verified, and nothing resumes before both were; the fleet records that it
    serves pushed weights (so no rollback to them by path is ever attempted)."""
    async with harness(tmp_path, replicas=3, mode="inflight", fleet_extra=PUSH_FLEET) as h:
        pushed_revision(h, "step-1", 1)
        trainer = Trainer(h, "step-1", 1)
        outcome = await h.run_pass()  # opens the verifier sessions, then waits for the trainer
        assert not outcome.idle
        status = h.revision_status("step-1")
        assert status["push"]["protocol"] == 1 and status["push"]["epoch"] >= 1
        assert {c["type"]: c["reason"] for c in status["conditions"]}["SessionsOpen"] == "VerifierSessionsOpen"
        assert await trainer.send("verifier") == 3
        await h.run_pass()  # ends and verifies the verifier sessions, opens the draft sessions
        assert all(h.served(p).verifier == 1 and h.served(p).paused for p in h.pods)
        assert await trainer.send("draft") == 3
        await h.settle()

        assert h.revision_status("step-1")["phase"] == "Succeeded"
        served = h.fleet_status()["served"]
        assert served["verifierPushed"] and served["draftPushed"] and "verifierPath" not in served
        for pod in h.pods:
            assert h.served(pod) == (1, 1, False), pod
            assert session_calls(h.engine_log(pod)) == [
                "rolloutfleet_push_begin:verifier",
                "start_weight_update",
                "update_weights",
                "finish_weight_update",
                "rolloutfleet_push_end",
                "rolloutfleet_push_begin:draft",
                "start_draft_weight_update",
                "update_weights",
                "finish_weight_update",
                "rolloutfleet_push_end",
                "resume",
            ], pod
        digests = {p["verifierDigest"] for p in h.revision_status("step-1")["pods"]}
        assert digests == {digest_directory(trainer.verifier)}


async def test_push_rolling_moves_one_pod_per_epoch_and_never_two_out(tmp_path: pathlib.Path) -> None:
    """Rolling with maxUnavailable 1: sessions open on one pod at a time, each set under a new epoch; the
    trainer serves each epoch as it appears."""
    async with harness(
        tmp_path, replicas=3, mode="inflight", rollout="Rolling", max_unavailable=1, fleet_extra=PUSH_FLEET
    ) as h:
        pushed_revision(h, "step-1", 1)
        trainer = Trainer(h, "step-1", 1)
        epochs = []
        for _ in range(3):
            await h.run_pass()
            assert len(trainer.sessions("verifier")) == 1
            epochs.append(trainer.sessions("verifier")[0]["epoch"])
            await trainer.send("verifier")
            await h.run_pass()
            await trainer.send("draft")
            await h.run_pass()
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert epochs == sorted(set(epochs))  # a new epoch per set of sessions, never reused
        assert all(h.served(p) == (1, 1, False) for p in h.pods)


async def test_a_failed_draft_session_never_serves_and_the_pod_is_restarted(tmp_path: pathlib.Path) -> None:
    """A wrong shape in the draft session fails the update (vLLM leaves the draft on meta): the pod must
    never resume on it; the operator deletes it (only a new process repairs it)."""
    async with harness(tmp_path, replicas=2, mode="inflight", max_retries=0, fleet_extra=PUSH_FLEET) as h:
        h.apply_revision("step-1", 1)  # a path revision first: what a failed push rolls back to
        await h.settle()
        pushed_revision(h, "step-2", 2)
        trainer = Trainer(h, "step-2", 2)
        await h.run_pass()
        await trainer.send("verifier")
        await h.run_pass()
        await trainer.send("draft", bad_shape=True)
        await h.run_pass()  # ends the failed sessions: the draft is destroyed
        await h.run_pass()  # restarts the pods
        deleted = [p for p in h.pods if h.kube.peek("v1", "Pod", h.namespace, p) is None]
        assert deleted == h.pods
        for pod in h.pods:
            names = [call_name(e) for e in ok_calls(h.engine_log(pod))]
            assert "resume" not in names[names.index("rolloutfleet_push_begin:verifier") :], pod
        assert any(e["reason"] == "EngineRestarted" for e in h.kube.events)
        for pod in list(h.pods):
            await recreate(h, pod)
        await h.settle()
        status = h.revision_status("step-2")
        assert status["phase"] == "RolledBack", status.get("message")
        assert all(h.served(p) == (1, 1, False) for p in h.pods)  # back on the path revision, by path


async def test_a_trainer_that_never_sends_meets_the_push_deadline(tmp_path: pathlib.Path) -> None:
    """Every wait has a deadline: an unmarked session is abandoned after pushSeconds (a failed attempt), the
    pod is restarted rather than left with its target on meta, and once its StatefulSet recreated it the
    revision rolls back to what the fleet served (the initial weights, by path)."""
    async with harness(
        tmp_path,
        replicas=1,
        mode="inflight",
        max_retries=0,
        fleet_extra=PUSH_FLEET,
        timeouts={"wakeSeconds": 30, "loadSeconds": 30, "pushSeconds": 1},
    ) as h:
        pod = h.pods[0]
        pushed_revision(h, "step-1", 1)
        await h.run_pass()
        assert len(Trainer(h, "step-1", 1).sessions("verifier")) == 1
        await asyncio.sleep(1.2)
        await h.run_pass()  # abandons: the deadline passed
        await h.run_pass()  # restarts the pod
        assert h.kube.peek("v1", "Pod", h.namespace, pod) is None
        names = [call_name(e) for e in ok_calls(h.engine_log(pod))]
        assert "resume" not in names[names.index("rolloutfleet_push_begin:verifier") :]
        await recreate(h, pod)
        await h.settle()
        status = h.revision_status("step-1")
        assert (status["phase"], status["reason"]) == ("RolledBack", "RolledBack")
        assert [(f["name"], f["reason"]) for f in status["failures"]] == [(pod, "PushAbandoned")]
        served = h.served(pod)  # the new pod serves the initial weights (revision 0 or never loaded: None)
        assert served.verifier in (None, 0) and served.draft in (None, 0) and not served.paused


async def recreate(h: Harness, pod: str) -> None:
    """What the StatefulSet controller does after the operator deleted a pod: the same name, a new engine."""
    await h.sim.remove(h.pod_ips.pop(pod), h.port)
    await h.add_pod(pod)


async def test_the_trainers_error_mark_ends_the_sessions(tmp_path: pathlib.Path) -> None:
    async with harness(tmp_path, replicas=2, mode="inflight", max_retries=0, fleet_extra=PUSH_FLEET) as h:
        pushed_revision(h, "step-1", 1)
        trainer = Trainer(h, "step-1", 1)
        await h.run_pass()
        trainer.mark("error", "CUDA out of memory on rank 0")
        await h.run_pass()
        status = h.revision_status("step-1")
        messages = " ".join(p.get("message") or "" for p in status["pods"])
        assert "CUDA out of memory" in messages, status["pods"]
        assert all(not h.served(p).verifier for p in h.pods)


async def test_an_operator_restarted_mid_push_continues_from_the_engines(tmp_path: pathlib.Path) -> None:
    """Nothing of a push lives only in the operator's memory: a new operator process (no memory) finds the
    open sessions and their epochs on the engines and the trainer's marks on the revision, and finishes."""
    async with harness(tmp_path, replicas=2, mode="inflight", fleet_extra=PUSH_FLEET) as h:
        pushed_revision(h, "step-1", 1)
        trainer = Trainer(h, "step-1", 1)
        await h.run_pass()
        await trainer.send("verifier")
        await forget(h)  # the operator is SIGKILLed after the trainer marked, before it ended the sessions
        await h.run_pass()
        await forget(h)  # and again with the draft sessions open
        await trainer.send("draft")
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert all(h.served(p) == (1, 1, False) for p in h.pods)


async def forget(h: Harness) -> None:
    """A new operator process: the fleet's memory (pool, attempts, epochs in flight) is gone."""
    memory = h.ctx.fleets.pop((h.namespace, h.fleet), None)
    if memory is not None and memory.pool is not None:
        await memory.pool.close()


async def test_a_sender_that_dies_mid_send_ends_in_a_restart_not_a_hang(tmp_path: pathlib.Path) -> None:
    """vLLM has no timeout inside a transfer (DESIGN §4b): a sender that dies mid-broadcast leaves
    ``/update_weights`` blocked, and every later call to that engine (our state read too) queues behind it.
    The engine then reads as unreachable; past the push deadline the operator restarts the pod instead of
    waiting forever or finishing a session it cannot see."""
    async with harness(
        tmp_path,
        replicas=2,
        mode="inflight",
        max_retries=0,
        fleet_extra=PUSH_FLEET,
        timeouts={"wakeSeconds": 30, "loadSeconds": 30, "pushSeconds": 1},
    ) as h:
        await forget(h)  # the next pool reads engines with a short deadline (a blocked engine answers nothing)
        quick = functools.partial(
            EnginePool,
            retry=RetryPolicy(attempts=1, base_delay=0.005, max_delay=0.01),
            timeouts=EngineTimeouts(default=0.5),
        )
        with mock.patch.object(revision_reconcile, "EnginePool", quick):
            stuck = h.pods[0]
            h.engine(stuck).add_fault(FaultRule(step="update_weights", kind=FaultKind.HANG, delay=300.0))
            pushed_revision(h, "step-1", 1)
            trainer = Trainer(h, "step-1", 1)
            await h.run_pass()
            sending = asyncio.create_task(trainer.send("verifier"))  # blocks on the stuck engine forever
            await asyncio.sleep(0.3)
            for _ in range(20):  # passes, as the daemon runs them, until the stuck pod is restarted
                await h.run_pass()
                if h.kube.peek("v1", "Pod", h.namespace, stuck) is None:
                    break
                await asyncio.sleep(0.2)
            assert h.kube.peek("v1", "Pod", h.namespace, stuck) is None, "the blocked pod was never restarted"
            why = [e["message"] for e in h.kube.events_for(stuck, "EngineRestarted")]
            assert why and "has not answered" in why[0], why
            # The trainer died, so the other pod's session was never fed either: abandoned, then restarted.
            other = [e["message"] for e in h.kube.events_for(h.pods[1], "EngineRestarted")]
            assert other and "destroyed" in other[0], other
            names = [call_name(e) for e in ok_calls(h.engine_log(stuck))]
            assert "resume" not in names[names.index("rolloutfleet_push_begin:verifier") :]
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)  # the stuck send ends with its engine


async def test_a_new_operator_at_every_pass_still_converges(tmp_path: pathlib.Path) -> None:
    """The operator killed between any two passes of a push (each pass is a few steps: open, end, open,
    end, stamp, resume): with no memory at all each time, it converges from the engines and the status."""
    async with harness(tmp_path, replicas=2, mode="sleep", fleet_extra=PUSH_FLEET) as h:
        pushed_revision(h, "step-1", 1)
        trainer = Trainer(h, "step-1", 1)
        for _ in range(30):
            await forget(h)
            outcome = await h.run_pass()
            status = h.revision_status("step-1")
            if status.get("phase") == "Succeeded":
                break
            for target in ("verifier", "draft"):
                if any(s["epoch"] > trainer.served.get(target, 0) for s in trainer.sessions(target)):
                    await trainer.send(target)
            assert outcome is not None
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert all(h.served(p) == (1, 1, False) for p in h.pods)
        for pod in h.pods:  # each session opened once: no step was repeated by a forgetful operator
            names = session_calls(h.engine_log(pod))
            assert names.count("rolloutfleet_push_begin:verifier") == 1 and names.count("update_weights") == 2, names


async def test_an_epoch_is_never_published_before_every_session_of_it_was_read_back(tmp_path: pathlib.Path) -> None:
    """Found by bench/push_overhead.py at 64 pods: when the last open of an epoch returned, the epoch counted
    as complete while some of its pods had not been read back since (the open's acknowledgement does not
    carry the session); a status write then listed the epoch without them, the trainer marked it, and the
    unlisted sessions were ended with nothing received (their targets destroyed). Every snapshot of the
    status a trainer could read must list an epoch whole."""
    async with harness(tmp_path, replicas=3, mode="inflight", fleet_extra=PUSH_FLEET) as h:
        slow = h.pods[2]
        h.engine(slow).add_fault(FaultRule(step="start_weight_update", kind=FaultKind.SLOW, delay=0.8, count=None))
        pushed_revision(h, "step-1", 1)
        seen: list[dict[int, set[str]]] = []
        done = asyncio.Event()

        def snapshot() -> None:  # what a polling trainer sees
            push = h.revision_status("step-1").get("push") or {}
            by_epoch: dict[int, set[str]] = {}
            for s in push.get("sessions") or []:
                if s["epoch"] <= push.get("epoch", 0):
                    by_epoch.setdefault(s["epoch"], set()).add(s["pod"])
            seen.append(by_epoch)

        async def watch() -> None:
            while not done.is_set():
                snapshot()
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        await h.run_pass()
        done.set()
        await watcher
        snapshot()
        partial = [snap for snap in seen if any(len(pods) != 3 for pods in snap.values())]
        assert not partial, partial[:3]
        assert any(snap for snap in seen), "the sessions were never published"


NCCL_FLEET = {"weightTransfer": {"backend": "nccl"}, "tensorParallelSize": 2, "gpusPerPod": 2}


def rendezvous(h: Harness, name: str, value: str) -> None:
    body = h.kube.peek(common.API_VERSION, "WeightRevision", h.namespace, name)
    assert body is not None
    body["metadata"]["annotations"] = {**(body["metadata"].get("annotations") or {}), RENDEZVOUS: value}
    h.kube.apply_user(body)


def init_calls(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in ok_calls(log) if call_name(e) == "init_weight_transfer_engine"]


async def test_nccl_push_forms_the_group_before_any_session_and_keeps_it(tmp_path: pathlib.Path) -> None:
    """NCCL (docs/push.md, "Transfer group"): one broadcast from the trainer (rank 0) feeds every engine, so
    no session opens before the engines joined the group the operator published, at the trainer's
    rendezvous, each with its own ranks (tensor parallel 2: engines at ranks 1, 3, 5 of 7). A second push
    to the same pods reuses the group: vLLM's init is a collective that every rank must enter together,
    and re-running it on a formed group is neither needed nor safe."""
    async with harness(tmp_path, replicas=3, mode="inflight", fleet_extra=NCCL_FLEET) as h:
        pushed_revision(h, "step-1", 1)
        await h.run_pass()
        status = h.revision_status("step-1")
        group = status["push"]["group"]
        assert group["worldSize"] == 7 and group["epoch"] >= 1
        assert [(r["pod"], r["rankOffset"], r["worldSize"]) for r in group["ranks"]] == [
            ("policy-0", 1, 2),
            ("policy-1", 3, 2),
            ("policy-2", 5, 2),
        ]
        # Paused, waiting for the rendezvous: nothing joined, no session open.
        assert not status["push"]["sessions"]
        assert all(not init_calls(h.engine_log(p)) and h.served(p).paused for p in h.pods)

        rendezvous(h, "step-1", f"{group['epoch']}@127.0.0.1:29700")
        await h.run_pass()
        for pod, offset in zip(h.pods, (1, 3, 5), strict=True):
            (init,) = init_calls(h.engine_log(pod))
            assert init["args"]["init_info"] == {
                "master_address": "127.0.0.1",
                "master_port": 29700,
                "rank_offset": offset,
                "world_size": 7,
            }, pod
        trainer = Trainer(h, "step-1", 1)
        assert await trainer.send("verifier") == 3
        await h.run_pass()
        assert await trainer.send("draft") == 3
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert all(h.served(p) == (1, 1, False) for p in h.pods)

        pushed_revision(h, "step-2", 2)
        await h.run_pass()
        again = h.revision_status("step-2")["push"]
        # The same pods, all still in it: the same group, formed. No session before the trainer says it is
        # its rank 0 (a new trainer process would ask for a new group instead).
        assert again["group"] == {**group, "formed": True} and not again["sessions"]
        rendezvous(h, "step-2", f"{group['epoch']}@127.0.0.1:29700")
        await h.run_pass()
        trainer = Trainer(h, "step-2", 2)
        assert await trainer.send("verifier") == 3
        await h.run_pass()
        assert await trainer.send("draft") == 3
        await h.settle()
        assert h.revision_status("step-2")["phase"] == "Succeeded"
        assert all(len(init_calls(h.engine_log(p))) == 1 for p in h.pods)


async def test_nccl_a_restarted_engine_makes_every_engine_join_a_new_group(tmp_path: pathlib.Path) -> None:
    """A NCCL group cannot take a member back: once one engine process is new (it joined nothing), every
    engine joins a new group (a higher epoch) at the trainer's new rendezvous before the next session."""
    async with harness(tmp_path, replicas=2, mode="inflight", fleet_extra=NCCL_FLEET) as h:
        pushed_revision(h, "step-1", 1)
        await h.run_pass()
        first = h.revision_status("step-1")["push"]["group"]
        rendezvous(h, "step-1", f"{first['epoch']}@127.0.0.1:29700")
        trainer = Trainer(h, "step-1", 1)
        await h.run_pass()
        await trainer.send("verifier")
        await h.run_pass()
        await trainer.send("draft")
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"

        await h.engine(h.pods[1]).restart()  # a new process: no group, initial weights
        pushed_revision(h, "step-2", 2)
        await h.run_pass()
        second = h.revision_status("step-2")["push"]["group"]
        assert second["epoch"] > first["epoch"]
        assert not h.revision_status("step-2")["push"]["sessions"]  # nobody opens before the new group
        rendezvous(h, "step-2", f"{first['epoch']}@127.0.0.1:29700")  # a stale rendezvous is not taken
        await h.run_pass()
        assert all(len(init_calls(h.engine_log(p))) <= 1 for p in h.pods)
        rendezvous(h, "step-2", f"{second['epoch']}@127.0.0.1:29701")
        trainer = Trainer(h, "step-2", 2)
        await h.run_pass()
        assert [init_calls(h.engine_log(p))[-1]["args"]["init_info"]["master_port"] for p in h.pods] == [29701] * 2
        await trainer.send("verifier")
        await h.run_pass()
        await trainer.send("draft")
        await h.settle()
        assert h.revision_status("step-2")["phase"] == "Succeeded"


async def test_nccl_without_a_rendezvous_the_push_fails_at_its_deadline(tmp_path: pathlib.Path) -> None:
    """A trainer that never says where to join leaves pods paused for nothing: after pushSeconds the
    attempt fails (NoRendezvous) and, with no retries left, the revision rolls back by path."""
    async with harness(
        tmp_path,
        replicas=2,
        mode="inflight",
        fleet_extra=NCCL_FLEET,
        max_retries=0,
        timeouts={"wakeSeconds": 30, "loadSeconds": 30, "pushSeconds": 1},
    ) as h:
        pushed_revision(h, "step-1", 1)
        await h.run_pass()
        await asyncio.sleep(1.1)  # pushSeconds, waiting for a rendezvous that does not come
        await h.settle(require_idle=False, max_passes=30)
        status = h.revision_status("step-1")
        assert status["phase"] == "RolledBack", status
        assert "NoRendezvous" in str(status.get("message")), status
        assert all(not init_calls(h.engine_log(p)) for p in h.pods)
        assert all(not h.served(p).paused for p in h.pods)


async def test_a_pass_waiting_on_the_trainer_takes_its_marks_without_reading_the_fleet_again(
    tmp_path: pathlib.Path,
) -> None:
    """bench/results/push_overhead.md: after each trainer mark a new pass re-listed the pods and re-read every
    engine before its first step (0.3-0.9 s at 64 pods, twice per push). The marks are only the trainer's
    word that it sent; what the engines hold is already known from the pass's own reads. A pass waiting on
    the trainer takes the marks the watch delivers and ends the sessions at once: no engine is read between
    a mark and its finish_weight_update, and the whole push is one pass."""
    async with harness(tmp_path, replicas=3, mode="inflight", fleet_extra=PUSH_FLEET) as h:
        h.memory.marks_delivered = True  # as the operator's revision_changed handler does

        def deliver(target: str, value: str) -> None:
            Trainer.mark(trainer, target, value)
            body = h.kube.peek(common.API_VERSION, "WeightRevision", h.namespace, "step-1")
            assert body is not None
            h.memory.kick_marks("step-1", push.mark_annotations(body["metadata"]["annotations"]))

        pushed_revision(h, "step-1", 1)
        trainer = Trainer(h, "step-1", 1)
        trainer.mark = deliver  # type: ignore[method-assign]
        passes = len(h.outcomes)
        task = asyncio.create_task(h.run_pass())
        for count, target in enumerate(("verifier", "draft"), start=1):
            for _ in range(500):
                if len(trainer.sessions(target)) == 3 or task.done():
                    break
                await asyncio.sleep(0.01)
            assert not task.done(), "the pass ended instead of waiting for the trainer"
            seq = {p: len(h.engine_log(p)) for p in h.pods}
            assert await trainer.send(target) == 3
            await h.wait_for(
                h.pods,
                lambda log, n=count: sum(call_name(e) == "finish_weight_update" for e in ok_calls(log)) >= n,
            )
            for pod in h.pods:
                after = [call_name(e) for e in h.engine_log(pod)[seq[pod] :]]
                finish = next(i for i, name in enumerate(after) if name == "finish_weight_update")
                assert "rolloutfleet_state" not in after[:finish], (pod, after)
        await asyncio.wait_for(task, 20)
        assert len(h.outcomes) == passes + 1  # the whole push in one pass
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert all(h.served(p) == (1, 1, False) for p in h.pods)


async def test_a_push_whose_fleet_grew_past_the_handshake_limit_is_refused_and_its_pods_return(
    tmp_path: pathlib.Path,
) -> None:
    """docs/push.md: a fleet scaled past what a pushed revision's status can list while the push is under way
    has that revision refused at the next pass (``validation._check_push_lists``), as for any revision its fleet
    no longer admits. Its pods had opened sessions: each is abandoned and, since a session ended with nothing
    received leaves its target destroyed, the pod is restarted rather than resumed on it (as when a trainer
    never sends); recreated, each serves the revision the fleet served, verified, behind an open gate."""
    async with harness(tmp_path, replicas=3, mode="inflight", fleet_extra=PUSH_FLEET) as h:
        h.apply_revision("step-1", 1)  # a path revision first: what the pods return to
        await h.settle()
        pushed_revision(h, "step-2", 2)
        await h.run_pass()  # opens the verifier sessions, then waits for the trainer
        assert len(Trainer(h, "step-2", 2).sessions("verifier")) == 3
        assert all(h.served(p).paused for p in h.pods)
        fleet = h.fleet_manifest()
        fleet["spec"]["replicas"] = 20_000  # the StatefulSet's new pods would come later: these three stay
        h.kube.apply_user(fleet)
        await h.settle(max_passes=5, require_idle=False)
        status = h.revision_status("step-2")
        assert (status["phase"], status.get("reason")) == ("Failed", "ValidationFailed"), status
        assert "spec.verifier.push: the fleet has 20000 pods" in status["message"], status["message"]
        for pod in list(h.pods):
            assert h.kube.peek("v1", "Pod", h.namespace, pod) is None, pod  # restarted, never resumed
            names = [call_name(e) for e in ok_calls(h.engine_log(pod))]
            assert "resume" not in names[names.index("rolloutfleet_push_begin:verifier") :], pod
            await recreate(h, pod)
        # Not idle while 19,997 of the fleet's pods are still to come (no StatefulSet controller here): a few passes.
        await h.settle(max_passes=10, require_idle=False)
        for pod in h.pods:
            assert h.served(pod) == (1, 1, False), pod
            body = h.kube.peek("v1", "Pod", h.namespace, pod)
            assert body is not None
            gates = {c["type"]: c["status"] for c in body["status"]["conditions"]}
            assert gates.get("rolloutfleet.io/weights-ready") == "True", (pod, gates)
