"""The bench's follower processes (``bench/rollout_overhead.py``): their acknowledgements, and how many there are.

With several follower processes (``--engine-procs``) a shared temporary file let one follower's rename find
it gone, which killed that follower's watch: the bench then timed out waiting for a quarter of the engines.
"""

from __future__ import annotations

import os
import pathlib
import pstats
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, cast

import bench_modules
import pytest

from rolloutfleet.sim.follower import FollowedPod

pytestmark = pytest.mark.unit

bench = bench_modules.load("rollout_overhead")


def test_each_follower_writes_through_its_own_temporary_file(tmp_path: pathlib.Path) -> None:
    latency_file = tmp_path / "latencies.json"
    acks = [bench.ack_path(latency_file, i) for i in range(4)]
    temporaries = {bench._temporary(a) for a in acks}
    assert len(set(acks)) == 4 and len(temporaries) == 4
    assert all(t.parent == tmp_path and t not in acks and t != latency_file for t in temporaries)


@pytest.mark.parametrize(("cores", "procs"), [(1, 1), (2, 1), (4, 2), (16, 8), (64, 8)])
def test_engine_processes_default_to_half_the_cores(cores: int, procs: int) -> None:
    """One follower serving 1,024 engines on the 16-core device inflated every step it answered (the bench's
    lower bound assumes engines on time); on 2 cores a second one would only share them."""
    assert bench.default_engine_procs(cores) == procs


def test_the_pass_line_s_phases_are_read_and_older_lines_still_parse() -> None:
    """The operator's pass log line (``RolloutPass.run``) as the bench reads it: the last pass's phases, and
    the line as operators before the phases wrote it (an A/B against an older tree) still counted."""
    text = (
        "pass step-1: 300 iterations, 2048 engine reads in 4.75s (observe 0.16s, waiting on steps 4.1s, status 0.02s;"
        " at pre-flight 0.40s, first step 0.52s, last step ended 4.10s, succeeded 4.75s)\n"
        "pass step-2: 7 iterations, 8 engine reads in 1.50s (observe 0.01s, waiting on steps 1.2s, status 0.01s)\n"
    )
    lines = list(bench.PASS_LINE.finditer(text))
    assert [m["key"] for m in lines] == ["step-1", "step-2"] and lines[1]["marks"] is None
    phases = {m["phase"]: float(m["at"]) for m in bench.PASS_MARK.finditer(lines[0]["marks"])}
    assert phases == {"pre-flight": 0.4, "first step": 0.52, "last step ended": 4.1, "succeeded": 4.75}
    assert lines[0]["clock"] is None


def test_the_pass_line_s_start_on_the_machine_s_clock_is_read_apart_from_its_phases() -> None:
    """``--cpu-timeline`` lines the phases up with /proc readings through the pass's monotonic start; the start
    must not read as a phase (the phases' windows would end at an hour's uptime)."""
    line = (
        "pass step-1: 300 iterations, 2048 engine reads in 4.75s (observe 0.16s, waiting on steps 4.1s, status 0.02s;"
        " at pre-flight 0.40s, succeeded 4.75s; started at monotonic 81234.567)\n"
    )
    found = bench.PASS_LINE.search(line)
    assert found is not None and found["clock"] == "81234.567"
    assert {m["phase"] for m in bench.PASS_MARK.finditer(found["marks"])} == {"pre-flight", "succeeded"}


