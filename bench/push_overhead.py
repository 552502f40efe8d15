"""Benchmark: the operator's overhead in a pushed revision (docs/push.md) at 64 simulated pods.

A report, not a test. For each fleet size (default 64) and update mode (``inflight``, ``sleep``; AllAtOnce)
it starts the local control plane with enough fake 8-GPU nodes and runs four processes on the machine's
cores: the control plane, the real operator (``rolloutfleet run``), a follower serving simulated engines on
every pod's loopback IP (fixed per-step latencies, including vLLM's session routes and the extension's push
RPCs; each engine's parameters are those of a real tiny safetensors checkpoint it started from), and a
trainer running ``rolloutfleet.trainer.push_revision(..., sender=SimulatedSender())`` with one send per pod
at once. The bench process itself only watches the WeightRevision and reads /proc. Per revision it reports:

- wall: from the revision's creation (the first of the trainer's create answer and the bench's watch
  event) to the bench's watch seeing ``phase: Succeeded``;
- the critical-path lower bound: one pod's engine calls back to back (``STEPS``, each call's fixed
  simulated latency; the trainer's ``/update_weights`` into each session counts as the engine simulates
  it), every pod in parallel, with no time for the operator, the trainer's polling, its HTTP posts or its
  annotations, or the API server;
- wall minus the bound, split along the fleet's critical path into the operator's share and the trainer's
  share (polling for sessions, posting, marking), from the engines' call logs (monotonic clock, shared
  across processes on Linux) and the watch's timestamps of ``status.push`` and the trainer's marks;
- the operator's CPU seconds (``/proc/PID/stat`` utime+stime deltas) and peak RSS (VmHWM), its Kubernetes
  requests (its own counter on /metrics), the engine requests per pod (counted at the simulated engines,
  by route), the CPU of every other process (how the cores were shared), and the trainer's own split
  (digest, create, waiting for sessions, sending, marking, waiting for Ready);
- the operator log's ``pass ...: N iterations, M engine reads`` lines of the revision;
- whether the trainer sent into every session its marks covered (``epoch_order``: the operator ends every
  session up to a mark as sent, so a session listed too late is ended empty and its target destroyed).

The comparison with the target (push transaction overhead per pod beyond the engine's own calls ≤ 50 ms)
is made on three numbers: the operator's CPU seconds per pod, (wall - bound) / pods, and the operator's
share of it per pod. CPU and request counts cover the trainer's start to the moment the watch sees the
revision final. A run stops at its first failed revision. Diagnostics: ``--send-seconds`` (a slower
trainer), ``--profile-operator DIR`` (the operator under cProfile: not a measurement).

    .venv/bin/python bench/push_overhead.py --sizes 64 --out bench/results/push_overhead.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import itertools
import json
import os
import pathlib
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from rollout_overhead import create_weights_volume  # bench/, the scripts' directory, is sys.path[0]

# Per-step simulated latencies (seconds), keyed as the simulator's latency keys (rolloutfleet.sim.config:
# the most specific key of a call wins; ``rolloutfleet_push_begin`` covers both targets). Calls not listed
# (the operator's reads: /is_paused, /is_sleeping, /weight_info, rolloutfleet_state, /rolloutfleet/ready;
# admit and withdraw) take no simulated time: all of their time is overhead.
STEPS = {
    "pause": 0.05,
    "sleep": 0.5,
    "wake_up:weights": 0.3,
    "rolloutfleet_push_begin": 0.02,
    "start_weight_update": 0.05,
    "start_draft_weight_update": 0.05,
    # The trainer's send into one session, as the engine simulates it (``--send-seconds``; children inherit it).
    "update_weights": float(os.environ.get("PUSH_BENCH_SEND_SECONDS", "1.0")),
    "finish_weight_update": 0.1,
    "rolloutfleet_push_end": 0.2,  # the extension's digest of what was received
    "update_weight_version": 0.02,
    "wake_up:kv_cache": 0.2,
    "resume": 0.05,
}
VERIFIER_SESSION = [
    "rolloutfleet_push_begin:verifier",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "rolloutfleet_push_end",
]
DRAFT_SESSION = [
    "rolloutfleet_push_begin:draft",
    "start_draft_weight_update",
    "update_weights",
    "finish_weight_update",
    "rolloutfleet_push_end",
]
# One pod's engine calls (log keys) in a pushed revision, per mode (docs/push.md, "The transaction").
SEQUENCE = {
    "sleep": [
        "pause:keep",
        "sleep:2",
        "wake_up:weights",
        *VERIFIER_SESSION,
        *DRAFT_SESSION,
        "update_weight_version",
        "wake_up:kv_cache",
        "resume",
    ],
    "inflight": [
        "pause:keep",
        *VERIFIER_SESSION,
        *DRAFT_SESSION,
        "update_weight_version",
        "resume",
    ],
}
NAMESPACE, FLEET = "bench", "policy"
GROUP, VERSION = "rolloutfleet.io", "v1alpha1"
VERIFIER_TENSORS, DRAFT_TENSORS, TENSOR_SHAPE = 4, 2, (32, 32)  # tiny real checkpoints (F32)
FINAL = ("Succeeded", "Failed", "RolledBack")
POLL_INTERVAL = 0.5  # push_revision's default: how often the trainer reads the revision while it waits


def latency(key: str) -> float:
    """The simulated latency of one logged call (its key, e.g. ``pause:keep``, or its generic step)."""
    if key in STEPS:
        return STEPS[key]
    return STEPS.get(key.split(":", 1)[0], 0.0)


def lower_bound(mode: str) -> float:
    return sum(latency(k) for k in SEQUENCE[mode])


# ------------------------------------------------------------------------------------------- checkpoints


def write_checkpoints(root: pathlib.Path, revisions: int) -> None:
    """``root/policy/step-R/{verifier,draft}/model.safetensors``: small real checkpoints, one per revision."""
    import numpy as np
    from safetensors.numpy import save_file

    for rev in range(revisions + 1):
        for target, count, seed in (("verifier", VERIFIER_TENSORS, 100), ("draft", DRAFT_TENSORS, 200)):
            directory = root / "policy" / f"step-{rev}" / target
            directory.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng(seed + rev)
            tensors = {f"layers.{i}.weight": rng.standard_normal(TENSOR_SHAPE).astype(np.float32) for i in range(count)}
            save_file(tensors, str(directory / "model.safetensors"))


def records(checkpoint: pathlib.Path) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """The tensors a trainer holds for one step (read from the tiny checkpoint), as raw 4-tuples."""
    from safetensors.numpy import load_file

    tensors = load_file(str(checkpoint / "model.safetensors"))
    return [(name, "F32", tuple(t.shape), t.tobytes()) for name, t in sorted(tensors.items())]


# ------------------------------------------------------------------------------- the follower (engines)


def follower_main(kubeconfig: str, admin_port: int) -> None:
    """Child process: simulated engines on every pod of the fleet, plus a loopback admin route that returns
    their call logs and the number of requests each engine answered, by route (reads included)."""
    from aiohttp import web
    from kubernetes import config

    from rolloutfleet.sim import server
    from rolloutfleet.sim.config import Latencies, WeightsConfig
    from rolloutfleet.sim.follower import PodFollower

    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    original = server.SimulatedEngine.run_step

    async def counted(self: Any, keys: list[str], args: dict[str, Any], action: Any, **options: Any) -> Any:
        # Options passed through as they are (``log``, and ``note`` since staging): the count is all this adds.
        counts[self.key][keys[1] if keys[0] == "collective_rpc" else keys[0]] += 1
        return await original(self, keys, args, action, **options)

    server.SimulatedEngine.run_step = counted  # type: ignore[method-assign]

    api = config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    follower = PodFollower(
        api,
        NAMESPACE,
        FLEET,
        weights=WeightsConfig(synthetic_root=None),  # real checkpoints: the engines know their parameters
        latencies=Latencies(steps=dict(STEPS)),
        interval=2.0,  # pods do not change during a push; listing them loads the API server
    )

    async def logs(request: web.Request) -> web.Response:
        since = float(request.query.get("since", "0"))
        sim = follower.sim
        engines = {} if sim is None else dict(sim.engines)
        out = {key: [e for e in engine.log.entries if e["t"] >= since] for key, engine in engines.items()}
        return web.json_response(out)

    async def get_counts(request: web.Request) -> web.Response:
        return web.json_response({key: dict(c) for key, c in counts.items()})

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/logs", logs)
        app.router.add_get("/counts", get_counts)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", admin_port).start()
        await follower.run()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- trainer


def trainer_main(kubeconfig: str, root: str, concurrency: int, poll_interval: float) -> None:
    """Child process: the trainer. Reads ``{"revision": R}`` lines on stdin, pushes revision R's tensors with
    ``push_revision`` (SimulatedSender), answers one JSON line of timings per push on stdout."""
    from kubernetes import config

    from rolloutfleet.trainer import push as push_module
    from rolloutfleet.trainer.senders import SimulatedSender

    api = config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    timeline: dict[str, Any] = {}

    def stamp(name: str, **fields: Any) -> None:
        timeline.setdefault(name, []).append({"t": time.monotonic(), **fields})

    original_digest = push_module.digest_tensors

    def timed_digest(source: Any, **kw: Any) -> str:
        started = time.monotonic()
        try:
            return original_digest(source, **kw)
        finally:
            stamp("digest", start=started, target=getattr(source, "target", "?"))

    original_read, original_annotate = push_module.read_revision, push_module.annotate_revision

    def counted_read(*args: Any, **kw: Any) -> Any:
        started = time.monotonic()
        try:
            return original_read(*args, **kw)
        finally:
            stamp("read", start=started)

    def timed_annotate(*args: Any, **kw: Any) -> Any:
        started = time.monotonic()
        try:
            return original_annotate(*args, **kw)
        finally:
            stamp("annotate", start=started, annotations=args[-1] if args else kw.get("annotations"))

    push_module.digest_tensors = timed_digest  # type: ignore[assignment]
    push_module.read_revision = counted_read  # type: ignore[assignment]
    push_module.annotate_revision = timed_annotate  # type: ignore[assignment]

    class TimedSender(SimulatedSender):
        def __init__(self) -> None:
            self.targets: dict[int, str] = {}

        def prepare(self, tensors: Any, target: str = "tensors") -> Any:
            started = time.monotonic()
            prepared = super().prepare(tensors, target)
            self.targets[id(prepared)] = target
            stamp("prepare", start=started, target=target, bytes=len(prepared.body))
            return prepared

        def send(self, address: str, token: str, prepared: Any, timeout: float) -> None:
            started = time.monotonic()
            try:
                super().send(address, token, prepared, timeout)
            finally:
                stamp("send", start=started, address=address, target=self.targets.get(id(prepared), "?"))

    base = pathlib.Path(root) / "policy"
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        revision = int(json.loads(line)["revision"])
        verifier, draft = records(base / f"step-{revision}" / "verifier"), records(base / f"step-{revision}" / "draft")
        timeline = {}
        cpu0 = time.process_time()
        stamp("call")

        def progress(p: Any) -> None:
            stamp("progress", stage=p.stage, message=p.message)

        try:
            result = push_module.push_revision(
                FLEET,
                revision,
                verifier,
                draft,
                NAMESPACE,
                sender=TimedSender(),
                api_client=api,
                concurrency=concurrency,
                poll_interval=poll_interval,
                timeout=600,
                session_timeout=300,
                progress=progress,
            )
            outcome: dict[str, Any] = {"phase": result.phase, "sends": result.sends, "served": result.served}
        except Exception as exc:  # reported, not raised: the bench writes what happened
            outcome = {"phase": "error", "error": f"{type(exc).__name__}: {exc}"}
        stamp("return")
        outcome.update(revision=revision, timeline=timeline, cpu_s=time.process_time() - cpu0)
        print(json.dumps(outcome), flush=True)


# ----------------------------------------------------------------------------------------- bench helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu(pid: int, task: int | None = None) -> float:
    """utime+stime of a process (all its threads), or of one of its threads (``task``)."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    fields = pathlib.Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _component_pids(local: Any, exclude: set[int]) -> dict[str, int]:
    """The control plane's processes by binary name (our own children mention its kubeconfig too)."""
    out = {}
    for pid in set(local.pids()) - exclude:
        try:
            out[pathlib.Path(f"/proc/{pid}/comm").read_text().strip()] = pid
        except OSError:
            continue
    return out


