"""Soak: many WeightRevisions across a simulated fleet under random faults, watched by an independent observer.

A report, not a test. It starts the local control plane (``rolloutfleet.sandbox``, cluster ``soak``),
installs the CRDs, runs the real operator as a process and serves a simulated vLLM engine on every pod's
loopback IP (``rolloutfleet.sim.follower.PodFollower``, as ``rolloutfleet sandbox demo`` does), then:

- a driver applies ``--revisions`` WeightRevisions one after another (tiny real safetensors checkpoints,
  digests pinned); most use the fleet's level-2-sleep AllAtOnce strategy, some an in-flight Rolling
  override with ``maxUnavailable: 25%``, a few pin a wrong digest (they must roll back), and a few are
  applied before the previous one ended (it must be Superseded);
- an injector fires faults at random moments (a Poisson process per kind, seeded choices): engine
  crashes (now, or at a random step; the engine restarts on its initial weights), slow steps, corrupt
  loads, HTTP 500s on a route, control-token rotation, pod deletion, revision deletion and re-apply of
  the identical manifest (a GitOps pruner), and operator SIGKILL + restart;
- an observer (``bench/soak_observer.py``) samples every 100 ms what every engine really holds (the
  simulator's in-process state), the pods' readiness (Ready and every readiness gate) and the fleet
  status (both from watches of the API server), and counts violations.

The markdown report lists parameters, durations, revisions by final phase, faults by kind, violation
counts with examples, the operator's RSS and the command that reproduces the run:

    .venv/bin/python bench/soak.py --revisions 200 --pods 32 --seed 1 --report bench/results/soak.md
    .venv/bin/python bench/soak.py --smoke            # 8 pods, 10 revisions: does the harness work?

Token rotation: the pod follower restarts *every* engine when the control token changes (a fleet-wide
crash), while the real worker (``rolloutfleet_worker.auth``) re-reads its mounted Secret and accepts the
previous token for a grace period. The soak therefore serves ``RotatingEngine``s: simulated engines that
switch to the new token after a random propagation delay (the kubelet updating the Secret volume) and
keep accepting the old one for ``--token-grace`` seconds.

Operator RSS: a SIGKILL starts a new process, so kills are injected only while fewer than
``--kill-before`` revisions have been applied, and the process that runs to the end is measured after it
handled ``--rss-at`` revisions itself (a process killed and restarted at revision 13 has not "run 20
revisions" at revision 20: its caches are still warming) and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import hmac
import json
import math
import os
import pathlib
import platform
import random
import re
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from aiohttp import web
from kubernetes import client, config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import soak_observer as obs

from rolloutfleet.adapters.kube import Kube
from rolloutfleet.api import crdgen
from rolloutfleet.digest import digest_directory
from rolloutfleet.resources import labels
from rolloutfleet.sandbox import binaries, cluster, demo_weights, operator_process
from rolloutfleet.sim import server as sim_server
from rolloutfleet.sim.config import FaultKind, FaultRule, Latencies, WeightsConfig
from rolloutfleet.sim.fleet import SimulatedFleet
from rolloutfleet.sim.follower import PodFollower

T = TypeVar("T")
GROUP, VERSION = "rolloutfleet.io", "v1alpha1"
NAMESPACE, FLEET = "soak", "policy"
FINAL = ("Succeeded", "Failed", "RolledBack", "Superseded")
REPO = pathlib.Path(__file__).resolve().parents[1]

# Simulated step latencies (seconds): loads 0.08-0.2 s, everything else quick, so 200 revisions fit in
# about half an hour on two cores.
LATENCIES = {
    "*": 0.01,
    "sleep": 0.05,
    "wake_up": 0.05,
    "rolloutfleet_load:verifier": 0.2,
    "rolloutfleet_load:draft": 0.08,
}
TIMEOUTS = {"pauseSeconds": 3, "sleepSeconds": 3, "wakeSeconds": 3, "loadSeconds": 5, "verifySeconds": 3}
INFLIGHT = {"mode": "inflight", "rollout": "Rolling", "maxUnavailable": "25%"}
# Steps a fault can target (sim/config.py keys).
STEPS = [
    "pause",
    "sleep:2",
    "wake_up:weights",
    "rolloutfleet_load:verifier",
    "rolloutfleet_load:draft",
    "update_weight_version",
    "wake_up:kv_cache",
    "reset_prefix_cache",
    "resume",
]
READ_STEPS = ["rolloutfleet_state", "is_paused", "is_sleeping", "weight_info"]
# Faults per minute of soak (before --fault-scale); operator_kill only while kills are allowed.
RATES = {
    "engine_crash": 0.6,
    "slow_step": 1.0,
    "corrupt_load": 0.4,
    "http_500": 1.2,
    "token_rotation": 0.3,
    "pod_delete": 0.4,
    "revision_delete": 0.3,
    "operator_kill": 3.0,
}


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- simulated engines with in-place token rotation ------------------------------------------------


class RotatingEngine(sim_server.SimulatedEngine):
    """A simulated engine whose control token rotates in place, like ``rolloutfleet_worker.auth``:
    the new token is accepted from now on, the previous one until its grace period ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._previous: str | None = None
        self._previous_until = 0.0

    def rotate(self, token: str, grace: float) -> None:
        if token == self._token:
            return
        self._previous, self._previous_until = self._token, time.monotonic() + grace
        self._token = token
        self.log.add("token_rotated", grace=grace)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._previous and time.monotonic() < self._previous_until and not sim_server.is_open(request.path):
            scheme, _, presented = request.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), self._previous.encode()):
                resp: web.StreamResponse = await handler(request)
                return resp
        return await super()._auth(request, handler)


@dataclasses.dataclass
class SoakFollower(PodFollower):
    """``PodFollower`` with ``RotatingEngine``s: a token change rotates engines in place, after a random
    propagation delay each, instead of restarting every engine."""

    token_propagation: float = 3.0
    token_grace: float = 300.0
    rng: random.Random = dataclasses.field(default_factory=random.Random)

    def _new_fleet(self, token: str) -> SimulatedFleet:
        return SimulatedFleet(token=token, weights=self.weights, latencies=self.latencies, engine_class=RotatingEngine)

    async def _token_changed(self, token: str) -> None:
        # Each engine takes the new token after its own propagation delay, keeping the previous one for the
        # grace period (the worker image's rotation), instead of every engine restarting.
        assert self.sim is not None
        self.sim.token = token
        loop = asyncio.get_running_loop()
        for engine in self.sim.engines.values():
            if isinstance(engine, RotatingEngine):
                loop.call_later(self.rng.uniform(0, self.token_propagation), engine.rotate, token, self.token_grace)


