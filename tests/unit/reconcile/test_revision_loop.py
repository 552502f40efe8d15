"""The revision loop's stops (issue 15 defect 14) and a revision deleted while it rolls (defect 17).

Same harness as ``test_reconcile_rollout``. Loads are held with ``hold_loads`` so that a stop or a delete
lands exactly while a load runs; every outcome is read from the engines' call logs and the fake API.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time
from typing import Any
from unittest import mock

import kopf
import pytest
from kube_fakes import FakeCall
from reconcile_fakes import Harness, call_name, count_observations, harness, loads, ok_calls, pod_of

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.handlers import wiring
from rolloutfleet.reconcile import revision, revision_loop, status_writes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
log = logging.getLogger(__name__)


class Stop:
    """A ``StopSignal`` the test raises: the operator exiting, or the fleet deleted."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.fleet_deleted = False

    def stopping(self) -> bool:
        return self.event.is_set()

    def deleted(self) -> bool:
        return self.fleet_deleted

    async def wait(self) -> None:
        await self.event.wait()


def started_loads(entries: list[dict[str, object]]) -> int:
    return sum(1 for e in entries if e.get("step") == "rolloutfleet_load" and "fault" in e)


async def _loop_mid_load(h: Harness) -> tuple[asyncio.Task[None], asyncio.Event, Stop]:
    """The loop started, revision step-1 applied, and its load on the first pod held once it began: (the loop,
    the gate that releases the load, the loop's stop signal)."""
    pod = h.pods[0]
    gate = h.hold_loads(pod)
    h.mark_arrivals("rolloutfleet_load")
    stop = Stop()
    loop = asyncio.create_task(revision_loop.run(h.ctx, h.namespace, h.fleet, h.memory, stop, log))
    h.apply_revision("step-1", 1)
    h.memory.kick.set()
    await h.wait_for([pod], lambda entries: started_loads(entries) >= 1)
    return loop, gate, stop


async def _stop_mid_load(tmp_path: pathlib.Path, *, deleted: bool) -> tuple[bool, list[str]]:
    async with harness(tmp_path, replicas=2) as h:
        pod = h.pods[0]
        loop, gate, stop = await _loop_mid_load(h)
        stop.fleet_deleted = deleted
        stop.event.set()
        if deleted:  # it must return while the load is still held (bounded only so a hang fails)
            await asyncio.wait({loop}, timeout=10)
        else:
            await asyncio.sleep(0.05)  # the loop gets every chance to return early; it must not
        returned_before_release = loop.done()
        gate.set()
        await asyncio.wait_for(loop, timeout=10)
        calls = [str(e["step"]) for e in h.engine_log(pod) if "status" in e]
        return returned_before_release, calls


async def test_operator_stop_drains_the_running_load(tmp_path: pathlib.Path) -> None:
    """Issue 15 defect 14: a SIGTERM mid-load neither cuts the load nor starts the next step. The request that
    was running finishes (since the draft's load rides in the verifier's request, transaction.chain: both
    loads), and nothing is sent after it."""
    returned_early, calls = await _stop_mid_load(tmp_path, deleted=False)
    assert not returned_early, "the loop returned while a load was still running"
    assert calls[-1] == "rolloutfleet_load", calls  # the request's loads completed and were the last calls
    assert "resume" not in calls and calls.count("rolloutfleet_load") == 2, calls
    assert calls[-3:] == ["wake_up", "rolloutfleet_load", "rolloutfleet_load"], calls  # that request's end


async def test_fleet_deletion_does_not_wait_for_the_running_load(tmp_path: pathlib.Path) -> None:
    """A deleted fleet's pods go with it: holding its deletion until a load ends would only delay it."""
    returned_early, _calls = await _stop_mid_load(tmp_path, deleted=True)
    assert returned_early


