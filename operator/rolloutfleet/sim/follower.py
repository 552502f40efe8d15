"""The pod follower: keep one simulated engine listening on every running pod of a fleet.

Used by the sandbox demo and the integration tests, in place of the kubelet starting ``vllm serve``.
It polls the fleet's pods (every ``interval`` seconds, through the official client on a worker thread)
and, for each Running pod with an IP, serves a simulated engine on ``podIP:port`` shaped by the fleet's
spec (draft method and policy, sleep mode, tensor parallelism) and guarded by the fleet's control token;
engines of pods that went away are stopped. vLLM's ``--weight-transfer-config`` comes from the pod's own
``engine`` container arguments (what ``vllm serve`` would parse), or from ``spec.weightTransfer`` for a pod
without them. Pod IPs are on loopback (127.1.0.0/16) in the local control
plane, so nothing but loopback is ever listened on or dialled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
from typing import Any, cast

from kubernetes import client

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


def engine_args(pod: Any) -> list[str] | None:
    """The ``engine`` container's arguments of a pod (None when it has no such container)."""
    for container in getattr(pod.spec, "containers", None) or []:
        if container.name == ENGINE_CONTAINER:
            return [str(a) for a in container.args or []]
    return None


@dataclasses.dataclass
class PodFollower:
    """Follows one fleet's pods; ``run()`` until cancelled, or ``sync()`` once."""

    api: client.ApiClient
    namespace: str
    fleet: str
    weights: WeightsConfig = dataclasses.field(default_factory=lambda: WeightsConfig(synthetic_root=None))
    latencies: Latencies = dataclasses.field(default_factory=Latencies)
    interval: float = 0.3
    sim: SimulatedFleet | None = None

    async def _read(self) -> tuple[dict[str, Any] | None, str | None, list[Any]]:
        def call() -> tuple[dict[str, Any] | None, str | None, list[Any]]:
            core = client.CoreV1Api(self.api)
            custom = client.CustomObjectsApi(self.api)
            try:
                fleet = cast(
                    dict[str, Any],
                    custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, "rolloutfleets", self.fleet),
                )
            except client.ApiException as exc:
                if exc.status == 404:
                    return None, None, []
                raise
            try:
                secret = core.read_namespaced_secret(f"{self.fleet}-control-token", self.namespace)
                token = base64.b64decode(str((secret.data or {})["token"])).decode()
            except client.ApiException:
                token = None
            pods = core.list_namespaced_pod(self.namespace, label_selector=f"rolloutfleet.io/fleet={self.fleet}").items
            return fleet, token, list(pods)

        return await asyncio.to_thread(call)

    async def sync(self) -> int:
        """One reconciliation of engines against pods; returns how many engines run."""
        fleet, token, pods = await self._read()
        if fleet is None or token is None:
            return 0 if self.sim is None else len(self.sim.engines)
        if self.sim is None or self.sim.token != token:
            if self.sim is not None:
                await self.sim.stop()
            self.sim = SimulatedFleet(token=token, weights=self.weights, latencies=self.latencies)
            await self.sim.start()
        port = int((fleet.get("spec") or {}).get("port") or 8000)
        wanted = {
            f"{p.status.pod_ip}:{port}": p
            for p in pods
            if p.status.phase == "Running" and p.status.pod_ip and not p.metadata.deletion_timestamp
        }
        for key in list(self.sim.engines):
            if key not in wanted:
                ip, _, p = key.rpartition(":")
                await self.sim.remove(ip, int(p))
        for key in set(wanted) - set(self.sim.engines):
            ip, _, _ = key.rpartition(":")
            await self.sim.add(ip, port, spec=engine_spec_for(fleet, engine_args(wanted[key])))
        return len(self.sim.engines)

    async def run(self) -> None:
        """Follow until cancelled; the engines stop with it."""
        try:
            while True:
                try:
                    await self.sync()
                except (client.ApiException, OSError) as exc:
                    log.warning("pod follower: %s", exc)
                await asyncio.sleep(self.interval)
        finally:
            if self.sim is not None:
                with contextlib.suppress(Exception):
                    await self.sim.stop()