def _machine_busy() -> float:
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    match = re.search(r"VmHWM:\s+(\d+) kB", pathlib.Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


def _scrape(port: int) -> dict[str, float]:
    """The operator's counters that matter here: Kubernetes requests by verb (``kube:VERB``) and, per step
    of the transaction, the time its engine calls took as the operator saw them (``step:STEP:sum|count``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for metric, labels, value in re.findall(r"^(rolloutfleet_[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if metric == "rolloutfleet_kube_api_requests_total":
            out[f"kube:{fields['verb']}"] += float(value)
        elif metric in (
            "rolloutfleet_update_step_duration_seconds_sum",
            "rolloutfleet_update_step_duration_seconds_count",
        ):
            out[f"step:{fields['step']}:{metric.rsplit('_', 1)[1]}"] += float(value)
    return dict(out)


def _get_json(url: str) -> Any:
    return json.loads(urllib.request.urlopen(url, timeout=30).read())


class RevisionWatch:
    """Watches the namespace's WeightRevisions; keeps (monotonic time, compact view) per event."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client, watch

        self.custom = client.CustomObjectsApi(api)
        self.watch = watch.Watch()
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="revision-watch")
        self.thread.start()

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        resource_version = None
        while not self.stopped.is_set():
            try:
                kw = {"resource_version": resource_version} if resource_version else {}
                for event in self.watch.stream(
                    self.custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    NAMESPACE,
                    "weightrevisions",
                    timeout_seconds=60,
                    **kw,
                ):
                    now = time.monotonic()
                    obj = event["object"]
                    resource_version = obj["metadata"].get("resourceVersion")
                    with self.lock:
                        self.events.append({"t": now, "type": event["type"], **_compact(obj)})
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = None
                else:
                    time.sleep(0.2)
            except Exception:  # the stream broke (the bench is ending, or the API server hiccuped)
                if self.stopped.is_set():
                    return
                time.sleep(0.2)

    def of(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["name"] == name]

    def stop(self) -> None:
        self.stopped.set()
        self.watch.stop()


