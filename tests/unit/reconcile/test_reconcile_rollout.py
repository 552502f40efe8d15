"""The revision loop end to end in one process: ``FakeKube``, simulated engines, real reconcile passes.

Baseline behaviour that holds today. Orders (barrier, budget) are read from the engines' call logs,
whose entries share one harness-wide ``order`` counter; where a test holds an engine's loads, it is so
that a broken rule would show in that order, never to make it hold.
"""

from __future__ import annotations

import asyncio
import collections
import pathlib

import pytest
from kube_fakes import FakeCall
from reconcile_fakes import (
    WRONG_DIGEST,
    arrivals,
    call_name,
    condition,
    harness,
    loaded,
    loads,
    max_overlap,
    ok_calls,
    out_of_service,
    served_revisions,
    skip_without_ipv6_loopback,
)

from rolloutfleet.reconcile import rollout_pass
from rolloutfleet.sim.config import FaultKind, FaultRule

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60), pytest.mark.both_loops]  # a hang fails, never blocks the run


async def test_all_at_once_sleep_mode_moves_every_engine_and_records_success(tmp_path: pathlib.Path) -> None:
    """The basic promise of a WeightRevision (DESIGN §3/§4): every engine ends up serving the revision's
    verifier *and* draft, verified, back in service; the revision says Succeeded/Ready and the fleet's
    currentRevision names it, so ``kubectl wait --for=condition=Ready`` and the fleet's columns tell the truth.
    """
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("step-1", 1)
        await h.settle()

        for pod in h.pods:
            assert h.served(pod) == (1, 1, False), pod
            names = [call_name(e) for e in ok_calls(h.engine_log(pod))]
            # The sleep-mode transaction, in order (DESIGN §4), inside the engine's admission: admitted when
            # the fleet came up on its initial weights, withdrawn (out of the Service) before the pause,
            # admitted again only after it resumed on the verified revision.
            assert names == [
                "admit",
                "withdraw",
                "pause:keep",
                "sleep:2",
                "wake_up:weights",
                "rolloutfleet_load:verifier",
                "rolloutfleet_load:draft",
                "update_weight_version",
                "wake_up:kv_cache",
                "resume",
                "admit",
            ], (pod, names)
        status = h.revision_status("step-1")
        assert status["phase"] == "Succeeded"
        ready = condition(status, "Ready")
        assert ready is not None and ready["status"] == "True"
        assert h.fleet_status()["currentRevision"] == 1
        assert h.fleet_status().get("targetRevision") is None
        assert [p["revision"] for p in h.fleet_status()["pods"]] == [1, 1, 1]


async def test_a_pod_with_an_ipv6_address_is_updated_and_routed(tmp_path: pathlib.Path) -> None:
    """On an IPv6 cluster every pod's status.podIP is an IPv6 address. The revision loop used to write it bare
    into the engine's URL, so every pass failed before its first request: such a fleet never left its initial
    weights and its pods never became Ready. The engine here listens on ``::1``, as a pod's engine on its IPv6
    address (started with ``--host ::``: docs/install.md)."""
    skip_without_ipv6_loopback()
    async with harness(tmp_path, replicas=1, ipv6=True) as h:
        (pod,) = h.pods
        h.apply_revision("step-1", 1)
        await h.settle()
        assert h.served(pod) == (1, 1, False)
        assert h.revision_status("step-1")["phase"] == "Succeeded"
        (entry,) = h.fleet_status()["pods"]
        assert (entry["ip"], entry["revision"], entry["ready"]) == ("::1", 1, True), entry


