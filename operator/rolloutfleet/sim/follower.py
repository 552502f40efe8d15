"""The pod follower: keep one simulated engine listening on every running pod of a fleet.

Used by the sandbox demo and the integration tests, in place of the kubelet starting ``vllm serve``.
It lists then watches the fleet's pods (``PodWatch``, on a thread of its own, the answers decoded as plain
JSON) and, for each Running pod with an IP, serves a simulated engine on ``podIP:port`` shaped by the
fleet's spec (draft method and policy, sleep mode, tensor parallelism) and guarded by the fleet's control
token; engines of pods that went away are stopped. vLLM's ``--weight-transfer-config`` comes from the pod's
own ``engine`` container arguments (what ``vllm serve`` would parse), or from ``spec.weightTransfer`` for a
pod without them. Pod IPs are on loopback (127.1.0.0/16) in the local control plane, so nothing but
loopback is ever listened on or dialled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import threading
from typing import Any, cast

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from rolloutfleet.sim.config import EngineSpec, Latencies, WeightsConfig, weight_transfer_from_args
from rolloutfleet.sim.fleet import SimulatedFleet

log = logging.getLogger(__name__)
GROUP, VERSION = "rolloutfleet.io", "v1alpha1"


ENGINE_CONTAINER = "engine"  # rolloutfleet.resources.children.ENGINE_CONTAINER


def engine_spec_for(fleet: dict[str, Any], args: list[str] | None = None) -> EngineSpec:
    """The simulated engine that ``vllm serve`` with this fleet's flags would be (``args``: the pod's own)."""
    spec = fleet.get("spec") or {}
    if args is not None:
        transfer = weight_transfer_from_args(args)
    else:
        backend = (spec.get("weightTransfer") or {}).get("backend")
        transfer = None if backend is None else {"backend": str(backend)}
    draft = spec.get("draft") or {}
    method = draft.get("method") or "none"
    strategy = spec.get("updateStrategy") or {}
    return EngineSpec(
        verifier_path=(spec.get("verifier") or {}).get("path", "/weights/initial"),
        draft_path=None if method == "none" else draft.get("path") or "/weights/mtp",
        draft_method=None if method == "none" else method,
        draft_policy=draft.get("policy") or "coUpdate",
        num_speculative_tokens=int(draft.get("numSpeculativeTokens") or 3),
        sleep_mode=(strategy.get("mode") or "sleep") == "sleep",
        tp_size=int(spec.get("tensorParallelSize") or 1),
        served_model_name=(spec.get("verifier") or {}).get("servedModelName") or "policy",
        shared_tensors=("embed_tokens.weight", "lm_head.weight") if method in ("eagle", "eagle3", "mtp") else (),
        weight_transfer=transfer,
    )


def engine_args(pod: dict[str, Any]) -> list[str] | None:
    """The ``engine`` container's arguments of a pod, as the API serves it (None without such a container)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == ENGINE_CONTAINER:
            return [str(a) for a in container.get("args") or []]
    return None


def _json(response: Any) -> dict[str, Any]:
    """The body of a client call made with ``_preload_content=False`` (a urllib3 response)."""
    return cast(dict[str, Any], json.loads(response.data))


@dataclasses.dataclass(frozen=True)
class FollowedPod:
    """What the follower reads of a pod (a pod's full JSON is ~20 KB; this is kept per pod instead)."""

    name: str
    ip: str | None
    running: bool
    args: list[str] | None

    @classmethod
    def of(cls, pod: dict[str, Any]) -> FollowedPod:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        running = status.get("phase") == "Running" and not meta.get("deletionTimestamp")
        return cls(str(meta.get("name") or ""), status.get("podIP") or None, running, engine_args(pod))


WATCH_SECONDS = 60  # how long one watch request lasts before it is renewed from its last resourceVersion
RETRY_SECONDS = 0.5  # after a failed list or watch


