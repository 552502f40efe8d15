"""The fleet's periodic resync (``handlers.wiring.fleet_resync`` → ``reconcile.fleet.reconcile_fleet`` with
``fresh_within``) next to a revision's pass, which rebuilds the fleet's status itself.

Same harness as ``test_reconcile_rollout``: ``FakeKube``, one simulated engine per pod, real reconcile passes.
"""

from __future__ import annotations

import pathlib

import pytest
from kube_fakes import FakeCall
from reconcile_fakes import harness

from rolloutfleet.api import common
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