async def _kicked_mid_load(tmp_path: pathlib.Path, about: tuple[str, int] | None) -> tuple[int, list[str]]:
    """A revision rolled by the loop; while a load is held, a kick (``about``: what it was seen on). Returns
    the passes that started before the revision was Succeeded, and the held pod's engine calls."""
    async with harness(tmp_path, replicas=2) as h:
        pod = h.pods[0]
        gate = h.hold_loads(pod)
        h.mark_arrivals("rolloutfleet_load")
        stop, passes = Stop(), []
        original = revision_loop.revision.reconcile_revisions

        async def counted(*args: Any, **kwargs: Any) -> Any:
            status = h.kube.peek("rolloutfleet.io/v1alpha1", "WeightRevision", h.namespace, "step-1")
            passes.append(((status or {}).get("status") or {}).get("phase"))
            return await original(*args, **kwargs)

        with mock.patch.object(revision_loop.revision, "reconcile_revisions", counted):
            loop = asyncio.create_task(revision_loop.run(h.ctx, h.namespace, h.fleet, h.memory, stop, log))
            h.apply_revision("step-1", 1)
            h.memory.kick_all()  # what starts the pass (kopf's handler, or the loop's own idle pass)
            await h.wait_for([pod], lambda entries: started_loads(entries) >= 1)
            h.memory.kick_all(about)
            gate.set()
            await h.until(lambda: h.revision_status("step-1").get("phase") == "Succeeded", "Succeeded", give_up=20)
            stop.event.set()
            await asyncio.wait_for(loop, timeout=10)
        return sum(1 for phase in passes if phase != "Succeeded"), [str(e["step"]) for e in h.engine_log(pod)]


async def test_the_kick_of_the_revisions_own_creation_does_not_start_its_pass_over(tmp_path: pathlib.Path) -> None:
    """Issue 18: the loop's own pass can pick a new revision up before kopf's handler for its creation runs;
    that handler's kick then ended the running pass, and the next read every engine again (3 of ~40 device
    revisions at 1,024 pods: two passes, every engine read twice, 1.5-2.5 s more). A kick about the creation
    of the revision the pass carries out, at the generation it read, tells it nothing: it goes on. Any other
    kick still ends it (the control below; a deleted revision: the test after)."""
    passes, _ = await _kicked_mid_load(tmp_path / "own", ("step-1", 1))
    assert passes == 1
    passes, calls = await _kicked_mid_load(tmp_path / "other", None)
    assert passes == 2, calls  # the pass ended after the running load, and a new one finished the revision


async def test_only_the_creation_handler_scopes_its_kick_to_the_revision(tmp_path: pathlib.Path) -> None:
    """The handler side of the rule above: kopf's creation of a revision kicks about that revision at its
    generation (a pass carrying it out goes on); an update (a spec change, labels, annotations other than the
    trainer's marks) kicks as before, ending the pass."""
    async with harness(tmp_path, replicas=1) as h:
        h.apply_revision("step-1", 1)
        stored = h.kube.peek("rolloutfleet.io/v1alpha1", "WeightRevision", h.namespace, "step-1")
        assert stored is not None
        memo = kopf.Memo(ctx=h.ctx)
        kwargs: dict[str, Any] = {"memo": memo, "namespace": h.namespace, "spec": stored["spec"], "body": stored}
        h.memory.working_on = ("step-1", stored["metadata"]["generation"])
        await wiring.revision_changed(diff=(), reason="create", **kwargs)
        assert h.memory.kick.is_set() and h.memory.stale_kick()
        await wiring.revision_changed(
            diff=(("change", ("metadata", "labels", "team"), "a", "b"),), reason="update", **kwargs
        )
        assert h.memory.kick.is_set() and not h.memory.stale_kick()
        h.memory.clear_kick()
        h.memory.working_on = ("step-1", stored["metadata"]["generation"] - 1)  # a pass that read it before a change
        await wiring.revision_changed(diff=(), reason="create", **kwargs)
        assert not h.memory.stale_kick()


async def test_deleting_a_revision_mid_rollout_returns_every_pod_to_the_served_revision(
    tmp_path: pathlib.Path,
) -> None:
    """Issue 15 defect 17 (and the soak's GitOps prune): a revision deleted before it completed is cancelled,
    whatever step its pods were at: every pod ends on the revision the fleet served, verified, and no pod
    stays Ready on the deleted revision's weights."""
    async with harness(tmp_path, replicas=4, rollout="Rolling", max_unavailable=2) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        gate = h.hold_loads(h.pods[3])
        h.apply_revision("step-2", 2)

        async def prune_once_two_pods_moved() -> None:
            await h.wait_for(h.pods[:2], lambda entries: bool(loads(entries, revision=2)))
            h.delete_revision("step-2")
            gate.set()

        await asyncio.gather(h.settle(require_idle=False, max_passes=3), prune_once_two_pods_moved())
        await h.settle()
        assert {p: h.served(p) for p in h.pods} == dict.fromkeys(h.pods, (1, 1, False))
        status = h.fleet_status()
        assert status["currentRevision"] == 1 and status.get("targetRevision") is None
        for pod in h.pods:
            body = h.kube.peek("v1", "Pod", h.namespace, pod)
            assert body is not None
            gates = {c["type"]: c["status"] for c in body["status"]["conditions"]}
            assert gates.get("rolloutfleet.io/weights-ready") == "True", (pod, gates)