async def test_all_at_once_barrier_no_engine_resumes_before_every_engine_loaded(tmp_path: pathlib.Path) -> None:
    """AllAtOnce means no pod serves the new revision while another still serves (or loads) the old one:
    an RL step's rollouts must come from one policy. So every engine's resume composition (its first call,
    ``wake_up:kv_cache``) must arrive after the last load of every engine finished. One engine's loads are
    held until every other engine waits to resume, so without the barrier those would resume first.
    """
    async with harness(tmp_path, replicas=4) as h:
        slow, others = "policy-2", [p for p in h.pods if p != "policy-2"]
        gate = h.hold_loads(slow)
        h.mark_arrivals("wake_up:kv_cache", "resume")

        async def release_when_the_others_wait() -> None:
            await h.wait_for(others, loaded)
            gate.set()

        h.apply_revision("step-1", 1)
        await asyncio.gather(h.settle(), release_when_the_others_wait())

        logs = h.logs()
        last_load = max(e["order"] for log in logs.values() for e in loads(log, revision=1))
        first_resume = min(e["order"] for log in logs.values() for e in arrivals(log, "wake_up:kv_cache"))
        assert first_resume > last_load
        assert all(h.served(p) == (1, 1, False) for p in h.pods)


async def test_rolling_max_unavailable_one_never_has_two_engines_out_of_service(tmp_path: pathlib.Path) -> None:
    """Rolling with maxUnavailable=1 is the capacity promise: at most one engine is out of service at any
    moment, so the fleet keeps N-1 engines generating. Read from the logs: an engine is out of service from
    its pause to its resume; no two such intervals overlap.
    """
    async with harness(tmp_path, replicas=4, rollout="Rolling", max_unavailable=1) as h:
        h.apply_revision("step-1", 1)
        await h.settle()

        intervals = [iv for log in h.logs().values() for iv in out_of_service(log)]
        assert len(intervals) == 4
        assert max_overlap(intervals) == 1
        assert all(h.served(p) == (1, 1, False) for p in h.pods)
        assert h.revision_status("step-1")["phase"] == "Succeeded"


async def test_a_rolling_pod_with_a_pinned_pair_moves_in_one_request_and_resumes_only_on_verified_digests(
    tmp_path: pathlib.Path,
) -> None:
    """Issue 18: a Rolling pod's resume waits for no other pod, so where the revision names both digests it goes
    in its loads' request, behind a check that every rank holds them. Each pod then costs two engine requests
    per revision (the pre-flight with its read; the update) instead of three, and the promise is unchanged: a
    draft digest that does not verify resumes nothing on it (every pod is back on revision 1, and no engine
    served revision 2), and the capacity budget still holds."""
    async with harness(tmp_path, replicas=3, rollout="Rolling", max_unavailable=1) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        before = collections.Counter(h.requests)
        h.apply_revision("step-2", 2, draft_digest=True)
        await h.settle()
        assert h.revision_status("step-2")["phase"] == "Succeeded", h.revision_status("step-2").get("message")
        sent = collections.Counter(h.requests)
        sent.subtract(before)
        for pod in h.pods:  # (step: the request's calls; a sequence's are joined by "+")
            moves = [step for (p, step), n in sent.items() for _ in range(n) if p == pod and "resume" in step]
            assert len(moves) == 1 and "rolloutfleet_load:draft+rolloutfleet_state+" in moves[0], sent
        assert all(h.served(p) == (2, 2, False) for p in h.pods)
        intervals = [iv for log in h.logs().values() for iv in out_of_service(log)]
        assert max_overlap(intervals) == 1
        assert {t["step"] for t in h.revision_status("step-2")["timings"]} >= {"LoadDraft", "Resume"}

        h.apply_revision("step-3", 3, draft_digest=WRONG_DIGEST)
        await h.settle()
        assert h.revision_status("step-3")["phase"] == "RolledBack", h.revision_status("step-3").get("message")
        for pod in h.pods:
            assert h.served(pod) == (2, 2, False), pod
            assert 3 not in served_revisions(h.engine_log(pod)), pod


