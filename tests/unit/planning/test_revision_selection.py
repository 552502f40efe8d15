"""Selection of the active revision and refusal of invalid ones, before any engine is touched.

The table holds the invalid WeightRevisions of the bad-input list: each is refused with a reason and a
field-path message, and never becomes the goal (so no engine call is ever made for it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.api import validation
from rolloutfleet.api.revision import Phase, WeightRevisionStatus
from rolloutfleet.planning import revisions

ROOT = "/weights/p"
DIGEST = "blake3:" + "0" * 64
FLEET: dict[str, Any] = {
    "image": "vllm:0.33",
    "replicas": 4,
    "verifier": {"path": f"{ROOT}/0/v"},
    "draft": {"method": "draft_model", "path": f"{ROOT}/0/d"},
    "weights": {"claimName": "ckpt", "allowedRoots": [ROOT]},
}
GOOD: dict[str, Any] = {
    "fleetRef": {"name": "p"},
    "revision": 5,
    "verifier": {"path": f"{ROOT}/5/v"},
    "draft": {"path": f"{ROOT}/5/d"},
}


def fleet(**changes: Any) -> Any:
    raw = copy.deepcopy(FLEET)
    raw.update(changes)
    spec, errors = validation.parse_fleet_spec(raw)
    assert spec is not None, errors
    return spec


def rev(
    name: str,
    spec: dict[str, Any],
    *,
    phase: Phase = Phase.PENDING,
    created: str = "2026-01-01T00:00:00Z",
    reason: str | None = None,
) -> revisions.Revision:
    parsed, errors = validation.parse_revision_spec(spec)
    return revisions.Revision(name, created, parsed, WeightRevisionStatus(phase=phase, reason=reason), tuple(errors))


def served(n: int, name: str | None = None) -> revisions.Served:
    """The fleet's status record of serving revision ``n`` (as written when ``n`` completed)."""
    return revisions.Served(n, f"{ROOT}/{n}/v", DIGEST, f"{ROOT}/{n}/d", DIGEST, name)


