"""Benchmark: the operator's own overhead when rolling WeightRevisions across fleets of 64 to 4,096 pods.

A report, not a test; the engineer runs it (minutes per fleet size; about an hour with ``--soak-revisions
1000``). For each fleet size it starts the local control plane with enough fake GPU nodes, runs the real
operator as a process, serves a simulated engine on every pod's loopback IP from ``--engine-procs``
follower processes (synthetic weights), waits until the operator has settled the fleet (it opened every
pod's readiness gate: ``status.readyReplicas == n``), then runs a sequence of scenarios on that one fleet,
each one new WeightRevision (``<latencies>-<rollout>-<mode>``: per-engine step latencies drawn uniform or
long-tailed from a seed, AllAtOnce or Rolling 25 %, sleep or in-flight). Per scenario it reports the wall
time from creation to a final phase against the lower bound for the same drawn latencies (a pure
function, ``lower_bound``), the operator's CPU seconds, peak and current RSS (from /proc), its engine and
Kubernetes API requests per pod (its own counters on /metrics) and how the machine's cores were shared.
``--profile`` samples the operator with py-spy during each scenario (a profiler, not a dependency of the
project: ``.venv/bin/pip install py-spy`` first; ``--profile-native`` samples with ``--native`` instead, the
event loop's thread only, its polls told apart; ``--profile-cprofile`` runs the operator's event loop under
cProfile with its thread's CPU clock instead: calls counted exactly, ``bench/operator_cprofile``); each row
carries a calibration of the machine's speed taken right before its revision (``calibrate``);
``--soak-revisions N`` then applies N zero-latency revisions back to back and samples the operator's RSS every
50 (``--soak-keep K`` deletes each
revision once K newer ones succeeded, as a trainer or a Git repository that prunes its history would: what
the operator keeps per revision object is then told apart from what it keeps per revision rolled).

    .venv/bin/python bench/rollout_overhead.py --sizes 64 256 1024 --out bench/results/rollout_overhead.md
    .venv/bin/python bench/rollout_overhead.py --sizes 64 --soak-revisions 1000 --out /tmp/soak.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import heapq
import itertools
import json
import math
import os
import pathlib
import platform
import pstats
import random
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from typing import Any

from rolloutfleet.adapters import kube_http
from rolloutfleet.api import vllm_flags
from rolloutfleet.sim.config import Latencies, WeightsConfig
from rolloutfleet.sim.follower import FollowedPod, PodFollower

# Base per-step simulated latencies (seconds), keyed as the simulator keys its steps (``Latencies.fixed``
# takes the most specific configured key: ``pause:keep`` falls back to ``pause``, ``sleep:2`` to ``sleep``).
# ``reset_prefix_cache`` is in the resume composition only where prefix caching is on (not in this fleet:
# the parity profile disables it); it is listed so that enabling it does not make it free. The fast reads
# (is_paused, is_sleeping, the extension's state RPC, weight_info, ready, health) and the pre-flight
# (headers only) get no latency: they are what the operator's overhead is made of.
BASE_STEPS = {
    "pause": 0.05,
    "sleep": 0.5,
    "wake_up:weights": 0.3,
    "rolloutfleet_load:verifier": 2.0,
    "rolloutfleet_load:draft": 0.5,
    "update_weight_version": 0.02,
    "wake_up:kv_cache": 0.2,
    "reset_prefix_cache": 0.02,
    "resume": 0.05,
}
LOAD_STEPS = ("rolloutfleet_load:verifier", "rolloutfleet_load:draft")
LONGTAIL_SIGMA = 0.35  # per engine and step: base x lognormal(0, sigma): median x1, 95th percentile ~x1.8
STRAGGLER_FRACTION = 0.03  # engines whose loads are slow on top (a slow disk or a busy node)
STRAGGLER_LOAD_FACTOR = 3.0
LATENCY_KINDS = ("uniform", "longtail", "zero")
ROLLOUTS = {"allatonce": "AllAtOnce", "rolling": "Rolling"}
MODES = ("sleep", "inflight")
ROLLING_MAX_UNAVAILABLE = "25%"
DEFAULT_SCENARIOS = (
    "uniform-allatonce-sleep",
    "longtail-allatonce-sleep",
    "longtail-allatonce-inflight",
    "longtail-rolling-sleep",
)
FINAL_PHASES = ("Succeeded", "Failed", "RolledBack", "Superseded")
NAMESPACE, FLEET = "bench", "policy"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller on each pod (Kubernetes 1.28+)
GROUP, VERSION = "rolloutfleet.io", "v1alpha1"
MAX_NODES = 255  # rolloutfleet.sandbox.nodes.MAX_NODES: one /24 of 127.1.0.0/16 per fake node
REVISION_TIMEOUT_S = 900.0
SOAK_REVISION_TIMEOUT_S = 120.0
SOAK_SAMPLE_EVERY = 50
PASS_LINE = re.compile(
    r"pass (?P<key>\S+): (?P<iterations>\d+) iterations, (?P<reads>\d+) engine reads in (?P<seconds>[0-9.]+)s"
    r"(?:[^;\n]*; at (?P<marks>[^;)\n]*)(?:; started at monotonic (?P<clock>[0-9.]+))?\))?"
)
PASS_MARK = re.compile(r"(?P<phase>[a-z][a-z -]*) (?P<at>[0-9.]+)s")


# -- scenarios, latencies and the lower bound (pure) ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """``<latencies>-<rollout>-<mode>``, e.g. ``longtail-rolling-sleep``."""

    name: str
    latencies: str
    rollout: str  # the API's value: AllAtOnce or Rolling
    mode: str

    @classmethod
    def parse(cls, name: str) -> Scenario:
        parts = name.strip().split("-")
        if len(parts) != 3 or parts[0] not in LATENCY_KINDS or parts[1] not in ROLLOUTS or parts[2] not in MODES:
            raise ValueError(
                f"scenario {name!r}: expected <{'|'.join(LATENCY_KINDS)}>-<{'|'.join(ROLLOUTS)}>-<{'|'.join(MODES)}>"
            )
        return cls(name.strip(), parts[0], ROLLOUTS[parts[1]], parts[2])

    @property
    def max_unavailable(self) -> int | str:
        return ROLLING_MAX_UNAVAILABLE if self.rollout == "Rolling" else 1


def scenario_rng(seed: int, index: int) -> random.Random:
    """The scenario's own generator: a run is reproducible, and scenarios do not share draws."""
    return random.Random(seed * 1_000_003 + index)


def draw_latencies(kind: str, n: int, rng: random.Random) -> tuple[list[dict[str, float]], list[int]]:
    """Per-pod step latencies (index = pod ordinal) and the ordinals of the stragglers.

    ``uniform``: every engine gets the base values. ``longtail``: each engine's each step is base x
    lognormal(0, LONGTAIL_SIGMA), and ~3 % of the engines (at least one) load 3x slower on top.
    ``zero``: nothing takes time (the soak)."""
    if kind == "zero":
        return [dict.fromkeys(BASE_STEPS, 0.0) for _ in range(n)], []
    if kind == "uniform":
        return [dict(BASE_STEPS) for _ in range(n)], []
    if kind != "longtail":
        raise ValueError(f"unknown latency kind {kind!r}")
    stragglers = sorted(rng.sample(range(n), max(1, round(STRAGGLER_FRACTION * n))))
    per_pod = [
        {step: base * rng.lognormvariate(0.0, LONGTAIL_SIGMA) for step, base in BASE_STEPS.items()} for _ in range(n)
    ]
    for ordinal in stragglers:
        for step in LOAD_STEPS:
            per_pod[ordinal][step] *= STRAGGLER_LOAD_FACTOR
    return per_pod, stragglers


def resolve_max_unavailable(value: int | str, total: int) -> int:
    """As the operator does (``planning.rollout``): an integer, or a percentage rounded down; at least 1."""
    if isinstance(value, str) and value.endswith("%"):
        return max(1, math.floor(total * int(value[:-1]) / 100))
    return max(1, int(value))


def pod_sequence(
    steps: dict[str, float], mode: str, *, reset_prefix_cache: bool = False, versioned: bool = True
) -> tuple[float, float]:
    """One pod's (pre-resume, resume) seconds: the steps the operator runs on it, back to back.

    Sleep mode: pause, sleep, wake weights, load verifier, load draft, then the resume composition
    (``reconcile.executor``'s resume calls, after the AllAtOnce barrier): set the weight version, wake kv_cache
    [+ reset prefix cache] + resume. In-flight: the same without sleep and wakes. ``versioned``: the engine has
    weight-version routes (vLLM 0.33; 0.26 skips the step). Until 2026-12-06 this bench counted the stamp
    before the barrier: an AllAtOnce bound differs by it only where the draws make another pod the slowest on
    one side of the barrier, by milliseconds; a Rolling bound not at all."""
    pre = ["pause"]
    if mode == "sleep":
        pre += ["sleep", "wake_up:weights"]
    pre += list(LOAD_STEPS)
    resume = ["update_weight_version"] if versioned else []
    if mode == "sleep":
        resume.append("wake_up:kv_cache")
    if reset_prefix_cache:
        resume.append("reset_prefix_cache")
    resume.append("resume")
    return sum(steps.get(s, 0.0) for s in pre), sum(steps.get(s, 0.0) for s in resume)


def lower_bound(
    per_pod_steps: list[dict[str, float]],
    mode: str,
    rollout: str,
    max_unavailable: int | str = 1,
    *,
    reset_prefix_cache: bool = False,
    versioned: bool = True,
) -> float:
    """The shortest possible rollout of these engines, with zero operator overhead.

    AllAtOnce: no pod resumes before every pod finished its pre-resume steps (the barrier), so the bound is
    the slowest pre-resume sum plus the slowest resume. Rolling: pods start in ordinal order, at most
    ``max_unavailable`` out of service at once, each running its whole sequence back to back: the makespan
    of that greedy list schedule."""
    seqs = [pod_sequence(s, mode, reset_prefix_cache=reset_prefix_cache, versioned=versioned) for s in per_pod_steps]
    return schedule_bound(seqs, rollout, max_unavailable)


def schedule_bound(seqs: list[tuple[float, float]], rollout: str, max_unavailable: int | str = 1) -> float:
    """``lower_bound`` of pods whose (pre-resume, resume) seconds are ``seqs``, in ordinal order."""
    if not seqs:
        return 0.0
    if rollout == "AllAtOnce":
        return max(pre for pre, _ in seqs) + max(res for _, res in seqs)
    if rollout != "Rolling":
        raise ValueError(f"unknown rollout {rollout!r}")
    slots = [0.0] * min(resolve_max_unavailable(max_unavailable, len(seqs)), len(seqs))
    for pre, res in seqs:
        heapq.heappush(slots, heapq.heappop(slots) + pre + res)
    return max(slots)


# The steps that make a pod's resume (``pod_sequence``): the first of them to run starts it.
RESUME_KEYS = frozenset({"update_weight_version", "wake_up:kv_cache", "reset_prefix_cache", "resume"})


def engine_spans(steps: list[tuple[str, float, float]]) -> dict[str, float] | None:
    """One engine's revision as it ran, from its own log (``step_times``): when its pause, its last pre-resume
    step, its resume's first step and its resume ran (this machine's monotonic clock), or None
    if it did not pause and resume in this window. The engine's own time is pause → last pre-resume step and
    its resume's first step → resume: what the bound's pre-resume and resume seconds were configured as, plus
    what the engine took beyond them (its process busy with the other engines it serves)."""
    ordered = sorted(steps, key=lambda s: s[1])
    pause = next((i for i, s in enumerate(ordered) if s[0].split(":", 1)[0] == "pause"), None)
    if pause is None:
        return None
    first_resume = next((i for i in range(pause + 1, len(ordered)) if ordered[i][0] in RESUME_KEYS), None)
    resume = next((s for s in ordered[pause + 1 :] if s[0] == "resume"), None)
    if first_resume is None or resume is None:
        return None
    pre = ordered[pause:first_resume]  # (the withdrawal runs before the pause, the admission after the resume)
    return {
        "pause": ordered[pause][1],
        "pre_end": max(s[2] for s in pre),
        "resume_start": ordered[first_resume][1],
        "resume_end": resume[2],
    }


