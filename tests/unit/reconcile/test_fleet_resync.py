"""The fleet's periodic resync (``handlers.wiring.fleet_resync`` → ``reconcile.fleet.reconcile_fleet`` with
``fresh_within``) next to a revision's pass, which rebuilds the fleet's status itself.

Same harness as ``test_reconcile_rollout``: ``FakeKube``, one simulated engine per pod, real reconcile passes.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from kube_fakes import FakeCall
from reconcile_fakes import harness

from rolloutfleet.api import common
from rolloutfleet.api.engine import EngineState
from rolloutfleet.planning import fleet_status
from rolloutfleet.reconcile import fleet as fleet_reconcile

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


async def test_the_resync_leaves_a_status_just_built_and_rebuilds_an_older_one(tmp_path: pathlib.Path) -> None:
    """A revision's pass rebuilds the fleet's status every 1-2 s at 1,024 pods (from the pods and what it read
    of the engines); the resync every 10 s rebuilt it once more, from the same sources, for nothing: 4.8 % of
    the operator's samples in a 25 s Rolling revision (bench/results/rollout_overhead.md). It still applies
    the children (someone may have edited one), and builds the status when nobody did for half its period."""
    async with harness(tmp_path, replicas=3) as h:
        calls: list[tuple[str, str]] = []

        async def record(call: FakeCall) -> None:
            calls.append((call.verb, call.kind))

        body = h.kube.peek(common.API_VERSION, "RolloutFleet", h.namespace, h.fleet)
        assert body is not None
        h.kube.before_call = record
        # Right after the harness's passes built the status:
        outcome = await fleet_reconcile.reconcile_fleet(h.ctx, body, fresh_within=5.0)
        assert outcome.valid and outcome.applied > 0 and not outcome.status_written
        assert ("apply", "StatefulSet") in calls
        assert ("list", "Pod") not in calls and not any(verb == "patch_status" for verb, _ in calls), calls
        # Built longer ago than that: the resync builds it (and writes what changed, here a pod's phase).
        h.memory.status_observed_at -= 10.0
        h.kube.set_pod(h.namespace, h.pods[0], phase="Unknown")
        calls.clear()
        outcome = await fleet_reconcile.reconcile_fleet(h.ctx, body, fresh_within=5.0)
        assert ("list", "Pod") in calls and outcome.status_written
        assert {p["name"]: p["phase"] for p in h.fleet_status()["pods"]}[h.pods[0]] == "Unknown"


async def test_a_refresh_writes_on_from_its_own_last_write_and_reads_the_fleet_after_anyone_else_s(
    tmp_path: pathlib.Path,
) -> None:
    """A pass refreshes the fleet's status every 2 s at 1,024 pods. Reading the fleet back each time (a row per
    pod) and parsing its status again were a quarter of each refresh, though the status read is the one this
    process wrote (issue 18): the next refresh now builds on that write, conditional on the version it
    answered. Anyone else's write since (here a status field the refresh owns, set wrong by another writer)
    makes that a 409: the fleet is read again, and the field is put right rather than left as the other
    writer set it. A fleet deleted meanwhile is no error."""
    async with harness(tmp_path, replicas=3) as h:
        calls: list[tuple[str, str]] = []

        async def record(call: FakeCall) -> None:
            calls.append((call.verb, call.kind))

        h.kube.before_call = record
        assert await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet) is False  # nothing changed
        h.kube.set_pod(h.namespace, h.pods[0], phase="Unknown")
        assert await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert ("get", "RolloutFleet") not in calls and ("patch_status", "RolloutFleet") in calls, calls
        assert {p["name"]: p["phase"] for p in h.fleet_status()["pods"]}[h.pods[0]] == "Unknown"

        await h.kube.patch_status(common.API_VERSION, "RolloutFleet", h.namespace, h.fleet, {"readyReplicas": 99})
        h.kube.set_pod(h.namespace, h.pods[1], phase="Unknown")
        calls.clear()
        assert await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert calls.count(("patch_status", "RolloutFleet")) == 2 and ("get", "RolloutFleet") in calls, calls
        status = h.fleet_status()
        assert status["readyReplicas"] == sum(p["ready"] for p in status["pods"]) != 99
        assert {p["name"]: p["phase"] for p in status["pods"]}[h.pods[1]] == "Unknown"

        h.kube.set_pod(h.namespace, h.pods[2], phase="Unknown")
        h.kube.delete_user(common.API_VERSION, "RolloutFleet", h.namespace, h.fleet)
        assert await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet) is False


async def test_a_condition_flipped_by_a_refresh_from_its_own_write_is_an_event_on_the_fleet(
    tmp_path: pathlib.Path,
) -> None:
    """The sandbox demo's operator log showed a KeyError: a refresh built on its own last write (the fleet not
    read again) kept only the fleet's metadata and spec, and the Event for a flipped condition names the
    fleet by apiVersion and kind too. A pod failing flips Degraded: the Warning is posted on the fleet."""
    async with harness(tmp_path, replicas=3) as h:
        assert h.memory.status_memo is not None  # the passes' refresh wrote the status: the next builds on it
        h.kube.set_pod(h.namespace, h.pods[0], phase="Failed")
        assert await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        degraded = h.kube.events_for(h.fleet, "PodsFailing")
        assert [(e["apiVersion"], e["kind"], e["type"]) for e in degraded] == [
            (common.API_VERSION, "RolloutFleet", "Warning")
        ]


async def test_each_refresh_shows_what_the_revision_loop_last_saw_of_each_engine(tmp_path: pathlib.Path) -> None:
    """A refresh keeps each pod's engine summary with the observation and step it was made from, instead of
    making all of them again at every write (as costly as the rest of the status at 1,024 pods, issue 18). A
    new observation, a new step, an engine that stopped answering and a pod replaced under its name must each
    show in the next refresh: a summary kept past any of them would show what the pod no longer serves."""
    async with harness(tmp_path, replicas=3) as h:
        h.apply_revision("rev-1", 1)
        await h.settle()
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        pod = h.pods[0]

        def entry() -> dict[str, object]:
            return {p["name"]: p for p in h.fleet_status()["pods"]}[pod]

        def see(state: EngineState) -> None:
            h.memory.remember({**h.memory.engine_view, pod: state}, dict(h.memory.engine_view_incarnations))

        before = h.memory.engine_view[pod]
        assert entry()["revision"] == before.verifier.revision is not None
        see(dataclasses.replace(before, weight_version="seen-again"))
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert entry()["weightVersion"] == "seen-again"

        h.memory.steps = {**h.memory.steps, pod: "LoadVerifier"}
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert entry()["step"] == "LoadVerifier"

        see(EngineState(reachable=False))
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert (entry().get("revision"), entry()["step"]) == (None, "LoadVerifier")

        see(before)
        h.memory.steps = {**h.memory.steps, pod: "Done"}
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert (entry()["revision"], entry()["step"]) == (before.verifier.revision, "Done")
        h.memory.engine_view_incarnations[pod] = "another-uid/0"  # read through a pod since recreated
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        assert (entry().get("revision"), entry().get("step")) == (None, None)


async def test_a_fleet_small_again_lists_every_pod_and_drops_its_common_state(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet of more than ``MAX_POD_ENTRIES`` pods names the state its unlisted pods share in podsCommon
    (``planning.fleet_status.listing``; the limit is 2 here, so that 3 pods are a large fleet). Scaled down to
    the limit it lists every pod again, and podsCommon must go with the write (a merge patch keeps a field the
    patch leaves out): left behind, it would count pods the status does not list."""
    monkeypatch.setattr(fleet_status, "MAX_POD_ENTRIES", 2)
    async with harness(tmp_path, replicas=3) as h:
        await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        status = h.fleet_status()
        assert status["podsCommon"]["pods"] == 3 and status["podsCommon"]["ready"] is True
        assert status.get("pods", []) == [] and status["readyReplicas"] == 3
        h.kube.delete_pod(h.namespace, h.pods[2])
        assert await fleet_reconcile.refresh_status(h.ctx, h.namespace, h.fleet)
        status = h.fleet_status()
        assert "podsCommon" not in status and [p["name"] for p in status["pods"]] == h.pods[:2]