async def _first_revision_deleted_before_its_record(h: Harness) -> None:
    """The fleet's first revision, deleted after its pods resumed on it and were routed, right before the fleet
    recorded it as served (a GitOps prune at the worst moment)."""
    original = status_writes.still_exists

    async def deleted_just_before_the_record(ctx: Any, rev: Any) -> bool:
        h.delete_revision("step-1")
        return await original(ctx, rev)

    with mock.patch.object(status_writes, "still_exists", deleted_just_before_the_record):
        h.apply_revision("step-1", 1)
        await h.settle(require_idle=False, max_passes=1)
    assert {p: h.served(p).verifier for p in h.pods} == dict.fromkeys(h.pods, 1)  # resumed on it, routed


async def test_a_first_revision_deleted_after_its_gates_opened_returns_every_pod_to_the_initial_weights(
    tmp_path: pathlib.Path,
) -> None:
    """Found by the smoke soak once it ran again: a fleet's first revision deleted after its pods resumed and
    their gates opened, right before the fleet recorded it. The fleet serves its initial weights, whose pass
    read only the pods not routed (a fleet at rest costs no reads), so every pod stayed Ready on the deleted
    revision's weights (soak check c) until it was applied again. Every pod must go back to the initial
    weights, and only then be routed."""
    async with harness(tmp_path, replicas=3) as h:
        await _first_revision_deleted_before_its_record(h)
        await h.settle()
        # (0: the initial checkpoint loaded back, ``transaction.INITIAL_REVISION``)
        assert {p: h.served(p).verifier for p in h.pods} == dict.fromkeys(h.pods, 0), "still on the deleted one"
        assert h.fleet_status().get("currentRevision") is None
        for pod in h.pods:
            body = h.kube.peek("v1", "Pod", h.namespace, pod)
            assert body is not None
            gates = {c["type"]: c for c in body["status"]["conditions"]}
            assert gates["rolloutfleet.io/weights-ready"]["status"] == "True", (pod, gates)  # on revision 0, verified


async def test_a_deleted_first_revision_s_target_is_cleared_only_once_no_pod_is_routed_on_it(
    tmp_path: pathlib.Path,
) -> None:
    """Found by the smoke soak (bench/results/soak_smoke.md: check c, one sample on every pod 0.3 s after the
    fleet's first revision was pruned). With no revision left, the pass cleared ``targetRevision`` first and
    then read the engines and closed the gates of the pods on the deleted weights: in between, the fleet said
    it served its initial weights and moved nowhere while its pods were Ready on another revision. The fleet
    status must not say "nothing is moving" while a pod is routed on weights the fleet does not serve: the
    target is cleared once no pod is, and while pods are moved back it names where they go."""
    async with harness(tmp_path, replicas=3) as h:
        await _first_revision_deleted_before_its_record(h)
        seen: list[str] = []

        async def each_write(_call: Any) -> None:  # the stored state between any two writes
            status = h.fleet_status()
            if status.get("targetRevision") is not None or status.get("currentRevision") is not None:
                return
            for pod in h.pods:
                body = h.kube.peek("v1", "Pod", h.namespace, pod)
                assert body is not None
                gate = {c["type"]: c["status"] for c in body["status"]["conditions"]}["rolloutfleet.io/weights-ready"]
                if gate == "True" and h.served(pod).verifier == 1:
                    seen.append(pod)

        h.kube.before_call = each_write
        await h.settle()
        assert {p: h.served(p).verifier for p in h.pods} == dict.fromkeys(h.pods, 0)
        assert h.fleet_status().get("targetRevision") is None
        assert seen == [], f"routed on the deleted revision while the fleet moved nowhere: {sorted(set(seen))}"


