"""The soak observer's pure checks (``bench/soak_observer.py``): readiness, violations a-d, lag, episodes.

The soak's verdict is only as good as these rules, so each test says which real situation it stands for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import bench_modules
import pytest

pytestmark = pytest.mark.unit

obs = bench_modules.load("soak_observer")

GATE = "rolloutfleet.io/weights-ready"
PINS = {
    0: obs.Pin("blake3:v0", "blake3:d0"),
    4: obs.Pin("blake3:v4", "blake3:d4"),
    5: obs.Pin("blake3:v5", "blake3:d5"),
}


def pod(
    ready: str = "True", gate: str | None = "True", gated: bool = True, terminating: bool = False
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": ready}]
    if gate is not None:
        conditions.append({"type": GATE, "status": gate})
    meta: dict[str, Any] = {"name": "policy-0"}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"readinessGates": [{"conditionType": GATE}]} if gated else {},
        "status": {"podIP": "127.1.64.2", "conditions": conditions},
    }


def slot(kind: str | None = "loaded", revision: int | None = 5, digest: str | None = None) -> Any:
    """A model slot; loaded/corrupt content is claimed (revision, digest) by the extension, the rest is not."""
    claimed = revision if kind in ("loaded", "corrupt") else None
    return obs.SlotView(
        kind, revision, "/w", claimed, digest if claimed is not None else None, claimed is not None, False
    )


def engine(verifier: Any = None, draft: Any = None, **state: Any) -> Any:
    verifier = verifier or slot(digest="blake3:v5")
    draft = draft if draft is not None else slot(digest="blake3:d5")
    base = {
        "running": True,
        "incarnation": 1,
        "paused": False,
        "sleep_level": 0,
        "weights_awake": True,
        "kv_awake": True,
    }
    base.update(state)
    return obs.EngineView(key="127.1.64.2:8000", verifier=verifier, draft=draft, **base)


def fleet(current: int | None = 5, target: int | None = None, pods: dict[str, int | None] | None = None) -> Any:
    return obs.FleetView(current, target, {"policy-0": 5} if pods is None else pods)


def checks(found: list[Any]) -> list[str]:
    return [f.check for f in found]


# --- readiness ---------------------------------------------------------------------------------------


def test_ready_needs_every_readiness_gate_true() -> None:
    # kwok marks pods Ready without looking at gates; the kubelet would not, so neither does the observer.
    assert obs.pod_ready(pod())
    assert not obs.pod_ready(pod(gate="False"))
    assert not obs.pod_ready(pod(gate=None))  # a gate never set is not True
    assert not obs.pod_ready(pod(ready="False"))
    assert obs.pod_ready(pod(gate=None, gated=False))  # no gates in the spec: Ready alone decides


def test_a_terminating_pod_is_not_routed() -> None:
    # Endpoints of terminating pods are not ready for traffic, so what their engine holds is not served.
    assert obs.pod_ready(pod(terminating=True))
    assert not obs.routed(pod(terminating=True))


def test_serving_excludes_paused_and_sleeping_engines() -> None:
    assert engine().serving
    assert not engine(paused=True).serving
    assert not engine(sleep_level=2, weights_awake=False, kv_awake=False).serving
    assert not engine(kv_awake=False).serving
    assert not engine(running=False).serving


# --- checks a, b, c ----------------------------------------------------------------------------------


def test_a_verified_pair_of_the_current_revision_is_clean() -> None:
    assert obs.check_serving("policy-0", engine(), fleet(), PINS) == []


def test_a_mixed_pair_is_a() -> None:
    # The stale-draft bug: the verifier moved to 5, the co-updated draft still holds 4.
    found = obs.check_serving("policy-0", engine(draft=slot(revision=4, digest="blake3:d4")), fleet(target=5), PINS)
    assert checks(found) == ["a"]


def test_a_frozen_draft_of_another_revision_is_not_a() -> None:
    found = obs.check_serving(
        "policy-0", engine(draft=slot(revision=4, digest="blake3:d4")), fleet(target=5), PINS, draft_co_updated=False
    )
    assert "a" not in checks(found)


@pytest.mark.parametrize(
    ("verifier", "draft", "why"),
    [
        (slot(kind="partial", revision=5, digest=None), None, "a load cut short: memory half written"),
        (slot(kind="corrupt", digest="blake3:bad"), None, "a load that read wrong bytes"),
        (slot(kind=None, revision=None, digest=None), None, "level-2 sleep, woken without a reload: zeros"),
        (slot(digest="blake3:v4"), None, "a digest that is not the revision's pin"),
        (slot(digest=None), None, "a load with no digest claimed"),
        (None, slot(kind="partial", revision=5, digest=None), "the draft half loaded"),
    ],
)
def test_unverified_or_partial_weights_are_b(verifier: Any, draft: Any, why: str) -> None:
    found = obs.check_serving("policy-0", engine(verifier=verifier, draft=draft), fleet(target=5), PINS)
    assert "b" in checks(found), why


def test_b_uses_the_pin_of_the_revision_as_published() -> None:
    # A revision published with a wrong pin: the engine holds the true bytes, but the pin says otherwise,
    # so serving it is serving weights the publisher did not vouch for.
    pins = {**PINS, 5: obs.Pin("blake3:v4", "blake3:d5")}
    assert "b" in checks(obs.check_serving("policy-0", engine(), fleet(), pins))


def test_b_an_unpublished_revision_is_b() -> None:
    found = obs.check_serving(
        "policy-0", engine(slot(revision=9, digest="blake3:v9"), slot(revision=9, digest="blake3:d9")), fleet(9), PINS
    )
    assert "b" in checks(found)


def test_initial_weights_are_fine_until_the_fleet_moves_past_them() -> None:
    # vLLM serve loaded them and the extension claims nothing: the operator may route them only while the
    # fleet has never served another revision.
    initial = engine(slot(kind="initial", revision=None, digest=None), slot(kind="initial", revision=None, digest=None))
    assert obs.check_serving("policy-0", initial, fleet(current=None, pods={"policy-0": None}), PINS) == []
    assert obs.check_serving("policy-0", initial, fleet(current=0), PINS) == []
    # A restarted engine (crash, new pod) comes back on them: routed on a fleet at revision 5, it is b and c.
    assert sorted(checks(obs.check_serving("policy-0", initial, fleet(current=5), PINS))) == ["b", "c"]


def test_rollback_to_the_initial_checkpoint_is_revision_zero() -> None:
    rolled = engine(slot(revision=0, digest="blake3:v0"), slot(revision=0, digest="blake3:d0"))
    assert obs.check_serving("policy-0", rolled, fleet(current=None), PINS) == []
    assert obs.check_serving("policy-0", rolled, fleet(current=0), PINS) == []


def test_not_resident_is_b_even_with_a_claim() -> None:
    lost = dataclasses.replace(slot(digest="blake3:v5"), lost=True)
    assert "b" in checks(obs.check_serving("policy-0", engine(verifier=lost), fleet(), PINS))


def test_another_revision_outside_a_rollout_is_c() -> None:
    found = obs.check_serving(
        "policy-0", engine(slot(revision=4, digest="blake3:v4"), slot(revision=4, digest="blake3:d4")), fleet(5), PINS
    )
    assert checks(found) == ["c"]


def test_another_revision_during_a_rollout_is_not_c() -> None:
    # Rolling: pods not yet updated keep serving the previous revision while targetRevision is set.
    found = obs.check_serving(
        "policy-0",
        engine(slot(revision=4, digest="blake3:v4"), slot(revision=4, digest="blake3:d4")),
        fleet(current=4, target=5),
        PINS,
    )
    assert found == []


def test_no_fleet_status_checks_only_the_engine() -> None:
    assert obs.check_serving("policy-0", engine(), None, PINS) == []


# --- check d -----------------------------------------------------------------------------------------


def test_status_disagreement() -> None:
    assert obs.status_disagreement("policy-0", engine(), fleet()) is None
    assert "r4" in (obs.status_disagreement("policy-0", engine(), fleet(pods={"policy-0": 4})) or "")
    assert "missing" in (obs.status_disagreement("policy-0", engine(), fleet(pods={})) or "")
    assert obs.status_disagreement("policy-0", engine(), None) is None
    # During a load the verifier memory holds the new revision partially: that is a (short) disagreement.
    loading = engine(verifier=slot(kind="partial", revision=6, digest=None))
    assert obs.status_disagreement("policy-0", loading, fleet()) is not None


def test_a_large_fleet_s_unlisted_pods_are_judged_by_its_common_state() -> None:
    """A fleet of more than 256 pods lists only its pods unlike the rest (``status.podsCommon`` says what the
    others hold): an unlisted pod is not missing from the status, and is held to the common state."""
    view = obs.fleet_view(
        {
            "status": {
                "currentRevision": 5,
                "pods": [{"name": "policy-1", "revision": 4}],
                "podsCommon": {"pods": 300, "revision": 5},
            }
        }
    )
    assert view is not None and view.said("policy-0") == (5, None) and view.said("policy-1") == (4, None)
    assert obs.status_disagreement("policy-0", engine(), view) is None
    assert "r5" in (obs.status_disagreement("policy-0", engine(verifier=slot(revision=6)), view) or "")
    small = obs.fleet_view({"status": {"currentRevision": 5, "pods": [{"name": "policy-1", "revision": 4}]}})
    assert "missing" in (obs.status_disagreement("policy-0", engine(), small) or "")


def test_lag_counts_only_past_the_tolerance_and_resets_on_agreement() -> None:
    lag = obs.Lag(3.0)
    assert lag.observe(10.0, "p", True) == (False, 0.0)
    assert lag.observe(12.9, "p", True)[0] is False
    beyond, lasted = lag.observe(13.2, "p", True)
    assert beyond and lasted == pytest.approx(3.2)
    assert lag.observe(13.3, "p", False) == (False, 0.0)
    assert lag.observe(20.0, "p", True) == (False, 0.0)  # a new disagreement starts from zero


# --- tally -------------------------------------------------------------------------------------------


def test_tally_counts_samples_and_groups_episodes() -> None:
    tally = obs.Tally(keep_examples=2)
    for t in (1.0, 1.1, 1.2):
        tally.add(t, "a", "p0", {"message": "m"})
        tally.end_sample()
    tally.end_sample()  # p0 recovered
    tally.add(2.0, "a", "p0", {"message": "again"})
    tally.end_sample()
    assert tally.counts["a"] == 4
    assert tally.episode_counts["a"] == 2
    first = tally.episodes[0]
    assert (first.start, first.end, first.samples) == (1.0, 1.2, 3)
    assert len(tally.examples["a"]) == 2
    assert tally.longest["a"] == pytest.approx(0.2)  # the longer of the two episodes (the report shows it)


def test_an_unjudged_sample_does_not_split_an_episode() -> None:
    tally = obs.Tally()
    tally.add(1.0, "b", "p0", {})
    tally.end_sample()
    tally.end_sample(skipped={"p0"})  # the engine moved during this sample: no verdict
    tally.add(1.2, "b", "p0", {})
    tally.end_sample()
    assert tally.episode_counts["b"] == 1


# --- one sample end to end ---------------------------------------------------------------------------


def test_judge_skips_engines_that_changed_during_the_sample() -> None:
    async def never() -> Any:
        raise AssertionError("not called")

    observer = obs.Observer(never, never, PINS)
    bad = engine(draft=slot(revision=4, digest="blake3:d4"))
    key = bad.key
    observer.judge(1.0, [pod()], fleet(target=5), {key: engine()}, {key: bad})
    assert observer.stats["ambiguous"] == 1 and observer.tally.counts["a"] == 0
    observer.judge(1.1, [pod()], fleet(target=5), {key: bad}, {key: bad})
    assert observer.tally.counts["a"] == 1


def test_judge_ignores_pods_that_are_not_routed_but_still_checks_status() -> None:
    async def never() -> Any:
        raise AssertionError("not called")

    observer = obs.Observer(never, never, PINS, tolerance=0.05)
    bad = engine(draft=slot(revision=4, digest="blake3:d4"))
    view = fleet(target=5, pods={"policy-0": 4})
    observer.judge(1.0, [pod(gate="False")], view, {bad.key: bad}, {bad.key: bad})
    observer.judge(1.1, [pod(gate="False")], view, {bad.key: bad}, {bad.key: bad})
    assert observer.tally.counts["a"] == 0
    assert observer.tally.counts["d"] == 2 and observer.tally.counts["d_beyond"] == 1


def test_judge_notes_an_engine_restart() -> None:
    async def never() -> Any:
        raise AssertionError("not called")

    observer = obs.Observer(never, never, PINS)
    first = engine()
    observer.judge(1.0, [pod()], fleet(), {first.key: first}, {first.key: first})
    fresh = engine(
        slot(kind="initial", revision=None, digest=None),
        slot(kind="initial", revision=None, digest=None),
        incarnation=2,
    )
    observer.judge(2.0, [pod()], fleet(), {fresh.key: fresh}, {fresh.key: fresh})
    example = observer.tally.examples["b"][0]
    assert example["engine_restarted_s_ago"] == 0.0


def test_a_status_that_could_not_read_the_engine_claims_nothing() -> None:
    """A pod whose last read failed is reported with no revision and a step that says so: that is not a
    wrong claim (check d) but it is counted apart; a missing revision without such a step is still d."""
    unread = obs.FleetView(current=3, target=None, pods={"policy-0": None}, steps={"policy-0": "EngineError"})
    assert obs.status_disagreement("policy-0", engine(), unread) is None
    assert "unknown" in (obs.status_unread("policy-0", engine(), unread) or "")
    silent = obs.FleetView(current=3, target=None, pods={"policy-0": None}, steps={"policy-0": "Done"})
    assert obs.status_disagreement("policy-0", engine(), silent) is not None
    assert obs.status_unread("policy-0", engine(), silent) is None


def test_a_status_that_names_no_revision_while_a_paused_engine_runs_a_chain_claims_nothing() -> None:
    """Since caa0a69 a pod running steps sent in one request (pause, sleep, wake, load) is shown as its engine is
    while the last of them runs: no revision, since the sleep inside the request releases the one held before
    at a moment the operator cannot see (the soak had seen the old revision claimed 3.2 s after the sleep).
    Until the sleep happens the engine still holds the old revision: the status claims nothing then, which is
    counted apart from d. Only while the engine is paused (mid-transaction): a resumed engine the status still
    reports with no revision is a disagreement, as is a step no request ends at."""
    chained = obs.FleetView(current=3, target=4, pods={"policy-0": None}, steps={"policy-0": "LoadVerifier"})
    paused = engine(paused=True)
    assert obs.status_disagreement("policy-0", paused, chained) is None
    assert "while its steps run" in (obs.status_pending("policy-0", paused, chained) or "")
    assert obs.status_disagreement("policy-0", engine(), chained) is not None  # resumed: not pending any more
    assert obs.status_pending("policy-0", engine(), chained) is None
    done = obs.FleetView(current=3, target=4, pods={"policy-0": None}, steps={"policy-0": "Done"})
    assert obs.status_disagreement("policy-0", paused, done) is not None


def test_the_observer_s_chain_steps_are_the_operator_s() -> None:
    """Written out in the observer (it judges the operator, it does not take its rules from it): kept equal."""
    from rolloutfleet.planning.transaction import CHAIN_TO

    assert {step.value for step in CHAIN_TO} == obs.CHAIN_STEPS
