"""The soak's independent observer: what the engines really hold, checked against readiness and fleet status.

Used by ``bench/soak.py`` (it samples every 100 ms); the check functions here are pure and unit-tested in
``tests/unit/bench/test_soak_observer.py``. The observer never asks the operator: an engine's truth is read
from the simulator's in-process objects (``SimulatedEngine.core``: what memory holds, not what is claimed),
a pod's readiness is computed from the pod as the API server stores it (``Ready`` True *and* every
readiness gate of its spec True) and from its engine's admission (the readiness probe
``/rolloutfleet/ready``, which kwok does not run: a kubelet would fail it for an un-admitted engine), and
the fleet's view is
its ``status`` (``currentRevision``, ``targetRevision``, ``pods[].revision``).

Per sample and per pod whose engine serves (listening, not paused, not asleep) while the pod is routed
(Ready with its gates, not terminating), a finding is one of:

- ``a``: the co-updated draft holds another revision than the verifier (a mixed pair);
- ``b``: the weights are not resident, partially loaded or corrupt, carry no digest, or their digest is not
  the revision's pinned one (the fleet's initial weights count as verified only while the fleet has never
  moved past them: they are what ``vllm serve`` was given);
- ``c``: the engine serves another revision than ``status.currentRevision`` while ``status.targetRevision``
  is unset (outside a rollout);
- ``d`` (every pod with a listening engine, served or not): ``status.pods[].revision`` differs from the
  revision the engine's verifier memory holds; counted raw, and beyond a tolerance (status is written
  after each pass, so a short lag is expected). A status that names no revision claims nothing: after a
  failed read (``status_unread``) or while a paused engine runs steps sent in one request
  (``status_pending``), it is counted apart, not as ``d``.

Revision numbers: ``None`` is what a slot holds when the extension claims nothing (the initial weights, or
memory discarded by a level-2 sleep). For ``a`` and ``c`` the initial weights and revision 0 (a rollback to
the initial checkpoint) are the same revision.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

CHECKS = ("a", "b", "c", "d")
TITLES = {
    "a": "Ready pod serves a verifier and a draft of different revisions",
    "b": "Ready pod serves unverified or partially loaded weights",
    "c": "Ready pod serves another revision than the fleet's current one outside a rollout",
    "d": "fleet status.pods[].revision disagrees with the engine's verifier",
}
INITIAL = 0

Manifest = dict[str, Any]


# --- views -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotView:
    """One model slot of an engine: the truth (content) and the extension's claim."""

    kind: str | None  # "initial" | "loaded" | "corrupt" | "partial"; None: memory reads zero
    revision: int | None  # revision of the content in memory
    path: str | None
    claimed_revision: int | None
    digest: str | None  # claimed digest (what the extension reports)
    verified: bool  # the extension's claim that a load completed
    lost: bool  # discarded by a level-2 sleep and not reloaded


@dataclasses.dataclass(frozen=True)
class EngineView:
    """What one simulated engine really is at one instant."""

    key: str
    running: bool
    incarnation: int  # changes when the engine restarts (fresh state)
    paused: bool
    sleep_level: int
    weights_awake: bool
    kv_awake: bool
    verifier: SlotView
    draft: SlotView | None
    admitted: bool = True  # the engine process's readiness probe passes (worker_image/README.md)

    @property
    def serving(self) -> bool:
        """Listening and generating: not paused, not asleep (what a routed request would hit)."""
        return self.running and not self.paused and self.sleep_level == 0 and self.weights_awake and self.kv_awake

    @property
    def resident(self) -> bool:
        draft_lost = self.draft is not None and self.draft.lost
        return self.weights_awake and not self.verifier.lost and not draft_lost

    def brief(self) -> dict[str, Any]:
        """A compact, JSON-friendly description for violation records."""

        def slot(s: SlotView | None) -> Any:
            if s is None:
                return None
            return {"kind": s.kind, "rev": s.revision, "claim": s.claimed_revision, "digest": _short(s.digest)}

        return {
            "running": self.running,
            "paused": self.paused,
            "sleep": self.sleep_level,
            "resident": self.resident,
            "verifier": slot(self.verifier),
            "draft": slot(self.draft),
        }