def engine_timeline(
    steps_by_ip: dict[str, list[tuple[str, float, float]]],
    order: list[str],
    configured: list[tuple[float, float]],
    rollout: str,
    max_unavailable: int | str,
    created: float,
    total: float,
) -> dict[str, Any] | None:
    """Where a revision's wall went, read from the engines' own logs: the bound with each engine's steps as long
    as they took (``engines_bound_s``, against ``lower_bound``'s configured ones), how much longer than configured
    the engines' own parts took, and (AllAtOnce) the revision's milestones in seconds from its creation.

    ``order``: the pods' IPs in ordinal order; ``configured``: their (pre-resume, resume) seconds as drawn, in
    the same order; ``created``: the revision's creation on this machine's monotonic clock; ``total``: its wall.
    None when some pod's engine did not log a whole update in the window."""
    spans = [engine_spans(steps_by_ip.get(ip, [])) for ip in order]
    if not spans or any(s is None for s in spans):
        return None
    real = [s for s in spans if s is not None]
    if rollout == "AllAtOnce":  # two requests, the barrier between them
        ran = [(s["pre_end"] - s["pause"], s["resume_end"] - s["resume_start"]) for s in real]
    else:  # one request from the pause through the resume: the engine's time is all of it
        ran = [(s["resume_end"] - s["pause"], 0.0) for s in real]
    late = [sum(a) - sum(c) for a, c in zip(ran, configured, strict=True)]
    engines_bound = schedule_bound(ran, rollout, max_unavailable)
    out: dict[str, Any] = {
        "engines_bound_s": round(engines_bound, 3),
        "over_engines_bound_s": round(total - engines_bound, 3),
        # How much longer than drawn each engine's own part took (its process serving other engines).
        "engines_late_ms": {"mean": round(1000 * sum(late) / len(late), 1), "max": round(1000 * max(late), 1)},
    }
    if rollout == "AllAtOnce":

        def at(t: float) -> float:
            return round(t - created, 3)

        out["milestones_s"] = {
            "first pause started": at(min(s["pause"] for s in real)),
            "last pause started": at(max(s["pause"] for s in real)),
            "last pre-resume step ended": at(max(s["pre_end"] for s in real)),
            "first resume started": at(min(s["resume_start"] for s in real)),
            "last resume started": at(max(s["resume_start"] for s in real)),
            "last resume ended": at(max(s["resume_end"] for s in real)),
            "revision final": round(total, 3),
        }
    return out


def _py_spy() -> str:
    """py-spy beside this interpreter (``.venv/bin/pip install py-spy``), else the first on PATH (the device:
    its static binary carried, scripts/bench/device-bench.sh)."""
    beside = pathlib.Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile: no py-spy beside the interpreter nor on PATH (pip install py-spy)")
    return found


# -- py-spy profiles (pure) ------------------------------------------------------------------------------

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# The frames every sample of a thread passes through on its way to the work (runpy, asyncio.run, the loop's
# dispatch, thread bootstrap, the executor's worker): left out of the library list, where they would top it.
SCAFFOLDING = frozenset(
    {
        "_run_module_as_main (<frozen runpy>)",
        "_run_code (<frozen runpy>)",
        "run (asyncio/runners.py)",
        "Runner.run (asyncio/runners.py)",
        "BaseEventLoop.run_until_complete (asyncio/base_events.py)",
        "BaseEventLoop.run_forever (asyncio/base_events.py)",
        "BaseEventLoop._run_once (asyncio/base_events.py)",
        "Handle._run (asyncio/events.py)",
        "Thread._bootstrap (threading.py)",
        "Thread._bootstrap_inner (threading.py)",
        "Thread.run (threading.py)",
        "_worker (concurrent/futures/thread.py)",
        "_WorkItem.run (concurrent/futures/thread.py)",
    }
)
# Leaves where a thread waits rather than works (py-spy's idle detection misses some in --nonblocking mode):
# the event loop's select, a blocking read of the API server's answer in an executor thread, an executor
# thread blocked on its queue, a threading wait.
IDLE_LEAVES = frozenset(
    {
        "EpollSelector.select (selectors.py)",
        "SSLSocket.read (ssl.py)",
        "_worker (concurrent/futures/thread.py)",
        "Condition.wait (threading.py)",
        "Event.wait (threading.py)",
    }
)


def _short_path(path: str) -> str:
    """py-spy already shortens paths under sys.path; shorten what is left the same way."""
    if not path.startswith("/"):
        return path
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "rolloutfleet/" in path:
        return "rolloutfleet/" + path.rsplit("rolloutfleet/", 1)[1]
    stdlib = re.search(r"/lib/python3\.\d+/(.*)$", path)
    return stdlib.group(1) if stdlib else path


def _frame(frame: str) -> tuple[str, str]:
    """``func (path/file.py:LINE)`` → (``func (short/path.py)``, short path)."""
    match = FRAME.match(frame)
    if match is None:
        return frame, ""
    path = _short_path(match["file"])
    return f"{match['func']} ({path})", path


# --profile-native: the event loop's thread is the one whose stack passes through this frame; a sample whose
# innermost native frame is the loop's poll is told apart (a wait, or with work ready a poll that does not
# wait: py-spy drops the samples it sees idle, and cannot tell these two apart).
MAIN_THREAD_FRAME = "Runner.run (asyncio/runners.py)"
NATIVE_IDLE_LEAVES = frozenset({"epoll_pwait", "epoll_wait", "poll", "select"})


def _is_python(path: str) -> bool:
    return path.endswith(".py") or path.startswith("<frozen")


def summarize_profile(raw: str, *, top: int = 15, library_top: int = 10, native: bool = False) -> dict[str, Any]:
    """Summarize py-spy's raw output (lines ``frame;frame;... COUNT``, outermost frame first).

    Functions (frames without their line) as percentages of all samples: the ``top`` by self time, the
    ``top`` of ours (``rolloutfleet/``) by inclusive time, and the ``library_top`` other functions by
    inclusive time, ``SCAFFOLDING`` left out. A function counts once per sample however often it recurs in
    the stack. ``idle_pct``: samples whose leaf is a wait (``IDLE_LEAVES``).

    ``native`` (``py-spy --native``, blocking, every thread): only the event loop's thread
    (``MAIN_THREAD_FRAME``); samples in the loop's poll (``NATIVE_IDLE_LEAVES``) are counted in ``idle_pct``
    and left out of the percentages; "self" is the innermost Python frame (the C code under it, uvloop's
    included, is charged to it; the loop's own C work to ``Runner.run``)."""
    total = idle = 0
    own_self: collections.Counter[str] = collections.Counter()
    own_incl: collections.Counter[str] = collections.Counter()
    lib_incl: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        if native:
            if not any(name == MAIN_THREAD_FRAME for name, _ in frames):
                continue
            if frames[-1][0].split(" (", 1)[0] in NATIVE_IDLE_LEAVES:
                idle += samples
                continue
            frames = [(name, path) for name, path in frames if _is_python(path)]
            if not frames:
                continue
        total += samples
        own_self[frames[-1][0]] += samples
        idle += samples if frames[-1][0] in IDLE_LEAVES else 0
        for name in {name for name, path in frames if path.startswith("rolloutfleet/")}:
            own_incl[name] += samples
        for name in {name for name, path in frames if not path.startswith("rolloutfleet/")} - SCAFFOLDING:
            lib_incl[name] += samples

    def pct(counter: collections.Counter[str], k: int) -> list[tuple[str, float]]:
        return [(name, round(100 * c / total, 1)) for name, c in counter.most_common(k)] if total else []

    seen = total + idle if native else total  # native: the waits were left out of ``total``
    return {
        "samples": total,
        "native": native,
        "idle_pct": round(100 * idle / seen, 1) if seen else None,
        "self": pct(own_self, top),
        "own_inclusive": pct(own_incl, top),
        "library_inclusive": pct(lib_incl, library_top),
    }


# The control plane's processes other than the API server and etcd, together in the CPU split (each apart in
# the JSON's ``other_control_plane_by_process``).
OTHER_CONTROL_PLANE = "other control plane"


def _role(comm: str) -> str:
    """A control-plane process's column in the CPU split, by its command name."""
    return comm if comm in ("kube-apiserver", "etcd") else OTHER_CONTROL_PLANE


# --profile-cprofile: the operator's event loop under cProfile with its thread's CPU clock
# (bench/operator_cprofile/sitecustomize.py), per scenario.
CPROFILE_HOOK = pathlib.Path(__file__).resolve().parent / "operator_cprofile"
CPROFILE_DIR_ENV = "ROLLOUTFLEET_BENCH_CPROFILE_DIR"


def _cprofile_area(path: str) -> str:
    """Where a profiled function lives: our package by its subpackage, a library, the standard library, or C."""
    if path == "~":
        return "builtins (C)"
    if "rolloutfleet/" in path:
        parts = path.rsplit("rolloutfleet/", 1)[1].split("/")
        return f"rolloutfleet.{parts[0]}" if len(parts) > 1 else "rolloutfleet"
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1].split("/", 1)[0]
    stdlib = re.search(r"/lib/python3\.\d+/([^/]+)", path)
    if stdlib:
        name = stdlib.group(1)
        return f"stdlib {name.removesuffix('.py')}"
    return "other"


CProfileStats = dict[tuple[str, int, str], tuple[Any, ...]]


def summarize_cprofile(stats: CProfileStats, pods: int, *, top: int = 20) -> dict[str, Any]:
    """``pstats.Stats(...).stats`` (``(file, line, function) -> (primitive calls, calls, self s, cumulative s,
    callers)``) summarized: the profiled CPU seconds, each area's share of the self time, and the ``top``
    functions by self time with their calls per pod and self µs per call."""
    total = sum(entry[2] for entry in stats.values())
    areas: collections.Counter[str] = collections.Counter()
    for (path, _, _), entry in stats.items():
        areas[_cprofile_area(path)] += entry[2]
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    functions = []
    for (path, line, name), entry in ranked:
        where = name if path == "~" else f"{name} ({_short_path(path)}:{line})"
        functions.append(
            {
                "function": where,
                "self_pct": round(100 * entry[2] / total, 1) if total else 0.0,
                "calls_per_pod": round(entry[1] / pods, 2),
                "self_us_per_call": round(1e6 * entry[2] / entry[1], 1) if entry[1] else 0.0,
            }
        )
    return {
        "profiled_cpu_s": round(total, 2),
        "areas": [(area, round(100 * s / total, 1)) for area, s in areas.most_common()] if total else [],
        "top_self": functions,
    }