def with_(path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(GOOD)
    node = out
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


INVALID = [
    (
        "path outside allowedRoots",
        with_("verifier.path", "/etc/v"),
        None,
        "ValidationFailed",
        "spec.verifier.path: must be under",
    ),
    ("relative path", with_("verifier.path", "w/5/v"), None, "ValidationFailed", "spec.verifier.path"),
    ("dotdot path", with_("verifier.path", f"{ROOT}/../x"), None, "ValidationFailed", "'..'"),
    (
        "draft path outside roots",
        with_("draft.path", "/tmp/d"),
        None,
        "ValidationFailed",
        "spec.draft.path: must be under",
    ),
    ("draft dotdot", with_("draft.path", f"{ROOT}/5/../../d"), None, "ValidationFailed", "spec.draft.path"),
    ("missing draft for co-updated draft", with_("draft", None), None, "ValidationFailed", "spec.draft: is required"),
    (
        "draft for fleet without draft",
        GOOD,
        {"draft": {"method": "none"}},
        "ValidationFailed",
        "the fleet has no draft",
    ),
    (
        "draft for frozen draft",
        GOOD,
        {"draft": {"method": "draft_model", "path": f"{ROOT}/0/d", "policy": "frozen"}},
        "ValidationFailed",
        "frozen",
    ),
    ("draft for MTP", GOOD, {"draft": {"method": "mtp"}}, "ValidationFailed", "no weights of its own"),
    ("malformed digest", with_("verifier.digest", "blake3:xyz"), None, "ValidationFailed", "spec.verifier.digest"),
    ("sha256 digest", with_("verifier.digest", "sha256:" + "0" * 64), None, "ValidationFailed", "spec.verifier.digest"),
    ("malformed draft digest", with_("draft.digest", DIGEST[:-1]), None, "ValidationFailed", "spec.draft.digest"),
    (
        "not newer than current",
        with_("revision", 3),
        None,
        "NotNewer",
        "must be newer than the fleet's current revision (3)",
    ),
    ("equal to current", with_("revision", 3), None, "NotNewer", "(3)"),
    ("negative revision", with_("revision", -1), None, "ValidationFailed", "spec.revision"),
    ("missing verifier", with_("verifier", None), None, "ValidationFailed", "spec.verifier"),
    ("missing fleetRef", with_("fleetRef", None), None, "ValidationFailed", "spec.fleetRef"),
    ("unknown field", with_("surprise", 1), None, "ValidationFailed", "spec.surprise"),
    (
        "bad maxUnavailable",
        with_("strategy", {"maxUnavailable": "0%"}),
        None,
        "ValidationFailed",
        "spec.strategy.maxUnavailable",
    ),
    ("bad mode override", with_("strategy", {"mode": "hot"}), None, "ValidationFailed", "spec.strategy.mode"),
    (
        "empty parity probe",
        with_("parityProbe", {"promptTokenIds": [], "expectedLogprobs": []}),
        None,
        "ValidationFailed",
        "spec.parityProbe",
    ),
    ("revision as string", with_("revision", "five"), None, "ValidationFailed", "spec.revision"),
]


@pytest.mark.parametrize(("why", "spec", "fleet_changes", "reason", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_revision_is_refused_and_never_the_goal(
    why: str, spec: dict[str, Any], fleet_changes: dict[str, Any] | None, reason: str, message: str
) -> None:
    f = fleet(**(fleet_changes or {}))
    sel = revisions.select(f, served(3), [rev("bad", spec)])
    assert sel.active is None and sel.goal is not None and sel.goal.revision == 3, why  # the fleet keeps serving 3
    assert len(sel.refused) == 1
    refusal = sel.refused[0]
    assert refusal.reason == reason
    assert message in refusal.message, refusal.message


def test_duplicate_revision_number() -> None:
    first = rev("a", GOOD, created="2026-01-01T00:00:00Z")
    second = rev("b", GOOD, created="2026-01-01T00:00:05Z")
    sel = revisions.select(fleet(), served(3), [second, first])
    assert sel.active is not None and sel.active.name == "a"
    assert [(r.revision.name, r.reason) for r in sel.refused] == [("b", "DuplicateRevision")]


def test_newest_wins_older_unfinished_superseded() -> None:
    older = rev("r5", GOOD)
    newer = rev("r6", with_("revision", 6))
    sel = revisions.select(fleet(), served(3), [older, newer])
    assert sel.active is not None and sel.active.name == "r6"
    assert [r.name for r in sel.superseded] == ["r5"]
    assert sel.goal is not None and sel.goal.revision == 6


def test_rolling_back_targets_what_the_fleet_serves_even_without_its_object() -> None:
    """Issue 15 defect 5: the rollback target is the fleet's status record, not the WeightRevision object
    of the served revision (Argo CD and Flux prune those); before, with r3's object gone, the rollback
    targeted revision 0."""
    failing = rev("r5", GOOD, reason=revisions.ROLLING_BACK)
    sel = revisions.select(fleet(), served(3), [failing])
    assert sel.rolling_back and sel.goal is not None
    assert (sel.goal.revision, sel.goal.verifier_path, sel.goal.draft_path) == (3, f"{ROOT}/3/v", f"{ROOT}/3/d")
    assert (sel.goal.verifier_digest, sel.goal.draft_digest) == (DIGEST, DIGEST)  # pinned to what was verified


def test_rolling_back_to_initial_weights() -> None:
    sel = revisions.select(fleet(), None, [rev("r5", GOOD, reason=revisions.ROLLING_BACK)])
    assert sel.goal is not None and sel.goal.revision == 0 and sel.goal.verifier_path == f"{ROOT}/0/v"


def test_idle_fleet_keeps_pods_on_what_it_serves_without_any_revision_object() -> None:
    """Issue 15 defects 5/16: steady state comes from the fleet's record, so a pod replaced after the
    served revision's object was deleted is still moved to it (before: the goal vanished with the object
    and the new pod served the initial weights, Ready, while the fleet reported itself converged)."""
    sel = revisions.select(fleet(), served(3), [])
    assert sel.active is None and sel.goal is not None
    assert (sel.goal.revision, sel.goal.verifier_path, sel.goal.verifier_digest) == (3, f"{ROOT}/3/v", DIGEST)


def test_a_fleet_on_its_initial_weights_has_no_goal_to_keep() -> None:
    """Engines start on the initial weights; with nothing published there is nothing to move."""
    assert revisions.select(fleet(), None, []).goal is None


def test_reapplying_what_the_fleet_serves_is_already_served() -> None:
    """Issue 15 defect 17: a pruned and re-created revision that is exactly what the fleet serves is Ready at
    once (before: Failed/NotNewer, and `kubectl wait` hung while every pod served it)."""
    same = {**with_("revision", 3), "verifier": {"path": f"{ROOT}/3/v"}, "draft": {"path": f"{ROOT}/3/d"}}
    sel = revisions.select(fleet(), served(3), [rev("r3-again", same)])
    assert [r.name for r in sel.already_served] == ["r3-again"] and not sel.refused and sel.active is None
    pinned = {**same, "verifier": {"path": f"{ROOT}/3/v", "digest": DIGEST}}
    assert [r.name for r in revisions.select(fleet(), served(3), [rev("x", pinned)]).already_served] == ["x"]


def test_the_served_number_with_other_sources_is_refused() -> None:
    """One revision number means one checkpoint: the served number with another path is not a re-apply."""
    other = {**with_("revision", 3), "verifier": {"path": f"{ROOT}/3b/v"}, "draft": {"path": f"{ROOT}/3/d"}}
    sel = revisions.select(fleet(), served(3), [rev("r3b", other)])
    assert [(r.revision.name, r.reason) for r in sel.refused] == [("r3b", "NotNewer")]
    digest = {**with_("revision", 3), "verifier": {"path": f"{ROOT}/3/v", "digest": "blake3:" + "1" * 64}}
    digest["draft"] = {"path": f"{ROOT}/3/d"}
    assert [r.reason for r in revisions.select(fleet(), served(3), [rev("d", digest)]).refused] == ["NotNewer"]


def test_revision_equal_to_current_and_unfinished_is_finishing_not_stale() -> None:
    """The operator recorded the served revision, then died before marking the revision Succeeded: the
    next pass finishes it (Succeeded), never refuses it or rolls a pod."""
    same = {**with_("revision", 5)}
    sel = revisions.select(fleet(), served(5), [rev("r5", same, phase=Phase.PROGRESSING)])
    assert not sel.refused and sel.active is None and [r.name for r in sel.already_served] == ["r5"]
