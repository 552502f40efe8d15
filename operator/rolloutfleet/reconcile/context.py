"""What every reconcile needs from the process: the Kubernetes adapter, metrics and settings.

Built once by the handlers at operator start-up and kept in kopf's memo; passed explicitly to reconcilers
(no globals), so tests and benchmarks can build their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from rolloutfleet.adapters.engine import EnginePool
from rolloutfleet.adapters.kube import Kube
from rolloutfleet.api.engine import EngineState
from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from rolloutfleet.metrics import Metrics
from rolloutfleet.planning.fleet_status import EngineSummary, PodFactsMemo
from rolloutfleet.planning.pod_view import PodViewMemo


@dataclasses.dataclass(frozen=True)
class RestMark:
    """A fleet at rest, as its last full read found it: every engine serving ``goal``, verified.

    ``pods``: what Kubernetes showed of its pods when that read began (``PodViewMemo.signature``);
    ``read_at``: when (``time.monotonic``). ``revision.reconcile_revisions`` reads the engines again only once
    either differs, or the read is ``REST_READ_SECONDS`` old.
    """

    goal: object
    pods: tuple[tuple[object, ...], ...]
    read_at: float


@dataclasses.dataclass(frozen=True)
class StatusMemo:
    """A fleet's status as this process last wrote (or found) it, and the fleet as it was then.

    ``body``: the fleet's metadata (``resourceVersion`` the one the write answered) and spec, ``spec`` the
    spec parsed, ``status`` and ``wire`` the status as a model and as written. ``reconcile.fleet`` builds the
    next status from it instead of reading the fleet again; the write is conditional on that resourceVersion,
    so any other write to the fleet since (a spec change, the revision loop's own fields, another process)
    makes it a 409, and the fleet is read again.
    """

    body: dict[str, object]
    spec: RolloutFleetSpec
    status: RolloutFleetStatus
    wire: dict[str, object]


@dataclasses.dataclass
class FleetMemory:
    """Per-fleet bookkeeping of the revision loop that may be lost at any time without harm.

    Nothing here decides where a pod is (that comes from the engines); it holds retry counts (mirrored in
    the WeightRevision status, which seeds them after a restart), step durations for timings, the last
    engine observations for the fleet's status, and the engine connection pool.
    """

    attempts: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    durations: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    unreachable_since: dict[str, float] = dataclasses.field(default_factory=dict)
    started: dict[str, float] = dataclasses.field(default_factory=dict)
    engine_view: dict[str, EngineState] = dataclasses.field(default_factory=dict)
    # The pod incarnation (``pod_readiness.incarnation``: uid and restart counts) each view was read through: a
    # pod recreated under the same name, or restarted, is another engine process.
    engine_view_incarnations: dict[str, str] = dataclasses.field(default_factory=dict)
    steps: dict[str, str] = dataclasses.field(default_factory=dict)
    # When the fleet's status was last built from fresh reads (monotonic; ``reconcile.fleet``): a periodic
    # resync right after a pass's refresh has nothing to add to it.
    status_observed_at: float = float("-inf")
    status_memo: StatusMemo | None = None
    status_facts: PodFactsMemo = dataclasses.field(default_factory=PodFactsMemo)  # each pod read once per change
    # Each pod's engine summary for the status, with the observation, step, pod object and the incarnation the
    # observation was read through that it was made from (``reconcile.fleet``).
    summaries: dict[str, tuple[EngineState, str | None, dict[str, Any], str | None, EngineSummary]] = dataclasses.field(
        default_factory=dict
    )
    probe_passed: dict[str, bool] = dataclasses.field(default_factory=dict)
    preflight_passed: dict[str, bool] = dataclasses.field(default_factory=dict)
    revision_labels: set[str] = dataclasses.field(default_factory=set)  # pods_at_revision label values set
    pool: EnginePool | None = None
    kick: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # The trainer's marks (push.rolloutfleet.io/<target>, error) delivered by the watch, per revision: a
    # kick that carries only these lets a pass waiting on the trainer go on without a new pass (no re-list
    # of the pods, no re-read of every engine). ``marks_delivered``: the watch delivers them (the operator
    # process; not the unit harness, whose passes end when they wait).
    marks: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    marks_only: bool = False
    marks_delivered: bool = False
    # The revision the running pass carries out, (name, metadata.generation), and what the kicks since the
    # pass started were about (``kicked_about``; None: at least one was about something else, or unknown).
    working_on: tuple[str, int] | None = None
    kicked_about: set[tuple[str, int]] | None = dataclasses.field(default_factory=set)
    rest: RestMark | None = None  # None: the next pass reads every engine
    pod_views: PodViewMemo = dataclasses.field(default_factory=PodViewMemo)  # each pod object read once per pass's view

    def kick_all(self, about: tuple[str, int] | None = None) -> None:
        """Something else than the trainer's marks changed: the running pass ends, a new one starts.

        ``about``: the revision (name, generation) the change was seen on, when it was one. See ``stale_kick``.
        """
        self.marks_only = False
        if about is None or self.kicked_about is None:
            self.kicked_about = None
        else:
            self.kicked_about.add(about)
        self.kick.set()

    def stale_kick(self) -> bool:
        """The kicks since the pass started were all about the revision it carries out, at the generation it
        read: nothing it does not know. The revision loop's own pass can pick a new revision up before the
        watch's handler for its creation runs; that handler's kick then ended the pass and the next one read
        every engine again (3 of ~40 device revisions at 1,024 pods: two passes, 1.5-2.5 s more; issue 18)."""
        return self.working_on is not None and self.kicked_about is not None and self.kicked_about <= {self.working_on}

    def kick_marks(self, revision: str, annotations: dict[str, str]) -> None:
        """Only the trainer's marks on ``revision`` changed (``annotations``: its push annotations now)."""
        self.marks[revision] = annotations
        if not self.kick.is_set():
            self.marks_only = True
        self.kick.set()

    def clear_kick(self) -> None:
        self.kick.clear()
        self.marks_only = False
        self.kicked_about = set()

    def retain(self, key: str, pods: set[str]) -> None:
        """Forget what belongs to other revisions than ``key`` and to pods that are gone.

        Called at the start of every pass, so memory stays bounded by one revision's pods however many
        revisions a fleet goes through (the status keeps what must survive: attempts, timings).
        """
        self.attempts = {k: v for k, v in self.attempts.items() if k[0] == key and k[1] in pods}
        self.durations = {k: v for k, v in self.durations.items() if k == key}
        self.started = {k: v for k, v in self.started.items() if k == key}
        self.probe_passed = {k: v for k, v in self.probe_passed.items() if k == key}
        self.preflight_passed = {k: v for k, v in self.preflight_passed.items() if k == key}
        self.unreachable_since = {k: v for k, v in self.unreachable_since.items() if k in pods}
        self.engine_view = {k: v for k, v in self.engine_view.items() if k in pods}
        self.engine_view_incarnations = {k: v for k, v in self.engine_view_incarnations.items() if k in pods}
        self.steps = {k: v for k, v in self.steps.items() if k in pods}
        self.marks = {k: v for k, v in self.marks.items() if k == key}

    def remember(self, states: dict[str, EngineState], incarnations: dict[str, str]) -> None:
        """The last engine observations, for the fleet status, each tied to the pod incarnation it was read
        through."""
        self.engine_view = dict(states)
        self.engine_view_incarnations = {p: incarnations[p] for p in states if p in incarnations}

    def replaced(self, pod: str, incarnation: str | None) -> bool:
        """The last observation of ``pod`` was read through another pod of that name (since recreated) or
        another process of its container (since restarted)."""
        return incarnation is not None and self.engine_view_incarnations.get(pod) not in (None, incarnation)


@dataclasses.dataclass
class OperatorContext:
    """Process-wide collaborators of the reconcilers."""

    kube: Kube
    metrics: Metrics
    operator_namespace: str | None = None
    fleets: dict[tuple[str, str], FleetMemory] = dataclasses.field(default_factory=dict)
    # Told when each revision pass starts (True) and ends (False): ``handlers.gc_tuning.FullCollections``.
    on_pass: Callable[[bool], None] | None = None

    def memory(self, namespace: str, name: str) -> FleetMemory:
        """The bookkeeping of one fleet (created on first use)."""
        return self.fleets.setdefault((namespace, name), FleetMemory())