def _new_file(
    directory: pathlib.Path, pattern: str, before: set[pathlib.Path], timeout: float, poll: float
) -> pathlib.Path | None:
    """The newest file matching ``pattern`` that is not in ``before``, once one appears within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = set(directory.glob(pattern)) - before
        if new:
            return max(new, key=lambda f: f.stat().st_mtime)
        time.sleep(poll)
    return None


def _await_cprofile_start(directory: pathlib.Path, before: set[pathlib.Path], timeout: float = 10) -> bool:
    """Whether the operator said it started profiling (a ``.started`` marker not in ``before``) within
    ``timeout``: the revision is created only after, so that its first steps are in the profile."""
    return _new_file(directory, "operator-*.started", before, timeout, poll=0.01) is not None


def _read_cprofile(directory: pathlib.Path, before: set[pathlib.Path], timeout: float = 60) -> pathlib.Path | None:
    """The statistics file the operator writes after the stopping signal (a name not in ``before``)."""
    return _new_file(directory, "operator-*.pstats", before, timeout, poll=0.1)


# -- the follower process: simulated engines, latencies from a file ----------------------------------------


def _ordinal(pod_name: str) -> int:
    match = re.search(r"-(\d+)$", pod_name)
    return int(match.group(1)) if match else 0


@dataclasses.dataclass
class BenchFollower(PodFollower):
    """A pod follower that serves only its share of the pods (ordinal % procs == index) and applies the
    per-engine latencies the bench writes to ``latency_file`` (``{"serial", "latencies": {ip: {step: s}}}``),
    acknowledging in ``<latency_file>.ack.<index>`` how many of its engines run them."""

    index: int = 0
    procs: int = 1
    latency_file: pathlib.Path | None = None
    pods: int = 0  # the fleet's size (0: not known, watch them all)
    watch_all: bool = False  # every follower watches every pod of the fleet (the bench until 2026-12-04)
    _serial: int = dataclasses.field(default=-1, init=False)
    _wanted: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict, init=False)
    _applied: dict[str, Any] = dataclasses.field(default_factory=dict, init=False)  # engine key -> engine set
    _acked: tuple[int, int, int] | None = dataclasses.field(default=None, init=False)
    _dumped: int = dataclasses.field(default=-1, init=False)

    def mine(self, pod: FollowedPod) -> bool:
        return _ordinal(pod.name) % self.procs == self.index

    def selector(self) -> str:
        """Only this follower's share of the pods, by the StatefulSet's pod-index label: with every follower
        watching the whole fleet, each pod update (two gate writes per pod per revision, the kubelet's) was
        decoded by all of them, 8 full pods per update at 1,024 pods on 16 cores, and the API server sent it
        8 times. Real engines watch nothing; this harness's load should not stand in the operator's way."""
        if self.watch_all or self.procs < 2 or self.pods < 1:
            return super().selector()
        share = ",".join(str(i) for i in range(self.index, self.pods, self.procs))
        return f"{super().selector()},{POD_INDEX_LABEL} in ({share})"

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch())
        try:
            await super().run()
        finally:
            watcher.cancel()

    async def _watch(self) -> None:
        assert self.latency_file is not None
        seen: tuple[int, int, int] | None = None
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                st = self.latency_file.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # the bench replaces the file: a new inode
                if stamp != seen:
                    data = json.loads(self.latency_file.read_text())
                    seen = stamp
                    if int(data["serial"]) != self._serial:
                        self._serial, self._wanted = int(data["serial"]), data["latencies"]
                        self._applied.clear()
            self._apply()  # every round: an engine started since (a pod restarted) gets its latencies too
            self._dump()
            await asyncio.sleep(0.5)

    def _apply(self) -> None:
        engines = dict(self.sim.engines) if self.sim is not None else {}
        for key, engine in engines.items():
            steps = self._wanted.get(key.rpartition(":")[0])
            if steps is not None and self._applied.get(key) is not engine:
                engine.set_latencies(Latencies(steps=dict(steps)))
                self._applied[key] = engine
        updated = sum(1 for key, engine in self._applied.items() if engines.get(key) is engine)
        ack = (self._serial, updated, len(engines))
        if ack != self._acked and self.latency_file is not None:
            _write_whole(
                ack_path(self.latency_file, self.index), {"serial": ack[0], "updated": ack[1], "engines": ack[2]}
            )
            self._acked = ack

    def _dump(self) -> None:
        """Answer the bench's request for its engines' step times (``dump_path``), once per request."""
        assert self.latency_file is not None
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
            request = json.loads(dump_path(self.latency_file).read_text())
            serial, since = int(request["serial"]), float(request["since"])
            if serial == self._dumped:
                return
            engines = dict(self.sim.engines) if self.sim is not None else {}
            times = {key.rpartition(":")[0]: step_times(e.log.entries, since) for key, e in engines.items()}
            _write_whole(steps_path(self.latency_file, self.index), {"serial": serial, "engines": times})
            self._dumped = serial


def step_times(entries: list[dict[str, Any]], since: float) -> list[tuple[str, float, float]]:
    """An engine's answered steps that ended at or after ``since`` (this machine's monotonic clock, as the
    bench's): each as (its most specific key, when it started, when it ended), in the engine's order."""
    return [
        (str(e.get("key") or e["step"]), float(e["t0"]), float(e["t"]))
        for e in entries
        if "t0" in e and e.get("status") == 200 and e["t"] >= since
    ]


def dump_path(latency_file: pathlib.Path) -> pathlib.Path:
    """Where the bench asks the followers for their engines' step times (``{"serial", "since"}``)."""
    return latency_file.with_name(f"{latency_file.name}.dump")


def steps_path(latency_file: pathlib.Path, index: int) -> pathlib.Path:
    """Where follower ``index`` answers with its engines' step times (``{"serial", "engines": {ip: [...]}}``)."""
    return latency_file.with_name(f"{latency_file.name}.steps.{index}")


def ack_path(latency_file: pathlib.Path, index: int) -> pathlib.Path:
    """Where follower ``index`` acknowledges the latencies it applied."""
    return latency_file.with_name(f"{latency_file.name}.ack.{index}")


def _temporary(path: pathlib.Path) -> pathlib.Path:
    # The name plus a suffix, not ``with_suffix``: that replaced ``.ack.<index>``'s ``.<index>``, so every
    # follower wrote the same temporary file and one follower's ``replace`` could find it gone (its watch
    # task then died: "followers applied latencies to 768/1024 engines", four followers at 1,024 pods).
    return path.with_name(path.name + ".tmp")


def _write_whole(path: pathlib.Path, data: Any) -> None:
    """``data`` as JSON at ``path``, replaced whole: the bench and its followers read each other's files while
    they are written (``_temporary``)."""
    tmp = _temporary(path)
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def follower_main(
    kubeconfig: str, index: int, procs: int, latency_file: str, pods: int = 0, watch_all: bool = False
) -> None:
    """Child process: serve simulated engines on this follower's share of the fleet's pods until killed."""
    from kubernetes import config

    api = config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    follower = BenchFollower(
        api,
        NAMESPACE,
        FLEET,
        weights=WeightsConfig(synthetic_root="/synthetic", verifier_bytes=16 * 2**30, draft_bytes=2**30),
        latencies=Latencies(steps=dict(BASE_STEPS)),
        interval=3.0,  # the fleet and its token: the fleet object carries a status row per pod
        index=index,
        procs=procs,
        latency_file=pathlib.Path(latency_file),
        pods=pods,
        watch_all=watch_all,
    )
    asyncio.run(follower.run())


# -- /proc and /metrics ----------------------------------------------------------------------------------------


def default_engine_procs(cores: int) -> int:
    """Half the machine's cores, at least 1 and at most 8. One follower process serving 1,024 engines answers
    the fleet's bursts late (on 16 cores its engines took 0.63-0.89 s for a 0.5 s draft load), and the lower
    bound assumes engines that take their configured time; on 2 cores more processes only share the same
    cores with the operator and the control plane (bench/results/rollout_overhead_16_cores.md)."""
    return max(1, min(8, cores // 2))


def default_idle_before(keep_alive: int | None) -> float:
    """Seconds the settled fleet idles before each revision: past the engines' keep-alive (vLLM's 5 s unless
    ``--engine-keep-alive``) and past the time the operator keeps an idle API server connection (15 s), so each
    revision opens its connections to the engines and to the API server as one minutes after the last would.
    With the second shorter, the API connections were kept or not depending on how long the fleet took to settle
    after the scenario before: 0 and 63 TLS handshakes in two runs of one code (issue 18)."""
    engines = float(keep_alive if keep_alive is not None else vllm_flags.HTTP_KEEP_ALIVE_DEFAULT)
    return max(engines, kube_http.IDLE_SECONDS) + 1.0


@dataclasses.dataclass(frozen=True)
class _CalibrationState:
    """A small frozen value, made and copied as the operator makes its engine snapshots."""

    index: int
    serving: bool
    digest: str | None
    step: str


# A pod-like document, as the operator decodes and encodes its watch events and status rows.
_CALIBRATION_DOC = json.dumps(
    {
        "metadata": {"name": "policy-0", "namespace": "ns", "labels": {"app": "policy", "hash": "policy-abc"}},
        "status": {"phase": "Running", "conditions": [{"type": t, "status": "True"} for t in ("A", "B", "C", "D")]},
    }
)


def _calibration_work(rounds: int) -> int:
    """Pure-Python work of the operator's kind (JSON, dicts, small frozen values, f-strings, calls)."""
    total = 0
    for i in range(rounds):
        doc = json.loads(_CALIBRATION_DOC)
        doc["metadata"]["name"] = f"policy-{i}"
        conditions = {c["type"]: c["status"] == "True" for c in doc["status"]["conditions"]}
        state = dataclasses.replace(_CalibrationState(i, all(conditions.values()), None, "Pause"), step="Done")
        total += len(json.dumps(doc)) + state.index % 7 + len(conditions)
    return total


def calibrate(repeats: int = 5, rounds: int = 4000) -> float:
    """How fast this machine and interpreter run the operator's kind of code right now: the best of ``repeats``
    runs of ``_calibration_work``, in CPU milliseconds of this thread. Taken before each revision, on a fleet
    at rest, so that CPU per pod measured on two machines or in two hours can be compared with the speed each
    ran at: the simulated engines' CPU for one revision differed 1.7x between hours of one box, and the long tail
    cost the operator more on 16-core machines than here, with nothing to tell a slower core from the code
    (rollout_overhead.md)."""
    best = math.inf
    for _ in range(repeats):
        started = time.thread_time()
        _calibration_work(rounds)
        best = min(best, time.thread_time() - started)
    return round(1000 * best, 2)


SPEED_PROBE_ROUNDS = 400  # ~4 ms of work per sample: a twentieth of a core at SPEED_PROBE_INTERVAL_S
SPEED_PROBE_INTERVAL_S = 0.1
# How the bench starts the probe's process (``rollout_overhead.py SPEED_PROBE_CHILD PATH``): not the user's
# ``--speed-probe``, which with one other argument was taken for it.
SPEED_PROBE_CHILD = "--speed-probe-child"


def speed_probe_main(path: str, rounds: int = SPEED_PROBE_ROUNDS, interval: float = SPEED_PROBE_INTERVAL_S) -> None:
    """``--speed-probe``: the calibration's work in small pieces, for as long as its parent lives, each timed in
    this thread's CPU and written to ``path`` as ``<monotonic seconds> <CPU ms per calibration>`` (scaled to
    ``calibrate``'s rounds). Why: ``calibrate`` is one moment before a revision, and a 16-core machine's speed
    changed 2x within minutes (rollout_overhead_16_cores.md); CPU time grows under contention for a core's shared
    parts (another hardware thread on it, caches, memory) but not under time slicing, so this follows how much
    slower the operator's kind of code ran *during* each revision than at rest. CLOCK_MONOTONIC is one clock for
    every process of the machine, so the bench cuts the samples at its own revision window."""
    parent = os.getppid()
    scale = 4000 / rounds
    with open(path, "a", buffering=1) as out:
        while os.getppid() == parent:
            at, started = time.monotonic(), time.thread_time()
            _calibration_work(rounds)
            out.write(f"{at:.3f} {1000 * scale * (time.thread_time() - started):.2f}\n")
            time.sleep(interval)


def speed_probe_summary(text: str, start: float, end: float, rest_s: float) -> dict[str, Any] | None:
    """The probe's samples (``speed_probe_main``'s lines) in the revision [start, end] and in the ``rest_s``
    before it (the settled fleet idle): the median of each, and how much slower the work ran during the revision.
    None without samples in both."""
    during, rest = [], []
    for line in text.splitlines():
        at_text, _, value = line.partition(" ")
        try:
            at, ms = float(at_text), float(value)
        except ValueError:  # a line cut by the probe's end
            continue
        if start <= at <= end:
            during.append(ms)
        elif start - rest_s <= at < start:
            rest.append(ms)
    if not during or not rest:
        return None
    during_ms, rest_ms = statistics.median(during), statistics.median(rest)
    return {
        "rest_ms": round(rest_ms, 2),
        "during_ms": round(during_ms, 2),
        "slowdown": round(during_ms / rest_ms, 3),
        "samples": len(during),
    }


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``/sys/devices/system/cpu/cpuN/topology/thread_siblings_list``: ``3,11``, ``0-1``,
    ``4``) as its CPUs."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def smt_siblings(cpu: int, sys_cpu: pathlib.Path = pathlib.Path("/sys/devices/system/cpu")) -> set[int]:
    """``cpu`` and the hardware threads that share its core (``{cpu}`` where the kernel does not say): what
    ``--operator-cpu`` keeps everything else off, as the static CPU manager's ``full-pcpus-only`` option does
    for a Guaranteed pod. A busy sibling takes a share of the core's execution units, and the operator's CPU
    seconds then measure a slower core, not more work."""
    try:
        text = (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    return parse_cpu_list(text) | {cpu}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_times(pid: int, thread: int | None = None) -> tuple[float, float] | None:
    """User and system CPU seconds (all threads) of a live process, from /proc, or of its thread ``thread`` alone;
    None for one that is gone."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = pathlib.Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a live process; 0 for one that is gone."""
    times = _proc_times(pid)
    return 0.0 if times is None else times[0] + times[1]


def _proc_sched(pid: int) -> dict[str, float]:
    """How a process spent its CPU: user and system seconds (all threads), its main thread's (the event loop's:
    what a profile of the loop sees; the rest is the Kubernetes client's pool, the metrics server), and its main
    thread's voluntary context switches (each one a sleep in epoll and a wake-up after it). Empty when gone."""
    times, main = _proc_times(pid), _proc_times(pid, thread=pid)
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    if times is None or main is None:
        return {}
    out = {"user_s": times[0], "system_s": times[1], "main_thread_s": main[0] + main[1]}
    for line in status.splitlines():
        if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
            key, value = line.split(":")
            out[key] = float(value)
    return out


def _sched_delta(after: dict[str, float], before: dict[str, float], pods: int) -> dict[str, float] | None:
    """The operator's user/system split and wake-ups over a revision (``_proc_sched`` readings), per pod too."""
    if not after or not before:
        return None
    user, system = after["user_s"] - before["user_s"], after["system_s"] - before["system_s"]
    loop = after["main_thread_s"] - before["main_thread_s"]
    woken = after.get("voluntary_ctxt_switches", 0.0) - before.get("voluntary_ctxt_switches", 0.0)
    preempted = after.get("nonvoluntary_ctxt_switches", 0.0) - before.get("nonvoluntary_ctxt_switches", 0.0)
    return {
        "user_s": round(user, 2),
        "system_s": round(system, 2),
        "loop_thread_s": round(loop, 2),
        "other_threads_s": round(user + system - loop, 2),
        "loop_wakeups": int(woken),
        "loop_wakeups_per_pod": round(woken / pods, 2),
        "loop_preempted": int(preempted),
        "cpu_us_per_wakeup": round(1e6 * (user + system) / woken, 1) if woken else None,
    }


def _machine_busy() -> float:
    """CPU seconds all cores spent busy since boot (from /proc/stat)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _roles(reading: dict[str, float]) -> dict[str, float]:
    """A ``Fleet.cpu`` reading by role: the engine processes summed, the bench's own and the clock left out."""
    out = {k: v for k, v in reading.items() if not k.startswith("engines.") and k not in ("t", "bench", "py-spy")}
    out["engines"] = sum(v for k, v in reading.items() if k.startswith("engines."))
    return out


def _at(samples: list[dict[str, float]], when: float) -> dict[str, float]:
    """The CPU seconds by role at ``when``, interpolated between the two readings around it (clamped)."""
    later = next((i for i, s in enumerate(samples) if s["t"] >= when), len(samples) - 1)
    a, b = samples[max(0, later - 1)], samples[later]
    share = 0.0 if b["t"] <= a["t"] else min(1.0, max(0.0, (when - a["t"]) / (b["t"] - a["t"])))
    ra, rb = _roles(a), _roles(b)
    return {k: ra.get(k, 0.0) + share * (rb.get(k, 0.0) - ra.get(k, 0.0)) for k in rb}


def cpu_by_phase(samples: list[dict[str, float]], start: float, phases: dict[str, float]) -> list[dict[str, Any]]:
    """How many cores each role kept busy between consecutive phases of a pass (``--cpu-timeline``).

    ``samples``: ``Fleet.cpu`` readings taken every few tens of milliseconds, each with its monotonic ``t``;
    ``start``: the pass's start on the same clock (its log line); ``phases``: seconds from it. Each window's
    rate is the difference of the readings interpolated at its ends, over its length: /proc counts in clock
    ticks (10 ms), so a window of a tenth of a second is good to about a tenth of a core per process.
    """
    if len(samples) < 2:
        return []
    bounds = [("pass start", 0.0), *sorted(phases.items(), key=lambda p: p[1])]
    out = []
    for (first, a), (second, b) in itertools.pairwise(bounds):
        if b <= a:
            continue
        before, after = _at(samples, start + a), _at(samples, start + b)
        cores = {k: round((after[k] - before.get(k, 0.0)) / (b - a), 2) for k in after}
        out.append({"from": first, "to": second, "seconds": round(b - a, 3), "cores": cores})
    return out


class CpuTimeline:
    """``Fleet.cpu`` read every ``interval`` seconds on a thread while a scenario runs (``--cpu-timeline``):
    what each process did in each phase of the pass, not only in the whole revision."""

    def __init__(self, fleet: Fleet, interval: float) -> None:
        self.fleet, self.interval = fleet, interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(self.fleet.cpu())
            if self._stop.wait(self.interval):
                self.samples.append(self.fleet.cpu())
                return

    def __enter__(self) -> CpuTimeline:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmHWM, VmRSS) in MB: the peak since start or since ``_reset_peak``, and now."""
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    values = []
    for key in ("VmHWM", "VmRSS"):
        match = re.search(rf"{key}:\s+(\d+) kB", text)
        values.append(int(match.group(1)) / 1024 if match else float("nan"))
    return values[0], values[1]


def _reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0), so the peak is this scenario's."""
    try:
        pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _metrics(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The operator's /metrics as (name, labels, value) samples."""
    return metric_samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """A Prometheus /metrics text as (name, labels, value) samples."""
    out = []
    for match in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        out.append((match.group(1), labels, float(match.group(3))))
    return out


def _request_counts(port: int) -> dict[str, dict[str, float]]:
    """The operator's engine requests by route, its Kubernetes API requests by verb, its cycle collector's
    seconds by generation and the connections it opened to engines and to the API server, so far."""
    engine: dict[str, float] = collections.defaultdict(float)
    kube: dict[str, float] = collections.defaultdict(float)
    gc_seconds: dict[str, float] = {}
    lag: dict[str, float] = {}
    connections = {"engine": 0.0, "kube": 0.0}
    for name, labels, value in _metrics(port):
        if name == "rolloutfleet_engine_connections_opened_total":
            connections["engine"] = value
        elif name == "rolloutfleet_kube_connections_opened_total":
            connections["kube"] = value
        elif name == "rolloutfleet_engine_request_duration_seconds_count":
            engine[labels.get("route", "?")] += value
        elif name == "rolloutfleet_kube_api_requests_total":
            kube[labels.get("verb", "?")] += value
        elif name == "rolloutfleet_gc_seconds_total":
            gc_seconds[labels.get("generation", "?")] = value
        elif name == "rolloutfleet_event_loop_lag_seconds_bucket":
            lag[labels.get("le", "?")] = value
    return {"engine": dict(engine), "kube": dict(kube), "gc": gc_seconds, "connections": connections, "lag": lag}


def loop_lag_summary(after: dict[str, float], before: dict[str, float]) -> dict[str, Any] | None:
    """The operator's event-loop lag samples over a revision (``rolloutfleet_event_loop_lag_seconds``'s cumulative
    buckets read before and after): how many, how many ran over 10, 50 and 250 ms late, and the bound of the
    bucket that holds the worst (``+Inf`` past the last); None for an operator without the metric."""
    if not after:
        return None
    counts = {le: after[le] - before.get(le, 0.0) for le in after}
    total = counts.get("+Inf", 0.0)
    bounds = sorted((float(le), n) for le, n in counts.items() if le != "+Inf")
    worst = next((le for le, n in bounds if n >= total), math.inf) if total else 0.0
    return {
        "samples": int(total),
        **{f"over_{ms}ms": int(total - counts.get(str(ms / 1000), total)) for ms in (10, 50, 250)},
        "worst_under_s": "+Inf" if worst == math.inf else worst,
    }


# What the API server itself counts (its /metrics): every client's requests, not only the operator's, and
# the watch events it sent: (metric, the labels that key it).
SERVER_METRICS = {
    "apiserver_request_total": ("verb", "resource", "subresource"),
    "apiserver_request_duration_seconds_sum": ("verb", "resource", "subresource"),
    "apiserver_watch_events_total": ("kind", "resource"),
    "apiserver_watch_events_sizes_sum": ("kind", "resource"),
}


def server_counts(text: str) -> dict[str, float]:
    """``SERVER_METRICS`` from the API server's /metrics text, summed by their keys: ``metric verb/resource/sub``."""
    out: dict[str, float] = collections.defaultdict(float)
    for match in re.finditer(r"^([a-z_]+)\{([^}]*)\} (\S+)$", text, re.M):
        keys = SERVER_METRICS.get(match.group(1))
        if keys is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        key = "/".join(labels[k] for k in keys if labels.get(k))
        out[f"{match.group(1)} {key}"] += float(match.group(3))
    return dict(out)


def _server_metrics(local: Any) -> dict[str, float]:
    raw = local.request("GET", "/metrics")
    return server_counts(raw if isinstance(raw, str) else "")


def controller_queue_counts(text: str) -> dict[str, float]:
    """Each work queue's seconds in its workers and items added, from a controller's /metrics text (keys
    ``seconds <queue>`` and ``adds <queue>``): which of the controller manager's controllers the CPU in "other
    control plane" went to (its endpoint slices, the StatefulSet's status, the disruption budget)."""
    out: dict[str, float] = {}
    names = {"workqueue_work_duration_seconds_sum": "seconds", "workqueue_adds_total": "adds"}
    for name, labels, value in metric_samples(text):
        if name in names:
            key = f"{names[name]} {labels.get('name', '?')}"
            out[key] = out.get(key, 0.0) + value
    return out


def _controller_queues(local: Any) -> dict[str, float]:
    read = getattr(local, "component_metrics", None)  # (None: an older operator tree first on PYTHONPATH, A/B)
    if read is None:
        return {}
    try:
        return controller_queue_counts(read("kube-controller-manager"))
    except (OSError, ValueError, RuntimeError) as exc:  # (RuntimeError: ClusterError, a cluster without the port)
        _log(f"controller manager metrics: {exc}")
        return {}


def controller_queue_summary(after: dict[str, float], before: dict[str, float]) -> dict[str, dict[str, float]]:
    """The queues that worked during a revision: ``{queue: {"seconds": s, "adds": n}}``, the busiest first."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    queues = {k.split(" ", 1)[1] for k in delta}
    out = {
        q: {"seconds": round(delta.get(f"seconds {q}", 0.0), 3), "adds": delta.get(f"adds {q}", 0.0)} for q in queues
    }
    busy = {q: v for q, v in out.items() if v["seconds"] > 0 or v["adds"] > 0}
    return dict(sorted(busy.items(), key=lambda kv: -kv[1]["seconds"]))


def _apiserver_profile(local: Any, seconds: int, path: pathlib.Path) -> threading.Thread:
    """The API server's CPU profile (Go pprof) over the next ``seconds``, written to ``path`` by a thread."""

    def fetch() -> None:
        req = urllib.request.Request(
            f"{local.server}/debug/pprof/profile?seconds={seconds}",
            headers={"Authorization": f"Bearer {local.pki.admin_token()}"},
        )
        try:
            with urllib.request.urlopen(req, context=local.ssl_context(), timeout=seconds + 60) as resp:
                path.write_bytes(resp.read())
        except OSError as exc:
            _log(f"apiserver profile: {exc}")

    thread = threading.Thread(target=fetch, name="apiserver-profile", daemon=True)
    thread.start()
    return thread


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    keys = set(after) | set(before)
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(keys) if after.get(k) != before.get(k)}


def _cluster_sizing(n: int, subnet_offset: int) -> tuple[int, int]:
    """(nodes, GPUs per node): 8-GPU nodes, at least 4; past 255 - offset nodes (one /24 of pod IPs each),
    fatter nodes (a multiple of 8 GPUs) instead."""
    available = MAX_NODES - subnet_offset
    gpus = 8
    while math.ceil(n / gpus) > available:
        gpus += 8
    return max(4, math.ceil(n / gpus)), gpus


# -- one fleet size --------------------------------------------------------------------------------------------


def create_weights_volume(core: Any, namespace: str, host_path: str) -> None:
    """The fleet's weights volume: a ReadOnlyMany PersistentVolume ``w`` on ``host_path`` bound to the claim
    ``w`` in ``namespace`` (kwok never mounts it; the pods only need it to be bound). Shared by the benches."""
    core.create_persistent_volume(
        {
            "metadata": {"name": "w"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": host_path},
                "claimRef": {"namespace": namespace, "name": "w"},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": "w"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": "w",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )


def fleet_spec(n: int, keep_alive: int | None = None) -> dict[str, Any]:
    """The bench's RolloutFleet spec for ``n`` pods (its StatefulSet's pods are what every bench here writes to);
    ``keep_alive``: the engines' VLLM_HTTP_TIMEOUT_KEEP_ALIVE in its env (vLLM's 5 s without)."""
    env = [] if keep_alive is None else [{"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": str(keep_alive)}]
    return {
        "env": env,
        "replicas": n,
        "image": "vllm-rolloutfleet:0.33.0",  # has the weight-version routes: update_weight_version is a step
        "verifier": {"path": "/synthetic/policy/step-0/verifier"},
        "draft": {"method": "draft_model", "path": "/synthetic/policy/step-0/draft"},
        "weights": {"claimName": "w", "mountPath": "/synthetic", "allowedRoots": ["/synthetic/policy"]},
        "updateStrategy": {"mode": "sleep", "rollout": "AllAtOnce", "timeouts": {"wakeSeconds": 60}},
    }


@dataclasses.dataclass
class Fleet:
    """One control plane with one fleet, its operator and its engines: what the scenarios run against."""

    n: int
    args: argparse.Namespace
    tmp: pathlib.Path
    local: Any
    api: Any
    metrics_port: int
    operator: subprocess.Popen[bytes]
    followers: list[subprocess.Popen[bytes]]
    latency_file: pathlib.Path
    components: dict[int, str]  # control-plane pid -> its command name (``_role`` groups them)
    reset_prefix_cache: bool
    probe: subprocess.Popen[bytes] | None = None  # --speed-probe
    serial: int = 0
    dump_serial: int = 0

    @property
    def probe_path(self) -> pathlib.Path:
        return self.tmp / "speed-probe.txt"

    @property
    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api)

    @property
    def log_path(self) -> pathlib.Path:
        return self.tmp / "operator.log"

    def get_fleet(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "rolloutfleets", FLEET)

    def pods(self) -> list[tuple[int, str, str]]:
        """(ordinal, pod IP, uid) of the fleet's Running pods, by ordinal."""
        items = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"rolloutfleet.io/fleet={FLEET}").items
        pods = [
            (_ordinal(p.metadata.name), p.status.pod_ip, p.metadata.uid)
            for p in items
            if p.status.phase == "Running" and p.status.pod_ip
        ]
        return sorted(pods)

    def wait_settled(self, timeout: float) -> float:
        """Until the operator reconciled the latest spec and opened every pod's gate: readyReplicas == n."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            body = self.get_fleet()
            status = body.get("status") or {}
            generation = int(body["metadata"].get("generation") or 0)
            if (
                int(status.get("readyReplicas") or 0) == self.n
                and int(status.get("observedGeneration") or 0) >= generation
            ):
                return time.monotonic() - started
            time.sleep(0.5)  # each GET carries the per-pod status of the whole fleet: poll gently
        raise TimeoutError(f"fleet not settled (readyReplicas == {self.n}) in {timeout:.0f}s")

    def set_strategy(self, rollout: str, max_unavailable: int | str) -> None:
        """The fleet's rollout and maxUnavailable (neither is in the pod template, so no pod restarts).

        The mode is not set here: ``updateStrategy.mode`` decides ``--enable-sleep-mode``, so changing it
        rolls every pod (a StatefulSet update) and then forbids sleep-mode revisions. Scenarios give the
        mode in the revision's ``spec.strategy`` override instead, on a fleet started in sleep mode."""
        self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            "rolloutfleets",
            FLEET,
            {"spec": {"updateStrategy": {"rollout": rollout, "maxUnavailable": max_unavailable}}},
        )

    def push_latencies(self, by_ip: dict[str, dict[str, float]], timeout: float = 120.0) -> None:
        """Hand the followers their engines' latencies; return once they run on every engine."""
        self.serial += 1
        _write_whole(self.latency_file, {"serial": self.serial, "latencies": by_ip})
        acks = [ack_path(self.latency_file, i) for i in range(len(self.followers))]
        started = time.monotonic()
        updated = 0
        while time.monotonic() - started < timeout:
            updated = 0
            for path in acks:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    ack = json.loads(path.read_text())
                    if ack["serial"] == self.serial:
                        updated += int(ack["updated"])
            if updated >= len(by_ip):
                return
            time.sleep(0.2)
        raise TimeoutError(f"followers applied latencies to {updated}/{len(by_ip)} engines in {timeout:.0f}s")

    def engine_steps(self, since: float, timeout: float = 30.0) -> dict[str, list[tuple[str, float, float]]] | None:
        """Every engine's answered steps since ``since`` (``step_times``), by pod IP, as the followers logged
        them; None if a follower did not answer within ``timeout``."""
        self.dump_serial += 1
        _write_whole(dump_path(self.latency_file), {"serial": self.dump_serial, "since": since})
        pending = {i: steps_path(self.latency_file, i) for i in range(len(self.followers))}
        merged: dict[str, list[tuple[str, float, float]]] = {}
        started = time.monotonic()
        while pending and time.monotonic() - started < timeout:
            for i, path in list(pending.items()):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    answer = json.loads(path.read_text())
                    if answer["serial"] == self.dump_serial:
                        merged.update({ip: [tuple(s) for s in steps] for ip, steps in answer["engines"].items()})
                        del pending[i]
            if pending:
                time.sleep(0.2)
        if pending:
            _log(f"followers {sorted(pending)} gave no step times within {timeout:.0f}s")
            return None
        return merged

    def cpu(self, spy: int | None = None) -> dict[str, float]:
        """CPU seconds so far by role, plus the machine's busy seconds and a monotonic timestamp."""
        out: dict[str, float] = collections.defaultdict(float)
        out["operator"] = _proc_cpu(self.operator.pid)
        for i, follower in enumerate(self.followers):
            out[f"engines.{i}"] = _proc_cpu(follower.pid)
        for pid, comm in self.components.items():
            used, role = _proc_cpu(pid), _role(comm)
            out[role] += used
            if role == OTHER_CONTROL_PLANE:
                out[f"{OTHER_CONTROL_PLANE}.{comm}"] += used  # (not summed: a split)
        out["bench"] = _proc_cpu(os.getpid()) + (_proc_cpu(self.probe.pid) if self.probe is not None else 0.0)
        if spy is not None:
            out["py-spy"] = _proc_cpu(spy)
        out["machine"] = _machine_busy()
        out["t"] = time.monotonic()
        return dict(out)

    def log_offset(self) -> int:
        return self.log_path.stat().st_size

    def passes(self, offset: int, key: str) -> dict[str, Any]:
        """The operator's pass log lines for one revision since ``offset``: count, iterations, engine reads."""
        with self.log_path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        found = [m for m in PASS_LINE.finditer(text) if m["key"] == key]
        last_marks = (found[-1]["marks"] or "") if found else ""
        return {
            "passes": len(found),
            "iterations": sum(int(m["iterations"]) for m in found),
            "engine_reads": sum(int(m["reads"]) for m in found),
            "seconds": round(sum(float(m["seconds"]) for m in found), 2),
            # When the last pass reached each phase, seconds from its start (the operator's own log line).
            "phases": {m["phase"]: float(m["at"]) for m in PASS_MARK.finditer(last_marks)},
            # That start on the machine's monotonic clock (None from operators before 2026-12-04's stop 46).
            "started_monotonic": float(found[-1]["clock"]) if found and found[-1]["clock"] else None,
        }

    def create_revision(self, revision: int, mode: str) -> str:
        """A WeightRevision of the synthetic pair of ``revision``; with ``--digests pinned`` (the default) naming
        both digests, as ``rolloutfleet.trainer`` publishes them (the synthetic weights' digests are known without
        reading anything: ``synthetic_digest``)."""
        from rolloutfleet.sim.weights import synthetic_digest

        name = f"step-{revision}"
        verifier, draft = f"/synthetic/policy/step-{revision}/verifier", f"/synthetic/policy/step-{revision}/draft"
        pair: dict[str, Any] = {"verifier": {"path": verifier}, "draft": {"path": draft}}
        if self.args.digests == "pinned":
            pair["verifier"]["digest"], pair["draft"]["digest"] = synthetic_digest(verifier), synthetic_digest(draft)
        self.custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            "weightrevisions",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "WeightRevision",
                "metadata": {"name": name},
                "spec": {
                    "fleetRef": {"name": FLEET},
                    "revision": revision,
                    **pair,
                    "strategy": {"mode": mode},
                },
            },
        )
        return name

    def delete_revision(self, revision: int) -> None:
        """Delete ``create_revision``'s object for ``revision`` (gone already: nothing to do)."""
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            name = f"step-{revision}"
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "weightrevisions", name)

    def await_revision(self, name: str, timeout: float) -> dict[str, Any]:
        """Watch the revision until a final phase (or the timeout); the last status seen.

        A watch, not a poll: the bench sees the final phase when the operator writes it. Until 2026-12-03 the
        bench read the whole object every 0.2 s, which saw it up to 0.2 s late plus the read itself (the
        per-pod status of the fleet), added to every wall time measured."""
        from kubernetes import watch

        started = time.monotonic()
        status: dict[str, Any] = {}
        while (left := timeout - (time.monotonic() - started)) > 0:
            w = watch.Watch()
            for event in w.stream(
                self.custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                NAMESPACE,
                "weightrevisions",
                field_selector=f"metadata.name={name}",
                timeout_seconds=max(1, int(left)),
            ):
                status = event["object"].get("status") or {}
                if status.get("phase") in FINAL_PHASES:
                    w.stop()
                    return status
        return status


