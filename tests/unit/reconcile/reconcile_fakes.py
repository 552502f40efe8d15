"""The reconcile unit-test harness: ``FakeKube`` + one simulated engine per pod + an ``OperatorContext``.

Used by the tests beside it. ``harness(tmp_path, ...)`` builds, in milliseconds and without a control
plane: tiny real safetensors checkpoints under ``tmp_path`` (``step-N/verifier`` and ``step-N/draft``), a
valid ``RolloutFleet`` whose ``weights.allowedRoots`` hold them, its control-token Secret, one Pod per
replica and a ``SimulatedFleet`` engine listening on each pod's IP (``127.2.0.1``, ``127.2.0.2``, ... all
on the same port, since the operator dials ``podIP:spec.port``) with no simulated latency. ``settle()``
runs ``reconcile.revision.reconcile_revisions`` passes until one is idle, as the fleet's daemon would.

Every engine's call log is stamped with ``order``: one counter shared by all engines of the harness (they
share one event loop), so "A happened before B" across engines is read from the logs, never from clocks.
Log entries are written when a call finished; ``mark_arrivals`` additionally logs when a request arrived
(a zero-delay ``SLOW`` fault, which the simulator logs before acting).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import pathlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NamedTuple, cast
from unittest import mock

import numpy as np
import pytest
from kube_fakes import FakeKube
from safetensors.numpy import save_file

from rolloutfleet.adapters.engine import EngineClient, EnginePool, RetryPolicy
from rolloutfleet.adapters.kube import Kube
from rolloutfleet.api import common, engine, validation
from rolloutfleet.digest import digest_directory
from rolloutfleet.metrics import Metrics
from rolloutfleet.reconcile import fleet as fleet_reconcile
from rolloutfleet.reconcile import revision as revision_reconcile
from rolloutfleet.reconcile.context import FleetMemory, OperatorContext
from rolloutfleet.resources import children, labels
from rolloutfleet.sim.config import FaultKind, FaultRule, Latencies, WeightsConfig
from rolloutfleet.sim.engine import EngineLog
from rolloutfleet.sim.fleet import SimulatedFleet
from rolloutfleet.sim.follower import engine_spec_for
from rolloutfleet.sim.server import SimulatedEngine

Manifest = dict[str, Any]
NAMESPACE = "team-rl"
FLEET = "policy"
TOKEN = "reconcile-unit-token"
IP_PREFIX = "127.2"  # engines on 127.2.0.1, 127.2.0.2, ...; never-listening pods on 127.2.1.x
WRONG_DIGEST = "blake3:" + "0" * 64


def write_checkpoint(directory: pathlib.Path, seed: int, tensors: int = 3) -> pathlib.Path:
    """A small real checkpoint whose content (and so digest) depends on ``seed``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file(
        {f"layers.{i}.weight": rng.standard_normal((8, 8)).astype(np.float32) for i in range(tensors)},
        str(directory / "model.safetensors"),
    )
    return directory


class OrderedLog(EngineLog):
    """An engine's call log whose entries also carry ``order`` from a counter shared by every engine."""

    def __init__(self, counter: Iterator[int]) -> None:
        super().__init__()
        self._order = counter

    def add(self, step: str, **fields: Any) -> dict[str, Any]:
        entry = super().add(step, **fields)
        entry["order"] = next(self._order)
        return entry


class Served(NamedTuple):
    """What an engine's extension reports it holds, and whether it is out of service.

    ``paused`` is what ``/is_sleeping`` answers: true while paused or asleep (not serving).
    """

    verifier: int | None
    draft: int | None
    paused: bool