@dataclasses.dataclass(frozen=True)
class Pin:
    """The digests a revision pins (``None``: not pinned)."""

    verifier: str | None
    draft: str | None


@dataclasses.dataclass(frozen=True)
class FleetView:
    """The fleet's status as the API server holds it."""

    current: int | None
    target: int | None
    pods: Mapping[str, int | None]  # pod name -> status.pods[].revision
    steps: Mapping[str, str | None] = dataclasses.field(default_factory=dict)  # pod name -> status.pods[].step
    # status.podsCommon's (revision, step): a fleet of more than 256 pods lists only the pods unlike it, and
    # says this of every pod it leaves out.
    common: tuple[int | None, str | None] | None = None

    def said(self, pod: str) -> tuple[int | None, str | None] | None:
        """(revision, step) the status says of ``pod``: its row, else the common state; None: nothing."""
        if pod in self.pods:
            return self.pods[pod], self.steps.get(pod)
        return self.common


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    pod: str
    message: str
    details: dict[str, Any]


def slot_view(slot: Any, mapped: bool) -> SlotView:
    """A ``rolloutfleet.sim.weights.Slot`` as a ``SlotView`` (read only, in the engines' event loop)."""
    content = slot.content
    return SlotView(
        kind=None if content is None else content[0],
        revision=None if content is None else content[2],
        path=None if content is None else content[1],
        claimed_revision=slot.revision if mapped and not slot.lost else None,
        digest=slot.digest if mapped and not slot.lost else None,
        verified=bool(slot.verified) and mapped and not slot.lost,
        lost=bool(slot.lost),
    )


def engine_view(engine: Any) -> EngineView:
    """A ``rolloutfleet.sim.server.SimulatedEngine`` as an ``EngineView`` (no await: one consistent instant)."""
    core = engine.core
    mapped = bool(core.weights_awake)
    return EngineView(
        key=engine.key,
        running=bool(engine.running),
        incarnation=id(core),
        paused=bool(core.paused),
        sleep_level=int(core.sleep_level),
        weights_awake=mapped,
        kv_awake=bool(core.kv_awake),
        verifier=slot_view(core.verifier, mapped),
        draft=None if core.draft is None else slot_view(core.draft, mapped),
        admitted=bool(getattr(engine, "admitted", True)),
    )


def fleet_view(fleet: Manifest | None) -> FleetView | None:
    """The fleet's status (None when the fleet or its status does not exist)."""
    status = (fleet or {}).get("status")
    if not status:
        return None
    pods = {str(p.get("name")): p.get("revision") for p in status.get("pods") or [] if p.get("name")}
    steps = {str(p.get("name")): p.get("step") for p in status.get("pods") or [] if p.get("name")}
    shared = status.get("podsCommon")
    common = (shared.get("revision"), shared.get("step")) if isinstance(shared, dict) else None
    return FleetView(
        current=status.get("currentRevision"),
        target=status.get("targetRevision"),
        pods=pods,
        steps=steps,
        common=common,
    )


# --- pure checks -------------------------------------------------------------------------------------


def _condition(pod: Manifest, type_: str) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return str(cond.get("status"))
    return None


def pod_ready(pod: Manifest) -> bool:
    """Ready as the kubelet would compute it: the Ready condition True and every readiness gate True."""
    if _condition(pod, "Ready") != "True":
        return False
    gates = [str(g.get("conditionType")) for g in (pod.get("spec") or {}).get("readinessGates") or []]
    return all(_condition(pod, gate) == "True" for gate in gates)


def routed(pod: Manifest) -> bool:
    """Receives traffic: Ready (with gates) and not terminating (terminating endpoints are not ready)."""
    return pod_ready(pod) and not (pod.get("metadata") or {}).get("deletionTimestamp")


def same_revision(a: int | None, b: int | None) -> bool:
    """Equal revisions, the initial weights (None) and revision 0 being the same."""
    return (INITIAL if a is None else a) == (INITIAL if b is None else b)


def _short(digest: str | None) -> str | None:
    return None if digest is None else digest[:19]


