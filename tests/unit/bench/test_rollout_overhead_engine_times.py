"""The bench's reading of the engines' own logs (``bench/rollout_overhead.py``: ``step_times``, ``engine_spans``,
``engine_timeline``, the followers' answers).

The lower bound takes every step to last what it was drawn as. A simulated engine shares its process with the
other engines it serves and the machine with the control plane, and on 16 cores one follower serving 1,024
engines made a 0.5 s load take 0.63-0.89 s: that part of a revision's wall is the harness's. These tests pin
how the bench tells it apart, from the steps as the simulator logs them (the names
``tests/unit/engine/test_executor_chain.py`` pins for a real simulated engine's chains).
"""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace
from typing import Any, cast

import bench_modules
import pytest

pytestmark = pytest.mark.unit

bench = bench_modules.load("rollout_overhead")

# A sleep-mode AllAtOnce pod as the simulator logs it (127.1.0.1 of a real 8-pod run): the chain up to the
# barrier, then the resume's request (``reconcile.executor``: stamp the weight version, wake the KV cache,
# resume, admit). Seconds from the pod's pause, and from the barrier.
PRE = [("withdraw", 0.0, 0.0), ("pause:keep", 0.0, 0.05), ("sleep:2", 0.05, 0.55), ("wake_up:weights", 0.55, 0.85)]
LOADS = [("rolloutfleet_load:verifier", 0.85, 2.85), ("rolloutfleet_load:draft", 2.85, 3.35)]
RESUME = [
    ("update_weight_version", 0.0, 0.02),
    ("wake_up:kv_cache", 0.02, 0.22),
    ("resume", 0.22, 0.27),
    ("admit", 0.29, 0.3),
]


def pod_log(start: float, barrier: float, *, late: float = 0.0) -> list[tuple[str, float, float]]:
    """One pod's answered steps: paused at ``start``, its resume from ``barrier``; ``late`` stretches its draft
    load (the engine's process busy elsewhere)."""
    steps = [(key, start + a, start + b) for key, a, b in PRE + LOADS[:1]]
    key, a, b = LOADS[1]
    steps.append((key, start + a, start + b + late))
    steps += [(key, barrier + a, barrier + b) for key, a, b in RESUME]
    return steps


CONFIGURED = (3.35, 0.27)  # ``pod_sequence`` of the base latencies: pre-resume, resume


def test_an_engine_s_own_time_runs_from_its_pause_to_its_last_pre_resume_step_and_through_its_resume() -> None:
    spans = bench.engine_spans(pod_log(10.0, 14.0, late=0.2))
    assert spans is not None
    assert spans["pre_end"] - spans["pause"] == pytest.approx(3.55)  # 3.35 drawn, 0.2 late
    assert spans["resume_end"] - spans["resume_start"] == pytest.approx(0.27)  # the admission is not the resume's
    # The admission after the resume is not timed as the resume's: it goes with the gate, and the bound gives
    # it no time either.
    shuffled = list(reversed(pod_log(10.0, 14.0)))  # the engines' logs are read in start order
    assert bench.engine_spans(shuffled) == bench.engine_spans(pod_log(10.0, 14.0))


def test_an_engine_that_did_not_pause_and_resume_in_the_window_gives_no_span() -> None:
    whole = pod_log(10.0, 14.0)
    assert bench.engine_spans([s for s in whole if s[0] != "resume"]) is None
    assert bench.engine_spans([s for s in whole if not s[0].startswith("pause")]) is None
    assert bench.engine_spans([]) is None


def test_allatonce_wall_is_split_into_the_engines_own_bound_and_what_was_added_around_it() -> None:
    """Three pods: one paused 0.1 s after the others (the operator's dispatch), one whose draft load ran 0.4 s
    late (its engine's process): the engines' bound grows by the late engine only, and what is over it is the
    rest of the wall."""
    created = 100.0
    logs = {
        "127.1.0.1": pod_log(101.0, 105.0),
        "127.1.0.2": pod_log(101.1, 105.0),
        "127.1.0.3": pod_log(101.0, 105.0, late=0.4),
    }
    order = list(logs)
    out = bench.engine_timeline(logs, order, [CONFIGURED] * 3, "AllAtOnce", 1, created, 5.6)
    assert out is not None
    assert out["engines_bound_s"] == pytest.approx(3.75 + 0.27)
    assert out["over_engines_bound_s"] == pytest.approx(5.6 - 4.02)
    assert out["engines_late_ms"] == {"mean": 133.3, "max": 400.0}
    m = out["milestones_s"]
    assert m["first pause started"] == pytest.approx(1.0) and m["last pause started"] == pytest.approx(1.1)
    assert m["last pre-resume step ended"] == pytest.approx(1.0 + 3.35 + 0.4)
    assert m["first resume started"] == pytest.approx(5.0) and m["last resume ended"] == pytest.approx(5.27)
    assert m["revision final"] == 5.6
    # The drawn bound of the same pods, through the same schedule: the engines' bound with nothing late.
    assert bench.schedule_bound([CONFIGURED] * 3, "AllAtOnce") == pytest.approx(3.62)