def start_fleet(n: int, args: argparse.Namespace, tmp: pathlib.Path, stack: contextlib.ExitStack) -> Fleet:
    """Control plane, CRDs, weights volume, operator, followers and the fleet, up to engines answering."""
    from kubernetes import client, config

    from rolloutfleet.api import crdgen
    from rolloutfleet.api.fleet import RolloutFleetSpec
    from rolloutfleet.planning.revisions import prefix_caching_on
    from rolloutfleet.sandbox import cluster

    nodes, gpus = _cluster_sizing(n, args.subnet_offset)
    local = cluster.Cluster(
        tmp,
        name=f"bench{n}",
        nodes=nodes,
        gpus_per_node=gpus,
        subnet_offset=args.subnet_offset,
        tie_to_parent=True,
        apiserver_profiling=args.apiserver_profile > 0,
    )
    stack.callback(local.stop)
    local.start()
    api = config.new_client_from_config(config_file=str(local.kubeconfig), persist_config=False)
    ext = client.ApiextensionsV1Api(api)
    for crd in crdgen.custom_resource_definitions().values():
        ext.create_custom_resource_definition(crd)
    time.sleep(2)
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    while not core.list_namespaced_service_account(NAMESPACE).items:
        time.sleep(0.2)
    create_weights_volume(core, NAMESPACE, "/synthetic")
    # The control plane's processes, before ours exist (the followers' command lines name the kubeconfig).
    components = {}
    for pid in local.pids():
        with contextlib.suppress(OSError):
            components[pid] = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    metrics_port = _free_port()
    env = dict(
        os.environ,
        KUBECONFIG=str(local.kubeconfig),
        ROLLOUTFLEET_IDLE_SECONDS="1",
        ROLLOUTFLEET_RESYNC_SECONDS="10",
    )
    if args.profile_cprofile:  # the operator alone imports the hook (its sitecustomize), and only now
        (tmp / "cprofile").mkdir(exist_ok=True)
        env[CPROFILE_DIR_ENV] = str(tmp / "cprofile")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPROFILE_HOOK), env.get("PYTHONPATH", "")) if p)
    log = stack.enter_context((tmp / "operator.log").open("wb"))
    stack.callback(
        lambda: (pathlib.Path(tempfile.gettempdir()) / f"rf-bench-operator-{n}.log").write_bytes(
            (tmp / "operator.log").read_bytes()
        )
    )
    operator = subprocess.Popen(
        [
            *(sys.executable, "-m", "rolloutfleet.cli", "run", "-A", "--standalone"),
            *("--metrics-port", str(metrics_port), "--liveness", ""),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    if args.operator_cpu is not None:  # at once, while it is one thread: the threads it starts inherit the core
        os.sched_setaffinity(operator.pid, {args.operator_cpu})
    stack.callback(_stop, operator)
    latency_file = tmp / "latencies.json"
    followers = []
    for i in range(args.engine_procs):
        follower_log = stack.enter_context(
            (pathlib.Path(tempfile.gettempdir()) / f"rf-bench-follower-{n}-{i}.log").open("wb")
        )
        follower = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--follower",
                str(local.kubeconfig),
                str(i),
                str(args.engine_procs),
                str(latency_file),
                str(n),
                *(["--watch-all"] if args.followers_watch_all else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=follower_log,
            # The simulated engines keep idle connections as vLLM does, for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds.
            env=dict(os.environ)
            if args.engine_keep_alive is None
            else dict(os.environ, VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(args.engine_keep_alive)),
        )
        stack.callback(_stop, follower)
        followers.append(follower)
    spec = fleet_spec(n, args.engine_keep_alive)
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP,
        VERSION,
        NAMESPACE,
        "rolloutfleets",
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RolloutFleet", "metadata": {"name": FLEET}, "spec": spec},
    )
    fleet = Fleet(
        n=n,
        args=args,
        tmp=tmp,
        local=local,
        api=api,
        metrics_port=metrics_port,
        operator=operator,
        followers=followers,
        latency_file=latency_file,
        components=components,
        reset_prefix_cache=prefix_caching_on(RolloutFleetSpec.model_validate(spec)),
    )
    if args.speed_probe:
        fleet.probe = subprocess.Popen([sys.executable, __file__, SPEED_PROBE_CHILD, str(fleet.probe_path)])
        stack.callback(_stop, fleet.probe)
    timeout = 120 + 0.25 * n
    started = time.monotonic()
    _wait_engines(core, n, timeout=timeout)
    _log(f"n={n}: {n} pods Running with engines answering in {time.monotonic() - started:.1f}s")
    settled = fleet.wait_settled(timeout)
    _log(f"n={n}: fleet settled (readyReplicas == {n}) {settled:.1f}s later")
    return fleet


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _wait_engines(core: Any, n: int, timeout: float) -> float:
    import aiohttp

    started = time.monotonic()

    async def healthy(ips: list[str]) -> list[bool]:
        connector = aiohttp.TCPConnector(limit=256)  # 4,096 engines: not 4,096 sockets at once
        async with aiohttp.ClientSession(trust_env=False, connector=connector) as session:

            async def one(ip: str) -> bool:
                try:
                    async with session.get(f"http://{ip}:8000/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        return resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    return False

            return list(await asyncio.gather(*(one(ip) for ip in ips)))

    said = started
    pods: list[Any] = []
    ips: list[str] = []
    up: set[str] = set()  # engines that answered: at 8,192 a round of every engine's check never saw all at once
    while time.monotonic() - started < timeout:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"rolloutfleet.io/fleet={FLEET}").items
        ips = [p.status.pod_ip for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        if len(ips) == n:
            rest = [ip for ip in ips if ip not in up]
            up.update(ip for ip, ok in zip(rest, asyncio.run(healthy(rest)), strict=True) if ok)
            if up.issuperset(ips):
                return time.monotonic() - started
        if time.monotonic() - said >= 15:  # a large fleet takes minutes to come up: say how far it got
            said = time.monotonic()
            _log(f"n={n}: {len(pods)} pods, {len(ips)} Running, {len(up)} engines answered")
        time.sleep(1)
    raise TimeoutError(
        f"{n} engines did not come up in {timeout:.0f}s ({len(pods)} pods, {len(ips)} Running, {len(up)} answered)"
    )


def run_scenario(fleet: Fleet, scenario: Scenario, index: int, revision: int) -> dict[str, Any]:
    """One scenario: strategy, settle, latencies, then one revision measured from creation to a final phase."""
    n, args = fleet.n, fleet.args
    fleet.set_strategy(scenario.rollout, scenario.max_unavailable)
    time.sleep(2)
    settle_s = fleet.wait_settled(120 + 0.25 * n)
    pods = fleet.pods()
    if len(pods) != n:
        raise RuntimeError(f"{len(pods)}/{n} pods Running before {scenario.name}")
    per_pod, stragglers = draw_latencies(scenario.latencies, n, scenario_rng(args.seed, index))
    fleet.push_latencies({ip: steps for (_, ip, _), steps in zip(pods, per_pod, strict=True)})
    bound = lower_bound(
        per_pod, scenario.mode, scenario.rollout, scenario.max_unavailable, reset_prefix_cache=fleet.reset_prefix_cache
    )
    # Outside the measured window: the operator reads no engine at rest, so after this its revision's first
    # requests find the engines' keep-alive (vLLM's 5 s) expired, as between a trainer's revisions minutes apart.
    # Without it, whether the pre-flight reused connections depended on how soon this bench created the revision
    # after the last pass, and the runs of one code differed by a connection per pod (rollout_overhead.md).
    time.sleep(args.idle_before)
    calibration_ms = calibrate()
    spy, spy_file = None, None
    if args.profile:
        spy_file = pathlib.Path(tempfile.gettempdir()) / f"rf-bench-profile-{n}-{index}-{scenario.name}.txt"
        spy_file.unlink(missing_ok=True)
        with (fleet.tmp / f"py-spy-{index}.log").open("wb") as spy_log:
            spy = subprocess.Popen(
                [
                    _py_spy(),
                    *("record", "-p", str(fleet.operator.pid), "-r", "100", "-f", "raw"),
                    "--native" if args.profile_native else "--nonblocking",
                    *("-o", str(spy_file), "-d", str(int(REVISION_TIMEOUT_S) + 60)),
                ],
                stdout=spy_log,
                stderr=subprocess.STDOUT,
            )
        time.sleep(1.0)  # attached and sampling before the revision exists
    cprofile_dir = fleet.tmp / "cprofile"
    cprofile_before = set(cprofile_dir.glob("operator-*.pstats")) if args.profile_cprofile else set()
    if args.profile_cprofile:
        started_before = set(cprofile_dir.glob("operator-*.started"))
        os.kill(fleet.operator.pid, signal.SIGUSR2)  # starts the profile (bench/operator_cprofile)
        if not _await_cprofile_start(cprofile_dir, started_before):
            raise RuntimeError("the operator did not start its cProfile within 10 s of SIGUSR2")
    try:
        offset = fleet.log_offset()
        peak_reset = _reset_peak(fleet.operator.pid)
        req0, cpu0 = _request_counts(fleet.metrics_port), fleet.cpu(spy.pid if spy else None)
        sched0 = _proc_sched(fleet.operator.pid)
        server0, queues0 = _server_metrics(fleet.local), _controller_queues(fleet.local)
        pprof = pathlib.Path(tempfile.gettempdir()) / f"rf-bench-apiserver-{n}-{index}-{scenario.name}.pprof"
        profiling = _apiserver_profile(fleet.local, args.apiserver_profile, pprof) if args.apiserver_profile else None
        with contextlib.ExitStack() as sampling:
            timeline = sampling.enter_context(CpuTimeline(fleet, args.cpu_timeline)) if args.cpu_timeline > 0 else None
            t0 = time.monotonic()
            name = fleet.create_revision(revision, scenario.mode)
            status = fleet.await_revision(name, REVISION_TIMEOUT_S)
            total = time.monotonic() - t0
        sched1 = _proc_sched(fleet.operator.pid)
        cpu1, req1 = fleet.cpu(spy.pid if spy else None), _request_counts(fleet.metrics_port)
        server = _delta(_server_metrics(fleet.local), server0)
        queues = controller_queue_summary(_controller_queues(fleet.local), queues0)
        if profiling is not None:
            profiling.join()
        peak, rss = _rss_mb(fleet.operator.pid)
    finally:
        if args.profile_cprofile:
            os.kill(fleet.operator.pid, signal.SIGUSR2)  # stops it and writes the statistics
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
    # After every reading of the revision's window: the followers take up to their poll (0.5 s) to answer, and
    # answering costs them CPU that is not the revision's.
    engine_steps = fleet.engine_steps(t0)
    profile = (
        summarize_profile(spy_file.read_text(), native=args.profile_native)
        if spy_file is not None and spy_file.exists()
        else None
    )
    cprofile = None
    if args.profile_cprofile:
        written = _read_cprofile(cprofile_dir, cprofile_before)
        if written is None:
            _log(f"n={n} {scenario.name}: the operator wrote no cProfile statistics")
        else:
            kept = pathlib.Path(tempfile.gettempdir()) / f"rf-bench-cprofile-{n}-{index}-{scenario.name}.pstats"
            shutil.copyfile(written, kept)
            loaded: CProfileStats = pstats.Stats(str(written)).stats  # type: ignore[attr-defined]
            cprofile = {"file": str(kept), **summarize_cprofile(loaded, n)}
    replaced = len({uid for _, _, uid in pods} - {uid for _, _, uid in fleet.pods()})
    passes = fleet.passes(offset, name)
    cpu = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 2) for k in cpu1}
    wall = cpu.pop("t")
    machine = cpu.pop("machine")
    # "other control plane" by process (the controller manager, the scheduler, kwok), kept out of the sums below
    split = f"{OTHER_CONTROL_PLANE}."
    other_by_process = {k[len(split) :]: cpu.pop(k) for k in [k for k in cpu if k.startswith(split)]}
    engines = round(sum(v for k, v in cpu.items() if k.startswith("engines.")), 2)
    engine_req, kube_req = _delta(req1["engine"], req0["engine"]), _delta(req1["kube"], req0["kube"])
    gc_s = _delta(req1["gc"], req0["gc"])
    lag = loop_lag_summary(req1["lag"], req0["lag"])
    phase = status.get("phase") or "Timeout"
    engines_ran = (
        engine_timeline(
            engine_steps,
            [ip for _, ip, _ in pods],
            [pod_sequence(steps, scenario.mode, reset_prefix_cache=fleet.reset_prefix_cache) for steps in per_pod],
            scenario.rollout,
            scenario.max_unavailable,
            t0,
            total,
        )
        if engine_steps is not None and phase == "Succeeded"
        else None
    )
    row = {
        "kind": "scenario",
        "pods": n,
        "scenario": scenario.name,
        "revision": revision,
        "seed": args.seed,
        "engine_procs": args.engine_procs,
        "phase": phase,
        "reason": status.get("reason"),
        "message": status.get("message"),
        "total_s": round(total, 2),
        "lower_bound_s": round(bound, 2),
        "overhead_s": round(total - bound, 2),
        "overhead_pct": round(100 * (total - bound) / bound, 1) if bound > 0 else None,
        "target_s": round(0.05 * bound + 1, 2),
        # The wall against the engines as they ran (``engine_timeline``): what the simulated engines took beyond
        # their configured latencies is theirs, not the operator's.
        "engine_timeline": engines_ran,
        "operator_cpu_s": cpu["operator"],
        "operator_cpu_ms_per_pod": round(1000 * cpu["operator"] / n, 2),
        # ``calibrate`` on this machine right before the revision: the speed the CPU per pod was measured at.
        "calibration_ms": calibration_ms,
        # --speed-probe: the same work's speed during the revision against the idle period before it.
        "speed_probe": speed_probe_summary(fleet.probe_path.read_text(), t0, t0 + total, args.idle_before)
        if fleet.probe is not None and fleet.probe_path.exists()
        else None,
        # The operator's cycle collector (its own clock, rolloutfleet_gc_seconds_total), part of operator_cpu_s.
        "operator_gc_s": round(sum(gc_s.values()), 2),
        # User and system seconds of operator_cpu_s, and how often its event loop slept and woke.
        "operator_sched": _sched_delta(sched1, sched0, n),
        "operator_gc_s_by_generation": gc_s,
        "peak_rss_mb": round(peak, 1),
        "peak_rss_scope": "scenario" if peak_reset else "process lifetime",
        "rss_mb": round(rss, 1),
        "engine_requests": round(sum(engine_req.values())),
        "engine_requests_per_pod": round(sum(engine_req.values()) / n, 2),
        "engine_requests_by_route": engine_req,
        # New TCP connections to engines (the rest of the requests reused one kept alive).
        "engine_connections_per_pod": round(_delta(req1["connections"], req0["connections"]).get("engine", 0.0) / n, 3),
        # New TLS connections to the API server for the revision's requests (each a handshake).
        "kube_connections": round(_delta(req1["connections"], req0["connections"]).get("kube", 0.0)),
        "loop_lag": lag,
        "engine_keep_alive_s": args.engine_keep_alive,
        "idle_before_s": args.idle_before,
        "followers_watch": "all" if args.followers_watch_all or args.engine_procs < 2 else "own share",
        "operator_cpu_pinned": args.operator_cpu,
        # The operator's core and its idle SMT siblings: no other process ran on these.
        "operator_cpu_reserved": args.operator_cpu_reserved,
        "digests": args.digests,
        "kube_requests": round(sum(kube_req.values())),
        "kube_requests_per_pod": round(sum(kube_req.values()) / n, 3),
        "kube_requests_by_verb": kube_req,
        # Every client's requests and the watch events as the API server counted them (``SERVER_METRICS``).
        "apiserver": server,
        "apiserver_profile": str(pprof) if profiling is not None and pprof.exists() else None,
        "cpu_split_s": {
            "operator": cpu["operator"],
            "engines": engines,
            "engines_by_proc": [cpu[f"engines.{i}"] for i in range(len(fleet.followers))],
            "kube-apiserver": cpu.get("kube-apiserver", 0.0),
            "etcd": cpu.get("etcd", 0.0),
            "other control plane": cpu.get("other control plane", 0.0),
            "other_control_plane_by_process": other_by_process,
            # The controller manager's work queues: seconds in their workers (wall, not CPU) and items added.
            "controller_queues": queues,
            "bench": round(cpu["bench"] + cpu.get("py-spy", 0.0), 2),
            "rest of machine": round(machine - sum(v for k, v in cpu.items()), 2),
            "machine_busy": round(machine, 2),
            "wall": round(wall, 2),
        },
        "operator_passes": passes,
        "cpu_by_phase": cpu_by_phase(timeline.samples, passes["started_monotonic"], passes["phases"])
        if timeline is not None and passes["started_monotonic"] is not None
        else None,
        "timings": status.get("timings"),
        "stragglers": stragglers,
        "pods_replaced": replaced,
        "settle_s": round(settle_s, 1),
        "profile_file": str(spy_file) if spy_file else None,
        "profile": profile,
        "cprofile": cprofile,
    }
    if replaced:
        _log(f"n={n} {scenario.name}: {replaced} pods were replaced during the scenario")
    return row