async def test_fleet_status_shows_each_pod_s_revision_while_a_slow_pod_still_loads(tmp_path: pathlib.Path) -> None:
    """``status.pods`` is how users and trainers see which pod serves what: it must follow the engines
    during a pass, not only when the pass ends. With one pod's load held (a slow disk), the pods already
    moved show the new revision while that pod is still loading (the soak saw the status stay behind for
    the whole of a long pass). Rolling, one pod at a time, so the held pod moves last.
    """
    async with harness(tmp_path, replicas=3, rollout="Rolling", max_unavailable=1) as h:
        slow, moved = "policy-2", ["policy-0", "policy-1"]
        gate = h.hold_loads(slow)
        h.apply_revision("step-1", 1)
        rollout = asyncio.create_task(h.settle())
        await h.wait_for(moved, loaded)

        async def status_caught_up() -> bool:
            for _ in range(int(5.0 / 0.01)):  # bounds a broken write only; never decides the outcome
                pods = {p["name"]: p.get("revision") for p in h.fleet_status().get("pods") or []}
                if all(pods.get(p) == 1 for p in moved):
                    return True
                await asyncio.sleep(0.01)
            return False

        caught_up = await status_caught_up()
        assert not rollout.done(), "the held pod should still be loading"
        assert h.served(slow).verifier != 1
        gate.set()
        await rollout
        assert caught_up, f"status.pods during the pass: {h.fleet_status().get('pods')}"
        assert [p["revision"] for p in h.fleet_status()["pods"]] == [1, 1, 1]


async def test_corrupt_checkpoint_rolls_back_and_never_serves_unverified_weights(tmp_path: pathlib.Path) -> None:
    """A checkpoint whose digest does not match what the trainer pinned must never be served (DESIGN §4:
    fail-closed): every engine fails verification, the revision rolls back, and every engine serves the
    previous revision again (step-1, not the initial weights). No logged engine state ever has revision 2
    in service.
    """
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        assert h.revision_status("step-1")["phase"] == "Succeeded"

        h.apply_revision("step-2", 2, digest=WRONG_DIGEST)
        await h.settle()

        status = h.revision_status("step-2")
        assert status["phase"] == "RolledBack", status.get("message")
        for pod in h.pods:
            assert h.served(pod) == (1, 1, False), pod
            assert 2 not in served_revisions(h.engine_log(pod)), pod
            assert loads(h.engine_log(pod), revision=2), "the bad checkpoint was loaded (and refused)"
        assert h.fleet_status()["currentRevision"] == 1
        assert h.revision_status("step-1")["phase"] == "Succeeded"


async def test_all_at_once_opens_each_gate_at_the_barrier_and_admits_after_the_resume(tmp_path: pathlib.Path) -> None:
    """AllAtOnce, engines with admission: a pod's gate opens as soon as it waits at the barrier on verified
    weights, so the fleet's gate writes overlap the barrier and the resumes instead of following them (issue
    18: 1,024 of them took 1.1 s on 16 cores after the last resume). The pod is not Ready before it resumed
    all the same: Ready needs the readiness probe too, which passes only once the engine is admitted, and the
    resume's own request admits it only after the engine resumed. One engine's loads are held so that the
    others wait at the barrier: their gates must open before it loads, none of them resumed."""
    async with harness(tmp_path, replicas=3) as h:
        slow, others = "policy-2", ["policy-0", "policy-1"]
        gate = h.hold_loads(slow)
        h.mark_arrivals("wake_up:kv_cache")
        written = h.record_gates()

        async def release_when_the_others_are_open() -> None:
            await h.wait_for(others, loaded)
            await h.until(lambda: all((p, "True") in {(n, st) for n, st, _ in written} for p in others), "gates open")
            gate.set()

        h.apply_revision("step-1", 1)
        await asyncio.gather(h.settle(), release_when_the_others_are_open())
        logs = h.logs()
        first_resume = min(e["order"] for log in logs.values() for e in arrivals(log, "wake_up:kv_cache"))
        last_load = max(e["order"] for log in logs.values() for e in loads(log, revision=1))
        for pod in others:  # opened at the barrier: before the slow pod loaded, before anyone resumed
            opened = [order for name, status, order in written if name == pod and status == "True"]
            assert len(opened) == 1 and opened[0] < last_load < first_resume, (pod, written)
        for pod in h.pods:
            names = [call_name(e) for e in ok_calls(h.engine_log(pod))]
            moving = names[names.index("withdraw") :]  # (the first admit is the initial weights')
            assert moving.index("resume") < moving.index("admit"), names
        assert all(h.served(p) == (1, 1, False) for p in h.pods)
        assert h.revision_status("step-1")["phase"] == "Succeeded"