def _compact(obj: dict[str, Any]) -> dict[str, Any]:
    status = obj.get("status") or {}
    push = status.get("push") or {}
    notes = obj["metadata"].get("annotations") or {}
    return {
        "name": obj["metadata"]["name"],
        "phase": status.get("phase"),
        "marks": {t: notes.get(f"push.rolloutfleet.io/{t}") for t in ("verifier", "draft")},
        "error": notes.get("push.rolloutfleet.io/error"),
        "epoch": push.get("epoch"),
        "sessions": [(s.get("address"), s.get("target"), s.get("epoch")) for s in push.get("sessions") or []],
    }


def _wait_engines(core: Any, n: int, timeout: float) -> float:
    import aiohttp

    started = time.monotonic()

    async def healthy(ips: list[str]) -> int:
        async with aiohttp.ClientSession(trust_env=False) as session:

            async def one(ip: str) -> bool:
                try:
                    async with session.get(f"http://{ip}:8000/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        return resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    return False

            return sum(await asyncio.gather(*(one(ip) for ip in ips)))

    while time.monotonic() - started < timeout:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"rolloutfleet.io/fleet={FLEET}").items
        ips = [p.status.pod_ip for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        if len(ips) == n and asyncio.run(healthy(ips)) == n:
            return time.monotonic() - started
        time.sleep(1)
    raise TimeoutError(f"{n} engines did not come up in {timeout}s")


# ---------------------------------------------------------------------------------------------- one run


def run_one(
    n: int, mode: str, revisions: int, concurrency: int, poll_interval: float, profile: str = ""
) -> list[dict[str, Any]]:
    """One cluster, one fleet of ``n`` pods in ``mode``; ``revisions`` pushed revisions, one row each.

    ``profile``: a directory; the operator then runs under cProfile (its whole life: start-up, the fleet's
    creation, every revision) and leaves ``operator-N-MODE.prof`` there. A diagnostic: cProfile slows the
    operator, so its rows are not the measurement."""
    from kubernetes import client, config

    from rolloutfleet.api import crdgen
    from rolloutfleet.sandbox import cluster

    nodes = max(4, (n + 7) // 8)
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"rf-push-{n}-{mode}-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        root = tmp / "weights"
        write_checkpoints(root, revisions)
        local = cluster.Cluster(
            tmp / "cluster", name=f"push{n}{mode}", nodes=nodes, gpus_per_node=8, tie_to_parent=True
        )
        local.start()
        procs: list[subprocess.Popen[Any]] = []
        watcher: RevisionWatch | None = None
        log_path = tmp / "operator.log"
        try:
            api = config.new_client_from_config(config_file=str(local.kubeconfig), persist_config=False)
            ext = client.ApiextensionsV1Api(api)
            for crd in crdgen.custom_resource_definitions().values():
                ext.create_custom_resource_definition(crd)
            time.sleep(2)
            core = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})
            while not core.list_namespaced_service_account(NAMESPACE).items:
                time.sleep(0.2)
            create_weights_volume(core, NAMESPACE, str(root))
            metrics_port, admin_port = _free_port(), _free_port()
            env = dict(
                os.environ,
                KUBECONFIG=str(local.kubeconfig),
                ROLLOUTFLEET_IDLE_SECONDS="1",
                ROLLOUTFLEET_RESYNC_SECONDS="10",
            )
            log = log_path.open("wb")
            profiler = ["-m", "cProfile", "-o", str(pathlib.Path(profile) / f"operator-{n}-{mode}.prof")]
            operator = subprocess.Popen(
                [
                    sys.executable,
                    *(profiler if profile else []),
                    "-m",
                    "rolloutfleet.cli",
                    "run",
                    "-A",
                    "--standalone",
                    "--metrics-port",
                    str(metrics_port),
                    "--liveness",
                    "",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs.append(operator)
            follower = subprocess.Popen(
                [sys.executable, __file__, "--follower", str(local.kubeconfig), str(admin_port)],
                stdout=subprocess.DEVNULL,
            )
            procs.append(follower)
            trainer = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--trainer",
                    json.dumps([str(local.kubeconfig), str(root), concurrency, poll_interval]),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(trainer)
            assert trainer.stdout is not None and trainer.stdin is not None
            assert json.loads(trainer.stdout.readline()).get("ready")
            custom = client.CustomObjectsApi(api)
            custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                NAMESPACE,
                "rolloutfleets",
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "RolloutFleet",
                    "metadata": {"name": FLEET},
                    "spec": {
                        "replicas": n,
                        "image": "vllm-rolloutfleet:0.33.0",
                        "verifier": {"path": str(root / "policy/step-0/verifier")},
                        "draft": {
                            "method": "draft_model",
                            "path": str(root / "policy/step-0/draft"),
                            "policy": "coUpdate",
                        },
                        "weights": {
                            "claimName": "w",
                            "mountPath": str(root),
                            "allowedRoots": [str(root / "policy")],
                        },
                        "weightTransfer": {"backend": "ipc"},
                        "updateStrategy": {
                            "mode": mode,
                            "rollout": "AllAtOnce",
                            "maxRetries": 0,
                            "timeouts": {"wakeSeconds": 60, "pushSeconds": 120},
                        },
                    },
                },
            )
            started = time.monotonic()
            pods_ready = _wait_engines(core, n, timeout=600)
            while time.monotonic() - started < 600:
                fleet = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "rolloutfleets", FLEET)
                if (fleet.get("status") or {}).get("readyReplicas") == n:
                    break
                time.sleep(1)
            print(
                f"[bench] n={n} {mode}: {n} engines answering in {pods_ready:.1f}s, "
                f"fleet ready in {time.monotonic() - started:.1f}s",
                file=sys.stderr,
            )
            time.sleep(3)  # let the fleet settle (first resync passes)
            watcher = RevisionWatch(api)
            components = _component_pids(local, {operator.pid, follower.pid, trainer.pid})
            for revision in range(1, revisions + 1):
                name = f"{FLEET}-r{revision}"
                log_offset = log_path.stat().st_size
                cpu0 = {
                    "operator": _proc_cpu(operator.pid),
                    "operator's event-loop thread": _proc_cpu(operator.pid, operator.pid),
                    "engines (follower)": _proc_cpu(follower.pid),
                    "trainer": _proc_cpu(trainer.pid),
                    "bench (watch)": _proc_cpu(os.getpid()),
                    **{c: _proc_cpu(pid) for c, pid in components.items()},
                }
                scrape0, machine0 = _scrape(metrics_port), _machine_busy()
                counts0 = _get_json(f"http://127.0.0.1:{admin_port}/counts")
                t_go = time.monotonic()
                trainer.stdin.write(json.dumps({"revision": revision}) + "\n")
                trainer.stdin.flush()
                answer: dict[str, Any] = {}
                reader = threading.Thread(
                    target=lambda out=answer: out.update(json.loads(trainer.stdout.readline() or "{}")), daemon=True
                )
                reader.start()
                # Everything is read the moment the revision is final (not when the trainer's next poll sees
                # it): the operator's pass that follows a completed revision is not part of the push.
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline and not any(e["phase"] in FINAL for e in watcher.of(name)):
                    if not reader.is_alive():  # the trainer gave up (its answer says why)
                        break
                    time.sleep(0.02)
                cpu = {
                    "operator": _proc_cpu(operator.pid),
                    "operator's event-loop thread": _proc_cpu(operator.pid, operator.pid),
                    "engines (follower)": _proc_cpu(follower.pid),
                    "trainer": _proc_cpu(trainer.pid),
                    "bench (watch)": _proc_cpu(os.getpid()),
                    **{c: _proc_cpu(pid) for c, pid in components.items()},
                }
                machine = _machine_busy() - machine0
                t_cut = time.monotonic()
                scrape = {k: v - scrape0.get(k, 0.0) for k, v in _scrape(metrics_port).items()}
                counts1 = _get_json(f"http://127.0.0.1:{admin_port}/counts")
                reader.join(timeout=120)
                result = answer or {"phase": "error", "error": "the trainer did not answer"}
                logs = _get_json(f"http://127.0.0.1:{admin_port}/logs?since={t_go}")
                with log_path.open("rb") as f:
                    f.seek(log_offset)
                    op_log = f.read().decode(errors="replace")
                row = analyse(
                    n=n,
                    mode=mode,
                    name=name,
                    t_go=t_go,
                    trainer=result,
                    events=watcher.of(name),
                    logs=logs,
                    counts=(counts0, counts1),
                )
                row.update(
                    revision=revision,
                    cpu={k: round(cpu[k] - cpu0[k], 2) for k in cpu},
                    machine_busy_s=round(machine, 2),
                    cpu_window_s=round(t_cut - t_go, 2),
                    kube_requests={k[5:]: int(v) for k, v in scrape.items() if k.startswith("kube:") and v},
                    operator_steps_ms={
                        k[5:-4]: round(1000 * v / scrape[k[:-4] + ":count"], 1)
                        for k, v in scrape.items()
                        if k.startswith("step:") and k.endswith(":sum") and scrape.get(k[:-4] + ":count")
                    },
                    peak_rss_mb=round(_peak_rss_mb(operator.pid), 1),
                    pods_ready_s=round(pods_ready, 1),
                    passes=re.findall(r"pass [^\n]*iterations[^\n]*", op_log),
                    warnings=[
                        ln
                        for ln in op_log.splitlines()
                        if ("WARNING" in ln or "ERROR" in ln) and "Connection pool is full" not in ln
                    ][:20],
                    pool_full_warnings=op_log.count("Connection pool is full"),
                )
                print(json.dumps({k: v for k, v in row.items() if k not in ("pods_detail",)}), file=sys.stderr)
                rows.append(row)
                if row.get("wall_s") is None:
                    break  # its pods are restarting or left paused: a next revision would not measure a push
                time.sleep(3)  # the next revision starts from a fleet at rest
        finally:
            if watcher is not None:
                watcher.stop()
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            local.stop()
            if log_path.exists():
                copy = pathlib.Path(tempfile.gettempdir()) / f"rf-bench-push-operator-{n}-{mode}.log"
                copy.write_bytes(log_path.read_bytes())
    return rows