def run_rest(fleet: Fleet, seconds: float) -> dict[str, Any]:
    """The fleet at rest on what it serves for ``seconds`` (after the scenarios): the operator's CPU, its engine
    and Kubernetes requests, and its passes' engine reads meanwhile. The bench runs the operator with a 1 s
    idle period (5 s by default), so a loop that reads every engine at rest shows here five times over."""
    fleet.wait_settled(120 + 0.25 * fleet.n)
    time.sleep(2)  # the pass that found the last revision done has written its status
    offset, req0, cpu0 = fleet.log_offset(), _request_counts(fleet.metrics_port), fleet.cpu()
    time.sleep(seconds)
    cpu1, req1 = fleet.cpu(), _request_counts(fleet.metrics_port)
    with fleet.log_path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    found = list(PASS_LINE.finditer(text))
    engine_req, kube_req = _delta(req1["engine"], req0["engine"]), _delta(req1["kube"], req0["kube"])
    wall = cpu1["t"] - cpu0["t"]
    return {
        "kind": "rest",
        "pods": fleet.n,
        "seconds": round(wall, 1),
        "operator_cpu_s": round(cpu1["operator"] - cpu0["operator"], 2),
        "operator_cpu_per_minute_s": round(60 * (cpu1["operator"] - cpu0["operator"]) / wall, 2),
        "engine_requests": round(sum(engine_req.values())),
        "kube_requests": round(sum(kube_req.values())),
        "passes_reading": len(found),
        "engine_reads": sum(int(m["reads"]) for m in found),
    }