def test_cpu_by_phase_gives_each_role_s_cores_between_the_pass_s_phases() -> None:
    """Readings every 0.1 s of an operator busy one core until 1 s into the pass, then half a core; four engine
    processes a quarter of a core each. The windows are cut at the phases (interpolated between readings), so
    the operator's two rates and the engines' sum come back per window, whatever the readings' spacing."""
    start = 1000.0

    def reading(t: float) -> dict[str, float]:
        busy = min(t, 1.0) + 0.5 * max(0.0, t - 1.0)
        engines = {f"engines.{i}": 0.25 * t for i in range(4)}
        return {"t": start + t, "operator": busy, "kube-apiserver": 2.0 * t, "bench": 9.0, **engines}

    samples = [reading(0.1 * i - 0.5) for i in range(0, 36)]  # from before the pass to 3 s into it
    windows = bench.cpu_by_phase(samples, start, {"pre-flight": 0.25, "first step": 1.0, "succeeded": 2.5})
    assert [(w["from"], w["to"], w["seconds"]) for w in windows] == [
        ("pass start", "pre-flight", 0.25),
        ("pre-flight", "first step", 0.75),
        ("first step", "succeeded", 1.5),
    ]
    assert [w["cores"]["operator"] for w in windows] == [1.0, 1.0, 0.5]
    assert all(w["cores"]["engines"] == 1.0 and w["cores"]["kube-apiserver"] == 2.0 for w in windows)
    assert all("bench" not in w["cores"] for w in windows)
    assert bench.cpu_by_phase(samples[:1], start, {"succeeded": 2.5}) == []


def test_a_native_profile_counts_the_loop_thread_s_work_and_tells_its_waits_apart() -> None:
    """``--profile-native``: py-spy samples every thread. The nonblocking profiles put 40-47 % of the samples
    in ``Runner.run`` itself, whose native frames are largely the loop's poll (bench/results/
    rollout_overhead.md): here those are the waiting share, other threads are out, and C frames are charged to
    the Python frame above them."""
    loop = "Runner.run (asyncio/runners.py:118);run_until_complete (loop.c:35410);uv_run (core.c:452)"
    gate = "set_gate (rolloutfleet/reconcile/gates.py:70)"
    raw = "\n".join(
        [
            f"{loop};uv__io_poll (linux.c:1400);epoll_pwait (libc.so.6) 50",
            f"{loop};Handle__run (loop.c:70959);{gate};Py_DECREF (object.h:537) 30",
            f"{loop};uv__io_poll (linux.c:1400);uv__read (stream.c:1100) 20",
            "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81);futex (libc.so.6) 400",
        ]
    )
    profile = bench.summarize_profile(raw, native=True)
    assert profile["samples"] == 50 and profile["idle_pct"] == 50.0
    set_gate, loop_itself = "set_gate (rolloutfleet/reconcile/gates.py)", "Runner.run (asyncio/runners.py)"
    assert dict(profile["self"]) == {set_gate: 60.0, loop_itself: 40.0}
    assert dict(profile["own_inclusive"]) == {set_gate: 60.0}


def test_server_counts_key_the_api_server_s_own_metrics_by_request_and_watched_kind() -> None:
    """The API server's side of a revision (every client's requests and the watch events it sent) from its
    /metrics text: response codes and other labels summed away, other metrics ignored, empty labels dropped."""
    text = "\n".join(
        [
            "# HELP apiserver_request_total Counter of apiserver requests",
            'apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",'
            'scope="resource",subresource="status",verb="PATCH",version="v1"} 2048',
            'apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="pods",'
            'scope="resource",subresource="status",verb="PATCH",version="v1"} 3',
            'apiserver_request_total{code="200",component="apiserver",group="rolloutfleet.io",resource="rolloutfleets",'
            'scope="namespace",subresource="",verb="WATCH",version="v1alpha1"} 2',
            'apiserver_watch_events_total{group="",kind="Pod",version="v1"} 9000',
            'apiserver_watch_events_sizes_sum{group="",kind="Pod",version="v1"} 2.5e+07',
            'apiserver_storage_objects{resource="pods"} 1024',
        ]
    )
    assert bench.server_counts(text) == {
        "apiserver_request_total PATCH/pods/status": 2051.0,
        "apiserver_request_total WATCH/rolloutfleets": 2.0,
        "apiserver_watch_events_total Pod": 9000.0,
        "apiserver_watch_events_sizes_sum Pod": 2.5e7,
    }