def test_rolling_bound_of_the_engines_is_the_same_greedy_schedule_over_their_own_times() -> None:
    """maxUnavailable 1: the pods one after another, each as long as its engine ran from its pause through its
    resume (one request: what the engine took between its loads and its resume is its own, where in AllAtOnce
    it is the barrier's); milestones are the AllAtOnce barrier's and are not given."""
    logs = {f"127.1.0.{i}": pod_log(10.0 * i, 10.0 * i + 3.4 + 0.1 * i, late=0.1 * i) for i in range(1, 4)}
    out = bench.engine_timeline(logs, list(logs), [CONFIGURED] * 3, "Rolling", 1, 5.0, 40.0)
    assert out is not None
    assert out["engines_bound_s"] == pytest.approx(3 * (3.62 + 0.05) + 0.1 + 0.2 + 0.3)
    assert out["engines_late_ms"] == {"mean": 250.0, "max": 350.0}
    assert "milestones_s" not in out
    assert bench.lower_bound([dict(bench.BASE_STEPS)] * 3, "sleep", "Rolling", 1) == pytest.approx(3 * 3.62)


def test_a_pod_the_engines_did_not_log_whole_leaves_the_revision_unread() -> None:
    logs = {"127.1.0.1": pod_log(1.0, 5.0), "127.1.0.2": pod_log(1.0, 5.0)[:3]}
    assert bench.engine_timeline(logs, list(logs), [CONFIGURED] * 2, "AllAtOnce", 1, 0.0, 6.0) is None
    assert (
        bench.engine_timeline(
            {"127.1.0.1": pod_log(1.0, 5.0)}, ["127.1.0.1", "127.1.0.9"], [CONFIGURED] * 2, "AllAtOnce", 1, 0.0, 6.0
        )
        is None
    )


def test_step_times_keep_the_answered_steps_that_ended_in_the_window() -> None:
    """Reads (logged without a start), refused calls and steps of an earlier revision are not this revision's."""
    entries = [
        {"seq": 0, "t": 1.0, "t0": 0.5, "step": "pause", "key": "pause:keep", "status": 200},
        {"seq": 1, "t": 5.0, "step": "listen"},
        {"seq": 2, "t": 6.0, "t0": 5.5, "step": "pause", "key": "pause:keep", "status": 409},
        {"seq": 3, "t": 7.0, "t0": 6.0, "step": "resume", "status": 200},
    ]
    assert bench.step_times(entries, 2.0) == [("resume", 6.0, 7.0)]


def test_a_follower_answers_each_request_for_its_engines_step_times_once(tmp_path: pathlib.Path) -> None:
    """The bench asks through a file (the followers are other processes); each follower answers in its own file,
    keyed by pod IP, with the request's serial, and does not rewrite it until the next request."""
    latency_file = tmp_path / "latencies.json"
    log = SimpleNamespace(entries=[{"seq": 0, "t": 3.0, "t0": 2.0, "step": "resume", "status": 200}])
    follower = cast(Any, bench.BenchFollower)(
        cast(Any, None), "bench", "policy", index=1, procs=2, latency_file=latency_file
    )
    follower.sim = SimpleNamespace(engines={"127.1.0.7:8000": SimpleNamespace(log=log)})
    answer = bench.steps_path(latency_file, 1)
    follower._dump()
    assert not answer.exists()  # nothing asked yet
    bench.dump_path(latency_file).write_text(json.dumps({"serial": 1, "since": 1.0}))
    follower._dump()
    assert json.loads(answer.read_text()) == {"serial": 1, "engines": {"127.1.0.7": [["resume", 2.0, 3.0]]}}
    answer.unlink()
    follower._dump()
    assert not answer.exists()  # answered once per request
    assert bench.steps_path(latency_file, 0) != answer and bench.dump_path(latency_file) != latency_file


def test_the_weight_version_is_stamped_after_the_allatonce_barrier_as_part_of_the_resume() -> None:
    """``reconcile.executor``'s resume calls stamp the weight version, wake the KV cache and resume, in the one
    request sent after the barrier; the bound splits the steps there too (it counted the stamp before it)."""
    steps = dict(bench.BASE_STEPS)
    assert bench.pod_sequence(steps, "sleep") == pytest.approx(CONFIGURED)
    assert bench.pod_sequence(steps, "inflight") == pytest.approx((2.55, 0.07))
    assert bench.pod_sequence(steps, "inflight", versioned=False) == pytest.approx((2.55, 0.05))
    # A pod slow only at the stamp sets the resume side's maximum, not the pre-resume one's.
    slow = {**steps, "update_weight_version": 0.5}
    assert bench.lower_bound([steps, slow], "sleep", "AllAtOnce") == pytest.approx(3.35 + 0.75)