# ------------------------------------------------------------------------------------------------ analysis


def _first(events: list[dict[str, Any]], pred: Any) -> float | None:
    return next((e["t"] for e in events if pred(e)), None)


def analyse(
    *,
    n: int,
    mode: str,
    name: str,
    t_go: float,
    trainer: dict[str, Any],
    events: list[dict[str, Any]],
    logs: dict[str, list[dict[str, Any]]],
    counts: tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]],
) -> dict[str, Any]:
    """Wall time, the bound, and the critical path split between engines, operator and trainer."""
    tl = trainer.get("timeline") or {}
    created_report = next((p["t"] for p in tl.get("progress", []) if p["stage"] == "created"), None)
    added = _first(events, lambda e: e["type"] == "ADDED")
    t_created = min(t for t in (created_report, added) if t is not None)
    t_done = _first(events, lambda e: e["phase"] == "Succeeded")
    final = next((e["phase"] for e in reversed(events) if e["phase"]), None)
    bound = lower_bound(mode)
    out: dict[str, Any] = {"pods": n, "mode": mode, "phase": final, "trainer_phase": trainer.get("phase")}
    if trainer.get("error"):
        out["trainer_error"] = trainer["error"]
    out["epoch_order"] = epoch_order(events, logs, t_created, tl)
    if t_done is None:
        out["wall_s"] = None
        out["trainer_push_log"] = [
            f"{p['t'] - t_created:+.3f}s {p['message']}" for p in tl.get("progress", []) if p["stage"] == "push"
        ]
        return out
    wall = t_done - t_created

    # Per pod: the calls it answered (state-changing, logged), in order; what they were; how long they took.
    pods: dict[str, list[dict[str, Any]]] = {}
    for key, log in logs.items():
        calls = [e for e in log if e.get("status") == 200 and "t0" in e]
        pods[key] = sorted(calls, key=lambda e: e["seq"])
    expected = SEQUENCE[mode]
    sequences = collections.Counter(tuple(str(e.get("key") or e["step"]) for e in calls) for calls in pods.values())
    core = {
        key: [e for e in calls if str(e.get("key") or e["step"]) not in ("admit", "withdraw")]
        for key, calls in pods.items()
    }
    as_expected = sum(1 for calls in core.values() if [str(e.get("key") or e["step"]) for e in calls] == expected)

    # Fleet-wide milestones of the critical path.
    def last_end(key: str, nth: int = 0) -> float:
        return max(_nth(calls, key, nth)["t"] for calls in core.values())

    def first_start(key: str, nth: int = 0) -> float:
        return min(_nth(calls, key, nth)["t0"] for calls in core.values())

    epochs = {t: {_epoch_of(calls, t) for calls in core.values()} for t in ("verifier", "draft")}

    def published(target: str) -> float:
        top = max(epochs[target])
        return _first(events, lambda e: any(s[1] == target and s[2] == top for s in e["sessions"])) or float("nan")

    def marked(target: str) -> float:
        top = max(epochs[target])
        return _first(events, lambda e: int(e["marks"][target] or 0) >= top) or float("nan")

    milestones = [
        ("created", t_created),
        ("verifier sessions open on every pod", last_end("start_weight_update")),
        ("verifier sessions published (status.push)", published("verifier")),
        ("last verifier send answered", last_end("update_weights", 0)),
        ("verifier mark visible (annotation)", marked("verifier")),
        ("draft sessions open on every pod", last_end("start_draft_weight_update")),
        ("draft sessions published (status.push)", published("draft")),
        ("last draft send answered", last_end("update_weights", 1)),
        ("draft mark visible (annotation)", marked("draft")),
        ("every pod resumed", last_end("resume")),
        ("Succeeded visible", t_done),
    ]
    seq = expected
    iv, idr = seq.index("update_weights"), len(seq) - 1 - seq[::-1].index("update_weights")
    engine_parts = [
        sum(latency(k) for k in seq[: seq.index("start_weight_update") + 1]),
        0.0,
        latency("update_weights"),
        0.0,
        sum(latency(k) for k in seq[iv + 1 : seq.index("start_draft_weight_update") + 1]),
        0.0,
        latency("update_weights"),
        0.0,
        sum(latency(k) for k in seq[idr + 1 :]),
        0.0,
    ]
    owners = [
        "operator",
        "operator",
        "trainer",
        "trainer",
        "operator",
        "operator",
        "trainer",
        "trainer",
        "operator",
        "operator",
    ]
    segments = []
    for i, (engine_s, owner) in enumerate(zip(engine_parts, owners, strict=True)):
        (label0, t0), (label1, t1) = milestones[i], milestones[i + 1]
        span = t1 - t0
        segments.append(
            {
                "from": label0,
                "to": label1,
                "s": round(span, 3),
                "engine_s": round(engine_s, 3),
                "overhead_s": round(span - engine_s, 3),
                "owner": owner,
            }
        )
    ordered = all(milestones[i][1] <= milestones[i + 1][1] for i in range(len(milestones) - 1))
    operator_over = sum(s["overhead_s"] for s in segments if s["owner"] == "operator")
    trainer_over = sum(s["overhead_s"] for s in segments if s["owner"] == "trainer")

    # Per pod: the operator's gaps between two of its own consecutive calls on the pod (not the waits on the
    # trainer around /update_weights, not the wait for the first call nor after the last), by transition.
    gaps: list[float] = []
    transitions: dict[str, list[float]] = collections.defaultdict(list)
    for calls in pods.values():
        for a, b in itertools.pairwise(calls):
            ka, kb = str(a.get("key") or a["step"]), str(b.get("key") or b["step"])
            transitions[f"{ka} → {kb}"].append(1000 * (b["t0"] - a["t"]))
            if "update_weights" not in (ka, kb):
                gaps.append(1000 * (b["t0"] - a["t"]))
    order = [f"{a} → {b}" for a, b in itertools.pairwise(next(iter(sequences)))]
    durations = [e["t"] - e["t0"] for calls in core.values() for e in calls]
    configured = [latency(str(e.get("key") or e["step"])) for calls in core.values() for e in calls]
    # How long the operator took to make its first engine call after each thing it waits for.
    first_any = min(calls[0]["t0"] for calls in pods.values())
    pickups = {
        "revision created → first engine call": first_any - t_created,
        "verifier mark visible → first finish_weight_update": first_start("finish_weight_update", 0)
        - marked("verifier"),
        "draft mark visible → first finish_weight_update": first_start("finish_weight_update", 1) - marked("draft"),
        "last update_weight_version → first resume step": min(
            calls[calls.index(_nth(calls, "update_weight_version", 0)) + 1]["t0"] for calls in core.values()
        )
        - last_end("update_weight_version"),
        "last resume → last admit": max(calls[-1]["t"] for calls in pods.values()) - last_end("resume"),
    }

    # Engine requests per pod, by route: the operator's (all but /update_weights) and the trainer's.
    c0, c1 = counts
    by_route: collections.Counter[str] = collections.Counter()
    for key, routes in c1.items():
        for route, value in routes.items():
            by_route[route] += value - (c0.get(key) or {}).get(route, 0)
    trainer_reqs = by_route.pop("update_weights", 0)

    # The trainer's own split (its process's monotonic clock, the same as everyone's).
    call = tl["call"][0]["t"]
    ret = tl["return"][0]["t"]
    digest = sum(d["t"] - d["start"] for d in tl.get("digest", []))
    digest_end = max((d["t"] for d in tl.get("digest", [])), default=call)
    created_t = created_report or digest_end
    progress = tl.get("progress", [])
    serving = []  # (start, end) of each _serve: "sending to" … "marked"
    for p in progress:
        if p["stage"] == "push" and ": sending to " in p["message"]:
            serving.append([p["t"], None])
        elif (
            p["stage"] == "push"
            and serving
            and serving[-1][1] is None
            and ("marked" in p["message"] or "failed" in p["message"])
        ):
            serving[-1][1] = p["t"]
    serve_s = sum((b or ret) - a for a, b in serving)
    waiting, previous = 0.0, created_t  # from the create (or the last mark) to the next sessions seen
    for a, b in serving:
        waiting += max(0.0, a - previous)
        previous = b or ret
    sends = tl.get("send", [])
    send_spans = collections.defaultdict(list)
    for s in sends:
        send_spans[s["target"]].append(s)
    annotate_s = sum(a["t"] - a["start"] for a in tl.get("annotate", []))
    prepare_s = sum(p["t"] - p["start"] for p in tl.get("prepare", []))
    trainer_split = {
        "call_s": round(ret - call, 3),
        "reads_digest_create_s": round(created_t - call, 3),
        "digest_s": round(digest, 4),
        "waiting_for_sessions_s": round(waiting, 3),
        "serving_s": round(serve_s, 3),
        "prepare_s": round(prepare_s, 4),
        "sends": {
            t: {
                "n": len(v),
                "first_start_to_last_end_s": round(max(x["t"] for x in v) - min(x["start"] for x in v), 3),
                "median_s": round(statistics.median(x["t"] - x["start"] for x in v), 3),
            }
            for t, v in send_spans.items()
        },
        "annotate_s": round(annotate_s, 3),
        "waiting_for_ready_s": round(ret - previous, 3),
        "revision_reads": len(tl.get("read", [])),
        "annotations": len(tl.get("annotate", [])),
        "cpu_s": round(trainer.get("cpu_s", 0.0), 3),
        "served_epochs": trainer.get("served"),
    }
    out.update(
        wall_s=round(wall, 3),
        bound_s=round(bound, 3),
        overhead_s=round(wall - bound, 3),
        overhead_per_pod_ms=round(1000 * (wall - bound) / n, 1),
        operator_overhead_s=round(operator_over, 3),
        operator_overhead_per_pod_ms=round(1000 * operator_over / n, 1),
        trainer_overhead_s=round(trainer_over, 3),
        segments=segments,
        milestones_ordered=ordered,
        epochs={t: sorted(v) for t, v in epochs.items()},
        pods_as_expected=as_expected,
        sequences={" → ".join(k): v for k, v in sequences.items()},
        pickups_s={k: round(v, 3) for k, v in pickups.items()},
        operator_gaps_ms=_stats(gaps),
        gaps_by_transition_ms={k: _stats(transitions[k]) for k in order if k in transitions},
        engine_call_excess_ms=round(1000 * (sum(durations) - sum(configured)) / max(1, len(durations)), 2),
        engine_requests_per_pod={r: round(v / n, 2) for r, v in sorted(by_route.items(), key=lambda x: -x[1])},
        engine_requests_operator_per_pod=round(sum(by_route.values()) / n, 2),
        engine_requests_trainer_per_pod=round(trainer_reqs / n, 2),
        trainer_split=trainer_split,
    )
    return out