class EngineThread:
    """The follower and its engines on their own event loop (thread), so the observer reads them atomically."""

    def __init__(self, follower: SoakFollower) -> None:
        self.follower = follower
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="soak-engines")
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(follower.run(), self.loop)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def snapshot(self) -> dict[str, obs.EngineView]:
        async def read() -> dict[str, obs.EngineView]:  # no await inside: one instant of every engine
            sim = self.follower.sim
            return {} if sim is None else {k: obs.engine_view(e) for k, e in sim.engines.items()}

        return await self.call(read())

    def stop(self) -> None:
        async def shutdown() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            if self.follower.sim is not None:
                await self.follower.sim.stop()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# --- watched copies of the pods and the fleet -------------------------------------------------------


class Mirror:
    """A watched copy of the objects one list call returns, kept current by a thread (list, then watch).

    The observer reads it every 100 ms; listing 32 pods ten times a second from the API server instead would
    load the server the operator depends on, and on two cores it does not fit in 100 ms.
    """

    def __init__(self, list_call: Callable[..., Any], what: str) -> None:
        self._list = list_call
        self.items: dict[str, dict[str, Any]] = {}
        self.events = 0
        self.relists = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.synced = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"mirror-{what}")
        self._thread.start()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.items.values())

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                body = json.loads(self._list(_preload_content=False, _request_timeout=30).data)
                version = body["metadata"]["resourceVersion"]
                with self._lock:
                    self.items = {item["metadata"]["name"]: item for item in body["items"]}
                self.relists += 1
                self.synced.set()
                while not self._stopped.is_set() and version is not None:
                    version = self._watch(version)
            except Exception:  # the apiserver restarting, a timeout: list again
                time.sleep(0.5)

    def _watch(self, version: str) -> str | None:
        """Follow one watch call; the version to resume from, or None when the list must be redone."""
        stream = self._list(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=30,
            _preload_content=False,
            _request_timeout=60,
        )
        try:
            for line in stream:
                if self._stopped.is_set():
                    return None
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return None  # 410 Gone (or another error): relist
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if event.get("type") == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                with self._lock:
                    if event.get("type") == "DELETED":
                        self.items.pop(name, None)
                    else:
                        self.items[name] = obj
                    self.events += 1
        finally:
            stream.release_conn()
        return version


# --- the operator process ----------------------------------------------------------------------------


class OperatorSupervisor:
    """Starts, SIGKILLs and restarts ``rolloutfleet run``; reads its RSS from /proc."""

    def __init__(self, kubeconfig: pathlib.Path, log_path: pathlib.Path) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnations: list[dict[str, Any]] = []
        self.log_offset = 0

    def start(self, after_revision: int) -> None:
        self.proc = operator_process.start(self.kubeconfig, self.log_path)
        self.incarnations.append({"pid": self.proc.pid, "started_after_revision": after_revision})

    def kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def rss_kib(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()


# --- records -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Revision:
    number: int
    name: str
    body: dict[str, Any]
    strategy: str
    corrupt_pin: bool
    overlapped: bool
    applied: float = 0.0
    ended: float | None = None
    phase: str | None = None
    reason: str | None = None
    message: str | None = None
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    deletions: int = 0


class Events:
    """Every injected fault and driver milestone, with a timestamp (seconds since the soak began)."""

    def __init__(self, start: float, path: pathlib.Path) -> None:
        self.start = start
        self.items: list[dict[str, Any]] = []
        self._sink = path.open("w")

    def now(self) -> float:
        return time.monotonic() - self.start

    def add(self, kind: str, target: str | None = None, **detail: Any) -> None:
        wall = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]  # local time, as in the operator log
        item = {"t": round(self.now(), 2), "wall": wall, "kind": kind, "target": target, **detail}
        self.items.append(item)
        self._sink.write(json.dumps(item, default=str) + "\n")
        self._sink.flush()

    def recent(self, pod: str, t: float, window: float = 10.0) -> list[str]:
        """Faults on ``pod`` or on the whole fleet in the ``window`` seconds before ``t``."""
        out = []
        for item in reversed(self.items):
            if item["t"] < t - window:
                break
            fleet_wide = item.get("target") in ("fleet", "operator") or item["kind"] == "revision_delete"
            if item["kind"] in FAULT_KINDS and (item.get("target") == pod or fleet_wide):
                out.append(f"{item['kind']}@-{t - item['t']:.1f}s")
        return out[:6]

    def close(self) -> None:
        self._sink.close()


FAULT_KINDS = (*RATES, "corrupt_pin")