def _slot_problem(name: str, slot: SlotView, pin: str | None, fleet_on_initial: bool) -> str | None:
    if slot.kind is None:
        return f"{name} memory reads zero (discarded, not reloaded)"
    if slot.lost:
        return f"{name} discarded by a level-2 sleep"
    if slot.kind in ("partial", "corrupt"):
        return f"{name} holds {slot.kind} weights of revision {slot.revision}"
    if slot.kind == "initial":
        return None if fleet_on_initial else f"{name} holds the initial weights (no digest) on a fleet past them"
    if slot.digest is None or not slot.verified:
        return f"{name} revision {slot.revision} has no digest"
    if pin is not None and slot.digest != pin:
        return f"{name} revision {slot.revision} digest {_short(slot.digest)} != pinned {_short(pin)}"
    return None


def check_serving(
    pod: str, engine: EngineView, fleet: FleetView | None, pins: Mapping[int, Pin], draft_co_updated: bool = True
) -> list[Finding]:
    """Checks a, b, c for an engine that serves behind a routed pod (the caller filters on both)."""
    found: list[Finding] = []
    details = {"engine": engine.brief()}
    if fleet is not None:
        details["fleet"] = {"current": fleet.current, "target": fleet.target}
    v, d = engine.verifier, engine.draft
    if (
        draft_co_updated
        and d is not None
        and v.kind is not None
        and d.kind is not None
        and not same_revision(v.revision, d.revision)
    ):
        found.append(Finding("a", pod, f"verifier r{v.revision} with draft r{d.revision}", details))
    on_initial = fleet is None or same_revision(fleet.current, None)
    problems: list[str | None] = []
    if not engine.resident:
        problems.append("weights not resident")
    # Each slot is held to the pin of the revision it holds (a mixed pair is check a, not b).
    v_pin = pins.get(v.revision) if v.kind == "loaded" and v.revision is not None else None
    problems.append(_slot_problem("verifier", v, v_pin.verifier if v_pin else None, on_initial))
    if d is not None:
        d_pin = pins.get(d.revision) if d.kind == "loaded" and d.revision is not None else None
        problems.append(_slot_problem("draft", d, d_pin.draft if d_pin else None, on_initial))
    for s in (v, d):
        if s is not None and s.kind == "loaded" and s.revision is not None and s.revision not in pins:
            problems.append(f"revision {s.revision} is not a published revision")
    messages = [p for p in problems if p]
    if messages:
        found.append(Finding("b", pod, "; ".join(messages), details))
    if fleet is not None and fleet.target is None and not same_revision(v.revision, fleet.current):
        found.append(Finding("c", pod, f"serves r{v.revision}, fleet current r{fleet.current}, no target", details))
    return found


# Steps the operator reports for a pod whose engine it could not read (planning.transaction.Step).
UNREAD_STEPS = frozenset({"Unreachable", "EngineError"})


def status_disagreement(pod: str, engine: EngineView, fleet: FleetView | None) -> str | None:
    """Check d for one pod with a listening engine: what the status says vs what the verifier holds.

    A status that names no revision because the operator's last read of this engine failed (its step says
    so) claims nothing: that is ``status_unread``, counted apart, not a disagreement.
    """
    if fleet is None:
        return None
    said = fleet.said(pod)
    if said is None:
        return f"pod missing from status.pods (engine holds r{engine.verifier.revision})"
    revision, step = said
    held = engine.verifier.revision
    if revision != held and status_unread(pod, engine, fleet) is None and status_pending(pod, engine, fleet) is None:
        return f"status says r{revision} (step {step}), verifier holds r{held} ({engine.verifier.kind})"
    return None


def status_unread(pod: str, engine: EngineView, fleet: FleetView | None) -> str | None:
    """The status says the engine's revision is unknown because the operator could not read it."""
    said = None if fleet is None else fleet.said(pod)
    if said is None or said[0] is not None:
        return None
    step = said[1]
    if step not in UNREAD_STEPS or engine.verifier.revision is None:
        return None
    return f"status says unknown (step {step}), verifier holds r{engine.verifier.revision} ({engine.verifier.kind})"


# The steps a request of several steps ends at (the operator's ``planning.transaction.CHAIN_TO``, written out:
# the observer judges the operator, it does not take its rules from it; a unit test holds the two equal). While
# one runs, the status shows the pod as its engine is once the steps before it succeeded, since a level-2 sleep
# among them releases the revision held before at a moment the operator cannot see.
CHAIN_STEPS = frozenset({"Sleep", "WakeWeights", "LoadVerifier", "LoadDraft", "CommitVerifier", "CommitDraft"})