def epoch_order(
    events: list[dict[str, Any]], logs: dict[str, list[dict[str, Any]]], t_created: float, trainer: dict[str, Any]
) -> dict[str, Any]:
    """Whether the trainer sent into every session that the operator opened and the trainer's mark covered
    (the operator ends every session up to the mark as sent: docs/push.md).

    Per target: ``sessions`` and ``epochs`` opened (the engines' ``rolloutfleet_push_begin`` calls); ``late``:
    epochs first listed in ``status.push`` after a newer epoch was; ``unsent``: sessions of an epoch the mark
    covered that got no ``/update_weights`` from the trainer, each with when the trainer started serving
    (read the revision) and when the bench's watch first saw the session listed (s after the creation);
    ``listing``: for the epochs of unsent sessions, how many of their sessions were listed over time.
    """
    out: dict[str, Any] = {}
    progress = trainer.get("progress", [])
    for target in ("verifier", "draft"):
        opened = sorted(
            (int(e["args"]["kwargs"]["epoch"]), key)
            for key, log in logs.items()
            for e in log
            if e.get("key") == f"rolloutfleet_push_begin:{target}" and e.get("status") == 200
        )
        sent = {x["address"] for x in trainer.get("send", []) if x["target"] == target}
        serving = [  # "<revision>: <target> epoch <N>: sending to <pods>" (rolloutfleet.trainer.push)
            round(p["t"] - t_created, 3)
            for p in progress
            if p["stage"] == "push"
            and (parts := p["message"].split(": "))[1].startswith(f"{target} epoch ")
            and parts[2].startswith("sending to ")
        ]
        listed: dict[tuple[int, str], float] = {}
        first_epoch: dict[int, float] = {}
        counts: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
        top_mark = 0
        for e in events:
            per_epoch: collections.Counter[int] = collections.Counter()
            for address, t, epoch in e["sessions"]:
                if t == target and epoch is not None:
                    listed.setdefault((int(epoch), str(address)), e["t"])
                    first_epoch.setdefault(int(epoch), e["t"])
                    per_epoch[int(epoch)] += 1
            for epoch, count in per_epoch.items():
                if not counts[epoch] or counts[epoch][-1][1] != count:
                    counts[epoch].append((round(e["t"] - t_created, 3), count))
            top_mark = max(top_mark, int(e["marks"][target] or 0))
        late = sorted(x for x in first_epoch if any(y > x and first_epoch[y] < first_epoch[x] for y in first_epoch))
        missed = [(epoch, key) for epoch, key in opened if epoch <= top_mark and key not in sent]
        out[target] = {
            "sessions": len(opened),
            "epochs": len({e for e, _ in opened}),
            "late": late,
            "trainer_serving_at": serving,
            "unsent": [
                f"{key} epoch {epoch}, listed "
                + ("never" if (epoch, key) not in listed else f"{listed[(epoch, key)] - t_created:.3f}")
                for epoch, key in missed
            ],
            "listing": {epoch: counts[epoch] for epoch in sorted({e for e, _ in missed})},
        }
    return out