async def test_a_restarted_engine_is_kept_out_of_the_service_until_caught_up(tmp_path: pathlib.Path) -> None:
    """Issue 15 defect 6 (and the soak's crash finding): a container that restarts comes back on the
    initial checkpoint while its pod's gate, set for its predecessor, still says True. Its process starts
    un-admitted, so its readiness probe fails at once; the next pass moves it to the served revision (outside
    any rollout budget) and only then admits it again."""
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        pod = h.pods[1]
        engine = h.engine(pod)
        assert engine.admitted
        await engine.crash()
        await engine.restart()
        assert h.served(pod).verifier is None and not engine.admitted  # initial weights, probe failing
        # What the kubelet reports of it: the restart (its failing probe would keep the fake pod un-Ready
        # after the admit too: the fake kubelet does not probe).
        h.kube.set_pod(h.namespace, pod, restarted=True)
        await h.settle()
        assert h.served(pod) == (1, 1, False) and engine.admitted
        body = h.kube.peek("v1", "Pod", h.namespace, pod)
        assert body is not None
        gate = {c["type"]: c["status"] for c in body["status"]["conditions"]}["rolloutfleet.io/weights-ready"]
        assert gate == "True"


async def test_a_fleet_at_rest_reads_its_engines_only_once_a_pod_changed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18: a fleet at rest on a served revision was read whole at every idle pass (1,024 reads every 5 s,
    and a revision created meanwhile waited for them) to catch engines restarted on their initial weights. A
    restart shows on the pod (the kubelet counts it, a replaced pod has another uid, a process not admitted
    fails its probe), so passes at rest read no engine while the pods show no change, read the whole fleet
    once one does, and again once ``REST_READ_SECONDS`` passed whatever the pods show."""
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("step-1", 1)
        await h.settle()  # its last pass, at rest, read every engine
        h.observations.clear()
        for _ in range(3):
            await h.settle()
        assert sum(h.observations.values()) == 0, h.observations
        h.kube.set_pod(h.namespace, h.pods[0], restarted=True)
        await h.settle()
        assert h.observations == dict.fromkeys(h.pods, 1)
        h.observations.clear()
        await h.settle()
        assert sum(h.observations.values()) == 0, h.observations
        monkeypatch.setattr(revision, "REST_READ_SECONDS", 0.0)
        await h.settle()
        assert h.observations == dict.fromkeys(h.pods, 1)


async def test_a_fleet_at_rest_on_its_initial_weights_does_nothing_while_every_pod_is_routed(
    tmp_path: pathlib.Path,
) -> None:
    """Issue 18: a fleet still on its initial weights (before its first revision) read no engine at rest, but each
    idle pass still made a client for every engine, scanned every pod and rebuilt the fleet's status (a read of
    its StatefulSet and a walk over every pod; at 1,024 pods a pass every 5 s). With every pod routed and no target
    to clear, a pass at rest has nothing to do, as on a served revision; a pod that changes is read again."""
    async with harness(tmp_path, replicas=3) as h:
        await h.settle()  # the first pass reads every engine and opens the gates
        assert h.fleet_status().get("targetRevision") is None
        h.observations.clear()
        before = len(h.kube.calls)
        for _ in range(3):
            await h.settle()
        calls = h.kube.calls[before:]
        assert sum(h.observations.values()) == 0, h.observations
        # No status rebuilt (its read of the StatefulSet) and nothing written; the pass's own reads stay.
        assert [(c.verb, c.kind) for c in calls if c.kind == "StatefulSet" or c.verb not in ("get", "list")] == []
        h.kube.set_pod(h.namespace, h.pods[0], restarted=True)
        await h.settle()
        assert h.observations == dict.fromkeys(h.pods, 1)


async def test_a_restart_the_pods_do_not_show_is_caught_by_the_full_read(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net under the test above: an engine back on its initial weights with nothing on its pod to
    say so (a kubelet that did not report it) is found by the full read ``REST_READ_SECONDS`` after the last
    one, moved back to the served revision and only then admitted."""
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        engine = h.engine(h.pods[2])
        await engine.crash()
        await engine.restart()
        await h.settle()
        assert h.served(h.pods[2]).verifier is None and not engine.admitted  # not seen yet, and not admitted
        monkeypatch.setattr(revision, "REST_READ_SECONDS", 0.0)
        await h.settle()
        assert h.served(h.pods[2]) == (1, 1, False) and engine.admitted