def test_each_engine_process_watches_only_its_share_of_the_pods() -> None:
    """Eight engine processes watching the whole fleet decoded every pod update eight times (two gate writes per
    pod per revision) beside serving their engines, and the API server sent each one eight times: the harness's
    load, on the cores the operator and the control plane use. Each now asks for its own share by the
    StatefulSet's pod-index label, the same pods ``mine`` serves; one process, an unknown size, or
    ``--followers-watch-all`` watch them all."""

    def follower(**kwargs: object) -> Any:
        return cast(Any, bench.BenchFollower)(cast(Any, None), "bench", "policy", **kwargs)

    fleet = "rolloutfleet.io/fleet=policy"
    assert follower(index=1, procs=4, pods=10).selector() == f"{fleet},apps.kubernetes.io/pod-index in (1,5,9)"
    assert follower(index=0, procs=1, pods=10).selector() == fleet
    assert follower(index=1, procs=4, pods=0).selector() == fleet
    assert follower(index=1, procs=4, pods=10, watch_all=True).selector() == fleet
    share = follower(index=3, procs=8, pods=1024)
    wanted = {int(i) for i in share.selector().split(" in (")[1].rstrip(")").split(",")}
    assert wanted == {i for i in range(1024) if share.mine(FollowedPod(f"policy-{i}", "127.1.0.1", True, None))}


def test_the_operator_s_cpu_is_split_into_user_and_system_time_and_its_loop_s_wakeups() -> None:
    """Read from this process's own /proc: a sleep is a voluntary context switch of the main thread (the
    event loop's thread in the operator), so N sleeps count at least N wake-ups; a process gone reads empty."""
    before = bench._proc_sched(os.getpid())
    for _ in range(20):
        time.sleep(0.001)
    sum(i * i for i in range(200_000))  # some user time
    after = bench._proc_sched(os.getpid())
    split = bench._sched_delta(after, before, 10)
    assert split is not None
    assert split["loop_wakeups"] >= 20 and split["loop_wakeups_per_pod"] == split["loop_wakeups"] / 10
    assert split["user_s"] >= 0 and split["system_s"] >= 0
    assert bench._proc_sched(2**22 + 12345) == {}
    assert bench._sched_delta({}, before, 10) is None


def test_the_operator_s_cpu_is_split_between_its_event_loop_and_its_other_threads() -> None:
    """A profile of the operator's event loop sees its main thread only; the Kubernetes client's pool (server-side
    applies, events) and the metrics server run in threads beside it. The row says how much CPU each side spent,
    read from this process: work in a thread counts there, not as the loop's."""
    before = bench._proc_sched(os.getpid())
    thread = threading.Thread(target=lambda: sum(i * i for i in range(3_000_000)))
    thread.start()
    thread.join()
    after = bench._proc_sched(os.getpid())
    split = bench._sched_delta(after, before, 1)
    assert split is not None
    assert split["other_threads_s"] >= 0.05 > split["loop_thread_s"]


def test_each_revision_starts_after_the_engines_keep_alive_expired() -> None:
    """Whether a revision's pre-flight reused the last pass's connections depended on how soon the bench created
    it: runs of one code differed by a connection per pod, ~0.2-0.3 ms/pod of the operator's CPU, and by 0 or 63
    TLS handshakes with the API server. The fleet now idles past both first, as between revisions minutes apart."""
    assert bench.default_idle_before(None) == 16.0  # vLLM's 5 s, and the operator's 15 s for API connections
    assert bench.default_idle_before(60) == 61.0


def test_the_calibration_does_fixed_work_and_times_it_in_cpu_milliseconds() -> None:
    """The same work every time (its result is fixed), so that two machines' or two hours' timings of it compare;
    timed in this thread's CPU time, so that a wait (a sleep, other processes' turns) does not count, and the
    best of the repeats is kept."""
    assert bench._calibration_work(50) == bench._calibration_work(50) > 0
    started = time.thread_time()
    best = bench.calibrate(repeats=3, rounds=200)
    spent_ms = 1000 * (time.thread_time() - started)
    assert 0 < best <= spent_ms / 3 + 0.5  # the best of three is at most their mean