@dataclasses.dataclass
class Harness:
    """One fleet in a fake cluster with simulated engines; see the module docstring."""

    kube: FakeKube
    ctx: OperatorContext
    sim: SimulatedFleet
    root: pathlib.Path
    port: int
    namespace: str = NAMESPACE
    fleet: str = FLEET
    pod_ips: dict[str, str] = dataclasses.field(default_factory=dict)
    readiness_gates: tuple[str, ...] = ()  # the StatefulSet template's, which every engine pod carries
    observations: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    requests: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    outcomes: list[revision_reconcile.PassOutcome] = dataclasses.field(default_factory=list)
    _order: Iterator[int] = dataclasses.field(default_factory=itertools.count)
    _next_ip: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))

    @property
    def memory(self) -> FleetMemory:
        return self.ctx.memory(self.namespace, self.fleet)

    @property
    def pods(self) -> list[str]:
        """Pod names in ordinal order."""
        return sorted(self.pod_ips, key=lambda n: int(n.rsplit("-", 1)[1]))

    # --- checkpoints and revisions -----------------------------------------------------------------

    def checkpoint(self, revision: int) -> tuple[str, str]:
        """(verifier path, draft path) of a revision's checkpoints, written on first use."""
        base = self.root / "policy" / f"step-{revision}"
        verifier, draft = base / "verifier", base / "draft"
        if not verifier.is_dir():
            write_checkpoint(verifier, seed=100 + revision)
            write_checkpoint(draft, seed=200 + revision, tensors=2)
        return str(verifier), str(draft)

    def revision_manifest(
        self,
        name: str,
        revision: int,
        *,
        digest: str | bool = True,
        draft_digest: str | bool = False,
        strategy: Manifest | None = None,
    ) -> Manifest:
        """A WeightRevision as a trainer publishes it; ``digest`` (the verifier's) and ``draft_digest``: True pins
        the real one, a string pins that."""
        verifier, draft = self.checkpoint(revision)
        spec: Manifest = {
            "fleetRef": {"name": self.fleet},
            "revision": revision,
            "verifier": {"path": verifier},
            "draft": {"path": draft},
        }
        if digest is True:
            spec["verifier"]["digest"] = digest_directory(verifier)
        elif isinstance(digest, str):
            spec["verifier"]["digest"] = digest
        if draft_digest is True:
            spec["draft"]["digest"] = digest_directory(draft)
        elif isinstance(draft_digest, str):
            spec["draft"]["digest"] = draft_digest
        if strategy:
            spec["strategy"] = strategy
        return {
            "apiVersion": common.API_VERSION,
            "kind": "WeightRevision",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": spec,
        }

    def apply_revision(self, name: str, revision: int, **kwargs: Any) -> Manifest:
        """``kubectl apply`` of a WeightRevision (see ``revision_manifest`` for the options)."""
        return self.kube.apply_user(self.revision_manifest(name, revision, **kwargs))

    def delete_revision(self, name: str) -> None:
        self.kube.delete_user(common.API_VERSION, "WeightRevision", self.namespace, name)

    # --- pods and engines --------------------------------------------------------------------------

    async def add_pod(self, name: str | None = None, *, listening: bool = True, ip: str | None = None) -> str:
        """A new Running, Ready pod; with ``listening`` a fresh engine (initial weights) serves its IP (``ip``,
        or the next of ``IP_PREFIX``'s)."""
        index = next(self._next_ip)
        name = name or f"{self.fleet}-{len(self.pod_ips)}"
        ip = ip or f"{IP_PREFIX}.{0 if listening else 1}.{index}"
        if listening:
            engine_ = await self.sim.add(ip, self.port)
            engine_.log = engine_.core.log = engine_.core.staging.log = OrderedLog(self._order)
        self.kube.add_pod(
            self.namespace, name, ip, labels=labels.selector_labels(self.fleet), readiness_gates=self.readiness_gates
        )
        self.pod_ips[name] = ip
        return name

    def engine(self, pod: str) -> SimulatedEngine:
        return self.sim.engine(self.pod_ips[pod], self.port)

    def next_order(self) -> int:
        """A stamp from the engines' shared ``order`` counter: places a Kubernetes call among the engine calls."""
        return next(self._order)

    def engine_log(self, pod: str) -> list[dict[str, Any]]:
        """The engine's ordered call log (entries carry the harness-wide ``order``)."""
        return list(self.engine(pod).log.entries)

    def logs(self) -> dict[str, list[dict[str, Any]]]:
        """Every listening engine's call log, by pod name."""
        return {p: self.engine_log(p) for p in self.pods if f"{self.pod_ips[p]}:{self.port}" in self.sim.engines}

    def served(self, pod: str) -> Served:
        core = self.engine(pod).core
        report = core.state_results()[0]
        draft = report["draft"]
        return Served(report["verifier"]["revision"], None if draft is None else draft["revision"], core.is_sleeping)

    def hold_loads(self, pod: str) -> asyncio.Event:
        """Hold the engine's loads until the returned event is set (state reads still answer meanwhile)."""
        gate = asyncio.Event()
        core = self.engine(pod).core
        original = core.rpc

        async def rpc(method: str, kwargs: dict[str, Any], **options: Any) -> list[dict[str, Any]]:
            if method == "rolloutfleet_load":
                await gate.wait()
            return await original(method, kwargs, **options)

        core.rpc = rpc  # type: ignore[method-assign]
        return gate

    def mark_arrivals(self, *steps: str, pod: str | None = None) -> None:
        """Log each request for ``steps`` (fault keys such as ``resume``) when it arrives, not only when done."""
        for step in steps:
            rule = FaultRule(step=step, kind=FaultKind.SLOW, delay=0.0, count=None)
            for name in [pod] if pod is not None else self.pods:
                self.engine(name).add_fault(rule)

    # --- the reconcilers ---------------------------------------------------------------------------

    async def wait_for(
        self, pods: list[str], predicate: Callable[[list[dict[str, Any]]], bool], give_up: float = 10.0
    ) -> None:
        """Until every pod's engine log satisfies ``predicate`` (waits on a state, never stands in for one).

        ``give_up`` seconds only bound a test that would otherwise hang; they never decide an outcome.
        """

        def reached() -> bool:
            return all(predicate(self.engine_log(p)) for p in pods)

        try:
            await self.until(reached, "the engines' awaited state", give_up)
        except AssertionError:
            raise AssertionError(
                f"engines never reached the awaited state: {[p for p in pods if not predicate(self.engine_log(p))]}"
            ) from None

    async def until(self, condition: Callable[[], bool], what: str, give_up: float = 10.0) -> None:
        """Until ``condition()`` holds, looked at every 2 ms; ``give_up`` seconds only bound a test that would
        otherwise hang (an AssertionError naming ``what``)."""
        for _ in range(int(give_up / 0.002)):
            if condition():
                return
            await asyncio.sleep(0.002)
        raise AssertionError(f"never reached: {what}")

    def record_gates(self) -> list[tuple[str, str, int]]:
        """(pod, status, engine-log order when the write returned) of every readiness-gate write from now on:
        places the operator's Kubernetes writes among the engines' calls."""
        written: list[tuple[str, str, int]] = []
        real_patch = self.kube.patch_pod_condition

        async def patch(namespace: str, name: str, condition: Manifest, *, uid: str | None = None) -> None:
            await real_patch(namespace, name, condition, uid=uid)
            written.append((name, condition["status"], self.next_order()))

        self.kube.patch_pod_condition = patch  # type: ignore[method-assign]
        return written

    async def reconcile_fleet(self) -> fleet_reconcile.FleetOutcome:
        body = self.kube.peek(common.API_VERSION, "RolloutFleet", self.namespace, self.fleet)
        assert body is not None
        return await fleet_reconcile.reconcile_fleet(self.ctx, body)

    async def run_pass(self) -> revision_reconcile.PassOutcome:
        outcome = await revision_reconcile.reconcile_revisions(
            self.ctx, self.namespace, self.fleet, self.memory, interrupted=lambda: False
        )
        self.outcomes.append(outcome)
        return outcome

    async def settle(self, max_passes: int = 50, *, require_idle: bool = True) -> list[revision_reconcile.PassOutcome]:
        """Passes until one is idle (nothing left to do), as the daemon runs them; the outcomes in order.

        A pass that waits (``again=False, idle=False``: a budget or an unreachable engine) is followed by
        another at once, where the daemon would wait a second first.
        """
        outcomes = []
        for _ in range(max_passes):
            outcome = await self.run_pass()
            outcomes.append(outcome)
            if outcome.idle and not outcome.again:
                return outcomes
        if require_idle:
            raise AssertionError(f"no idle pass after {max_passes} passes (last: {outcomes[-3:]})")
        return outcomes

    # --- what the API server holds -----------------------------------------------------------------

    def revision_status(self, name: str) -> Manifest:
        obj = self.kube.peek(common.API_VERSION, "WeightRevision", self.namespace, name)
        assert obj is not None, f"WeightRevision {name} does not exist"
        return dict(obj.get("status") or {})

    def fleet_status(self) -> Manifest:
        obj = self.kube.peek(common.API_VERSION, "RolloutFleet", self.namespace, self.fleet)
        assert obj is not None
        return dict(obj.get("status") or {})

    def fleet_manifest(self) -> Manifest:
        obj = self.kube.peek(common.API_VERSION, "RolloutFleet", self.namespace, self.fleet)
        assert obj is not None
        return obj


