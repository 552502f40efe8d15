"""A fleet's ``PushWithinLimit`` condition (``planning.fleet_status``), written by ``reconcile.fleet``.

A pushed revision's status lists every pod of its fleet, and a revision whose fleet has more pods than those lists
can hold in one stored object is refused (``api.validation.push_limit_problem``, docs/push.md). Until now a user
learned it only when a trainer's push was refused, possibly hours after scaling the fleet: the fleet itself said
nothing. A fleet with ``weightTransfer`` now says on its status whether a push can reach all its pods, with a
Warning event when it stops being true; the fleet is not Degraded (it serves, and loads revisions from paths).

Same harness as ``test_fleet_resync``: ``FakeKube``, one simulated engine per pod, real reconcile passes.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from reconcile_fakes import harness

from rolloutfleet.api import common, validation
from rolloutfleet.api.fleet import RolloutFleetSpec
from rolloutfleet.planning import fleet_status

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
async def test_a_fleet_scaled_past_its_push_limit_says_so_and_warns_once(tmp_path: pathlib.Path, backend: str) -> None:
    async with harness(tmp_path, replicas=3, fleet_extra={"weightTransfer": {"backend": backend}}) as h:
        await h.reconcile_fleet()
        within = _condition(h.fleet_status(), fleet_status.PUSH_WITHIN_LIMIT)
        assert within is not None and (within["status"], within["reason"]) == ("True", "WithinPushLimit"), within
        spec = RolloutFleetSpec.model_validate(h.fleet_manifest()["spec"])
        most, problem = validation.push_limit_problem(h.fleet, spec)
        assert problem is None and f"a pushed revision can list up to {most}" in within["message"]

        # The limit said at three pods is the true one: a fleet scaled to it stays within (the first version
        # divided the budget by what a pod of today's three-pod fleet adds, 8,474 for this fleet, and a fleet of
        # 8,474 pods, whose names are three characters longer, was then refused). The pods need not exist yet:
        # the spec decides what a push must list.
        body = h.fleet_manifest()
        body["spec"]["replicas"] = most
        h.kube.apply_user(body)
        await h.reconcile_fleet()
        at = _condition(h.fleet_status(), fleet_status.PUSH_WITHIN_LIMIT)
        assert at is not None and at["status"] == "True", at

        # Scaled past it.
        body = h.fleet_manifest()
        body["spec"]["replicas"] = most + 1
        h.kube.apply_user(body)
        await h.reconcile_fleet()
        past = _condition(h.fleet_status(), fleet_status.PUSH_WITHIN_LIMIT)
        assert past is not None and (past["status"], past["reason"]) == ("False", "TooManyPodsToPush"), past
        assert f"at most {most} pods" in past["message"] and f"{most + 1} pods" in past["message"]
        # Not Degraded: the fleet serves and loads revisions from paths; only pushes are out of reach.
        degraded = _condition(h.fleet_status(), fleet_status.DEGRADED)
        assert degraded is not None and degraded["status"] == "False"
        warnings = h.kube.events_for(h.fleet, "TooManyPodsToPush")
        assert [e["type"] for e in warnings] == ["Warning"], warnings
        await h.reconcile_fleet()  # nothing flipped: no second event
        assert len(h.kube.events_for(h.fleet, "TooManyPodsToPush")) == 1

        # Back within it, then without weightTransfer (no push possible, so nothing to say).
        body = h.fleet_manifest()
        body["spec"]["replicas"] = 3
        h.kube.apply_user(body)
        await h.reconcile_fleet()
        back = _condition(h.fleet_status(), fleet_status.PUSH_WITHIN_LIMIT)
        assert back is not None and back["status"] == "True"
        # A Normal event each time it turns True: when the fleet was created, and now.
        assert [e["type"] for e in h.kube.events_for(h.fleet, "WithinPushLimit")] == ["Normal", "Normal"]
        del body["spec"]["weightTransfer"]
        h.kube.apply_user(body)
        await h.reconcile_fleet()
        assert _condition(h.fleet_status(), fleet_status.PUSH_WITHIN_LIMIT) is None


async def test_a_fleet_without_weight_transfer_has_no_push_condition(tmp_path: pathlib.Path) -> None:
    async with harness(tmp_path, replicas=3) as h:
        await h.reconcile_fleet()
        types = {c["type"] for c in h.fleet_status().get("conditions") or []}
        assert types == {"Available", "Progressing", "Degraded"}, types


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_the_fleet_says_false_exactly_where_a_pushed_revision_is_refused(backend: str) -> None:
    # The condition and the revision's refusal must agree at every size: a fleet that says True and then has its
    # trainer's push refused (or says False and accepts it) would be worse than saying nothing. Walked across the
    # boundary (where the longest pod name also gains a digit at 10,000 pods).
    fleet_raw = {
        "image": "vllm:0.33",
        "verifier": {"path": "/weights/p/step-0/v"},
        "weights": {"claimName": "ckpt", "allowedRoots": ["/weights/p"]},
        "weightTransfer": {"backend": backend},
    }
    rev_raw = {"fleetRef": {"name": "p"}, "revision": 3, "verifier": {"push": {}, "digest": "blake3:" + "1" * 64}}
    rev, errors = validation.parse_revision_spec(rev_raw)
    assert rev is not None and not errors, errors
    first, _ = validation.push_limit_problem("p", RolloutFleetSpec.model_validate({**fleet_raw, "replicas": 1}))
    sizes = sorted({1, 1024, 9_999, 10_000, 20_000, *range(max(first - 400, 1), first + 2)})
    verdicts = set()
    for replicas in sizes:
        spec = RolloutFleetSpec.model_validate({**fleet_raw, "replicas": replicas})
        refused = any(e.path == "spec.verifier.push" for e in validation.validate_revision(rev, spec))
        status = fleet_status.observed(fleet_status.RolloutFleetStatus(), spec, "p", 1, None, [])
        cond = next(c for c in status.conditions if c.type == fleet_status.PUSH_WITHIN_LIMIT)
        assert cond.status == (common.ConditionStatus.FALSE if refused else common.ConditionStatus.TRUE), replicas
        verdicts.add(refused)
    assert verdicts == {True, False}  # the walk crossed the limit