async def test_the_status_claims_nothing_for_a_restarted_container_until_it_is_read(tmp_path: pathlib.Path) -> None:
    """A container the kubelet restarted runs a new engine process on the initial checkpoint (like a pod
    recreated under the same name): the fleet's status must not show what the process before it served, even
    before any pass read it (the fleet's own reconcile writes the status too)."""
    async with harness(tmp_path, replicas=2) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        pod = h.pods[1]
        await h.engine(pod).crash()
        await h.engine(pod).restart()
        h.kube.set_pod(h.namespace, pod, restarted=True)
        await h.reconcile_fleet()
        entries = {p["name"]: p for p in h.fleet_status()["pods"]}
        assert entries[pod].get("revision") is None, entries[pod]
        assert entries[h.pods[0]].get("revision") == 1  # its neighbour's claim stands


async def test_a_slow_starting_pod_is_waited_for_not_failed(tmp_path: pathlib.Path) -> None:
    """Issue 15 defect 10: a pod Running but whose engine is not up yet (a large model loads for minutes)
    was admitted, failed every step and rolled the revision back long before its startup timeout. Now it is
    neither moved nor failed: the revision waits for it, and moves it once its engine is up."""
    async with harness(tmp_path, replicas=3) as h:
        starting = h.pods[2]
        h.kube.set_pod(h.namespace, starting, ready=False)  # startup probe not passed yet
        before = len(h.engine_log(starting))
        h.apply_revision("step-1", 1)
        outcomes = await h.settle(max_passes=10, require_idle=False)
        assert not any(o.idle for o in outcomes)  # it waits: not done, not failed
        status = h.revision_status("step-1")
        assert status["phase"] == "Progressing" and not status.get("failures"), status
        assert all(e.get("attempts", 0) == 0 for e in status.get("pods", []))
        assert [e for e in h.engine_log(starting)[before:] if "status" in e] == []  # never called
        h.kube.set_pod(h.namespace, starting, ready=True)  # its engine is up
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert {p: h.served(p) for p in h.pods} == dict.fromkeys(h.pods, (1, 1, False))


async def test_a_missing_checkpoint_fails_before_any_pod_leaves_service(tmp_path: pathlib.Path) -> None:
    """Issue 15 ("pre-flight"): a revision whose checkpoint is missing took the whole AllAtOnce demo fleet
    out of service (sleep, failed load, reload of the previous revision). The engines check the checkpoint's
    headers first: the revision is Failed/PreflightFailed and no engine was paused."""
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        before = {p: len(h.engine_log(p)) for p in h.pods}
        manifest = h.revision_manifest("step-2", 2, digest=False)
        manifest["spec"]["verifier"]["path"] = str(h.root / "policy" / "step-2-missing" / "verifier")
        manifest["spec"]["draft"]["path"] = str(h.root / "policy" / "step-2-missing" / "draft")  # both refused
        h.kube.apply_user(manifest)
        await h.settle()
        status = h.revision_status("step-2")
        assert (status["phase"], status["reason"]) == ("Failed", "PreflightFailed"), status
        assert "3/3 engines" in status["message"] and "no pod touched" in status["message"]
        assert {(f["step"], f["reason"]) for f in status["failures"]} == {("Preflight", "PreflightFailed")}
        for pod in h.pods:
            assert [e["step"] for e in h.engine_log(pod)[before[pod] :] if "status" in e] == [], pod
        assert {p: h.served(p) for p in h.pods} == dict.fromkeys(h.pods, (1, 1, False))