def condition(status: Manifest, type_: str) -> Manifest | None:
    """One condition of a status (camelCase wire form), or None."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def fleet_manifest(
    root: pathlib.Path, replicas: int, port: int, strategy: Manifest, extra: Manifest | None = None
) -> Manifest:
    spec = {
        "replicas": replicas,
        "image": "vllm-rolloutfleet:0.33.0",
        "port": port,
        "verifier": {"path": str(root / "policy/step-0/verifier")},
        "draft": {"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
        "weights": {"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
        "updateStrategy": strategy,
        **(extra or {}),
    }
    parsed, errors = validation.parse_fleet_spec(spec)
    assert parsed is not None and not errors, errors
    assert not validation.validate_fleet(parsed), validation.validate_fleet(parsed)
    return {
        "apiVersion": common.API_VERSION,
        "kind": "RolloutFleet",
        "metadata": {"name": FLEET, "namespace": NAMESPACE},
        "spec": spec,
    }


@contextlib.asynccontextmanager
async def harness(
    tmp_path: pathlib.Path,
    *,
    replicas: int = 3,
    unreachable: int = 0,
    mode: str = "sleep",
    rollout: str = "AllAtOnce",
    max_unavailable: int | str = 1,
    max_retries: int = 1,
    reconcile_fleet: bool = True,
    fleet_extra: Manifest | None = None,
    ipv6: bool = False,
    **strategy: Any,
) -> AsyncIterator[Harness]:
    """A fleet of ``replicas`` pods; the first ``unreachable`` of them have IPs nothing listens on. ``ipv6``: one
    pod, on ``::1`` (the one IPv6 loopback address), as a pod of an IPv6 cluster."""
    assert not ipv6 or replicas == 1, "one IPv6 loopback address: one pod"
    root = tmp_path / "weights"
    sim = SimulatedFleet(token=TOKEN, weights=WeightsConfig(synthetic_root=None), latencies=Latencies())
    kube = FakeKube()
    ctx = OperatorContext(kube=cast(Kube, kube), metrics=Metrics())
    try:
        await sim.start()
        # The first engine picks a free port; every other engine (on its own IP) listens on the same one.
        probe = await sim.add(f"{IP_PREFIX}.0.250", 0)
        port = probe.port
        await sim.remove(probe.ip, port)
        h = Harness(kube=kube, ctx=ctx, sim=sim, root=root, port=port)
        h.checkpoint(0)
        body = fleet_manifest(
            root,
            replicas,
            port,
            {
                "mode": mode,
                "rollout": rollout,
                "maxUnavailable": max_unavailable,
                "maxRetries": max_retries,
                "timeouts": {"wakeSeconds": 30, "loadSeconds": 30},
                **strategy,
            },
            fleet_extra,
        )
        stored = kube.apply_user(body)
        sim.spec = engine_spec_for(stored)
        owner = children.Owner(name=FLEET, namespace=NAMESPACE, uid=stored["metadata"]["uid"])
        kube.apply_user(children.build_token_secret(owner, TOKEN))
        parsed, _ = validation.parse_fleet_spec(stored["spec"])
        assert parsed is not None
        template = children.build_statefulset(owner, parsed)["spec"]["template"]["spec"]
        h.readiness_gates = tuple(g["conditionType"] for g in template.get("readinessGates") or [])
        for i in range(replicas):
            await h.add_pod(f"{FLEET}-{i}", listening=i >= unreachable, ip="::1" if ipv6 else None)
        with count_observations(h), fast_retries():
            if reconcile_fleet:
                await h.reconcile_fleet()
                # The fleet's daemon runs passes before any revision exists (e.g. to mark pods that serve the
                # initial weights): start the tests from there.
                await h.settle()
            yield h
    finally:
        memory = ctx.fleets.get((NAMESPACE, FLEET))
        if memory is not None and memory.pool is not None:
            await memory.pool.close()
        await sim.stop()
        kube.close()


def skip_without_ipv6_loopback() -> None:
    """Skip the calling test on a machine whose loopback has no IPv6 address (``harness(ipv6=True)`` needs it)."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")