def _nth(calls: list[dict[str, Any]], key: str, nth: int) -> dict[str, Any]:
    return [e for e in calls if str(e.get("key") or e["step"]) == key][nth]


def _epoch_of(calls: list[dict[str, Any]], target: str) -> int:
    begin = next(e for e in calls if e.get("key") == f"rolloutfleet_push_begin:{target}")
    return int(begin["args"]["kwargs"]["epoch"])


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median": round(statistics.median(ordered), 1),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
        "max": round(ordered[-1], 1),
    }


# -------------------------------------------------------------------------------------------------- report


def _table(headers: list[str], body: list[list[Any]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(headers) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return ["| " + " | ".join(headers) + " |", rule] + ["| " + " | ".join(str(c) for c in r) + " |" for r in body]


def _untimed(line: str) -> str:
    """An operator log line without its date and time."""
    return re.sub(r"^\S+ \S+ ", "", line)


def _others(row: dict[str, Any]) -> float:
    return round(row["machine_busy_s"] - sum(v for k, v in row["cpu"].items() if "thread" not in k), 2)


def _ms(stats: dict[str, float]) -> str:
    return f"{stats['median']:.0f} / {stats['p95']:.0f} / {stats['max']:.0f}" if stats else "-"


def _source() -> dict[str, str]:
    """What was measured: the commit, whether the operator's code differs from it, and the date."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--", "operator", "worker_image", "digest")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "tree": "with uncommitted changes under operator/ or worker_image/"
        if changed
        else "clean operator/ and worker_image/",
        "date": datetime.date.today().isoformat(),
    }


def report(rows: list[dict[str, Any]], command: str, source: dict[str, Any], concurrency: str, poll: float) -> str:
    """Markdown: the headline table, the target, then per run the critical path, requests, CPU, trainer."""
    ok = [r for r in rows if r.get("wall_s") is not None]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in ok:
        runs[(r["pods"], r["mode"])].append(r)
    lines = [
        "# Push transaction overhead of the operator (simulated engines)",
        "",
        f"Date {source.get('date')}, commit `{source.get('commit')}` ({source.get('tree')}), "
        f"CPython {platform.python_version()}, {os.cpu_count()} cores, {platform.platform()}.",
        f"Command: `{command}`",
        "",
        "## What is measured",
        "",
        "Per fleet size and mode, one local control plane (etcd, kube-apiserver, controller-manager, scheduler,",
        "kwok) with fake 8-GPU nodes; the real operator process; one follower process serving a simulated engine",
        "on every pod's loopback IP; one trainer process calling `rolloutfleet.trainer.push_revision` with",
        f"`SimulatedSender()`, `concurrency={concurrency}` (one send per pod at once) and `poll_interval={poll:g}`",
        "(the library's default), with the admin kubeconfig (not the least-privilege ServiceAccount). The fleet:",
        "`weightTransfer: {backend: ipc}`, a co-updated `draft_model` draft, AllAtOnce, `maxRetries: 0`; its",
        f"engines start from real tiny safetensors checkpoints ({VERIFIER_TENSORS} and {DRAFT_TENSORS} F32 tensors of "
        f"{TENSOR_SHAPE[0]}x{TENSOR_SHAPE[1]}),",
        "so each simulated engine knows its parameters and a session is complete only once the trainer sent every",
        "one. Each run pushes its revisions one after the other on the same fleet (revision 1 is the first push",
        "this operator and trainer process make). Simulated latencies of the engine calls (seconds):",
        "",
        "`" + json.dumps(STEPS) + "`",
        "",
        "**Lower bound** (the critical path): one pod's engine calls back to back, every pod in parallel, including",
        f"the trainer's two `/update_weights` (as the engine simulates them: {STEPS['update_weights']:g} s each); "
        "the operator's reads",
        "(`/is_paused`, `/is_sleeping`, `/weight_info`, `rolloutfleet_state`, `/rolloutfleet/ready`) and",
        "admit/withdraw take no simulated time, so their time is overhead. The trainer's polling is **not** in",
        "the bound (0 s): what it costs is the trainer's share below. Per mode:",
        "",
    ]
    for mode in sorted({r["mode"] for r in ok}):
        lines.append(f"- {mode}: {' → '.join(SEQUENCE[mode])} = **{lower_bound(mode):.2f} s**")
    lines += [
        "",
        "**Wall**: from the WeightRevision's creation (the trainer's create answer or the bench's watch event,",
        "whichever came first) to the bench's watch seeing `phase: Succeeded`. **Wall - bound** is split along",
        "the fleet's critical path (next section) into the operator's share (its own work and the control",
        "plane's latency: watch delivery, status writes) and the trainer's share (seeing the sessions — its",
        f"{poll:g} s polling —, posting, marking), using the engines' call logs and the watch's timestamps of",
        "`status.push` and of the trainer's marks (one monotonic clock for every process). CPU seconds and",
        "request counts cover the trainer's start to the moment the watch sees the revision final (the pass",
        "the operator runs after a completed revision is left out).",
        "",
        "## Results",
        "",
    ]
    headers = [
        "pods",
        "mode",
        "rev",
        "phase",
        "wall s",
        "bound s",
        "wall - bound s",
        "(wall - bound)/pod ms",
        "operator share s",
        "operator share/pod ms",
        "trainer share s",
        "operator CPU s",
        "operator CPU/pod ms",
        "peak RSS MB",
        "kube req/pod",
        "engine req/pod (operator)",
        "sends/pod (trainer)",
    ]
    body = []
    for r in ok:
        kube = sum(r["kube_requests"].values())
        cpu = r["cpu"]["operator"]
        body.append(
            [
                r["pods"],
                r["mode"],
                r["revision"],
                r["phase"],
                f"{r['wall_s']:.2f}",
                f"{r['bound_s']:.2f}",
                f"{r['overhead_s']:.2f}",
                f"{r['overhead_per_pod_ms']:.0f}",
                f"{r['operator_overhead_s']:.2f}",
                f"{r['operator_overhead_per_pod_ms']:.0f}",
                f"{r['trainer_overhead_s']:.2f}",
                f"{cpu:.2f}",
                f"{1000 * cpu / r['pods']:.0f}",
                r["peak_rss_mb"],
                f"{kube / r['pods']:.2f}",
                r["engine_requests_operator_per_pod"],
                r["engine_requests_trainer_per_pod"],
            ]
        )
    lines += _table(headers, body, "rlrlrrrrrrrrrrrrr")
    failed = [r for r in rows if r.get("wall_s") is None]
    for r in failed:
        lines += [
            "",
            f"**{r['pods']} pods, {r['mode']}, revision {r['revision']}: {r.get('phase')}** "
            f"(the trainer: {r.get('trainer_error') or r.get('trainer_phase')}). Session epochs: "
            f"`{json.dumps(r.get('epoch_order'))}` (`unsent`: sessions the trainer's mark covered before they were "
            "listed in `status.push`). The trainer's sends (s after creation): "
            + "; ".join(f"`{m}`" for m in r.get("trainer_push_log") or [])
            + ". The operator's warnings: "
            + "; ".join(f"`{_untimed(w)}`" for w in r.get("warnings", [])[:3]),
        ]
    cpu_pp = [1000 * r["cpu"]["operator"] / r["pods"] for r in ok]
    wall_pp = [r["overhead_per_pod_ms"] for r in ok]
    share_pp = [r["operator_overhead_per_pod_ms"] for r in ok]
    if ok:
        lines += [
            "",
            "## Against the target: push transaction overhead per pod beyond the engine's own calls ≤ 50 ms",
            "",
            'Readings of "overhead per pod", each over the revisions above:',
            "",
            f"- **operator CPU seconds per pod** (utime+stime of the operator process during the revision / pods): "
            f"{min(cpu_pp):.0f}-{max(cpu_pp):.0f} ms; ≤ 50 ms in {sum(v <= 50 for v in cpu_pp)} of {len(cpu_pp)}.",
            f"- **(wall - bound) / pods** (everything that is not an engine call, the trainer's share included): "
            f"{min(wall_pp):.0f}-{max(wall_pp):.0f} ms; ≤ 50 ms in {sum(v <= 50 for v in wall_pp)} of {len(wall_pp)}.",
            f"- **the operator's share of (wall - bound) / pods**: {min(share_pp):.0f}-{max(share_pp):.0f} ms; "
            f"≤ 50 ms in {sum(v <= 50 for v in share_pp)} of {len(share_pp)}.",
            f"- revisions that did not succeed: {len(failed)} of {len(rows)} (above; a run stops at its first "
            "failed revision).",
            "- read per pod without dividing by the fleet (each pod's own transaction: all pods run in parallel, "
            "so each waits the whole operator share): "
            f"{min(r['operator_overhead_s'] for r in ok):.2f}-{max(r['operator_overhead_s'] for r in ok):.2f} s.",
        ]
    for (n, mode), revs in runs.items():
        lines += ["", f"## {n} pods, {mode}: the critical path (seconds; overhead = span - simulated engine time)", ""]
        head = ["from → to", "owner", "engine s"] + [f"r{r['revision']} span / overhead" for r in revs]
        body = []
        for i, seg in enumerate(revs[0]["segments"]):
            body.append(
                [f"{seg['from']} → {seg['to']}", seg["owner"], f"{seg['engine_s']:.2f}"]
                + [f"{r['segments'][i]['s']:.2f} / {r['segments'][i]['overhead_s']:.2f}" for r in revs]
            )
        body.append(
            ["**total**", "", f"{revs[0]['bound_s']:.2f}"]
            + [f"**{r['wall_s']:.2f} / {r['overhead_s']:.2f}**" for r in revs]
        )
        lines += _table(head, body, "ll" + "r" * (len(head) - 2))
        unordered = [r["revision"] for r in revs if not r["milestones_ordered"]]
        if unordered:
            lines.append(f"\n(milestones out of order in revision(s) {unordered}: the split is approximate there)")
        lines += [
            "",
            "Session epochs (the operator opens one epoch per set of sessions it opens together) and what the",
            "trainer served: "
            + "; ".join(
                f"r{r['revision']}: verifier {len(r['epochs']['verifier'])} epochs, draft "
                f"{len(r['epochs']['draft'])} epochs, trainer marks {r['trainer_split']['served_epochs']}"
                for r in revs
            )
            + ". Epochs first listed after a newer one (out of order): "
            + "; ".join(
                f"r{r['revision']} "
                + ", ".join(f"{t} {v['late'] or 'none'}" for t, v in r["epoch_order"].items())
                + (
                    " (a mark covered an epoch before it was listed: "
                    + json.dumps({t: v["unsent"] for t, v in r["epoch_order"].items() if v["unsent"]})
                    + ")"
                    if any(v["unsent"] for v in r["epoch_order"].values())
                    else ""
                )
                for r in revs
            )
            + ". Every pod made exactly the expected calls: "
            + ", ".join(f"r{r['revision']} {r['pods_as_expected']}/{r['pods']}" for r in revs)
            + ".",
            "",
            "How long the operator took to act after what it waits for (seconds):",
            "",
        ]
        head = ["after", *(f"r{r['revision']}" for r in revs)]
        lines += _table(head, [[k, *(f"{r['pickups_s'][k]:.3f}" for r in revs)] for k in revs[0]["pickups_s"]])
        lines += [
            "",
            "Gaps between two consecutive engine calls on the same pod (ms, median / p95 / max over the pods):",
            "",
        ]
        head = ["transition", *(f"r{r['revision']}" for r in revs)]
        lines += _table(
            head,
            [
                [k, *(_ms(r["gaps_by_transition_ms"].get(k, {})) for r in revs)]
                for k in revs[0]["gaps_by_transition_ms"]
            ],
        )
        lines += [
            "",
            "The operator's step durations as its own metric measured them "
            "(`rolloutfleet_update_step_duration_seconds`, mean ms) and what the simulated calls in them take:",
            "",
        ]
        steps = list(revs[0]["operator_steps_ms"])
        lines += _table(
            ["step", *(f"r{r['revision']}" for r in revs)],
            [[k, *(r["operator_steps_ms"].get(k, "-") for r in revs)] for k in steps],
        )
        lines += ["", "Engine requests per pod, by route (counted at the engines):", ""]
        routes = list(revs[0]["engine_requests_per_pod"])
        lines += _table(
            ["route", *(f"r{r['revision']}" for r in revs)],
            [[k, *(r["engine_requests_per_pod"].get(k, 0) for r in revs)] for k in routes if k != "health"],
        )
        lines += ["", "Kubernetes requests of the operator (its counter), by verb:", ""]
        verbs = sorted({v for r in revs for v in r["kube_requests"]})
        lines += _table(
            ["verb", *(f"r{r['revision']}" for r in revs)],
            [[v, *(r["kube_requests"].get(v, 0) for r in revs)] for v in verbs],
        )
        lines += [
            "",
            "How the cores were shared during the revision (CPU seconds from /proc; machine busy is every core's",
            "non-idle time, steal included, so it also counts processes outside this bench):",
            "",
        ]
        procs = list(revs[0]["cpu"])
        lines += _table(
            ["process", *(f"r{r['revision']}" for r in revs)],
            [[p, *(r["cpu"].get(p, 0) for r in revs)] for p in procs]
            + [["not the bench's (other processes on the machine)", *(_others(r) for r in revs)]]
            + [["machine busy (all cores)", *(r["machine_busy_s"] for r in revs)]]
            + [["CPU window (the trainer's start → Succeeded seen)", *(r["cpu_window_s"] for r in revs)]],
        )
        lines += ["", "The trainer's own time (seconds; `push_revision` from call to return):", ""]
        keys = [
            ("call_s", "whole call"),
            ("reads_digest_create_s", "reads, validation, digest, create"),
            ("digest_s", "of which digest"),
            ("waiting_for_sessions_s", "waiting for sessions (polling the revision)"),
            ("serving_s", "serving (prepare, sends, mark)"),
            ("annotate_s", "of which marking (annotation PATCHes)"),
            ("waiting_for_ready_s", "waiting for Ready after the last mark"),
            ("revision_reads", "revision GETs"),
            ("annotations", "annotation PATCHes"),
            ("cpu_s", "trainer CPU s (its process)"),
        ]
        lines += _table(
            ["", *(f"r{r['revision']}" for r in revs)],
            [[label, *(r["trainer_split"][k] for r in revs)] for k, label in keys],
        )
        sends = "; ".join(
            f"r{r['revision']} "
            + ", ".join(
                f"{t}: {v['n']} sends, first start → last answer {v['first_start_to_last_end_s']:.2f} s "
                f"(median send {v['median_s']:.3f} s)"
                for t, v in r["trainer_split"]["sends"].items()
            )
            for r in revs
        )
        lines += ["", f"Sends: {sends}.", "", "The operator log's pass lines:", ""]
        for r in revs:
            lines += [f"- r{r['revision']}:"] + [f"  - `{p}`" for p in r["passes"]]
        warned = sorted({_untimed(w) for r in revs for w in r["warnings"]})
        lines += [
            "",
            "`Connection pool is full, discarding connection` warnings (urllib3, the operator's Kubernetes "
            "client) per revision: " + ", ".join(f"r{r['revision']} {r['pool_full_warnings']}" for r in revs) + ".",
        ]
        if warned:
            lines += ["", "Other warnings in the operator log during the revisions (distinct):", ""]
            lines += [f"- `{w}`" for w in warned]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--follower":
        follower_main(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) >= 3 and sys.argv[1] == "--trainer":
        kubeconfig, root, concurrency, poll = json.loads(sys.argv[2])
        trainer_main(kubeconfig, root, int(concurrency), float(poll))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--modes", nargs="+", default=["inflight", "sleep"], choices=["inflight", "sleep"])
    parser.add_argument("--revisions", type=int, default=3, help="pushed revisions per run (one row each)")
    parser.add_argument("--concurrency", type=int, default=0, help="the trainer's sends at once (0: one per pod)")
    parser.add_argument("--poll-interval", type=float, default=POLL_INTERVAL)
    parser.add_argument("--out", default="bench/results/push_overhead.md")
    parser.add_argument("--send-seconds", type=float, default=0.0, help="the simulated /update_weights (1.0)")
    parser.add_argument("--profile-operator", default="", help="a directory: run the operator under cProfile")
    parser.add_argument("--json", default="", help="also write the raw rows here")
    parser.add_argument("--from-json", default="", help="only render the report from rows written by --json")
    args = parser.parse_args()
    if args.send_seconds:
        os.environ["PUSH_BENCH_SEND_SECONDS"] = str(args.send_seconds)
        STEPS["update_weights"] = args.send_seconds
    rows = []
    if args.from_json:
        rows = json.loads(pathlib.Path(args.from_json).read_text())
    else:
        source = _source()
        for n in args.sizes:
            for mode in args.modes:
                rows += run_one(
                    n, mode, args.revisions, args.concurrency or n, args.poll_interval, args.profile_operator
                )
        for row in rows:
            row.update(source)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    command = "python bench/push_overhead.py --sizes " + " ".join(map(str, args.sizes))
    if args.modes != ["inflight", "sleep"]:
        command += " --modes " + " ".join(args.modes)
    if args.revisions != 3:
        command += f" --revisions {args.revisions}"
    if args.send_seconds:
        command += f" --send-seconds {args.send_seconds:g}"
    concurrency = str(args.concurrency) if args.concurrency else "pods"
    text = report(rows, command, rows[0] if rows else _source(), concurrency, args.poll_interval)
    pathlib.Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