async def test_a_gate_opened_at_the_barrier_is_closed_again_when_the_resume_fails(tmp_path: pathlib.Path) -> None:
    """The other side of the rule above: a resume that fails leaves its pod paused and un-admitted, and the
    gate opened at the barrier says its weights are ready: it is closed at once (not at the end of the pass),
    and opened again only once the retried resume succeeded."""
    async with harness(tmp_path, replicas=3, max_retries=2) as h:
        flaky = "policy-1"
        h.engine(flaky).add_fault(FaultRule(step="resume", kind=FaultKind.HTTP_ERROR, status=500, count=1))
        written = h.record_gates()
        h.apply_revision("step-1", 1)
        await h.settle()
        assert [status for name, status, _ in written if name == flaky] == ["False", "True", "False", "True"]
        for pod in h.pods:
            if pod != flaky:
                assert [status for name, status, _ in written if name == pod] == ["False", "True"]
        assert all(h.served(p) == (1, 1, False) for p in h.pods)
        assert h.revision_status("step-1")["phase"] == "Succeeded"


async def test_gates_opened_at_the_barrier_close_before_a_rollback_loads_anything(tmp_path: pathlib.Path) -> None:
    """Gates opened at the barrier belong to the revision's verified pair: when the revision fails instead (one
    pod cannot load it), every one of them is closed before any pod loads the previous revision again."""
    async with harness(tmp_path, replicas=3, max_retries=0) as h:
        h.apply_revision("step-1", 1)
        await h.settle()
        slow, others = "policy-2", ["policy-0", "policy-1"]
        gate = h.hold_loads(slow)
        written = h.record_gates()

        async def fail_the_slow_pod_once_the_others_are_open() -> None:
            await h.wait_for(others, lambda log: bool(loads(log, revision=2)) and loaded(log))
            await h.until(lambda: all((p, "True") in {(n, st) for n, st, _ in written} for p in others), "gates open")
            rule = FaultRule(step="rolloutfleet_load", kind=FaultKind.HTTP_ERROR, status=500, count=1)
            h.engine(slow).add_fault(rule)
            gate.set()

        h.apply_revision("step-2", 2)
        await asyncio.gather(h.settle(), fail_the_slow_pod_once_the_others_are_open())
        assert h.revision_status("step-2")["phase"] == "RolledBack"
        for pod in others:
            statuses = [(status, order) for name, status, order in written if name == pod]
            opened = next(order for status, order in statuses if status == "True")
            closed = next(order for status, order in statuses if status == "False" and order > opened)
            back = [e["order"] for e in loads(h.engine_log(pod), revision=1) if e["order"] > opened]
            assert back and closed < min(back), (pod, statuses, back)
            assert h.served(pod) == (1, 1, False), pod


async def test_the_final_phase_is_one_write_that_carries_the_last_progress(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the last resume and Succeeded each write of the revision is one more round trip on the rollout's
    critical path (issue 18: a forced progress write, then the phase's own, at 1,024 pods on 16 cores). The
    pass's last progress rides on the final phase's write: after the last resume the revision is written once,
    and that write shows every pod done. The progress writes that run beside the steps are switched off here
    (they are throttled, and where one lands depends on timing): every write seen is one the pass waits for."""

    async def not_beside_the_steps(self: rollout_pass.RolloutPass) -> None:
        return None

    monkeypatch.setattr(rollout_pass.RolloutPass, "_write_in_background", not_beside_the_steps)
    async with harness(tmp_path, replicas=3) as h:
        written: list[tuple[int, dict[str, object]]] = []

        async def record(call: FakeCall) -> None:
            if call.verb == "patch_status" and call.kind == "WeightRevision" and call.body is not None:
                written.append((h.next_order(), call.body["status"]))

        h.kube.before_call = record
        h.apply_revision("step-1", 1)
        await h.settle()
        last_resume = max(e["order"] for log in h.logs().values() for e in ok_calls(log) if call_name(e) == "resume")
        after = [status for order, status in written if order > last_resume]
        assert [status.get("phase") for status in after] == ["Succeeded"], after
        final = h.revision_status("step-1")
        assert [p["step"] for p in final["pods"]] == ["Done"] * 3, final["pods"]
        assert final["phase"] == "Succeeded" and final["updated"] == "3/3"