@contextlib.contextmanager
def fast_retries() -> Iterator[None]:
    """The revision loop's engine pool, retrying an unreachable engine's reads after milliseconds, not 0.3 s."""
    retry = RetryPolicy(attempts=2, base_delay=0.005, max_delay=0.01)
    with mock.patch.object(revision_reconcile, "EnginePool", functools.partial(EnginePool, retry=retry)):
        yield


def pod_of(h: Harness, client: EngineClient) -> str:
    """The pod an engine client talks to (its IP when no pod of the harness has it)."""
    ip = client.base_url.removeprefix("http://").rsplit(":", 1)[0]
    return next((p for p, a in h.pod_ips.items() if a == ip), ip)


@contextlib.contextmanager
def count_observations(h: Harness) -> Iterator[None]:
    """Count ``EngineClient.observe`` calls and the reads that ride in a pre-flight's request (one engine state
    read each) per pod into ``h.observations``, and
    every HTTP request to an engine per (pod, step) into ``h.requests``."""
    original = EngineClient.observe

    async def observe(client: EngineClient) -> engine.EngineState:
        pod = pod_of(h, client)
        h.observations[pod] += 1
        return await original(client)

    original_both = EngineClient.preflights_then_observe

    async def preflights_then_observe(client: EngineClient, *args: Any, **kwargs: Any) -> Any:
        # One state read whether it rode in the pre-flight's request or was sent apart (then ``observe``,
        # counted above, already counted it).
        pod = pod_of(h, client)
        before = h.observations[pod]
        answer = await original_both(client, *args, **kwargs)
        if h.observations[pod] == before:
            h.observations[pod] += 1
        return answer

    original_sent = EngineClient._sent

    async def sent(client: EngineClient, method: str, path: str, token: str | None, **kwargs: Any) -> Any:
        pod = pod_of(h, client)
        h.requests[(pod, str(kwargs.get("step")))] += 1
        return await original_sent(client, method, path, token, **kwargs)

    with (
        mock.patch.object(EngineClient, "observe", observe),
        mock.patch.object(EngineClient, "preflights_then_observe", preflights_then_observe),
        mock.patch.object(EngineClient, "_sent", sent),
    ):
        yield