def run_soak(fleet: Fleet, revisions: int, first_revision: int, keep: int | None = None) -> dict[str, Any]:
    """``revisions`` zero-latency sleep-mode AllAtOnce revisions back to back; the operator's RSS every 50.
    ``keep``: delete each soak revision once ``keep`` newer ones succeeded (None: every revision stays)."""
    fleet.set_strategy("AllAtOnce", 1)
    time.sleep(2)
    fleet.wait_settled(120 + 0.25 * fleet.n)
    pods = fleet.pods()
    fleet.push_latencies({ip: dict.fromkeys(BASE_STEPS, 0.0) for _, ip, _ in pods})
    _reset_peak(fleet.operator.pid)  # the soak's own peak
    started = time.monotonic()
    samples = [{"revisions": 0, "rss_mb": round(_rss_mb(fleet.operator.pid)[1], 1), "elapsed_s": 0.0}]
    failure = None
    done = 0
    for i in range(1, revisions + 1):
        name = fleet.create_revision(first_revision + i - 1, "sleep")
        status = fleet.await_revision(name, SOAK_REVISION_TIMEOUT_S)
        if status.get("phase") != "Succeeded":
            failure = {"revisions": i, "name": name, "phase": status.get("phase") or "Timeout"}
            failure.update({k: status.get(k) for k in ("reason", "message")})
            _log(f"soak: {name} ended {failure['phase']}: {status.get('reason')} {status.get('message')}; stopping")
            rss, elapsed = _rss_mb(fleet.operator.pid)[1], time.monotonic() - started
            samples.append({"revisions": i, "rss_mb": round(rss, 1), "elapsed_s": round(elapsed, 1)})
            break
        done = i
        if keep is not None and i > keep:
            fleet.delete_revision(first_revision + i - 1 - keep)
        if i % SOAK_SAMPLE_EVERY == 0 or i == revisions:
            elapsed = time.monotonic() - started
            rss = _rss_mb(fleet.operator.pid)[1]
            samples.append({"revisions": i, "rss_mb": round(rss, 1), "elapsed_s": round(elapsed, 1)})
            _log(
                f"soak: {i}/{revisions} revisions, {elapsed:.0f}s, {60 * i / elapsed:.1f} revisions/min, "
                f"RSS {rss:.1f} MB"
            )
    at_100 = next((s for s in samples if s["revisions"] == 100), None)
    growth = round(samples[-1]["rss_mb"] - at_100["rss_mb"], 1) if at_100 and samples[-1] is not at_100 else None
    return {
        "kind": "soak",
        "pods": fleet.n,
        "revisions": revisions,
        "kept": keep,
        "succeeded": done,
        "samples": samples,
        "growth_after_100_mb": growth,
        "failure": failure,
        "peak_rss_mb": round(_rss_mb(fleet.operator.pid)[0], 1),
    }