class PodWatch:
    """A fleet's pods, listed once then watched, on a daemon thread of their own.

    Why not a poll: every list carries every pod's full object (~20 KB each). Listing 64 pods every 0.2 s
    cost this process ~40 ms of CPU per list as the client's models (~10 ms as plain JSON), taken from the
    simulated engines it serves (one thread, one GIL): the 64-pod staging test measured their answers up to
    0.15 s late. A watch sends a pod again only when it changes. The thread is not the default executor's:
    a watch blocks for up to ``WATCH_SECONDS``, and ``asyncio.run`` waits for that executor at exit.

    Events are handed to the event loop (``call_soon_threadsafe``), so ``pods`` is only touched there.
    """

    def __init__(self, api: client.ApiClient, namespace: str, selector: str, loop: asyncio.AbstractEventLoop) -> None:
        self.api, self.namespace, self.selector, self.loop = api, namespace, selector, loop
        self.pods: dict[str, FollowedPod] = {}
        self.version = ""  # the resourceVersion of the last list or event handled on the loop
        self.listed = asyncio.Event()  # set once the first list arrived
        self.changed = asyncio.Event()  # set whenever a pod was added, changed what is read, or went away
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"pod-watch-{namespace}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread now: the open watch's socket is shut for reading (urllib3's ``shutdown``, made for
        this: ``close`` from another thread waited ~10 s for the blocked read), and the thread sees the flag."""
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # the watch ended meanwhile: nothing to shut
                response.shutdown()

    # --- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        while not self._stop.is_set():
            try:
                listed = _json(
                    core.list_namespaced_pod(self.namespace, label_selector=self.selector, _preload_content=False)
                )
                pods = [FollowedPod.of(p) for p in listed.get("items") or []]
                version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                self._hand(self._replace, {p.name: p for p in pods}, version)
                while not self._stop.is_set():
                    version = self._watch(core, version)
            except Exception as exc:  # any failure: list again (a 410 Gone, a dropped connection, a restart)
                if self._stop.is_set():
                    return
                log.debug("pod watch %s: %s; listing again", self.namespace, exc)
                self._stop.wait(RETRY_SECONDS)

    def _watch(self, core: client.CoreV1Api, version: str) -> str:
        """One watch request from ``version``; returns the version to go on from."""
        response: Any = core.list_namespaced_pod(
            self.namespace,
            label_selector=self.selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=(10, WATCH_SECONDS + 10),
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]  # the client's own splitter
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # e.g. 410: the version is too old to watch from
                    raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED"):
                    self._hand(self._put, FollowedPod.of(obj), version)
                elif kind == "DELETED":
                    self._hand(self._drop, str((obj.get("metadata") or {}).get("name") or ""), version)
        finally:
            self._response = None
            response.release_conn()
        return version

    def _hand(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the follower is gone
            self.loop.call_soon_threadsafe(fn, *args)

    # --- on the event loop ---------------------------------------------------------------------------

    def _replace(self, pods: dict[str, FollowedPod], version: str) -> None:
        self.version = version
        if pods != self.pods or not self.listed.is_set():
            self.pods = pods
            self.changed.set()
        self.listed.set()

    def _put(self, pod: FollowedPod, version: str) -> None:
        self.version = version
        if self.pods.get(pod.name) != pod:  # most changes (readiness, conditions) change nothing read here
            self.pods[pod.name] = pod
            self.changed.set()

    def _drop(self, name: str, version: str) -> None:
        self.version = version
        if self.pods.pop(name, None) is not None:
            self.changed.set()


@dataclasses.dataclass
class PodFollower:
    """Follows one fleet's pods; ``run()`` until cancelled."""

    api: client.ApiClient
    namespace: str
    fleet: str
    weights: WeightsConfig = dataclasses.field(default_factory=lambda: WeightsConfig(synthetic_root=None))
    latencies: Latencies = dataclasses.field(default_factory=Latencies)
    interval: float = 0.3  # the fleet and its control token are read again at least this often
    sim: SimulatedFleet | None = None
    # Engine restarts per engine key: the follower's own (a new control token restarts every engine) and the
    # engines' (a crash fault); ``_reported``: what the pod's restartCount says already.
    _restarted: dict[str, int] = dataclasses.field(default_factory=dict)
    _reported: dict[str, int] = dataclasses.field(default_factory=dict)

    def mine(self, pod: FollowedPod) -> bool:
        """Whether this follower serves ``pod`` (all of them; the bench splits a fleet between followers)."""
        return True

    def selector(self) -> str:
        """The label selector of the pods this follower watches: the fleet's (the bench narrows it to a share)."""
        return f"rolloutfleet.io/fleet={self.fleet}"

    async def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The fleet (None when it does not exist) and its control token (None while there is none)."""

        def call() -> tuple[dict[str, Any] | None, str | None]:
            core = client.CoreV1Api(self.api)
            custom = client.CustomObjectsApi(self.api)
            try:
                fleet = _json(
                    custom.get_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, "rolloutfleets", self.fleet, _preload_content=False
                    )
                )
            except client.ApiException as exc:
                if exc.status == 404:
                    return None, None
                raise
            try:
                secret = _json(
                    core.read_namespaced_secret(f"{self.fleet}-control-token", self.namespace, _preload_content=False)
                )
                token = base64.b64decode(str((secret.get("data") or {})["token"])).decode()
            except (client.ApiException, KeyError):
                token = None
            return fleet, token

        return await asyncio.to_thread(call)

    async def sync(self, pods: dict[str, FollowedPod]) -> int:
        """One reconciliation of engines against ``pods`` (the fleet and token read now); returns how many
        engines run."""
        fleet, token = await self._read()
        if fleet is None or token is None:
            return 0 if self.sim is None else len(self.sim.engines)
        if self.sim is None:
            self.sim = self._new_fleet(token)
            await self.sim.start()
        elif self.sim.token != token:
            await self._token_changed(token)
        port = int((fleet.get("spec") or {}).get("port") or 8000)
        wanted = {f"{p.ip}:{port}": p for p in pods.values() if p.running and p.ip and self.mine(p)}
        for key in list(self.sim.engines):
            if key not in wanted:
                ip, _, p = key.rpartition(":")
                await self.sim.remove(ip, int(p))
        for key in set(wanted) - set(self.sim.engines):
            ip, _, _ = key.rpartition(":")
            await self.sim.add(ip, port, spec=engine_spec_for(fleet, wanted[key].args))
        await self._report_restarts(wanted)
        return len(self.sim.engines)

    def _new_fleet(self, token: str) -> SimulatedFleet:
        """The engines' fleet (a subclass may start other engines)."""
        return SimulatedFleet(token=token, weights=self.weights, latencies=self.latencies)

    async def _token_changed(self, token: str) -> None:
        """A new control token: every engine restarts with it, as pods restart on a changed Secret (a
        subclass may rotate it in place instead, as the worker image does)."""
        assert self.sim is not None
        for key in self.sim.engines:  # before the stop, which forgets them
            self._restarted[key] = self._restarted.get(key, 0) + 1
        await self.sim.stop()
        self.sim = self._new_fleet(token)
        await self.sim.start()

    async def _report_restarts(self, wanted: dict[str, FollowedPod]) -> None:
        """Count each engine's restarts in its pod's ``restartCount``, as the kubelet counts a container's: the
        operator learns from the pod that the engine came back on its initial weights (a fleet at rest reads
        its engines only when a pod changed; docs/rollouts.md)."""
        assert self.sim is not None
        for key in set(self._restarted) | set(self._reported):
            if key not in wanted:  # another pod at that address later starts from zero, as a kubelet counts
                self._restarted.pop(key, None)
                self._reported.pop(key, None)
        due = {
            key: count
            for key, engine in self.sim.engines.items()
            if key in wanted and (count := self._restarted.get(key, 0) + engine.restarts) > self._reported.get(key, 0)
        }
        if not due:
            return

        def call() -> None:
            core = client.CoreV1Api(self.api)
            for key, count in due.items():
                patch = [{"op": "add", "path": "/status/containerStatuses/0/restartCount", "value": count}]
                try:
                    core.patch_namespaced_pod_status(wanted[key].name, self.namespace, patch, _preload_content=False)
                except client.ApiException as exc:  # gone meanwhile, or no container status yet: next sync
                    log.info("pod follower: restart of %s not reported: %s", wanted[key].name, exc.reason)
                    continue
                self._reported[key] = count

        await asyncio.to_thread(call)

    async def run(self) -> None:
        """Follow until cancelled; the engines stop with it. Engines follow the pods as soon as the watch
        shows a change; the fleet and the token are read at each such sync and every ``interval``."""
        watch = PodWatch(self.api, self.namespace, self.selector(), asyncio.get_running_loop())
        watch.start()
        try:
            await watch.listed.wait()
            while True:
                watch.changed.clear()  # before the sync: a change while it runs makes the next one at once
                try:
                    await self.sync(dict(watch.pods))
                except (client.ApiException, OSError) as exc:
                    log.warning("pod follower: %s", exc)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancellation that stops
                # the follower (see reconcile.waits; the test rig does not import the operator's reconcile layer).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await watch.changed.wait()
        finally:
            watch.stop()
            if self.sim is not None:
                with contextlib.suppress(Exception):
                    await self.sim.stop()
