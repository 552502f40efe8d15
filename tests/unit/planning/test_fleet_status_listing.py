"""``planning.fleet_status.listing``: what a large fleet's ``status.pods`` lists.

The API server stores and sends a RolloutFleet whole on every write, and etcd refuses an object over 1.5 MiB by
default. With a row per pod (110-210 bytes by the length of the fleet's name and of the pods' IPs), a fleet
past 7,500-14,000 pods could not write its status at all (etcdserver: request is too large:
``tests/integration/operator/test_crds_on_server.py``), although ``spec.replicas`` goes up to 100,000. A fleet
of more than ``MAX_POD_ENTRIES`` pods therefore lists only the pods unlike its most common state, which
``podsCommon`` names with its count; what the status says of each pod must stay exactly what a full list said.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rolloutfleet.api.common import MAX_POD_ENTRIES
from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from rolloutfleet.planning import fleet_status
from rolloutfleet.planning.fleet_status import EngineSummary
from rolloutfleet.resources import labels

pytestmark = pytest.mark.unit

# etcd's default request limit (--max-request-bytes) less room for the fleet's spec and metadata.
STATUS_BYTES_BUDGET = 1024 * 1024
LONGEST_NAME = "a" * 52  # the longest fleet name (FLEET_NAME_MAX_LENGTH)


def _spec(replicas: int) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate(
        {
            "replicas": replicas,
            "image": "rolloutfleet-worker:test",
            "verifier": {"path": "/weights/p/step-0/verifier"},
            "weights": {"claimName": "ckpt", "mountPath": "/weights", "allowedRoots": ["/weights/p"]},
        }
    )


def _pod(fleet: str, i: int, *, ready: bool = True) -> dict[str, Any]:
    gate = "True" if ready else "False"
    return {
        "metadata": {"name": f"{fleet}-{i}", "namespace": "ns", "uid": f"u-{i}"},
        "spec": {"readinessGates": [{"conditionType": labels.WEIGHTS_READY_CONDITION}]},
        "status": {
            "phase": "Running",
            "podIP": f"fd00:1234:5678:9abc:def0:1234:{i // 65536:x}:{i % 65536:x}",  # the longest form: IPv6
            "conditions": [
                {"type": "Ready", "status": gate},
                {"type": labels.WEIGHTS_READY_CONDITION, "status": gate},
            ],
        },
    }


def _fleet(n: int, fleet: str = "policy", *, not_ready: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    return [_pod(fleet, i, ready=i not in not_ready) for i in range(n)]


def _engines(fleet: str, n: int, **by_pod: EngineSummary) -> dict[str, EngineSummary]:
    out = {f"{fleet}-{i}": EngineSummary(4, 4, "Done", "4") for i in range(n)}
    out.update({f"{fleet}-{k}": v for k, v in by_pod.items()})
    return out


def _observed(
    n: int, pods: list[dict[str, Any]], engines: dict[str, EngineSummary] | None, *, fleet: str = "policy"
) -> RolloutFleetStatus:
    return fleet_status.observed(RolloutFleetStatus(), _spec(n), fleet, 1, None, pods, engines)


def test_a_fleet_of_up_to_the_limit_lists_every_pod() -> None:
    n = MAX_POD_ENTRIES
    status = _observed(n, _fleet(n), _engines("policy", n))
    assert [p.name for p in status.pods] == [f"policy-{i}" for i in range(n)]
    assert status.pods_common is None and status.pods_truncated is None
    assert "podsCommon" not in status.to_wire() and "podsTruncated" not in status.to_wire()


def test_a_larger_fleet_lists_the_pods_unlike_the_common_state_those_not_ready_first() -> None:
    n = MAX_POD_ENTRIES + 44
    moved = {str(i): EngineSummary(5, 5, "Done", "5") for i in (7, 120, 299)}
    status = _observed(n, _fleet(n, not_ready=frozenset({3, 200})), _engines("policy", n, **moved))
    assert [(p.name, p.ready, p.revision) for p in status.pods] == [
        ("policy-3", False, 4),
        ("policy-200", False, 4),
        ("policy-7", True, 5),
        ("policy-120", True, 5),
        ("policy-299", True, 5),
    ]
    common = status.pods_common
    assert common is not None
    assert (common.pods, common.phase, common.ready, common.revision, common.draft_revision) == (
        n - 5,
        "Running",
        True,
        4,
        4,
    )
    assert (common.step, common.weight_version, status.pods_truncated) == ("Done", "4", None)
    # The counts are the whole fleet's, not the list's.
    assert (status.replicas, status.ready_replicas) == (n, n - 2)


def test_pods_unlike_the_common_state_beyond_the_limit_are_counted() -> None:
    n = 1000
    moved = {str(i): EngineSummary(5, 5, "Done", "5") for i in range(600, 1000)}
    status = _observed(n, _fleet(n), _engines("policy", n, **moved))
    assert status.pods_common is not None and status.pods_common.pods == 600 and status.pods_common.revision == 4
    assert len(status.pods) == MAX_POD_ENTRIES and status.pods_truncated == 400 - MAX_POD_ENTRIES
    assert [p.name for p in status.pods] == [f"policy-{i}" for i in range(600, 600 + MAX_POD_ENTRIES)]


@pytest.mark.parametrize("n", [12_000, 100_000])
def test_the_largest_fleets_status_fits_etcd_midway_through_a_revision(n: int) -> None:
    """The worst case: the longest names and IPs, a quarter of the fleet moving with a step each, a third on the
    new revision, every hundredth pod not Ready. With a row per pod this status was 2.5 MB at 12,000 pods and
    21 MB at 100,000; listed, 56 KB at both."""
    steps = ["LoadVerifier", "LoadDraft", "WakeWeights", "Resume"]
    moved: dict[str, EngineSummary] = {}
    for i in range(n):
        if i % 4 == 0:
            moved[str(i)] = EngineSummary(4, 4, steps[i % len(steps)], "4")
        elif i % 3 == 0:
            moved[str(i)] = EngineSummary(5, 5, "Done", "5")
    pods = _fleet(n, LONGEST_NAME, not_ready=frozenset(range(0, n, 100)))
    status = _observed(n, pods, _engines(LONGEST_NAME, n, **moved), fleet=LONGEST_NAME)
    wire = json.dumps(status.to_wire(), separators=(",", ":")).encode()
    assert len(wire) < STATUS_BYTES_BUDGET, len(wire)
    common = status.pods_common
    assert common is not None and common.pods + len(status.pods) + (status.pods_truncated or 0) == n
    assert all(not p.ready for p in status.pods[: n // 100])  # the pods not Ready come first


def test_a_pod_left_out_carries_the_common_state_until_its_engine_is_read() -> None:
    """After an operator restart the status is built before any pass read the engines: a listed pod carries its
    row (``test_fleet_status_entries``), a Ready pod left out carries the state the status said it shared; a
    pod not Ready, or new since, is not claimed to hold anything until its engine is read."""
    n = MAX_POD_ENTRIES + 10
    before = _observed(n, _fleet(n), _engines("policy", n, **{"5": EngineSummary(5, 5, "Done", "5")}))
    assert before.pods_common is not None and [p.name for p in before.pods] == ["policy-5"]
    pods = _fleet(n + 1, not_ready=frozenset({9, n}))  # pod 9 lost its gate; pod n is new
    after = fleet_status.observed(before, _spec(n + 1), "policy", 1, None, pods, None)
    rows = {p.name: p for p in after.pods}
    assert rows["policy-5"].revision == 5  # its own row, carried
    assert (rows["policy-9"].ready, rows["policy-9"].revision) == (False, None)
    assert (rows[f"policy-{n}"].ready, rows[f"policy-{n}"].revision) == (False, None)
    assert after.pods_common == before.pods_common.model_copy(update={"pods": n - 2})