# -- the report ----------------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    return "" if value is None else str(value)


PHASE_ROLES = ("operator", "kube-apiserver", "etcd", "other control plane", "engines", "machine")


def phase_cpu_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per scenario run with ``--cpu-timeline``, the cores each role kept busy in each phase."""
    timed = [r for r in rows if r.get("cpu_by_phase")]
    if not timed:
        return []
    lines = [
        "",
        "## Cores busy per phase of the pass (`--cpu-timeline`: /proc read on a thread of the bench, interpolated "
        "at the pass's phases)",
    ]
    for r in timed:
        lines += [
            "",
            f"{r['pods']} pods, {r['scenario']}:",
            "",
            "| from | to | seconds | " + " | ".join(PHASE_ROLES) + " |",
            "|---|---|---:|" + "---:|" * len(PHASE_ROLES),
        ]
        for w in r["cpu_by_phase"]:
            cells = [w["from"], w["to"], w["seconds"], *(w["cores"].get(role, 0.0) for role in PHASE_ROLES)]
            lines.append("| " + " | ".join(_fmt(v) for v in cells) + " |")
    return lines


MILESTONES = (
    "first pause started",
    "last pause started",
    "last pre-resume step ended",
    "first resume started",
    "last resume started",
    "last resume ended",
    "revision final",
)


def engine_timeline_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: each revision's wall against the engines as they ran (``engine_timeline``), and the AllAtOnce
    revisions' milestones."""
    read = [r for r in rows if r.get("engine_timeline")]
    if not read:
        return []
    lines = [
        "",
        "## The wall against the engines as they ran (the engines' own logs)",
        "",
        "The lower bound takes each step to last what it was configured to; a simulated engine that shares its "
        "process with others (and the machine with the control plane) takes longer, and that part of the wall is "
        "the harness's, not the operator's. \"engines' bound\": the same bound with each engine's part as long as "
        "it ran by its own log (AllAtOnce: from its pause to its last pre-resume step, and from its resume's first "
        'step to the resume; Rolling: from its pause through its resume, one request); "late": how much longer '
        "than drawn each engine's part ran, mean and worst over the pods. What an engine's process spent before a "
        "request's first step started and after its resume ended (reading the request, writing the answer, its "
        "event loop busy with other engines) is not in its part: it counts as over the engines' bound, with the "
        "operator's and the control plane's time.",
        "",
        "| pods | scenario | total s | lower bound s | engines' bound s | over the lower bound s | over the engines' "
        "bound s | target s | engines late ms (mean, worst) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in read:
        t = r["engine_timeline"]
        late = t["engines_late_ms"]
        cells = [
            r["pods"],
            r["scenario"],
            r["total_s"],
            r["lower_bound_s"],
            t["engines_bound_s"],
            r["overhead_s"],
            t["over_engines_bound_s"],
            r["target_s"],
            f"{late['mean']}, {late['max']}",
        ]
        lines.append("| " + " | ".join(_fmt(v) for v in cells) + " |")
    marked = [r for r in read if r["engine_timeline"].get("milestones_s")]
    if marked:
        shown = [m for m in MILESTONES if any(m in r["engine_timeline"]["milestones_s"] for r in marked)]
        lines += [
            "",
            "AllAtOnce milestones, seconds from the revision's creation (engines' clocks; the last column the "
            "bench's watch of the revision):",
            "",
            "| pods | scenario | " + " | ".join(shown) + " |",
            "|---:|---|" + "---:|" * len(shown),
        ]
        for r in marked:
            m = r["engine_timeline"]["milestones_s"]
            lines.append(
                "| " + " | ".join(_fmt(v) for v in [r["pods"], r["scenario"], *(m.get(k) for k in shown)]) + " |"
            )
    return lines


def _placement(args: argparse.Namespace, cores: int | None) -> str:
    """The report's sentence on who ran on which cores."""
    if args.operator_cpu is None:
        return f"All of them and this bench share the machine's {cores} cores; nothing is pinned."
    reserved = args.operator_cpu_reserved
    idle = [c for c in reserved if c != args.operator_cpu]
    siblings = f", its SMT siblings {idle} idle" if idle else " (no SMT sibling)"
    return (
        f"The operator ran alone on core {args.operator_cpu}{siblings} (`--operator-cpu`); everything else "
        f"shared the other {(cores or 0) - len(reserved)}."
    )


def report(
    rows: list[dict[str, Any]],
    soaks: list[dict[str, Any]],
    command: str,
    args: argparse.Namespace,
    rests: list[dict[str, Any]] | None = None,
) -> str:
    cores = os.cpu_count()
    k = args.engine_procs
    engines = (
        "one follower process serves every engine"
        if k == 1
        else f"{k} follower processes serve them (follower i: the pods whose ordinal % {k} == i)"
    )
    paragraphs = [
        "Per fleet size: one local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok with "
        "fake 8-GPU nodes, fatter ones past 255 nodes; a gated pod's Ready follows its weights gate, as a kubelet's "
        "does), the real operator as one process, and a simulated engine "
        f"(synthetic weights) on every pod's loopback IP: {engines}. {_placement(args, cores)} Other work on the "
        "machine shows as 'rest of machine' in the CPU split. Its last column is how fast the machine ran a fixed "
        "piece of pure-Python work (JSON, dicts, small frozen values: `calibrate`, best of five, CPU ms of one "
        "thread) right before the revision: CPU per pod measured at another calibration was measured on a faster "
        "or slower machine.",
        "Scenarios (`<latencies>-<rollout>-<mode>`) run one after another on the same fleet, each one new "
        "WeightRevision, once the fleet is settled (the operator opened every pod's readiness gate: "
        f"`status.readyReplicas == n`) and has been idle {args.idle_before:g} s more (`--idle-before`; past the "
        "engines' keep-alive and the operator's idle API connections, so each revision opens its connections as one "
        "minutes after the last would). "
        "The rollout (AllAtOnce, or Rolling with `maxUnavailable: "
        f"{ROLLING_MAX_UNAVAILABLE}`) is patched into the fleet's `updateStrategy`; the mode (sleep or in-flight) "
        "is the revision's `spec.strategy.mode` override: the fleet's mode is in the pod template "
        "(`--enable-sleep-mode`), so changing it would restart every pod. The fleet starts in sleep mode. "
        + (
            "Each revision names both digests, as the trainer's publish does (`--digests pinned`)."
            if args.digests == "pinned"
            else "The revisions name no digest (`--digests none`): the operator verifies against the fleet's majority."
        ),
        "Base step latencies (seconds): "
        + ", ".join(f"`{step}` {seconds:g}" for step, seconds in BASE_STEPS.items())
        + ". `uniform`: every engine gets them. `longtail`: per engine and "
        f"step, base x lognormal(0, {LONGTAIL_SIGMA}), and {STRAGGLER_FRACTION:.0%} of the engines (at least one, "
        f"a seeded choice) load {STRAGGLER_LOAD_FACTOR:g}x slower on top (`rolloutfleet_load:*`). Draws are "
        f"seeded with `--seed {args.seed}` and the scenario's index. Fast reads (is_paused, is_sleeping, the "
        "extension's state, weight_info, ready, health) and the pre-flight take no time. "
        "`reset_prefix_cache` runs only where prefix caching is on (not in this fleet).",
        "Lower bound: the same drawn latencies with zero operator overhead (`lower_bound` in the bench). "
        "AllAtOnce: the slowest pod's pre-resume steps, then the slowest resume (the barrier). Rolling: pods in "
        "ordinal order, at most maxUnavailable out of service at once, each pod's steps back to back (a greedy "
        "list schedule's makespan). Totals run from the revision's creation to its final phase as a watch on the "
        "revision delivers it (until 2026-12-03: a read every 0.2 s, up to 0.2 s late). Peak RSS is the "
        "operator's VmHWM, reset before each scenario (`/proc/PID/clear_refs`); requests are the deltas of the "
        "operator's own counters over the scenario.",
    ]
    lines = [
        "# Rollout overhead of the operator (simulated engines)",
        "",
        f"Machine: {cores} cores, {platform.platform()}, Python {platform.python_version()}.",
        f"Command: `{command}`",
        "",
    ]
    for paragraph in paragraphs:
        lines += [textwrap.fill(paragraph, 110, break_long_words=False, break_on_hyphens=False), ""]
    if rows:
        lines += [
            "| pods | scenario | phase | total s | lower bound s | overhead s | overhead % | target s (5 % + 1 s) "
            "| operator CPU s | CPU ms/pod | of it GC s | peak RSS MB | RSS MB | engine req/pod | kube req/pod |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            cells = [
                r["pods"],
                r["scenario"],
                r["phase"],
                r["total_s"],
                r["lower_bound_s"],
                r["overhead_s"],
                r["overhead_pct"],
                r["target_s"],
                r["operator_cpu_s"],
                r["operator_cpu_ms_per_pod"],
                r.get("operator_gc_s"),
                r["peak_rss_mb"],
                r["rss_mb"],
                r["engine_requests_per_pod"],
                r["kube_requests_per_pod"],
            ]
            lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
        odd = [r for r in rows if r["phase"] != "Succeeded" or r["pods_replaced"]]
        for r in odd:
            lines.append("")
            lines.append(
                f"{r['pods']} pods, {r['scenario']}: {r['phase']} ({_fmt(r['reason'])}: {_fmt(r['message'])}); "
                f"{r['pods_replaced']} pods replaced during the scenario."
            )
        probed = any(r.get("speed_probe") for r in rows)
        lines += [
            "",
            f"## CPU split during each scenario (CPU seconds from /proc; {cores} cores)",
            "",
            "| pods | scenario | wall s | machine busy s | operator | engines | kube-apiserver | etcd "
            "| other control plane | bench | rest of machine | calibration ms |"
            + (" probe ms at rest → during the revision |" if probed else ""),
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if probed else ""),
        ]
        for r in rows:
            c = r["cpu_split_s"]
            engines = str(c["engines"])
            if len(c["engines_by_proc"]) > 1:
                engines += " (" + " + ".join(str(v) for v in c["engines_by_proc"]) + ")"
            cells = [
                r["pods"],
                r["scenario"],
                c["wall"],
                c["machine_busy"],
                c["operator"],
                engines,
                c["kube-apiserver"],
                c["etcd"],
                c["other control plane"],
                c["bench"],
                c["rest of machine"],
                r.get("calibration_ms"),
            ]
            if probed:
                probe = r.get("speed_probe")
                cells.append(f"{probe['rest_ms']} → {probe['during_ms']} (x{probe['slowdown']})" if probe else None)
            lines.append("| " + " | ".join(_fmt(v) for v in cells) + " |")
    lines += phase_cpu_tables(rows)
    lines += engine_timeline_tables(rows)
    profiled = [r for r in rows if r.get("profile")]
    if any(r["profile"].get("native") for r in profiled):
        lines += [
            "",
            "## Operator profiles (py-spy --native, 100 Hz, blocking; % of the event loop thread's working samples)",
            "",
            "py-spy stops the operator at each sample here: the profiled rows' CPU and walls are not comparable",
            "with unprofiled ones. Only the event loop's thread is counted. Its samples in the loop's poll (a wait,",
            "or a poll with work ready: py-spy cannot tell) are the 'waiting' share and left out of the",
            "percentages. Self time is charged to the innermost Python frame (C code under it included); the",
            "loop's own C work shows as `Runner.run`.",
        ]
    elif profiled:
        lines += [
            "",
            "## Operator profiles (py-spy, 100 Hz, non-blocking; % of the samples py-spy took of active threads)",
            "",
            "Profiled rows carry the sampler's own CPU (about a quarter of a core) in 'bench'. The library list",
            "leaves out the frames every stack passes through (runpy, asyncio.run, the event loop's dispatch,",
            "thread bootstrap, the executor's worker). 'Waiting' samples end in a wait that py-spy's non-blocking",
            "idle detection let through (the event loop's select, a thread's blocking TLS read of the API",
            "server's answer, an executor thread on its queue); they are in the percentages. Under uvloop",
            "`Runner.run`'s self time is the loop's C code, its polls included (`--profile-native` tells the",
            "polls apart).",
        ]
    for r in profiled:
        p = r["profile"]
        lines += [
            "",
            f"### {r['pods']} pods, {r['scenario']} ({p['samples']} samples, {_fmt(p.get('idle_pct'))} % "
            f"waiting; raw: `{r['profile_file']}`)",
        ]
        for title, key in (
            ("Self time", "self"),
            ("Inclusive, rolloutfleet/", "own_inclusive"),
            ("Inclusive, libraries", "library_inclusive"),
        ):
            lines += ["", f"{title}:", "", "| % | function |", "|---:|---|"]
            lines += [f"| {pct} | `{name}` |" for name, pct in p[key]]
    cprofiled = [r for r in rows if r.get("cprofile")]
    if cprofiled:
        lines += [
            "",
            "## Operator profiles (cProfile of the event loop's thread, its CPU clock; `--profile-cprofile`)",
            "",
            "Each function's calls are counted exactly and its time is CPU time of the operator's main thread (a",
            "wait counts nothing); every call pays the profiler's own cost, so the profiled CPU is higher than the",
            "row's and call-heavy code looks heavier than it is. Self time: in the function itself, C functions it",
            "calls listed apart (`builtins (C)`), the event loop's own C code in none of them.",
        ]
    for r in cprofiled:
        c = r["cprofile"]
        lines += [
            "",
            f"### {r['pods']} pods, {r['scenario']} (profiled {c['profiled_cpu_s']} CPU-s; raw: `{c['file']}`)",
            "",
            "Self time by area: " + ", ".join(f"{area} {pct} %" for area, pct in c["areas"][:12]) + ".",
            "",
            "| self % | calls per pod | µs per call | function |",
            "|---:|---:|---:|---|",
        ]
        lines += [
            f"| {f['self_pct']} | {f['calls_per_pod']} | {f['self_us_per_call']} | `{f['function']}` |"
            for f in c["top_self"]
        ]
    for soak in soaks:
        lines += [
            "",
            f"## Memory soak: {soak['pods']} pods, {soak['succeeded']}/{soak['revisions']} zero-latency revisions "
            "back to back",
            "",
            "Sleep-mode AllAtOnce revisions, each created once the previous one Succeeded; "
            + (
                "revisions are kept (not deleted)."
                if soak.get("kept") is None
                else f"each deleted once {soak['kept']} newer ones succeeded (--soak-keep)."
            ),
            "RSS is the operator's VmRSS after that many revisions.",
            "",
            "| revisions | RSS MB | elapsed s | s/revision since the previous sample |",
            "|---:|---:|---:|---:|",
        ]
        prev = None
        for s in soak["samples"]:
            rate = ""
            if prev is not None and s["revisions"] > prev["revisions"]:
                rate = str(round((s["elapsed_s"] - prev["elapsed_s"]) / (s["revisions"] - prev["revisions"]), 2))
            lines.append(f"| {s['revisions']} | {s['rss_mb']} | {s['elapsed_s']} | {rate} |")
            prev = s
        growth = soak["growth_after_100_mb"]
        lines += [
            "",
            f"Growth from revision 100 to the last sample: {growth} MB."
            if growth is not None
            else "Growth from revision 100 to the last sample: n/a (no sample after revision 100).",
        ]
        lines.append(f"Peak RSS (VmHWM) during the soak: {soak['peak_rss_mb']} MB.")
        if soak["failure"]:
            f = soak["failure"]
            lines.append(
                f"Stopped at revision {f['revisions']} ({f['name']}): {f['phase']}, {f['reason']}: {f['message']}."
            )
    if rests:
        lines += [
            "",
            "## The fleet at rest (after the scenarios; the bench's idle period 1 s)",
            "",
            "| pods | seconds | operator CPU s | per minute s | engine requests | kube requests | passes that read "
            "| engine reads |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rests:
            lines.append(
                f"| {r['pods']} | {r['seconds']} | {r['operator_cpu_s']} | {r['operator_cpu_per_minute_s']} | "
                f"{r['engine_requests']} | {r['kube_requests']} | {r['passes_reading']} | {r['engine_reads']} |"
            )
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)) + "\n"