async def test_each_engine_is_read_right_after_its_own_pre_flight(tmp_path: pathlib.Path) -> None:
    """Issue 18: at 1,024 pods on 16 cores the pre-flight took 0.30 s and the first read of the engines 0.15 s
    after it, both before any pod moves. Both only read, so each engine is read with its own pre-flight (in its
    request), not after the whole fleet's: one engine's pre-flight is held until the others have been read (read
    after every pre-flight, as before, they never would be) and its own read waits for it; the revision then
    completes from those answers."""
    async with harness(tmp_path, replicas=3) as h:
        arrived, held = asyncio.Event(), asyncio.Event()
        before: dict[str, int] = {}  # each engine's reads when the held pre-flight arrived

        async def release_once_the_others_were_read() -> None:
            await arrived.wait()
            others = ["policy-1", "policy-2"]
            await h.until(lambda: all(h.observations[p] > before.get(p, 0) for p in others), "the others read")
            assert h.observations["policy-0"] == before.get("policy-0", 0)  # its read waits for its pre-flight
            held.set()

        with count_observations(h):
            original = EngineClient.preflights_then_observe  # the counting one

            async def preflights(client: EngineClient, *args: Any, **kwargs: Any) -> Any:
                if pod_of(h, client) == "policy-0":
                    before.update(h.observations)
                    arrived.set()
                    await held.wait()
                return await original(client, *args, **kwargs)

            with mock.patch.object(EngineClient, "preflights_then_observe", preflights):
                h.apply_revision("step-1", 1)
                await asyncio.gather(h.settle(), release_once_the_others_were_read())
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        assert {p: h.served(p) for p in h.pods} == dict.fromkeys(h.pods, (1, 1, False))


async def test_finished_revisions_are_not_read_again(tmp_path: pathlib.Path) -> None:
    """Issue 15 defect 13 (memory): a trainer publishes one revision per step, and every pass listed them
    all, so the operator's memory grew with the namespace's history (the soak: +50 % RSS from revision 20
    to 200). A finished revision is labelled settled and the passes list only the others; whatever is
    settled is never needed again (what is served is in the fleet's status)."""
    async with harness(tmp_path, replicas=2) as h:
        selectors: list[str] = []
        original = h.kube.list

        async def list_(api_version: str, kind: str, namespace: str | None, label_selector: str = "") -> object:
            if kind == "WeightRevision":
                selectors.append(label_selector)
            return await original(api_version, kind, namespace, label_selector)

        h.kube.list = list_  # type: ignore[method-assign,assignment]
        for r in (1, 2, 3):
            h.apply_revision(f"step-{r}", r)
            await h.settle()
        assert selectors and set(selectors) == {"rolloutfleet.io/settled!=true"}
        for r in (1, 2, 3):
            body = h.kube.peek("rolloutfleet.io/v1alpha1", "WeightRevision", h.namespace, f"step-{r}")
            assert body is not None and body["metadata"]["labels"]["rolloutfleet.io/settled"] == "true"
        listed = h.kube.find("rolloutfleet.io/v1alpha1", "WeightRevision", h.namespace, "rolloutfleet.io/settled!=true")
        assert listed == []
        h.apply_revision("step-4", 4)
        await h.settle()
        assert h.fleet_status()["currentRevision"] == 4 and h.fleet_status()["served"]["name"] == "step-4"


async def test_the_status_claims_nothing_for_an_engine_that_does_not_answer(tmp_path: pathlib.Path) -> None:
    """Issue 15 soak, check (d): a crashed engine kept its last revision in the fleet status for as long as it
    was down (a crashed engine comes back on the initial checkpoint, so the old claim was wrong twice)."""
    async with harness(tmp_path, replicas=2) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        pod = h.pods[0]
        await h.engine(pod).crash()
        h.kube.set_pod(h.namespace, pod, restarted=True)  # the kubelet restarts it (it stays down here)
        await h.settle(max_passes=1, require_idle=False)
        entry = next(p for p in h.fleet_status()["pods"] if p["name"] == pod)
        assert entry.get("revision") is None and entry.get("step") == "Unreachable", entry


def is_target_write(call: FakeCall) -> bool:
    """The pass's write of the fleet's ``targetRevision`` for revision 1."""
    body = call.body if call.verb == "patch_status" and call.kind == "RolloutFleet" else None
    return body is not None and body["status"].get("targetRevision") == 1