# --- reading the engines' logs ---------------------------------------------------------------------


def ok_calls(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """State-changing calls that succeeded (HTTP 200), in order."""
    return [e for e in log if e.get("status") == 200]


def call_name(entry: dict[str, Any]) -> str:
    """A call's most specific key: ``pause:keep``, ``sleep:2``, ``wake_up:kv_cache``, ``rolloutfleet_load:draft``..."""
    return str(entry.get("key") or entry["step"])


def loads(log: list[dict[str, Any]], revision: int | None = None) -> list[dict[str, Any]]:
    """Successful ``rolloutfleet_load`` calls (of ``revision`` when given)."""
    out = []
    for e in ok_calls(log):
        if e["step"] != "rolloutfleet_load":
            continue
        if revision is None or (e.get("args") or {}).get("kwargs", {}).get("revision") == revision:
            out.append(e)
    return out


def loaded(log: list[dict[str, Any]]) -> bool:
    """The engine took its draft (the pair's last load): it waits at the barrier to be resumed (which stamps
    the weight version first)."""
    return any(call_name(e) == "rolloutfleet_load:draft" for e in ok_calls(log))


def pauses(log: list[dict[str, Any]]) -> int:
    """How many times the engine was paused."""
    return sum(1 for e in ok_calls(log) if call_name(e).startswith("pause"))


def arrivals(log: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Entries logged when a request arrived (``mark_arrivals``)."""
    return [e for e in log if "fault" in e and call_name(e) == name]


def out_of_service(log: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(order of the pause, order of the resume) of each time the engine left service (open: end = max)."""
    out, start = [], None
    for e in ok_calls(log):
        name = call_name(e)
        if name.startswith("pause") and start is None:
            start = e["order"]
        elif name == "resume" and start is not None:
            out.append((start, e["order"]))
            start = None
    if start is not None:
        out.append((start, 1 << 62))
    return out


def max_overlap(intervals: list[tuple[int, int]]) -> int:
    """The most intervals open at once (ends close before starts at the same point: they never tie)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def served_revisions(log: list[dict[str, Any]]) -> set[int | None]:
    """Every verifier revision whose weights the engine held while in service, after any logged call."""
    out: set[int | None] = set()
    for e in log:
        state = e.get("state")
        if not isinstance(state, dict):
            continue
        if not state["paused"] and state["weights_awake"] and state["kv_awake"]:
            out.add(state["verifier"])
    return out