def _raise_open_files() -> None:
    """Open-files soft limit up to the hard one: the bench polls every engine's /health at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _command() -> str:
    exe = os.path.relpath(sys.executable)
    return shlex.join([exe if not exe.startswith("..") else sys.executable, *sys.argv])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == SPEED_PROBE_CHILD:
        speed_probe_main(sys.argv[2])
        return 0
    if len(sys.argv) >= 6 and sys.argv[1] == "--follower":
        pods = int(sys.argv[6]) if len(sys.argv) > 6 else 0
        follower_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], pods, "--watch-all" in sys.argv)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help="comma-separated <uniform|longtail|zero>-<allatonce|rolling>-<sleep|inflight>; 'none' for none",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--engine-procs",
        type=int,
        default=default_engine_procs(os.cpu_count() or 1),
        help="follower processes serving the engines (default: half the cores, 1 to 8)",
    )
    parser.add_argument("--profile", action="store_true", help="sample the operator with py-spy per scenario")
    parser.add_argument(
        "--profile-cprofile",
        action="store_true",
        help="cProfile the operator's event loop per scenario, with its thread's CPU clock (exact calls per pod; "
        "the profiled rows' CPU and walls are not comparable with unprofiled ones); not with --profile",
    )
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="with --profile: py-spy --native (blocking: the profiled rows' CPU and walls are not comparable); "
        "the event loop's thread only, its waits told apart",
    )
    parser.add_argument("--soak-revisions", type=int, default=0, help="then N zero-latency revisions back to back")
    parser.add_argument(
        "--soak-keep", type=int, default=None, help="the soak deletes each revision once this many newer succeeded"
    )
    parser.add_argument(
        "--rest-seconds", type=float, default=0, help="then the fleet at rest this long: what the operator spends"
    )
    parser.add_argument(
        "--idle-before",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the settled fleet idles this long before each revision, outside the measured window (default: the "
        "longer of the engines' keep-alive and the operator's 15 s for idle API connections, plus 1 s: 16 with "
        "vLLM's 5 s; each revision opens its connections, as revisions minutes apart do; 6 s until 2026-12-05, "
        "0 (as soon as settled) until 2026-12-04)",
    )
    parser.add_argument(
        "--engine-keep-alive",
        type=int,
        default=None,
        help="the fleet's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (its spec.env, and the simulated engines'); vLLM's 5 s without",
    )
    parser.add_argument("--subnet-offset", type=int, default=0, help="first fake node's 127.1.<offset>.0/24")
    parser.add_argument(
        "--digests",
        choices=("pinned", "none"),
        default="pinned",
        help="pinned (default): each revision names both digests, as the trainer's publish does; none: the "
        "operator verifies against the fleet's majority (the bench's revisions until 2026-12-04)",
    )
    parser.add_argument(
        "--operator-cpu",
        type=int,
        default=None,
        help="run the operator on this core alone and everything else (this bench, the control plane, the "
        "engines) on the others, the core's SMT siblings left idle: a whole physical core, as a Guaranteed pod gets "
        "from the kubelet's static CPU manager with its full-pcpus-only option (siblings idle since 2026-12-05)",
    )
    parser.add_argument(
        "--speed-probe",
        action="store_true",
        help="time small pieces of the calibration's work every 0.1 s in a process of their own (~5 %% of a core) "
        "and report how much slower they ran during each revision than in the idle period before it "
        "(speed_probe in the JSON rows; `speed_probe_main`)",
    )
    parser.add_argument(
        "--cpu-timeline",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="read every process's CPU this often during each revision and report the cores each kept busy "
        "between the pass's phases (cpu_by_phase in the JSON rows; e.g. 0.05)",
    )
    parser.add_argument(
        "--apiserver-profile",
        type=int,
        default=0,
        metavar="SECONDS",
        help="start the API server with profiling and take its CPU profile (Go pprof) over the first SECONDS of "
        "each revision, into the temporary directory (rf-bench-apiserver-*.pprof; `go tool pprof -top` reads it)",
    )
    parser.add_argument(
        "--followers-watch-all",
        action="store_true",
        help="every engine process watches every pod of the fleet (the bench until 2026-12-04) instead of its own "
        "share (by the StatefulSet's pod-index label)",
    )
    parser.add_argument("--out", default="bench/results/rollout_overhead.md")
    parser.add_argument("--json", default=str(pathlib.Path(tempfile.gettempdir()) / "rollout_overhead.json"))
    args = parser.parse_args()
    if args.idle_before is None:
        args.idle_before = default_idle_before(args.engine_keep_alive)
    args.profile = args.profile or args.profile_native
    if args.profile and args.profile_cprofile:
        parser.error("--profile-cprofile and --profile: one profiler at a time")
    names = [] if args.scenarios.strip() in ("", "none") else [s for s in args.scenarios.split(",") if s.strip()]
    scenarios = [Scenario.parse(s) for s in names]
    if args.engine_procs < 1:
        parser.error("--engine-procs must be at least 1")
    _raise_open_files()
    args.operator_cpu_reserved = None  # the operator's core and its SMT siblings, with --operator-cpu
    if args.operator_cpu is not None:
        cores = os.sched_getaffinity(0)
        args.operator_cpu_reserved = sorted(smt_siblings(args.operator_cpu) & cores)
        if args.operator_cpu not in cores or not cores - set(args.operator_cpu_reserved):
            parser.error(f"--operator-cpu {args.operator_cpu}: not one of this process's cores {sorted(cores)}")
        # Every child started from here on inherits it; the operator's core's siblings stay idle (smt_siblings).
        os.sched_setaffinity(0, cores - set(args.operator_cpu_reserved))
    command, run_id = _command(), datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rows: list[dict[str, Any]] = []
    soaks: list[dict[str, Any]] = []
    rests: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        with pathlib.Path(args.json).open("a") as f:
            f.write(json.dumps({"run": run_id, "command": command, **row}) + "\n")

    for n in args.sizes:
        try:
            with tempfile.TemporaryDirectory(prefix=f"rf-bench-{n}-") as tmp, contextlib.ExitStack() as stack:
                fleet = start_fleet(n, args, pathlib.Path(tmp), stack)
                for index, scenario in enumerate(scenarios, start=1):
                    row = run_scenario(fleet, scenario, index, revision=index)
                    keys = ("pods", "scenario", "phase", "total_s", "lower_bound_s", "operator_cpu_s")
                    _log(json.dumps({k: row[k] for k in keys}))
                    rows.append(row)
                    record(row)
                if args.rest_seconds > 0:
                    rest = run_rest(fleet, args.rest_seconds)
                    _log(json.dumps(rest))
                    rests.append(rest)
                    record(rest)
                if args.soak_revisions > 0:
                    soak = run_soak(fleet, args.soak_revisions, len(scenarios) + 1, args.soak_keep)
                    soaks.append(soak)
                    record(soak)
        finally:  # after each size, and after a failure too: partial runs leave their results
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(report(rows, soaks, command, args, rests))
    print(report(rows, soaks, command, args, rests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