def test_the_cprofile_hook_profiles_the_process_between_two_signals(tmp_path: pathlib.Path) -> None:
    """``--profile-cprofile``: the bench's sitecustomize, first on the operator's path only, starts a profile at
    the first SIGUSR2 and writes it at the second; what ran in between is in it, counted call by call."""
    script = textwrap.dedent(
        """
        import os, signal
        def counted(): return sum(range(100))
        os.kill(os.getpid(), signal.SIGUSR2)  # Python runs the handler before the next statement
        for _ in range(37): counted()
        os.kill(os.getpid(), signal.SIGUSR2)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(bench.CPROFILE_HOOK), bench.CPROFILE_DIR_ENV: str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    written = bench._read_cprofile(tmp_path, set(), timeout=5)
    assert written is not None and not list(tmp_path.glob("*.partial"))
    # The start is said beside it, under the same name: the bench creates the revision only once it is there.
    assert written.with_suffix(".started").exists()
    stats = pstats.Stats(str(written)).stats  # type: ignore[attr-defined]
    calls = {key[2]: entry[1] for key, entry in stats.items()}
    assert calls["counted"] == 37
    summary = bench.summarize_cprofile(stats, pods=37)
    assert summary["profiled_cpu_s"] >= 0 and any(f["function"].startswith("counted (") for f in summary["top_self"])


def test_the_bench_waits_for_the_operator_to_say_its_profile_started(tmp_path: pathlib.Path) -> None:
    """The bench slept 0.5 s after the starting signal and hoped the operator's loop had handled it; a signal is
    handled only when the loop next runs Python, so a revision's first steps could escape the profile. It now
    waits for the hook's marker, one it had not seen before, and says so when none comes."""
    old = tmp_path / "operator-1-1.started"
    old.touch()
    assert not bench._await_cprofile_start(tmp_path, {old}, timeout=0.05)  # only an earlier profile's marker
    timer = threading.Timer(0.1, (tmp_path / "operator-1-2.started").touch)
    timer.start()
    try:
        assert bench._await_cprofile_start(tmp_path, {old}, timeout=5)
    finally:
        timer.cancel()


def _interpreters_from_3_12() -> list[str]:
    """CPython 3.12 and later found on this machine (on PATH, or installed by pyenv): from 3.12 cProfile is built on
    ``sys.monitoring``, whose events come from every thread, and the device machine's bench runs 3.12."""
    found: dict[str, str] = {}
    if sys.version_info >= (3, 12):
        found[f"{sys.version_info[0]}.{sys.version_info[1]}"] = sys.executable
    roots = [pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv")) / "versions"]
    candidates = [shutil.which(f"python3.{minor}") for minor in range(12, 16)]
    candidates += [str(path) for root in roots for path in sorted(root.glob("3.1[2-9]*/bin/python3"))]
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            found.setdefault(probe.stdout.strip(), candidate)
    return sorted(found.values())


@pytest.mark.parametrize("python", [sys.executable, *_interpreters_from_3_12()])
def test_the_cprofile_hook_profiles_only_the_thread_of_the_event_loop(python: str, tmp_path: pathlib.Path) -> None:
    """The operator runs threads beside its event loop (the metrics server answering the bench's scrapes, the
    Kubernetes client's pool). From Python 3.12 cProfile sees every thread's calls, and with the loop thread's CPU
    clock as its timer it charged one thread's calls with time read on another's: on the device (3.12) a
    long-tail Rolling revision's profile summed to 18 CPU-s for an operator that spent 7.6, with shares above
    100 % and below zero. The hook must keep the other threads' calls out, whatever the interpreter."""
    script = textwrap.dedent(
        """
        import os, signal, threading, time
        def beside():
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                sum(range(1000))
        def counted(): return sum(range(20000))
        os.kill(os.getpid(), signal.SIGUSR2)
        started = time.thread_time()
        thread = threading.Thread(target=beside)
        thread.start()
        for _ in range(37):
            counted()
            time.sleep(0.005)  # the other thread runs meanwhile
        thread.join()
        spent = time.thread_time() - started
        os.kill(os.getpid(), signal.SIGUSR2)
        print(spent)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(bench.CPROFILE_HOOK), bench.CPROFILE_DIR_ENV: str(tmp_path)}
    done = subprocess.run([python, "-c", script], env=env, check=True, timeout=60, capture_output=True, text=True)
    spent_s = float(done.stdout)
    written = bench._read_cprofile(tmp_path, set(), timeout=5)
    assert written is not None
    stats = pstats.Stats(str(written)).stats  # type: ignore[attr-defined]
    calls = {key[2]: entry[1] for key, entry in stats.items()}
    assert calls["counted"] == 37
    assert "beside" not in calls  # ran only in the other thread
    assert all(entry[2] >= 0 for entry in stats.values())
    summary = bench.summarize_cprofile(stats, pods=37)
    assert 0 < summary["profiled_cpu_s"] <= spent_s + 0.01


def test_a_cprofile_summary_gives_each_area_its_share_and_calls_per_pod() -> None:
    stats = {
        ("/x/operator/rolloutfleet/reconcile/rollout_pass.py", 10, "_step"): (2048, 2048, 0.3, 1.0, {}),
        ("/x/site-packages/kopf/_core/reactor/processing.py", 5, "process"): (10, 10, 0.1, 0.2, {}),
        ("/x/lib/python3.11/asyncio/tasks.py", 7, "create_task"): (4096, 4096, 0.1, 0.1, {}),
        ("~", 0, "<method 'get' of 'dict' objects>"): (10_240, 10_240, 0.5, 0.5, {}),
    }
    summary = bench.summarize_cprofile(stats, pods=1024, top=2)
    assert summary["profiled_cpu_s"] == 1.0
    assert dict(summary["areas"]) == {
        "builtins (C)": 50.0,
        "rolloutfleet.reconcile": 30.0,
        "kopf": 10.0,
        "stdlib asyncio": 10.0,
    }
    assert summary["top_self"] == [
        {
            "function": "<method 'get' of 'dict' objects>",
            "self_pct": 50.0,
            "calls_per_pod": 10.0,
            "self_us_per_call": 48.8,
        },
        {
            "function": "_step (rolloutfleet/reconcile/rollout_pass.py:10)",
            "self_pct": 30.0,
            "calls_per_pod": 2.0,
            "self_us_per_call": 146.5,
        },
    ]


def test_a_revision_s_loop_lag_is_read_from_the_histogram_s_buckets_before_and_after() -> None:
    """``rolloutfleet_event_loop_lag_seconds`` is cumulative (each bucket counts the samples at or under its bound,
    since the operator started): a revision's samples are the differences, and the worst is the first bound whose
    count holds them all."""
    before = {"0.01": 8.0, "0.05": 10.0, "0.25": 10.0, "1.0": 10.0, "+Inf": 10.0}
    after = {"0.01": 40.0, "0.05": 47.0, "0.25": 49.0, "1.0": 50.0, "+Inf": 50.0}
    assert bench.loop_lag_summary(after, before) == {
        "samples": 40,
        "over_10ms": 8,
        "over_50ms": 3,
        "over_250ms": 1,
        "worst_under_s": 1.0,
    }
    stalled = {**after, "+Inf": 51.0}
    assert bench.loop_lag_summary(stalled, before)["worst_under_s"] == "+Inf"  # type: ignore[index]
    assert bench.loop_lag_summary({}, {}) is None  # an operator before the metric


def test_the_controller_manager_s_queues_are_read_from_its_metrics_before_and_after() -> None:
    """The controller manager's work queues (``workqueue_*`` with the queue's ``name``) say which of its controllers
    the "other control plane" CPU went to; a revision's share is the difference of the cumulative counters, and the
    queues that did nothing in it are left out."""
    text = textwrap.dedent(
        """\
        # HELP workqueue_adds_total [ALPHA] Total number of adds handled by workqueue
        workqueue_adds_total{name="endpoint_slice"} 120
        workqueue_adds_total{name="statefulset"} 30
        workqueue_adds_total{name="disruption"} 4
        workqueue_work_duration_seconds_sum{name="endpoint_slice"} 2.5
        workqueue_work_duration_seconds_sum{name="statefulset"} 0.25
        workqueue_work_duration_seconds_sum{name="disruption"} 0.01
        workqueue_work_duration_seconds_count{name="endpoint_slice"} 120
        """
    )
    before = bench.controller_queue_counts(text)
    assert before["seconds endpoint_slice"] == 2.5 and before["adds statefulset"] == 30.0
    after = {**before, "seconds endpoint_slice": 7.5, "adds endpoint_slice": 2168.0, "adds statefulset": 31.0}
    summary = bench.controller_queue_summary(after, before)
    assert list(summary) == ["endpoint_slice", "statefulset"]  # the busiest first; "disruption" did nothing
    assert summary["endpoint_slice"] == {"seconds": 5.0, "adds": 2048.0}


@pytest.mark.parametrize(
    ("text", "cpus"), [("3,11\n", {3, 11}), ("0-1\n", {0, 1}), ("4\n", {4}), ("0-1,8-9\n", {0, 1, 8, 9})]
)
def test_kernel_cpu_lists_parse_as_the_kernel_writes_them(text: str, cpus: set[int]) -> None:
    assert bench.parse_cpu_list(text) == cpus


def test_the_operators_core_brings_its_smt_siblings(tmp_path: pathlib.Path) -> None:
    """On the 16-core device a revision of 1,024 pods kept 9-12 of its hardware threads busy (the control plane);
    a pinned operator whose sibling thread ran the API server measured a slower core, not more work. So
    ``--operator-cpu`` reserves the whole core, and a machine that does not say keeps only the named CPU."""
    topology = tmp_path / "cpu7" / "topology"
    topology.mkdir(parents=True)
    (topology / "thread_siblings_list").write_text("7,15\n")
    assert bench.smt_siblings(7, tmp_path) == {7, 15}
    assert bench.smt_siblings(3, tmp_path) == {3}


def test_the_report_says_where_the_operator_ran() -> None:
    import argparse

    pinned = argparse.Namespace(operator_cpu=7, operator_cpu_reserved=[7, 15])
    assert "alone on core 7, its SMT siblings [15] idle" in bench._placement(pinned, 16)
    assert "shared the other 14" in bench._placement(pinned, 16)
    assert "nothing is pinned" in bench._placement(argparse.Namespace(operator_cpu=None), 16)


def test_the_speed_probe_compares_the_revision_with_the_idle_period_before_it() -> None:
    """A calibration taken once before a revision could not tell how slow the machine ran during it: on the
    16-core device the same code's CPU per pod rose by a third when the control plane got busier, at the same
    calibration. The probe's samples are cut at the revision's window, and those of the idle period before it
    (not earlier ones, not later ones) are the baseline."""
    text = "\n".join(
        [
            "80.0 10.0",  # before the idle period: ignored
            "95.0 40.0",
            "98.0 42.0",  # the idle period [94, 100)
            "100.5 60.0",
            "104.0 56.0",
            "107.0 58.0",  # the revision [100, 108]
            "109.0 99.0",  # after it: ignored
            "110.0",  # a line cut by the probe's end
        ]
    )
    summary = bench.speed_probe_summary(text, 100.0, 108.0, 6.0)
    assert summary == {"rest_ms": 41.0, "during_ms": 58.0, "slowdown": 1.415, "samples": 3}
    assert bench.speed_probe_summary(text, 100.0, 108.0, 0.0) is None  # no baseline: no claim


def test_the_speed_probe_writes_timed_samples_until_stopped(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "probe.txt"
    probe = subprocess.Popen(
        [sys.executable, str(bench_modules.BENCH / "rollout_overhead.py"), bench.SPEED_PROBE_CHILD, str(out)]
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
            time.sleep(0.05)
    finally:
        probe.terminate()
        probe.wait(timeout=10)
    samples = [tuple(map(float, line.split())) for line in out.read_text().splitlines()[:3]]
    assert len(samples) == 3 and all(ms > 0 for _, ms in samples)
    assert samples[0][0] < samples[1][0] < samples[2][0] <= time.monotonic()


def test_the_user_flag_speed_probe_is_not_taken_for_the_probe_process() -> None:
    """The probe process was started as ``rollout_overhead.py --speed-probe PATH``, the user's own flag: a user's
    ``rollout_overhead.py --speed-probe --help`` (any one other argument) then ran as a probe writing to a file
    named after that argument, for as long as the shell lived, instead of the bench. The child has its own
    marker; the user's command line goes to the argument parser."""
    done = subprocess.run(
        [sys.executable, str(bench_modules.BENCH / "rollout_overhead.py"), "--speed-probe", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "usage:" in done.stdout