async def test_the_target_is_written_beside_the_pre_flight_and_before_any_pause(tmp_path: pathlib.Path) -> None:
    """The fleet's ``targetRevision`` goes out beside the pre-flight (which only reads) instead of before it:
    one round trip less between a revision's creation and its first pause (issue 18). It still lands before
    any engine moves: a pass that had paused engines for a target nobody recorded would show the fleet
    moving nowhere. The write is held here until every pre-flight has run; no pause may come before it."""
    async with harness(tmp_path, replicas=3) as h:
        preflights: list[int] = []
        landed: list[int] = []
        original = EngineClient.preflights_then_observe

        async def preflight(client: EngineClient, *args: Any, **kwargs: Any) -> Any:
            preflights.append(h.next_order())
            return await original(client, *args, **kwargs)

        async def slow_target(call: FakeCall) -> None:
            if is_target_write(call):
                await h.until(lambda: len(preflights) == 3, "every pre-flight while the target is written")
                landed.append(h.next_order())

        h.kube.before_call = slow_target
        with mock.patch.object(EngineClient, "preflights_then_observe", preflight):
            h.apply_revision("step-1", 1)
            await h.settle()
        pauses = [e["order"] for log in h.logs().values() for e in ok_calls(log) if call_name(e).startswith("pause")]
        assert len(landed) == 1 and len(preflights) == 3 and len(pauses) == 3
        assert max(preflights) < landed[0] < min(pauses)
        assert h.revision_status("step-1")["phase"] == "Succeeded"


async def test_a_target_that_cannot_be_written_moves_no_engine(tmp_path: pathlib.Path) -> None:
    """The other half of the rule above: the target's write failing (here, the API server refusing it) ends
    the pass with its error before any engine pauses, whatever the pre-flight beside it found; the next pass
    starts again from the engines."""
    async with harness(tmp_path, replicas=3) as h:

        async def refuse_target(call: FakeCall) -> None:
            if is_target_write(call):
                raise KubeError(500, "etcdserver: request timed out")

        h.kube.before_call = refuse_target
        h.apply_revision("step-1", 1)
        with pytest.raises(KubeError):
            await h.run_pass()
        assert not [e for log in h.logs().values() for e in ok_calls(log) if call_name(e).startswith("pause")]
        h.kube.before_call = None
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"


async def test_a_pass_logs_when_it_reached_each_phase(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """Where a revision's time went, from the operator's own log (the benchmark reads it: ``bench/
    rollout_overhead.py``, ``PASS_LINE``): each phase once, in the order a revision goes through them."""
    phases = [
        "pre-flight",
        "first step",
        "first resume",
        "last resume answered",
        "last step ended",
        "all done",
        "gates written",
        "fleet recorded",
        "succeeded",
    ]
    with caplog.at_level(logging.INFO, logger="rolloutfleet.reconcile.rollout_pass"):
        async with harness(tmp_path, replicas=2) as h:
            h.apply_revision("step-1", 1)
            await h.settle()
    # The pass that completed the revision (a pass that ends early, e.g. kicked, logs the phases it reached).
    line = next(
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("pass step-1:") and ", succeeded " in r.getMessage()
    )
    reached, started = line.split("; at ", 1)[1].rstrip(")").split("; started at monotonic ")
    marks = reached.split(", ")
    assert [m.rsplit(" ", 1)[0] for m in marks] == phases, line
    times = [float(m.rsplit(" ", 1)[1].rstrip("s")) for m in marks]
    assert times == sorted(times), line
    # The pass's start on the machine's clock, which the benchmark's /proc readings share (``--cpu-timeline``).
    assert 0 < time.monotonic() - float(started) < 60, line


async def test_full_collections_are_put_off_while_a_pass_rolls_a_revision(tmp_path: pathlib.Path) -> None:
    """The loop tells the process's ``FullCollections`` when each pass starts and ends (``ctx.on_pass``): while a
    revision's load runs no full pass of the collector may start (at 8,192-16,384 pods they stalled the event
    loop for seconds mid-revision), and when the loop returns every pass it announced has ended, so the
    thresholds are back as they were."""
    import gc

    from rolloutfleet.handlers import gc_tuning

    threshold = gc.get_threshold()
    collections = gc_tuning.FullCollections()
    seen: list[bool] = []

    def on_pass(running: bool) -> None:
        seen.append(running)
        collections.enter() if running else collections.leave()

    try:
        async with harness(tmp_path, replicas=2) as h:
            h.ctx.on_pass = on_pass
            loop, gate, stop = await _loop_mid_load(h)
            assert collections.deferring and gc.get_threshold()[2] > threshold[2]
            gate.set()
            await h.until(lambda: h.revision_status("step-1").get("phase") == "Succeeded", "Succeeded", give_up=20)
            stop.event.set()
            await asyncio.wait_for(loop, timeout=10)
        assert seen.count(True) == seen.count(False) >= 1, seen
        assert not collections.deferring and gc.get_threshold() == threshold
    finally:
        gc.set_threshold(*threshold)