# --- the soak ------------------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.local = cluster.Cluster.named(
            args.cluster, nodes=math.ceil(args.pods / 8) + 1, subnet_offset=64, tie_to_parent=True
        )
        self.artifacts = pathlib.Path(args.artifacts or (self.local.directory / "soak-artifacts"))
        self.workdir = self.local.directory / "soak-weights"
        self.revisions: list[Revision] = []
        self.pins: dict[int, obs.Pin] = {}
        self.applied = 0
        self.rss: list[dict[str, Any]] = []
        self.kills_skipped = 0
        self._operator_down = False  # a kill's restart is pending
        self.timings: dict[str, float] = {}
        self.final: dict[str, Any] = {}
        self.leftover_faults: dict[str, int] = {}
        self.engine_401s = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started_wall = ""

    # -- setup ---------------------------------------------------------------------------------------

    async def setup(self) -> None:
        t0 = time.monotonic()
        binaries.ensure(cluster.COMPONENTS)
        if self.local.running():
            self.local.stop(quiet=True)
        self.local.start()
        self.timings["cluster_start_s"] = time.monotonic() - t0
        self.kube = Kube.from_environment(str(self.local.kubeconfig))
        self.api = self._client()  # driver and injector
        self.watch_api = self._client()  # observer
        self.follower_api = self._client()
        self.artifacts.mkdir(parents=True, exist_ok=True)
        await self._install()
        self.operator = OperatorSupervisor(self.local.kubeconfig, self.local.directory / "logs" / "operator.log")
        # The sandbox appends to its logs across runs: this run's operator log starts here.
        self.operator.log_offset = self.operator.log_path.stat().st_size if self.operator.log_path.exists() else 0
        self.operator.start(0)
        say(f"operator pid {self.operator.proc.pid if self.operator.proc else '?'}, log {self.operator.log_path}")
        follower = SoakFollower(
            self.follower_api,
            NAMESPACE,
            FLEET,
            weights=WeightsConfig(synthetic_root=None),
            latencies=Latencies(steps=dict(LATENCIES)),
            interval=0.2,
            token_propagation=self.args.token_propagation,
            token_grace=self.args.token_grace,
            rng=random.Random(self.args.seed + 1),
        )
        self.engines = EngineThread(follower)
        await self._wait_ready()
        self.timings["setup_s"] = time.monotonic() - t0

    def _client(self) -> client.ApiClient:
        api = config.new_client_from_config(config_file=str(self.local.kubeconfig), persist_config=False)  # type: ignore[no-untyped-call]
        return cast(client.ApiClient, api)

    async def _install(self) -> None:
        for crd in crdgen.custom_resource_definitions().values():
            await self.kube.apply(crd)
        for crd in crdgen.custom_resource_definitions().values():
            for _ in range(200):
                seen = await self.kube.get(
                    "apiextensions.k8s.io/v1", "CustomResourceDefinition", None, crd["metadata"]["name"]
                )
                conds = ((seen or {}).get("status") or {}).get("conditions") or []
                if any(c.get("type") == "Established" and c.get("status") == "True" for c in conds):
                    break
                await asyncio.sleep(0.1)
        await self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        for _ in range(200):
            if await self.kube.get("v1", "ServiceAccount", NAMESPACE, "default"):
                break
            await asyncio.sleep(0.1)
        root = self.workdir / "weights"
        policy = root / "policy"
        for number in range(0, self.args.revisions + 1):
            verifier = demo_weights.write_checkpoint(
                policy / f"step-{number}" / "verifier", seed=1000 + number, tensors=6, size=256
            )
            draft = demo_weights.write_checkpoint(
                policy / f"step-{number}" / "draft", seed=200000 + number, tensors=2, size=128
            )
            self.pins[number] = obs.Pin(digest_directory(str(verifier)), digest_directory(str(draft)))
        say(f"{self.args.revisions + 1} checkpoints written and digested under {policy}")
        await self.kube.apply(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"{NAMESPACE}-weights"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "hostPath": {"path": str(root)},
                    "claimRef": {"namespace": NAMESPACE, "name": "weights"},
                },
            }
        )
        await self.kube.apply(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "weights", "namespace": NAMESPACE},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": f"{NAMESPACE}-weights",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
        )
        timeouts = dict(TIMEOUTS, loadSeconds=self.args.load_timeout)
        await self.kube.apply(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "RolloutFleet",
                "metadata": {"name": FLEET, "namespace": NAMESPACE},
                "spec": {
                    "replicas": self.args.pods,
                    "image": "vllm-rolloutfleet:0.33.0",
                    "verifier": {"path": str(policy / "step-0/verifier")},
                    "draft": {"method": "draft_model", "path": str(policy / "step-0/draft"), "policy": "coUpdate"},
                    "weights": {"claimName": "weights", "mountPath": str(root), "allowedRoots": [str(policy)]},
                    "updateStrategy": {
                        "mode": "sleep",
                        "rollout": "AllAtOnce",
                        "maxRetries": self.args.max_retries,
                        "timeouts": timeouts,
                    },
                },
            }
        )

    async def _wait_ready(self) -> None:
        say(f"waiting for {self.args.pods} pods, their engines and the weights gate ...")
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            fleet = await asyncio.to_thread(self._get, "rolloutfleets", FLEET)
            status = (fleet or {}).get("status") or {}
            if status.get("readyReplicas") == self.args.pods:
                say(f"fleet ready: {self.args.pods}/{self.args.pods} pods routed")
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the fleet did not become ready in 240 s (see {self.operator.log_path})")

    # -- API helpers (blocking; run in threads) ----------------------------------------------------

    def _get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            out = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, plural, name
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return cast(dict[str, Any], out)

    def _create_revision(self, body: dict[str, Any]) -> bool:
        try:
            client.CustomObjectsApi(self.api).create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "weightrevisions", body
            )
        except client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def _read_cluster(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        core = client.CoreV1Api(self.watch_api)
        resp = core.list_namespaced_pod(
            NAMESPACE, label_selector=f"{labels.FLEET_LABEL}={FLEET}", _preload_content=False, _request_timeout=5
        )
        pods = json.loads(cast(Any, resp).data)["items"]
        try:
            raw = client.CustomObjectsApi(self.watch_api).get_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "rolloutfleets", FLEET, _preload_content=False, _request_timeout=5
            )
            fleet = json.loads(cast(Any, raw).data)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            fleet = None
        return pods, fleet

    async def read_cluster(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The watched pods and fleet (no API call)."""
        fleets = self.fleet_mirror.snapshot()
        return self.pod_mirror.snapshot(), (fleets[0] if fleets else None)

    def _start_mirrors(self) -> None:
        core, custom = client.CoreV1Api(self.watch_api), client.CustomObjectsApi(self.watch_api)
        self.pod_mirror = Mirror(
            functools.partial(core.list_namespaced_pod, NAMESPACE, label_selector=f"{labels.FLEET_LABEL}={FLEET}"),
            "pods",
        )
        self.fleet_mirror = Mirror(
            functools.partial(
                custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                NAMESPACE,
                "rolloutfleets",
                field_selector=f"metadata.name={FLEET}",
            ),
            "fleet",
        )
        if not (self.pod_mirror.synced.wait(30) and self.fleet_mirror.synced.wait(30)):
            raise RuntimeError("could not list the pods and the fleet for the observer")

    # -- driver ----------------------------------------------------------------------------------------

    def _plan(self) -> None:
        n = self.args.revisions
        candidates = list(range(2, n + 1))
        corrupt = set(self.rng.sample(candidates, min(len(candidates), round(n * self.args.corrupt_pin_prob))))
        # A revision superseded on purpose is never one with a wrong pin (that one must end RolledBack).
        plain = [number for number in range(1, n) if number not in corrupt]
        overlapping = set(self.rng.sample(plain, min(len(plain), round(n * self.args.overlap_prob))))
        policy = self.workdir / "weights" / "policy"
        true_pins = dict(self.pins)
        for number in range(1, n + 1):
            inflight = self.rng.random() < self.args.inflight_prob
            pin = self.pins[number]
            verifier_digest = pin.verifier
            if number in corrupt:  # a publisher bug: the pin is another revision's digest
                verifier_digest = true_pins[number - 1].verifier
            spec: dict[str, Any] = {
                "fleetRef": {"name": FLEET},
                "revision": number,
                "verifier": {"path": str(policy / f"step-{number}/verifier"), "digest": verifier_digest},
                "draft": {"path": str(policy / f"step-{number}/draft"), "digest": pin.draft},
            }
            if inflight:
                spec["strategy"] = dict(INFLIGHT)
            name = f"step-{number}"
            body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WeightRevision", "metadata": {"name": name}}
            body["spec"] = spec
            self.pins[number] = obs.Pin(verifier_digest, pin.draft)  # what the revision pins is what counts
            self.revisions.append(
                Revision(
                    number,
                    name,
                    body,
                    "inflight/Rolling 25%" if inflight else "sleep/AllAtOnce",
                    number in corrupt,
                    number in overlapping,
                )
            )

    async def drive(self) -> None:
        pending: list[Revision] = []
        for rev in self.revisions:
            rev.applied = self.events.now()
            await asyncio.to_thread(self._create_revision, rev.body)
            self.applied = rev.number
            self.events.add("apply", rev.name, strategy=rev.strategy, corrupt_pin=rev.corrupt_pin)
            if rev.corrupt_pin:
                self.events.add("corrupt_pin", rev.name, detail="verifier digest pinned to the previous revision's")
            pending.append(rev)
            if rev.overlapped:
                await asyncio.sleep(self.rng.uniform(0.3, 2.5))
                continue
            await self._wait(pending)
            pending = []
            rss = self.operator.rss_kib()
            pid = self.operator.proc.pid if self.operator.proc else None
            self.rss.append({"after_revision": rev.number, "pid": pid, "rss_kib": rss})
            if rev.number % 10 == 0 or rev.number == self.revisions[-1].number:
                phases = collections.Counter(r.phase for r in self.revisions if r.phase)
                say(f"{rev.number}/{len(self.revisions)} revisions done; {dict(phases)}; operator RSS {rss} KiB")

    async def _wait(self, pending: list[Revision]) -> None:
        while True:
            open_ = [r for r in pending if r.phase is None]
            if not open_:
                return
            for rev in open_:
                wrev = await asyncio.to_thread(self._get, "weightrevisions", rev.name)
                status = (wrev or {}).get("status") or {}
                if status.get("phase") in FINAL:
                    rev.phase, rev.reason, rev.ended = status["phase"], status.get("reason"), self.events.now()
                    rev.message = status.get("message")
                    rev.failures = list(status.get("failures") or [])[:5]
                    self.events.add("revision_final", rev.name, phase=rev.phase, reason=rev.reason)
                elif self.events.now() - rev.applied > self.args.revision_timeout:
                    rev.phase = f"Timeout({status.get('phase') or ('deleted' if wrev is None else 'Pending')})"
                    rev.ended = self.events.now()
                    self.events.add("revision_timeout", rev.name, phase=status.get("phase"))
            await asyncio.sleep(0.5)

    # -- fault injector -----------------------------------------------------------------------------

    def _pods(self) -> list[tuple[str, str]]:
        out = []
        for pod in self.observer.latest_pods:
            ip = (pod.get("status") or {}).get("podIP")
            if ip and not pod["metadata"].get("deletionTimestamp"):
                out.append((pod["metadata"]["name"], f"{ip}:8000"))
        return sorted(out)

    async def inject(self) -> None:
        rates = {k: v * self.args.fault_scale for k, v in RATES.items()}
        for item in self.args.rate or []:
            kind, _, value = item.partition("=")
            rates[kind] = float(value)
        due = {k: self.events.now() + self.rng.expovariate(r / 60) for k, r in rates.items() if r > 0}
        while due:
            kind = min(due, key=lambda k: due[k])
            await asyncio.sleep(max(0.0, due[kind] - self.events.now()))
            due[kind] = self.events.now() + self.rng.expovariate(rates[kind] / 60)
            task = asyncio.create_task(self._fire(kind))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fire(self, kind: str) -> None:
        try:
            await getattr(self, f"_fault_{kind}")()
        except Exception as exc:  # a fault that could not be injected is logged, the soak goes on
            self.events.add("inject_error", kind, error=f"{type(exc).__name__}: {exc}")

    async def _arm(self, kind: str, rule: FaultRule) -> None:
        pods = self._pods()
        if not pods:
            return
        pod, key = self.rng.choice(pods)

        async def arm() -> bool:
            sim = self.engines.follower.sim
            engine = None if sim is None else sim.engines.get(key)
            if engine is None:
                return False
            engine.add_fault(rule)
            return True

        if await self.engines.call(arm()):
            detail = {k: v for k, v in rule.to_dict().items() if v not in (None, 0, 0.0, "before", 500) or k == "count"}
            self.events.add(kind, pod, rule=detail)

    async def _fault_engine_crash(self) -> None:
        restart_after = round(self.rng.uniform(0.5, 4.0), 2)
        if self.rng.random() < 0.5:
            await self._arm(
                "engine_crash",
                FaultRule(step=self.rng.choice(STEPS), kind=FaultKind.CRASH, restart_after=restart_after),
            )
            return
        pods = self._pods()
        if not pods:
            return
        pod, key = self.rng.choice(pods)

        async def crash() -> bool:
            sim = self.engines.follower.sim
            engine = None if sim is None else sim.engines.get(key)
            if engine is None or not engine.running:
                return False
            await engine.crash(restart_after)
            return True

        if await self.engines.call(crash()):
            self.events.add("engine_crash", pod, when="now", restart_after=restart_after)

    async def _fault_slow_step(self) -> None:
        step = self.rng.choice([*STEPS, "rolloutfleet_load:verifier", "rolloutfleet_load:draft"])
        delay = round(self.rng.uniform(0.5, self.args.slow_max), 2)
        await self._arm("slow_step", FaultRule(step=step, kind=FaultKind.SLOW, delay=delay))

    async def _fault_corrupt_load(self) -> None:
        step = self.rng.choice(["rolloutfleet_load:verifier", "rolloutfleet_load:draft"])
        await self._arm("corrupt_load", FaultRule(step=step, kind=FaultKind.CORRUPT_LOAD))

    async def _fault_http_500(self) -> None:
        step = self.rng.choice([*STEPS, *READ_STEPS])
        phase = "after" if step in STEPS and self.rng.random() < 0.3 else "before"
        rule = FaultRule(
            step=step,
            kind=FaultKind.HTTP_ERROR,
            status=500,
            body={"error": "injected by the soak"},
            count=self.rng.randint(1, 3),
            phase=phase,
        )
        await self._arm("http_500", rule)

    async def _fault_token_rotation(self) -> None:
        token = secrets.token_urlsafe(32)
        body = {"data": {labels.TOKEN_KEY: base64.b64encode(token.encode()).decode()}}
        await asyncio.to_thread(
            client.CoreV1Api(self.api).patch_namespaced_secret, labels.token_secret_name(FLEET), NAMESPACE, body
        )
        self.events.add("token_rotation", "fleet", propagation_max_s=self.args.token_propagation)

    async def _fault_pod_delete(self) -> None:
        pods = self._pods()
        if not pods:
            return
        pod, _ = self.rng.choice(pods)
        grace = self.rng.choice([0, 1, None])
        await asyncio.to_thread(
            client.CoreV1Api(self.api).delete_namespaced_pod, pod, NAMESPACE, grace_period_seconds=grace
        )
        self.events.add("pod_delete", pod, grace_period_seconds=grace)

    async def _fault_revision_delete(self) -> None:
        applied = [r for r in self.revisions if r.number <= self.applied]
        if not applied:
            return
        # Mostly the newest (often still rolling), sometimes an older one (a pruner resyncing history).
        rev = applied[-1] if self.rng.random() < 0.7 else self.rng.choice(applied)
        try:
            await asyncio.to_thread(
                client.CustomObjectsApi(self.api).delete_namespaced_custom_object,
                GROUP,
                VERSION,
                NAMESPACE,
                "weightrevisions",
                rev.name,
            )
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            return
        rev.deletions += 1
        gap = round(self.rng.uniform(0.5, 5.0), 2)
        self.events.add("revision_delete", rev.name, phase_seen=rev.phase, reapply_after=gap)
        await asyncio.sleep(gap)
        for _ in range(50):  # the object may still be finalizing
            if await asyncio.to_thread(self._create_revision, rev.body):
                self.events.add("revision_reapply", rev.name)
                return
            await asyncio.sleep(0.2)
        self.events.add("inject_error", "revision_reapply", error=f"{rev.name} still exists after 10 s")

    async def _fault_operator_kill(self) -> None:
        if self.applied >= self.args.kill_before:
            self.kills_skipped += 1
            return
        if self._operator_down:
            # A kill while the last one's restart is pending would start a second operator beside the first
            # (two standalone operators driving the same engines: a harness bug, not a fault to inject).
            self.kills_skipped += 1
            return
        self._operator_down = True
        try:
            await self._kill_and_restart()
        finally:
            self._operator_down = False

    async def _kill_and_restart(self) -> None:
        pid = self.operator.proc.pid if self.operator.proc else None
        await asyncio.to_thread(self.operator.kill)
        gap = round(self.rng.uniform(0.2, 3.0), 2)
        self.events.add("operator_kill", "operator", pid=pid, restart_after=gap)
        await asyncio.sleep(gap)
        self.operator.start(self.applied)
        self.events.add("operator_start", "operator", pid=self.operator.proc.pid if self.operator.proc else None)

    # -- run -----------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=24))
        try:
            await self.setup()
            self._plan()
            self.events = Events(time.monotonic(), self.artifacts / "events.jsonl")
            self.started_wall = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            await asyncio.to_thread(self._start_mirrors)
            self.observer = obs.Observer(
                self.engines.snapshot,
                self.read_cluster,
                self.pins,
                interval=self.args.interval,
                tolerance=self.args.tolerance,
                context=self.events.recent,
            )
            self.observer.start = self.events.start
            observing = asyncio.create_task(self.observer.run())
            await asyncio.sleep(1.0)  # the injector picks targets from the observer's latest pods
            injecting = asyncio.create_task(self.inject())
            trimming = asyncio.create_task(self._trim_logs())
            t0 = time.monotonic()
            try:
                await self.drive()
            finally:
                for task in (injecting, trimming):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self.timings["revisions_s"] = time.monotonic() - t0
            say("revisions done; waiting for in-flight faults (restarts, re-applies) to finish")
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=60)
            self.leftover_faults = await self.engines.call(self._disarm())
            await self._settle()
            self.observer.stop()
            await observing
            self.final = await self._final_state()
            self.timings["total_s"] = time.monotonic() - t0
            self._write_report()
            say(f"report: {self.args.report}")
            counts = self.observer.tally.counts
            return 0 if all(counts[c] == 0 for c in ("a", "b", "c", "d_beyond")) else 1
        finally:
            await self._teardown()

    async def _trim_logs(self) -> None:
        """Engines log every call with a state summary; count the 401s and drop the entries (memory)."""

        async def trim() -> None:
            sim = self.engines.follower.sim
            for engine in sim.engines.values() if sim else []:
                self.engine_401s += sum(1 for e in engine.log.entries if e.get("status") == 401)
                engine.log.entries.clear()

        while True:
            await asyncio.sleep(20)
            await self.engines.call(trim())

    async def _disarm(self) -> dict[str, int]:
        """Count armed faults that never fired, then disarm everything, so the settle phase is clean."""
        left: collections.Counter[str] = collections.Counter()
        sim = self.engines.follower.sim
        for engine in sim.engines.values() if sim else []:
            for fault in engine.faults:
                count = fault.rule.count
                if count is None or fault.fired < count:
                    left[str(fault.rule.kind)] += 1
            engine.clear_faults()
            self.engine_401s += sum(1 for e in engine.log.entries if e.get("status") == 401)
        return dict(left)

    async def _settle(self) -> None:
        """Observe until every pod is routed and the fleet has no target (or --settle-timeout), then more."""
        deadline = time.monotonic() + self.args.settle_timeout
        while time.monotonic() < deadline:
            pods = self.observer.latest_pods
            fleet = ((self.observer.latest_fleet or {}).get("status")) or {}
            if len(pods) == self.args.pods and all(obs.routed(p) for p in pods) and fleet.get("targetRevision") is None:
                break
            await asyncio.sleep(0.5)
        self.timings["settled_after_s"] = self.events.now()
        await asyncio.sleep(self.args.settle)

    async def _final_state(self) -> dict[str, Any]:
        pods, fleet = await asyncio.to_thread(self._read_cluster)  # a fresh list, not the watched copy
        engines = await self.engines.snapshot()
        status = (fleet or {}).get("status") or {}
        rows = []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            ip = (pod.get("status") or {}).get("podIP")
            engine = engines.get(f"{ip}:8000")
            rows.append(
                {
                    "pod": pod["metadata"]["name"],
                    "routed": obs.routed(pod),
                    "serving": bool(engine and engine.serving),
                    "verifier": engine.verifier.revision if engine else None,
                    "draft": engine.draft.revision if engine and engine.draft else None,
                    "kind": engine.verifier.kind if engine else None,
                }
            )
        wrevs = await asyncio.to_thread(
            client.CustomObjectsApi(self.api).list_namespaced_custom_object,
            GROUP,
            VERSION,
            NAMESPACE,
            "weightrevisions",
        )
        end_phases = collections.Counter(
            ((w.get("status") or {}).get("phase") or "Pending") for w in cast(dict[str, Any], wrevs)["items"]
        )
        return {
            "current": status.get("currentRevision"),
            "target": status.get("targetRevision"),
            "ready": status.get("readyReplicas"),
            "pods": rows,
            "wrev_phases_at_end": dict(end_phases),
        }

    async def _teardown(self) -> None:
        with contextlib.suppress(Exception):
            for task in list(self._tasks):
                task.cancel()
        for mirror in ("pod_mirror", "fleet_mirror"):
            if hasattr(self, mirror):
                getattr(self, mirror).stop()
        if hasattr(self, "operator"):
            await asyncio.to_thread(self.operator.stop)
        if hasattr(self, "engines"):
            await asyncio.to_thread(self.engines.stop)
        for name in ("api", "watch_api", "follower_api"):
            if hasattr(self, name):
                with contextlib.suppress(Exception):
                    getattr(self, name).close()
        if hasattr(self, "kube"):
            await self.kube.aclose()
        if hasattr(self, "events"):
            self.events.close()
        if not self.args.keep:
            self.local.stop()
            say(f"cluster {self.args.cluster!r} stopped")

    # -- report --------------------------------------------------------------------------------------

    def _write_report(self) -> None:
        report = pathlib.Path(self.args.report)
        report.parent.mkdir(parents=True, exist_ok=True)
        episodes = [dataclasses.asdict(e) for e in self.observer.tally.episodes]
        (self.artifacts / "violations.json").write_text(json.dumps(episodes, indent=1, default=str))
        report.write_text(render(self))


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def _operator_log_summary(path: pathlib.Path, offset: int) -> tuple[int, int, list[tuple[str, int]]]:
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return 0, 0, []
    errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
    tracebacks = sum(1 for line in lines if line.startswith("Traceback"))
    # Drop the timestamp and numbers so that repeats of one message group together.
    common = collections.Counter(
        re.sub(r"\d+", "N", re.sub(r"^\S+ \S+ ", "", line))[:160] for line in errors
    ).most_common(8)
    return len(errors), tracebacks, common


def _latest_fault(recent: list[str]) -> str:
    """The kind of the most recent fault in an observer context list (``kind@-1.2s``, newest first)."""
    return recent[0].split("@", 1)[0] if recent else "none"


def _kwok_gated(tally: obs.Tally, check: str) -> int:
    """Episodes whose first sample saw the weights gate True with no reason (the operator always gives one)."""
    count = 0
    for episode in tally.episodes:
        gate = episode.first.get("gate") or {}
        if episode.check == check and gate.get("status") == "True" and not gate.get("reason"):
            count += 1
    return count


def render(soak: Soak) -> str:
    args, o = soak.args, soak.observer
    tally = o.tally
    out: list[str] = []
    w = out.append
    cmd = f".venv/bin/python bench/soak.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}"
    w(f"# Soak: {args.revisions} revisions on {args.pods} simulated pods under random faults\n")
    w(
        f"Generated by `bench/soak.py` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit "
        f"{getattr(soak.args, 'commit', None) or _commit()} (when the soak started), "
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} cores. "
        "Engines are simulated (`rolloutfleet.sim`) on the pods' loopback IPs of the local control plane; the "
        "operator runs as a real process.\n"
    )
    w(f"Reproduce:\n\n```\n{cmd}\n```\n")
    w(f"Times `t` are seconds since the soak began at {soak.started_wall} (local time, as in the operator log).\n")
    w("## Parameters\n")
    w("| parameter | value |\n|---|---|")
    params = {
        "seed": args.seed,
        "pods / revisions": f"{args.pods} / {args.revisions}",
        "fleet strategy": f"sleep/AllAtOnce, maxRetries {args.max_retries}, "
        f"timeouts {dict(TIMEOUTS, loadSeconds=args.load_timeout)}",
        "in-flight Rolling overrides": f"p={args.inflight_prob} "
        f"({sum(r.strategy != 'sleep/AllAtOnce' for r in soak.revisions)} revisions)",
        "wrong pinned digest": f"{sum(r.corrupt_pin for r in soak.revisions)} revisions",
        "applied before the previous ended": f"{sum(r.overlapped for r in soak.revisions)} revisions",
        "simulated latencies (s)": LATENCIES,
        "fault rates per minute": {k: round(v * args.fault_scale, 2) for k, v in RATES.items()}
        | dict((i.split("=")[0], float(i.split("=")[1])) for i in args.rate or []),
        "operator SIGKILL window": f"while fewer than {args.kill_before} revisions are applied",
        "token propagation / grace": f"0-{args.token_propagation} s / {args.token_grace} s",
        "observer interval / status tolerance": f"{args.interval} s / {args.tolerance} s",
    }
    for key, value in params.items():
        w(f"| {key} | {value} |")
    w("")
    w("## Durations\n")
    ended = [r for r in soak.revisions if r.ended is not None and not r.overlapped]
    spans = sorted(r.ended - r.applied for r in ended if r.ended is not None)
    w(
        f"- cluster start {soak.timings.get('cluster_start_s', 0):.1f} s, "
        f"setup to a ready fleet {soak.timings.get('setup_s', 0):.1f} s"
    )
    w(
        f"- {args.revisions} revisions in {soak.timings.get('revisions_s', 0):.0f} s; "
        f"whole soak incl. settle {soak.timings.get('total_s', 0):.0f} s"
    )
    if spans:
        p95 = spans[min(len(spans) - 1, int(0.95 * len(spans)))]
        w(
            f"- per revision (apply to final phase): median {statistics.median(spans):.1f} s, "
            f"p95 {p95:.1f} s, max {spans[-1]:.1f} s"
        )
    w("")
    w("## Revisions by final phase (as the driver saw it)\n")
    by = collections.Counter((r.phase or "never ended", r.strategy) for r in soak.revisions)
    w("| phase | sleep/AllAtOnce | inflight/Rolling 25% |\n|---|---|---|")
    for phase in sorted({p for p, _ in by}):
        w(f"| {phase} | {by[(phase, 'sleep/AllAtOnce')]} | {by[(phase, 'inflight/Rolling 25%')]} |")
    w("")
    cp = collections.Counter(r.phase for r in soak.revisions if r.corrupt_pin)
    ov = collections.Counter(r.phase for r in soak.revisions if r.overlapped)
    w(f"- wrong pinned digest (expected RolledBack): {dict(cp) or '-'}")
    w(f"- the next one applied before it ended (expected Superseded, or Succeeded if fast): {dict(ov) or '-'}")
    reasons = collections.Counter(f"{r.phase}/{r.reason}" for r in soak.revisions if r.phase != "Succeeded")
    w(f"- reasons of the others: {dict(reasons) or '-'}")
    w(f"- phases of all WeightRevisions at the end (after prune/re-apply): {soak.final.get('wrev_phases_at_end')}")
    w("")
    others = [r for r in soak.revisions if r.phase not in ("Succeeded", "Superseded")]
    if others:
        w("Revisions that neither succeeded nor were superseded (first 20):\n")
        for r in others[:20]:
            fails = "; ".join(
                f"{f.get('pod')} {f.get('step')} {f.get('reason')}: {str(f.get('message'))[:80]}" for f in r.failures
            )
            pinned = ", wrong pin" if r.corrupt_pin else ""
            w(
                f"- {r.name} ({r.strategy}{pinned}) {r.phase}/{r.reason} at t={r.ended}s: "
                f"{(r.message or '')[:200]}{' | failures: ' + fails if fails else ''}"
            )
        w("")
    w("## Faults injected\n")
    kinds = collections.Counter(e["kind"] for e in soak.events.items if e["kind"] in FAULT_KINDS)
    w("| kind | injected |\n|---|---|")
    for kind in FAULT_KINDS:
        w(f"| {kind} | {kinds[kind]} |")
    w("")
    errors = [e for e in soak.events.items if e["kind"] == "inject_error"]
    w(
        f"- operator SIGKILLs skipped (outside the window): {soak.kills_skipped}; "
        f"operator processes: {len(soak.operator.incarnations)}"
    )
    w(f"- armed simulator faults that never fired (disarmed at the end): {soak.leftover_faults or 0}")
    w(f"- control-route answers 401 seen by the engines (counted every 20 s and at the end): {soak.engine_401s}")
    w(f"- faults that could not be injected: {len(errors)} {[e.get('error') for e in errors[:3]]}")
    w(f"- full timeline: `{soak.artifacts / 'events.jsonl'}`\n")
    w("## Observer\n")
    st = o.stats
    w(
        f"{st['samples']} samples in {o.now():.0f} s (mean interval {o.now() / max(1, st['samples']):.3f} s, "
        f"longest gap {o.max_gap:.2f} s); {st['pod_samples']} pod-samples judged, {st['routed_serving_samples']} "
        f"with a routed pod whose engine was serving; {st['ambiguous']} pod-samples skipped because the engine "
        f"changed during the sample; {st['errors']} failed samples {o.errors[:3]}. Mean cost of one sample "
        f"{1000 * o.busy / max(1, st['samples']):.1f} ms. Pods and fleet come from watches "
        f"({soak.pod_mirror.events} pod and {soak.fleet_mirror.events} fleet events, "
        f"{soak.pod_mirror.relists + soak.fleet_mirror.relists} lists).\n"
    )
    w("| check | what | pod-samples | episodes | of which the gate was set by kwok |\n|---|---|---|---|---|")
    for check in obs.CHECKS:
        w(
            f"| {check} | {obs.TITLES[check]} | {tally.counts[check]} | {tally.episode_counts[check]} | "
            f"{_kwok_gated(tally, check)} |"
        )
    w(
        f"| d > {args.tolerance:g} s | the same, lasting longer than the tolerance | {tally.counts['d_beyond']} | "
        f"{tally.episode_counts['d_beyond']} | - |"
    )
    w(
        f"| (d?) | status names no revision because the operator's last read of the engine failed (step "
        f"Unreachable/EngineError): a claim of nothing, counted apart from d | {tally.counts['unread']} | "
        f"{tally.episode_counts['unread']} | - |"
    )
    longest = tally.longest["pending"]
    w(
        f"| (d…) | status names no revision while the pod's steps sent in one request run on its paused engine, "
        f"which still holds one until the sleep among them (the longest episode: {longest:.1f} s): a claim of "
        f"nothing, counted apart from d | {tally.counts['pending']} | {tally.episode_counts['pending']} | - |"
    )
    w("")
    w(
        "Target: zero for a, b, c and d beyond the tolerance. *Gate set by kwok*: episodes whose pod's "
        "`rolloutfleet.io/weights-ready` condition was True without a reason, i.e. written by kwok's default "
        "pod-ready stage when the pod started (it sets every readiness gate True), not by the operator.\n"
    )
    for check in (*obs.CHECKS[:3], "d_beyond", "unread", "pending"):
        eps = [e for e in tally.episodes if e.check == check][:5]
        if not eps:
            continue
        w(f"### First episodes of {check}\n")
        for e in eps:
            first = e.first
            w(
                f"- t={e.start:.1f}s {e.pod} for {e.end - e.start:.1f} s ({e.samples} samples): "
                f"{first.get('message')}; "
                f"engine {json.dumps(first.get('engine'))}; fleet {first.get('fleet')}; engine restarted "
                f"{first.get('engine_restarted_s_ago')} s before; pod uid {first.get('pod_uid')} created "
                f"{first.get('pod_created')}, gate {first.get('gate')}; recent faults {first.get('recent_faults')}"
            )
        w("")
    beyond = [e for e in tally.episodes if e.check == "d_beyond"]
    if beyond:
        # Which fault preceded each long disagreement: an operator that is down cannot write status, so
        # those are expected during the kill window; any other cause is a defect to chase.
        causes = collections.Counter(_latest_fault(e.first.get("recent_faults") or []) for e in beyond)
        w("### d beyond the tolerance, by the latest fault in the 10 s before it began\n")
        w("| latest fault | episodes |\n|---|---|")
        for cause, n in causes.most_common():
            w(f"| {cause} | {n} |")
        w("")
    w(f"All episodes: `{soak.artifacts / 'violations.json'}`\n")
    w("## Operator RSS\n")
    last = soak.rss[-1] if soak.rss else None
    born = max(
        (i["started_after_revision"] for i in soak.operator.incarnations if last and i["pid"] == last["pid"]),
        default=0,
    )
    at = next(
        (s for s in soak.rss if s["pid"] == (last or {}).get("pid") and s["after_revision"] >= born + args.rss_at), None
    )
    if at and last and at["rss_kib"] and last["rss_kib"]:
        same = at["pid"] == last["pid"]
        growth = 100.0 * (last["rss_kib"] - at["rss_kib"]) / at["rss_kib"]
        w(
            f"- after revision {at['after_revision']}: {at['rss_kib'] / 1024:.1f} MiB (pid {at['pid']}); "
            "after revision "
            f"{last['after_revision']}: {last['rss_kib'] / 1024:.1f} MiB (pid {last['pid']}); growth {growth:+.1f} % "
            f"({'same process' if same else 'DIFFERENT processes: not comparable'}; target within 10 %)"
        )
    else:
        w("- not measured (too few revisions)")
    starts = ", ".join(
        f"pid {i['pid']} after revision {i['started_after_revision']}" for i in soak.operator.incarnations
    )
    w(f"- operator processes: {starts}")
    if last:
        firsts: dict[int, dict[str, Any]] = {}
        for sample in soak.rss:  # the first sample at or after each multiple of 20
            if sample["pid"] == last["pid"]:
                firsts.setdefault(sample["after_revision"] // 20, sample)
        trail = ", ".join(f"{s['after_revision']}: {(s['rss_kib'] or 0) / 1024:.1f}" for s in firsts.values())
        w(f"- RSS of the last process (MiB) after revision {trail}")
    peak = max((s["rss_kib"] or 0 for s in soak.rss), default=0)
    w(f"- peak sampled RSS {peak / 1024:.1f} MiB; sampled after every revision, in `{soak.artifacts / 'rss.json'}`\n")
    (soak.artifacts / "rss.json").write_text(json.dumps(soak.rss))
    w("## Final state\n")
    rows = soak.final.get("pods") or []
    routed = sum(1 for r in rows if r["routed"])
    serving = collections.Counter((r["verifier"], r["draft"], r["kind"]) for r in rows)
    w(
        f"fleet currentRevision {soak.final.get('current')}, targetRevision {soak.final.get('target')}, "
        f"readyReplicas {soak.final.get('ready')}; {routed}/{len(rows)} pods routed; engines by "
        f"(verifier, draft, content): {dict(serving)}\n"
    )
    n_err, n_tb, common = _operator_log_summary(soak.operator.log_path, soak.operator.log_offset)
    w("## Operator log\n")
    w(f"`{soak.operator.log_path}` (from byte {soak.operator.log_offset}): {n_err} ERROR lines, {n_tb} tracebacks.")
    for line, count in common:
        w(f"- {count}x `{line}`")
    w("")
    return "\n".join(out) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--revisions", type=int, default=200)
    parser.add_argument("--pods", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", default=None, help="markdown report (default bench/results/soak.md)")
    parser.add_argument("--smoke", action="store_true", help="8 pods, 10 revisions, denser faults: harness check")
    parser.add_argument("--cluster", default="soak", help="sandbox cluster name (default soak)")
    parser.add_argument("--artifacts", default=None, help="events/violations/RSS files (default: in the cluster dir)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    parser.add_argument("--inflight-prob", type=float, default=0.3, help="share of in-flight Rolling overrides")
    parser.add_argument("--corrupt-pin-prob", type=float, default=0.03, help="share of revisions with a wrong pin")
    parser.add_argument("--overlap-prob", type=float, default=0.08, help="share applied before the previous ended")
    parser.add_argument("--fault-scale", type=float, default=1.0, help="multiply every fault rate")
    parser.add_argument("--rate", action="append", metavar="KIND=PER_MIN", help=f"override one rate: {list(RATES)}")
    parser.add_argument("--slow-max", type=float, default=8.0, help="longest injected slow-step delay (s)")
    parser.add_argument("--load-timeout", type=int, default=5, help="fleet loadSeconds")
    parser.add_argument("--max-retries", type=int, default=2)
    parser.add_argument("--revision-timeout", type=float, default=240.0, help="driver gives up on a revision (s)")
    parser.add_argument("--kill-before", type=int, default=None, help="SIGKILL the operator only before this revision")
    parser.add_argument("--rss-at", type=int, default=20, help="RSS baseline after this revision")
    parser.add_argument(
        "--token-propagation", type=float, default=3.0, help="max delay until an engine sees a new token"
    )
    parser.add_argument("--token-grace", type=float, default=300.0, help="engines accept the previous token this long")
    parser.add_argument("--interval", type=float, default=0.1, help="observer sampling interval (s)")
    parser.add_argument("--tolerance", type=float, default=3.0, help="status lag tolerated for check d (s)")
    parser.add_argument("--settle", type=float, default=10.0, help="observe this long after the fleet settled (s)")
    parser.add_argument("--settle-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.smoke:
        defaults = {"revisions": 10, "pods": 8, "fault_scale": 4.0, "rss_at": 5, "corrupt_pin_prob": 0.1}
        for key, value in defaults.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        args.overlap_prob = max(args.overlap_prob, 0.15)
        args.report = args.report or "/tmp/rolloutfleet-soak-smoke.md"
    args.report = args.report or str(REPO / "bench/results/soak.md")
    if args.kill_before is None:
        args.kill_before = max(1, args.rss_at // 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.commit = _commit()  # the code the operator runs: it is loaded now, whatever changes later
    say(f"{args.revisions} revisions on {args.pods} pods, seed {args.seed}, report {args.report}")
    return asyncio.run(Soak(args).run())


if __name__ == "__main__":
    sys.exit(main())