def status_pending(pod: str, engine: EngineView, fleet: FleetView | None) -> str | None:
    """The status names no revision while the pod's steps, sent in one request, run on a paused engine that
    still holds one (its sleep has not come yet): a claim of nothing until the request answers."""
    said = None if fleet is None else fleet.said(pod)
    if said is None or said[0] is not None:
        return None
    step = said[1]
    if step not in CHAIN_STEPS or not engine.paused or engine.verifier.revision is None:
        return None
    return (
        f"status says unknown while its steps run (step {step}), verifier still holds r{engine.verifier.revision} "
        f"({engine.verifier.kind})"
    )


class Lag:
    """How long each pod's disagreement (check d) has lasted; reset when it agrees."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self._since: dict[str, float] = {}

    def observe(self, t: float, pod: str, disagrees: bool) -> tuple[bool, float]:
        """(beyond tolerance, seconds it has lasted) for this sample."""
        if not disagrees:
            self._since.pop(pod, None)
            return False, 0.0
        start = self._since.setdefault(pod, t)
        lasted = t - start
        return lasted > self.tolerance, lasted

    def forget(self, pod: str) -> None:
        self._since.pop(pod, None)


# --- tally -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Episode:
    """Consecutive samples in which one pod fails one check."""

    check: str
    pod: str
    start: float
    end: float
    samples: int
    first: dict[str, Any]


class Tally:
    """Counts findings per check (one per sample per pod) and groups them into episodes."""

    def __init__(self, keep_examples: int = 5, keep_episodes: int = 2000) -> None:
        # ``keep_episodes`` bounds each check on its own: the frequent, tolerated ``d`` episodes must not
        # crowd out the rare ones the report explains (``d_beyond``, a, b, c).
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        self.episodes: list[Episode] = []
        self.episode_counts: collections.Counter[str] = collections.Counter()
        self.longest: dict[str, float] = collections.defaultdict(float)  # each check's longest episode (s)
        self._open: dict[tuple[str, str], Episode] = {}
        self._seen: set[tuple[str, str]] = set()
        self._keep_examples, self._keep_episodes = keep_examples, keep_episodes

    def add(self, t: float, check: str, pod: str, record: dict[str, Any]) -> None:
        self.counts[check] += 1
        if len(self.examples[check]) < self._keep_examples:
            self.examples[check].append({"t": round(t, 2), "pod": pod, **record})
        key = (check, pod)
        self._seen.add(key)
        episode = self._open.get(key)
        if episode is None:
            episode = Episode(check, pod, t, t, 0, {"t": round(t, 2), **record})
            self._open[key] = episode
            self.episode_counts[check] += 1
            if self.episode_counts[check] <= self._keep_episodes:
                self.episodes.append(episode)
        episode.end = t
        episode.samples += 1
        self.longest[check] = max(self.longest[check], episode.end - episode.start)

    def end_sample(self, skipped: set[str] | frozenset[str] = frozenset()) -> None:
        """Close the episodes not seen in this sample (pods in ``skipped`` were not judged: kept open)."""
        for key in list(self._open):
            if key not in self._seen and key[1] not in skipped:
                del self._open[key]
        self._seen = set()


# --- the sampling loop -------------------------------------------------------------------------------

EnginesReader = Callable[[], Awaitable[dict[str, EngineView]]]
ClusterReader = Callable[[], Awaitable[tuple[list[Manifest], Manifest | None]]]
Context = Callable[[str, float], list[str]]


class Observer:
    """Samples every ``interval`` seconds: engines, then pods and fleet, then engines again.

    A pod whose engine changed between the two engine reads is not judged in that sample (counted as
    ambiguous): its readiness and the fleet status were read while it moved, so pairing them with either
    engine state could report a violation that never existed.
    """

    def __init__(
        self,
        engines: EnginesReader,
        cluster: ClusterReader,
        pins: Mapping[int, Pin],
        *,
        port: int = 8000,
        interval: float = 0.1,
        tolerance: float = 3.0,
        context: Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engines, self._cluster, self.pins = engines, cluster, pins
        self.port, self.interval = port, interval
        self.lag = Lag(tolerance)
        self.tally = Tally()
        self._context = context or (lambda pod, t: [])
        self._clock = clock
        self.start = clock()
        self.latest_pods: list[Manifest] = []
        self.latest_fleet: Manifest | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self.max_gap = 0.0
        self.busy = 0.0  # seconds spent sampling
        self._last_sample: float | None = None
        self._incarnations: dict[str, int] = {}
        self._restarted: dict[str, float] = {}
        self.errors: list[str] = []
        self._stop = asyncio.Event()

    def now(self) -> float:
        return self._clock() - self.start

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        while not self._stop.is_set():
            began = self._clock()
            try:
                await self.sample()
                self.busy += self._clock() - began
            except Exception as exc:  # an API hiccup (e.g. the apiserver busy): note it, keep sampling
                self.stats["errors"] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"{self.now():.1f}s {type(exc).__name__}: {exc}")
            delay = self.interval - (self._clock() - began)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, delay))

    async def sample(self) -> None:
        before = await self._engines()
        pods, fleet = await self._cluster()
        after = await self._engines()
        t = self.now()
        if self._last_sample is not None:
            self.max_gap = max(self.max_gap, t - self._last_sample)
        self._last_sample = t
        self.latest_pods, self.latest_fleet = pods, fleet
        self.judge(t, pods, fleet_view(fleet), before, after)

    def judge(
        self,
        t: float,
        pods: list[Manifest],
        fleet: FleetView | None,
        before: Mapping[str, EngineView],
        after: Mapping[str, EngineView],
    ) -> None:
        """Judge one sample (pure apart from the tally): every pod against its engine and the fleet."""
        self.stats["samples"] += 1
        skipped: set[str] = set()
        for pod in pods:
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            name, ip = str(meta.get("name")), status.get("podIP")
            if meta.get("deletionTimestamp") or not ip:
                self.lag.forget(name)
                continue
            key = f"{ip}:{self.port}"
            first, engine = before.get(key), after.get(key)
            if first is None or engine is None or not engine.running or not first.running:
                self.lag.forget(name)  # no engine listening: nothing to compare
                continue
            if first != engine:
                self.stats["ambiguous"] += 1
                skipped.add(name)
                continue
            if self._incarnations.get(key) != engine.incarnation:
                if key in self._incarnations:
                    self._restarted[name] = t
                self._incarnations[key] = engine.incarnation
            self.stats["pod_samples"] += 1
            since = self._restarted.get(name)
            gates = {str(g.get("conditionType")) for g in (pod.get("spec") or {}).get("readinessGates") or []}
            gate = next((c for c in status.get("conditions") or [] if c.get("type") in gates), None)
            context = {
                "ip": ip,
                "pod_uid": str(meta.get("uid", ""))[:8],
                "pod_created": meta.get("creationTimestamp"),
                "gate": None
                if gate is None
                else {k: gate.get(k) for k in ("status", "reason", "lastTransitionTime", "message")},
                "engine_restarted_s_ago": None if since is None else round(t - since, 2),
                "recent_faults": self._context(name, t),
            }
            said = status_disagreement(name, engine, fleet)
            unread = status_unread(name, engine, fleet)
            if unread is not None:
                self.tally.add(t, "unread", name, {"message": unread, **context})
            pending = status_pending(name, engine, fleet)
            if pending is not None:
                self.tally.add(t, "pending", name, {"message": pending, **context})
            beyond, lasted = self.lag.observe(t, name, said is not None)
            if said is not None:
                record = {"message": said, "lasted_s": round(lasted, 2), **context}
                self.tally.add(t, "d", name, record)
                if beyond:
                    self.tally.add(t, "d_beyond", name, record)
            # kwok runs no probes: the readiness probe (the engine's admission) is applied here, as a kubelet
            # would apply it to the pod's Ready condition.
            if routed(pod) and engine.admitted and engine.serving:
                self.stats["routed_serving_samples"] += 1
                for finding in check_serving(name, engine, fleet, self.pins):
                    self.tally.add(t, finding.check, name, {"message": finding.message, **finding.details, **context})
        self.tally.end_sample(skipped)
