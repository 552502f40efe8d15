"""``RolloutPass``: one pass that moves a fleet's engines toward one goal, each pod on its own.

Built and run by ``reconcile.revision`` once it has chosen the goal. Loop: read the engines whose state is
not known from an acknowledgement → decide each pod's next step (``planning.transaction``) → admit steps
under the budget (``planning.rollout``) → execute them (``executor``), each pod going on as soon as its own
step finished → until every pod is at the goal, a barrier or budget makes it wait, a failure changes the
plan, or a newer revision interrupts. A pod is read from its engine right before it resumes and before it
is called done; everything else between two reads is known from the engine's own acknowledgements.
Nothing here is a cursor: the next pass derives everything again from the engines.

The pass owns the pods' readiness gates (``reconcile.gates``): closed before a pod pauses, opened after it
resumed on verified weights, and reconciled for every pod when the pass ends. An AllAtOnce fleet, which
leaves and returns as one, writes them beside its pauses instead, and opens each pod's once it waits at the
barrier on verified weights (``_route_out_together``, ``_open_at_barrier``): the engines' admission holds
each pod out of the Service until its resume.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.api import engine
from rolloutfleet.api.engine import EngineFault
from rolloutfleet.api.fleet import RolloutFleetSpec, RolloutType
from rolloutfleet.api.revision import (
    ParityProbe,
    ParityProbeResult,
    Phase,
    PodFailure,
    PushGroupStatus,
    WeightRevisionStatus,
)
from rolloutfleet.planning import (
    failures,
    pod_readiness,
    revision_status,
    revisions,
    rollout,
    transaction,
    verification,
)
from rolloutfleet.planning.pod_view import PodView
from rolloutfleet.planning.transaction import Decision, Goal, Step
from rolloutfleet.reconcile import executor, fanout, gates, preflight, probe, push, staging, waits
from rolloutfleet.reconcile import fleet as fleet_reconcile
from rolloutfleet.reconcile import status_writes as writes
from rolloutfleet.reconcile.context import FleetMemory, OperatorContext

Manifest = dict[str, Any]
log = logging.getLogger(__name__)
STATUS_WRITE_INTERVAL = 0.5
ADMIT_RETRY_SECONDS = 0.5  # between admits of a pod that is done but was refused admission
MARKS_WAIT_SECONDS = 1.0  # a pass waits this long for the trainer's mark before reading the engines again
# The fleet's per-pod status is rewritten at most this often during a pass: a long pass (slow loads,
# retries) would otherwise leave status.pods behind the engines until it ended (the soak measured 3 s+).
FLEET_STATUS_INTERVAL = 1.0
# Both progress writes carry every pod (and the fleet's lists every pod first): a large fleet's are spaced
# by its size, so that they stay a small share of the operator's work. 1,024 pods: revision progress every
# second, the fleet's status.pods every two; 4,096 pods: every 4 and 8 s (bench/results/rollout_overhead.md).
PROGRESS_PODS_PER_SECOND = 1024
FLEET_STATUS_PODS_PER_SECOND = 512
RESUME_BATCH_SECONDS = 5.0  # a pod resumed with others waits at most this long for them before its admit
# An AllAtOnce fleet out of service writes no progress status for this long from its pause on: each write (a
# row per pod) and its watch echo cost the API server and the operator CPU right when the commits answer and
# the resumes go out (64 pods on 2 cores: the window 0.80-0.89 s with them, 0.69-0.81 s without; issue 17).
# A staged commit ends well within it; a longer pause (loads) reports again after it.
WINDOW_QUIET_SECONDS = 2.0
# A step's end wakes the pass; it then waits this long at most for more ends before it decides (at once when
# every step in flight has ended). Under uneven engines the ends come one at a time, and an iteration per end
# (~700 in a 1,024-pod long-tail revision) was work for nothing at the AllAtOnce barrier and a decision per
# freed slot under Rolling (bench/results/rollout_overhead.md). A step takes seconds to minutes on vLLM.
STEP_ENDS_GATHER_SECONDS = 0.05
UNDECIDED = Decision(Step.PAUSE)  # what a pod not decided yet counts as (one object, not one per lookup)
READ_CONCURRENCY = fanout.LIMIT  # engine reads in flight at once
FAULT_REASONS = {
    EngineFault.UNAUTHORIZED: "EngineUnauthorized",
    EngineFault.PROTOCOL: "EngineProtocolError",
    EngineFault.EXTENSION: "EngineExtensionError",
    EngineFault.INCONSISTENT: "EngineRanksDisagree",
}


@dataclasses.dataclass
class PassOutcome:
    """What a pass ended with; ``again`` asks the loop to run the next pass right away."""

    again: bool = False
    idle: bool = True


@dataclasses.dataclass
class _Batch:
    """Pods resumed together (AllAtOnce): ``done`` once none is left pending."""

    pending: set[str]
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class RolloutPass:
    """The steps of one pass (a class only to keep the many collaborators out of argument lists)."""

    def __init__(
        self,
        ctx: OperatorContext,
        spec: RolloutFleetSpec,
        fleet_body: Manifest,
        memory: FleetMemory,
        sel: revisions.Selection,
        pods: PodView,
        clients: dict[str, EngineClient],
        interrupted: Callable[[], bool],
        announced: asyncio.Future[None] | None = None,
    ) -> None:
        self.ctx, self.spec, self.fleet_body, self.memory, self.sel = ctx, spec, fleet_body, memory, sel
        self.pods, self.clients, self.interrupted = pods, clients, interrupted
        # The fleet's record of the target, written beside the pre-flight (``reconcile.revision``) and the
        # revision's RolloutStarted event: both waited for before the first step.
        self.before_steps: list[asyncio.Future[None]] = [announced] if announced is not None else []
        self.order = pods.order
        self.incarnations: dict[str, str] | None = None  # each pod's, as listed for this pass (``_remember_states``)
        self.timings_memo: revision_status.TimingsMemo = {}  # the progress's step timings (``revision_status.timings``)
        self.rank = {pod: i for i, pod in enumerate(self.order)}  # a pod's place in ``order``
        self._undone_hint: str | None = None  # a pod of ``order`` last found not done (``_all_done``)
        assert sel.goal is not None
        self.rev = sel.active
        # Set when a pass with no revision found every engine serving the goal (``revision.RestMark``).
        self.found_at_rest = False
        self.goal: Goal = push.goal_with_marks(sel.goal, spec, self.rev, rolling_back=sel.rolling_back)
        self.kept = revisions.served_goal(spec, sel.served)  # pods on it may keep serving meanwhile
        # Pushed weights: the newest epoch of sessions opened (the status keeps it across operator restarts)
        # and the epochs whose sessions are still being opened (not published before they are complete).
        self.push_epoch = push.recorded_epoch(self.rev)
        # NCCL: the transfer group of this pass's pods, chosen once their engines were first read.
        self.group: PushGroupStatus | None = None
        self.opening: dict[int, set[str]] = {}
        self.pod_epoch: dict[str, int] = {}
        self.restarted: set[str] = set()
        total = max(1, len(self.order) + len(pods.starting))
        self.plan = revisions.plan_budget(spec, sel.active, total)
        # None without maxConcurrentLoads: a semaphore as large as the fleet limits nothing, and each acquire
        # still costs (1,024 loads at once: 2 % of the operator's CPU, issue 18).
        limit = self.plan.max_concurrent_loads
        self.loads = asyncio.Semaphore(limit) if limit else None
        self.key = self.rev.name if self.rev is not None else f"current-{self.goal.revision}"
        memory.retain(self.key, set(pods.bodies))
        self.states: dict[str, engine.EngineState] = {}
        self.stale: set[str] = set(self.order)  # pods whose state must be read from the engine
        self.changed: set[str] = set(self.order)  # pods whose decision must be derived again
        self.inflight: dict[str, asyncio.Task[None]] = {}  # pods with a step running
        self.ended: list[str] = []  # pods of ``inflight`` whose step ended, in the order they ended
        self.step_done = asyncio.Event()  # set with each of them
        self.routed_out: set[str] = set()  # pods taken out of the Service ahead of their PAUSE step
        # AllAtOnce: gate writes running beside a pod's pause or resume (``_gate_beside``); the pod's next
        # routing waits for its own, so a pod's writes land in the order they were decided.
        self.gate_writes: dict[str, asyncio.Task[None]] = {}
        self.opened_early: set[str] = set()  # AllAtOnce: gates opened at the barrier, before the pod resumed
        self.resume_batch: dict[str, _Batch] = {}  # AllAtOnce: pods routed back in once their batch resumed
        self.paused_since: float | None = None  # AllAtOnce: when the fleet paused together (until it resumed)
        self.decided_goal: Goal | None = None  # the goal (with reference digests) decisions were made for
        self.tally: verification.DigestTally | None = None  # the pods' votes for the goal's reference digests
        self.verified: set[str] = set()  # pods read from the engine when they were ready to resume or done
        self.decisions: dict[str, Decision] = {}  # set through ``_set_decision`` only
        # Pods running a chain of steps in one request: the status shows each as its engine is while the chain's
        # first load runs (``transaction.as_step_starts``), until the engine's answer or a read says more.
        # Worked out once per chain, not at each status refresh: one object per chain also keeps the fleet
        # status's summary of the pod (``reconcile.fleet._engines`` keeps it while the state is the same object;
        # both worked out again for every pod in a chain were a fifth of each refresh, issue 18).
        self.chains: dict[str, engine.EngineState] = {}
        self.by_step = rollout.StepTally()  # the decisions by step, for ``rollout.admit``
        self.done = self.by_step.at[Step.DONE]  # the pods whose decision is Done (the tally keeps it)
        self.messages: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.last_write = 0.0
        self.last_fleet_write = 0.0
        self.fleet_writer: asyncio.Task[None] | None = None
        self.writer: asyncio.Task[None] | None = None
        meta = fleet_body["metadata"]
        self.fleet_labels = (str(meta["namespace"]), str(meta["name"]))
        self.probe_result: ParityProbeResult | None = None
        self.reads = 0
        # The first read, made with the pre-flight (``_preflight_refused``): the pods it read and its answers.
        self.first_read: tuple[list[str], list[engine.EngineState]] | None = None
        self.timing = {"start": time.monotonic(), "iterations": 0, "observe": 0.0, "steps": 0.0, "status": 0.0}
        # When the pass reached each of its phases, seconds from its start (logged at its end): where a
        # revision's time went, e.g. between the last engine step and the last gate write (issue 18).
        self.marks: dict[str, float] = {}
        # Staging (docs/staging.md): what each pod's staging came to, for the status (seeded from it).
        self.staging = staging.seeded(self.rev.status.pods) if self.rev is not None else {}
        if self.rev is not None:
            for pod in self.rev.status.pods:  # attempts survive operator restarts through the status
                prev = memory.attempts.get((self.key, pod.name), 0)
                memory.attempts[(self.key, pod.name)] = max(prev, pod.attempts)
            memory.started.setdefault(self.key, time.monotonic())

    async def run(self) -> PassOutcome:
        # What a kick about this revision's creation repeats (``FleetMemory.stale_kick``): it does not end the pass.
        self.memory.working_on = (self.rev.name, writes.generation(self.rev.body)) if self.rev is not None else None
        if self.rev is not None and self.rev.status.phase == Phase.PENDING:
            # Beside the pre-flight (events never fail a pass: ``Kube.event``).
            started = self.ctx.kube.event(
                writes.wrev_ref(self.rev.body),
                "Normal",
                "RolloutStarted",
                f"moving {len(self.order)} pods to revision {self.goal.revision} "
                f"({self.plan.mode.value}, {self.plan.rollout.value})",
            )
            self.before_steps.append(asyncio.ensure_future(started))
        try:
            refused = await self._rollback_impossible() or await self._preflight_refused()
            await self._before_steps()
            self._mark("pre-flight")
            if refused:
                return PassOutcome(again=True, idle=False)
            return await self._iterations()
        finally:
            # Only after an error are these still running: the pass's caller sees the error it raised.
            for waiting in self.before_steps:
                waiting.cancel()
            await asyncio.gather(*self.before_steps, return_exceptions=True)
            self.memory.working_on = None
            for task in self.inflight.values():  # only after an error: every normal exit drains first
                task.cancel()
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            if self.writer is not None:
                await asyncio.gather(self.writer, return_exceptions=True)
            await self._stop_fleet_writer()
            await asyncio.gather(*self.gate_writes.values(), return_exceptions=True)
            self.gate_writes.clear()
            with contextlib.suppress(KubeError):
                await self._sync_gates()
            self._remember_states()
            t = self.timing
            log.info(
                "pass %s: %d iterations, %d engine reads in %.2fs (observe %.2fs, waiting on steps %.2fs, "
                "status %.2fs; at %s; started at monotonic %.3f)",
                self.key,
                t["iterations"],
                self.reads,
                time.monotonic() - t["start"],
                t["observe"],
                t["steps"],
                t["status"],
                ", ".join(f"{phase} {at:.2f}s" for phase, at in sorted(self.marks.items(), key=lambda m: m[1])) or "-",
                # The host's monotonic clock (one per machine): a benchmark lines the phases up with what it
                # sampled of other processes in the same time (bench/rollout_overhead.py --cpu-timeline).
                t["start"],
            )

    def _mark(self, phase: str, *, again: bool = False) -> None:
        """Note when the pass reached ``phase`` (the first time only, unless ``again``)."""
        if again or phase not in self.marks:
            self.marks[phase] = time.monotonic() - self.timing["start"]

    async def _before_steps(self) -> None:
        """Wait for what runs beside the pre-flight (the target's record, the event); an error is raised here,
        before any engine moves."""
        await asyncio.gather(*self.before_steps)
        self.before_steps = []

    async def _rollback_impossible(self) -> bool:
        """A rollback to pushed weights cannot happen without the trainer: fail it at once, pods stay out of
        service (they wait for the next revision) rather than wait for a sender that will not come."""
        if self.rev is None or not self.sel.rolling_back or not self.goal.pushed:
            return False
        message = (
            f"cannot roll back: revision {self.goal.revision} was pushed by the trainer and no path can bring it "
            f"back; pods that moved stay out of service until the next revision ({self.rev.status.message or ''})"
        )
        await writes.finalize(self.ctx, self.rev, Phase.FAILED, "RollbackImpossible", message[:1024], warn=True)
        return True

    async def _preflight_refused(self) -> bool:
        """Before a revision's first step: the engines check its checkpoints (``reconcile.preflight``).

        A refusal fails the revision with no pod touched. Run once per revision, while it is still
        Pending (after an operator restart mid-rollout the pods are moving already: the loads verify).
        """
        rev = self.rev
        if rev is None or self.sel.rolling_back or rev.status.phase != Phase.PENDING:
            return False
        if self.memory.preflight_passed.get(self.key):
            return False
        deadline = float(self.spec.update_strategy.timeouts.verify_seconds)
        # Each engine is read right after its own pre-flight, in the same request where the image allows it
        # (``preflight.check_then_read``): both only read, and when the pre-flight lets the revision go those
        # answers are what the pass starts from. One after the other for the whole fleet, 1,024 pods on 16
        # cores took 0.30 s and then 0.15 s; the two fan-outs side by side, two requests at once to each
        # engine, took 0.57 s; each read after its own pre-flight, 0.40 s (issue 18).
        checks, first = preflight.targets(self.goal), self._to_read()
        reading = set(first)

        async def check_then_read(pod: str) -> tuple[list[preflight.Refusal], engine.EngineState | None]:
            if pod not in reading:
                return await preflight.check_pod(pod, self.clients[pod], checks, deadline), None
            refusals, state = await preflight.check_then_read(pod, self.clients[pod], checks, deadline)
            return refusals, (None if refusals else state)

        answers = dict(
            zip(self.order, await fanout.bounded((check_then_read(p) for p in self.order), fanout.LIMIT), strict=True)
        )
        refusals = [r for pod_refusals, _ in answers.values() for r in pod_refusals]
        states = [answers[p][1] for p in first]
        if not refusals and all(state is not None for state in states):
            self.first_read = (first, [state for state in states if state is not None])
        if not refusals:
            self.memory.preflight_passed[self.key] = True
            return False
        message = f"pre-flight, no pod touched: {preflight.summary(refusals, len(self.order))}"
        self.ctx.metrics.update_failures.labels(*self.fleet_labels, "Preflight", "PreflightFailed").inc(len(refusals))
        per_pod: dict[str, list[str]] = {}
        for r in refusals:  # status.failures is a map keyed by pod name: one entry per pod
            per_pod.setdefault(r.pod, []).append(f"{r.target.value}: {r.message}")
        entries = [
            PodFailure(name=pod, step="Preflight", reason="PreflightFailed", message="; ".join(why)[:1024])
            for pod, why in per_pod.items()
        ]
        await writes.finalize(
            self.ctx, rev, Phase.FAILED, "PreflightFailed", message, warn=True, failures=failures.bounded(entries)
        )
        return True

    async def _iterations(self) -> PassOutcome:
        """Each pod moves on as soon as its own step finished (no lock-step rounds across the fleet): a
        slow pod delays only itself, and the strategy's barrier and budget still hold (``rollout.admit``).
        """
        while True:
            self.timing["iterations"] += 1
            self._take_marks()
            mark = time.monotonic()
            read = await self._observe()
            self.timing["observe"] += time.monotonic() - mark
            await self._announce_target()
            # Called done only once read from the engine itself (an acknowledgement is not enough).
            self.verified |= {p for p in read if self.decisions[p].step in (Step.RESUME, Step.DONE)}
            # Set differences only, in C: a test of each pod neither verified nor in flight was ~5 % of the
            # operator's active CPU at 1,024 pods, the whole fleet waiting at the AllAtOnce barrier at each of
            # ~700 iterations (issue 18).
            unverified = self.done - self.verified - self.inflight.keys()
            if unverified:
                self.stale |= unverified
                continue
            if self._all_done():
                # Routed before the revision is called Succeeded: a pod that resumed but is not admitted yet
                # (an admit refused, or an operator that died between the resume and the admit) is out of the
                # Service, and Succeeded tells the trainer that every pod serves the revision.
                self._mark("all done")
                await self._sync_gates()
                self._mark("gates written", again=True)
                if self._complete():
                    await self._stop_fleet_writer()
                    return await self._finish()  # the pass's last progress rides on the final phase's write
                self.stale |= {p for p in self.order if self.states[p].admitted is False}
                if self.interrupted() or (self.rev is not None and self.rev.deleted):
                    await self._write_status(force=True)
                    return PassOutcome(again=True, idle=False)
                await asyncio.sleep(ADMIT_RETRY_SECONDS)  # the admit is retried after a fresh read
                continue
            await self._parity_probe()
            failed = self._exhausted()
            if failed:
                await self._drain()
                await self._write_status(force=True)
                return await self._give_up(failed)
            chosen = rollout.admit(
                self.decisions,
                self.order,
                self.plan,
                gate_open=self._probe_gate_open(),
                inflight=self.inflight,
                unavailable=self.pods.not_routed | self.pods.starting,
                tally=self.by_step,
                rank=self.rank,
            )
            # (A resume reads its engine itself, right before it resumes it: ``_still_ready``.)
            chosen = {p: d for p, d in chosen.items() if p not in self.restarted}  # gone: the next pass sees
            opens = [p for p, d in chosen.items() if d.step in push.OPEN_STEPS]
            if opens:  # one epoch per set of sessions opened together (docs/push.md, "Handshake")
                self.push_epoch = push.next_epoch(self.push_epoch, self.states.values())
                self.opening[self.push_epoch] = set(opens)
                self.pod_epoch.update(dict.fromkeys(opens, self.push_epoch))
            self._resume_together(chosen)
            if chosen:
                self._mark("first step")
                if any(d.step == Step.RESUME for d in chosen.values()):
                    self._mark("first resume")
            for pod, decision in chosen.items():
                task = self.inflight[pod] = asyncio.create_task(self._step(pod, decision))
                task.add_done_callback(functools.partial(self._step_ended, pod))
            self._route_out_together(chosen)  # after the steps: the pauses are sent first
            if chosen:  # the status shows the steps started (a chain runs long before its first answer)
                await self._write_status()
                self._schedule_fleet_status()
            if self.restarted and not self.inflight:
                # Restarted pods come back on the initial weights, as new pods: the next pass lists them.
                await self._write_status(force=True)
                return PassOutcome(again=True, idle=False)
            poll = staging.poll_seconds(self.decisions, self.states) if self.goal.stages else None
            if not self.inflight:
                if poll is not None:
                    # Engines stage while they serve: read them again about when the soonest should be done.
                    await self._write_status()
                    await asyncio.sleep(poll)
                    self._stage_due()
                    if self.interrupted() or (self.rev is not None and self.rev.deleted):
                        await self._write_status(force=True)
                        return PassOutcome(again=True, idle=False)
                    continue
                await self._write_status(force=True)
                waited = await self._wait_for_marks()
                if waited is None:
                    self._log_held()
                    return PassOutcome(again=False, idle=False)
                if waited:
                    continue  # the trainer marked: go on from what is known, without a new pass
                return PassOutcome(again=True, idle=False)  # read the engines again now (session ages)
            mark = time.monotonic()
            quiet = self._quiet_left()
            if quiet > 0:  # wake when the quiet moment ends: the progress it held back is written then
                poll = quiet if poll is None else min(poll, quiet)
            if not self.ended:
                # Each step's task reports its own end (``_step_ended``), not asyncio.wait over all of them:
                # that adds and removes a callback on every task in flight per call (1,024 pods: 3.7 % of the
                # operator's CPU, issue 18). Only the pods reported are taken: a task seen done before its
                # report arrived would wake the loop once more for nothing.
                await waits.event_set(self.step_done, poll)
            if self.ended:
                await self._gather_ends()
            else:
                self._stage_due()
            ended, self.ended = self.ended, []
            self.step_done.clear()
            for pod in ended:
                self.inflight.pop(pod).result()  # _step handles step errors; anything else is a bug: raise
            self.timing["steps"] += time.monotonic() - mark
            mark = time.monotonic()
            await self._write_status()
            self._schedule_fleet_status()
            self.timing["status"] += time.monotonic() - mark
            if self.interrupted() or (self.rev is not None and self.rev.deleted):
                await self._drain()
                await self._write_status(force=True)
                return PassOutcome(again=True, idle=False)

    async def _gather_ends(self) -> None:
        """After a step's end, the ends that follow it within ``STEP_ENDS_GATHER_SECONDS``: decided together in
        one iteration. Not waited for once every step in flight has ended (the barrier's last pod goes on at
        once); a revision superseded or deleted meanwhile is seen at the next end or when the window closes."""
        until = time.monotonic() + STEP_ENDS_GATHER_SECONDS
        while len(self.ended) < len(self.inflight) and not self.interrupted():
            left = until - time.monotonic()
            if left <= 0:
                return
            self.step_done.clear()
            if not await waits.event_set(self.step_done, left):
                return

    def _log_held(self) -> None:
        """Say what ends a pass with nothing to run: the next pass reads every engine again after
        ``revision_loop.WAITING_SECONDS``, so at a thousand pods one unreachable engine costs a whole-fleet read."""
        held = collections.Counter(d.step.value for d in self.decisions.values() if d.step is not Step.DONE)
        first = next((p for p in self.order if self.decisions.get(p, UNDECIDED).step is not Step.DONE), None)
        log.info(
            "pass %s: nothing to run; pods not done by step: %s (first: %s, %s)",
            self.key,
            dict(held),
            first,
            self.decisions[first].reason if first is not None and first in self.decisions else "-",
        )

    async def _wait_for_marks(self) -> bool | None:
        """Sessions wait for the trainer and nothing else is to do: wait here for its mark, which the
        watch hands over (``FleetMemory.kick_marks``), instead of ending the pass and reading the fleet
        again. True: marks came; False: not within ``MARKS_WAIT_SECONDS``, or another change ended the
        wait; None: this pass does not wait for marks."""
        if not (self.memory.marks_delivered and self.goal.pushed and self.rev is not None):
            return None
        if not any(
            self.decisions.get(p, UNDECIDED).step == Step.AWAIT_PUSH
            and (state := self.states.get(p)) is not None
            and state.session is not None
            for p in self.order
        ):
            return None
        self._schedule_fleet_status()
        if not await waits.event_set(self.memory.kick, MARKS_WAIT_SECONDS):
            return False
        return self.memory.marks_only

    def _take_marks(self) -> None:
        """Apply the trainer's marks the watch delivered for this revision (a marks-only kick)."""
        if not (self.memory.kick.is_set() and self.memory.marks_only) or self.rev is None:
            return
        marks = self.memory.marks.get(self.rev.name)
        self.memory.clear_kick()
        if marks is None or self.sel.goal is None:
            return
        self.rev.body = push.with_marks(self.rev.body, marks)
        self.goal = push.goal_with_marks(
            self.sel.goal,
            self.spec,
            self.rev,
            rolling_back=self.sel.rolling_back,
            group=self.group,
            rendezvous_expired=self.goal.push.rendezvous_expired,
        )
        self.changed |= set(self.order)

    async def _announce_target(self) -> None:
        """Without an active revision, ``targetRevision`` says whether pods are moving to what is served
        (a replaced pod caught up, a cancelled revision's pods moved back): set while any pod is not there."""
        if self.rev is not None:
            return
        moving = any(d.step != Step.DONE for d in self.decisions.values()) or bool(self.pods.starting)
        await writes.patch_fleet(self.ctx, self.fleet_body, {"targetRevision": self.goal.revision if moving else None})

    async def _drain(self) -> None:
        """Let the steps still running finish (a step is never abandoned half way by the pass), showing in
        the fleet's status what each one did as it ends: one slow step must not hold back the others'."""
        while self.inflight:
            await asyncio.wait(self.inflight.values(), return_when=asyncio.FIRST_COMPLETED)
            for pod in [p for p, task in self.inflight.items() if task.done()]:
                self.inflight.pop(pod).result()  # _step handles step errors; anything else is a bug: raise
            self._schedule_fleet_status()

    async def _observe(self) -> set[str]:
        """Read the engines whose state is not known from an acknowledgement; decide every pod's step.

        Returns the pods read. A step's success is an observation too (``transaction.acknowledged``), so
        after the first read only pods that failed, or that are about to resume or be called done, are read.
        """
        read = self._to_read()
        states = self._take_first_read(read)
        if states is None:
            states = await self._read(read)
        for pod, state in zip(read, states, strict=True):
            self._set_state(pod, state)
            if pod not in self.inflight:  # read after its open returned: what the engine holds is known
                self._confirm(pod)
        self.reads += len(read)
        self.stale.difference_update(read)
        self.changed.update(read)
        now = time.monotonic()
        self._mark_group(now)
        if self.tally is None or self.tally.goal is not self.goal:  # counted over the fleet once per goal
            self.tally = verification.DigestTally(self.goal, self.states)
        goal = self.tally.goal_with_references()
        # Decide again only where something changed (a read, a finished step), unless the reference
        # digests moved: then every settled pod's verdict may have.
        again = self.order if goal != self.decided_goal else [p for p in self.changed if p in self.rank]
        self.decided_goal = goal
        for pod in again:
            if pod in self.inflight or pod not in self.states:
                continue  # its decision is the step it is running
            self.changed.discard(pod)
            decision = self._decide(pod, goal, now)
            self._set_decision(pod, decision)
            if decision.step is not Step.DONE:
                self._open_at_barrier(pod, decision)
        for pod in read:
            self._record_staging(pod)
        # (The fleet status gets the states when it is written, ``_remember_states``: copying them for it at
        # every iteration was a tenth of the operator's CPU at 1,024 pods, Rolling.)
        return set(read)

    def _set_decision(self, pod: str, decision: Decision) -> None:
        """The one place a pod's decision is set: the tally (and with it the Done set) follows."""
        self.by_step.move(pod, self.decisions.get(pod), decision)
        self.decisions[pod] = decision

    def _to_read(self) -> list[str]:
        """The pods whose state must be read now, in the fleet's order."""
        return sorted((p for p in self.stale if p not in self.inflight and p in self.rank), key=self.rank.__getitem__)

    async def _read(self, pods: list[str]) -> list[engine.EngineState]:
        return await fanout.bounded((self.clients[p].observe() for p in pods), READ_CONCURRENCY)

    def _take_first_read(self, pods: list[str]) -> list[engine.EngineState] | None:
        """The answers of the read made with the pre-flight when it read exactly ``pods`` (None: read now)."""
        first, self.first_read = self.first_read, None
        if first is None or first[0] != pods:
            return None
        return first[1]

    async def _still_ready(self, pod: str) -> bool:
        """Resume only on what the engine says now, not on acknowledgements. Where the engine takes sequences
        the resume's own guard checks it in the same request (``executor``); elsewhere the executor calls
        this first: read the engine (``recheck``: its process and what the extension holds) inside the
        resume's own step, so every pod of a fleet resumed together is read in parallel with the others'
        resumes instead of in one read round after the barrier opened. A pod that is not ready any more is
        decided again from a full read."""
        state = await self.clients[pod].recheck(self.states[pod])
        self._set_state(pod, state)
        self.reads += 1
        self._record_staging(pod)
        if transaction.next_step(self.decided_goal or self.goal, state).step != Step.RESUME:
            self.stale.add(pod)
            return False
        self.verified.add(pod)
        return True

    def _set_state(self, pod: str, state: engine.EngineState) -> None:
        """What the engine holds now (read, or acknowledged); its votes for the reference digests with it."""
        if self.tally is not None and self.tally.goal is self.goal:
            self.tally.update(pod, state)
        self.states[pod] = state
        self.chains.pop(pod, None)

    def _record_staging(self, pod: str) -> None:
        """What the pod's staging came to, from what its engine was just read holding (the status shows it)."""
        recorded = staging.outcome(self.goal, self.states[pod], self.staging.get(pod))
        if recorded is not None:
            self.staging[pod] = recorded

    def _stage_due(self) -> None:
        """Read the staging engines again (their stage progressed while the pass waited)."""
        self.stale |= {p for p, d in self.decisions.items() if d.step == Step.AWAIT_STAGE and p not in self.inflight}

    def _mark_group(self, now: float) -> None:
        """NCCL: choose the transfer group once every pod was read, then keep the goal's push rules in step
        with it (the trainer's rendezvous for its epoch, and whether pods waited for it past the deadline)."""
        if not self.goal.pushed or self.rev is None or self.sel.rolling_back:
            return  # no sessions are opened (push.marks): no group either
        if self.group is None:
            if any(p not in self.states for p in self.order):
                return
            recorded = self.rev.status.push.group if self.rev.status.push is not None else None
            wants_new = push.new_group_requested(self.rev)
            self.group = push.transfer_group(self.spec, self.order, recorded, self.states, new_requested=wants_new)
            if self.group is None:
                return
        waited = now - self.memory.started.get(self.key, now)
        expired = waited >= float(self.spec.update_strategy.timeouts.push_seconds)
        if self.goal.push.group_epoch != self.group.epoch or self.goal.push.rendezvous_expired != expired:
            assert self.sel.goal is not None
            self.goal = push.goal_with_marks(
                self.sel.goal, self.spec, self.rev, rolling_back=False, group=self.group, rendezvous_expired=expired
            )

    def _decide(self, pod: str, goal: Goal, now: float) -> Decision:
        """The pod's next step, counting verdicts that are failures (they are read again next pass)."""
        state = self.states[pod]
        decision = transaction.next_step(goal, state)
        if decision.step == Step.UNREACHABLE:
            since = self.memory.unreachable_since.setdefault(pod, now)
            if self._pushing() and now - since >= self.spec.update_strategy.timeouts.push_seconds:
                # A sender that dies mid-send leaves vLLM blocked in the transfer with no timeout of its own
                # (DESIGN §4b), and every later call (our state read too) queues behind it: only a new
                # process ends it. The pod is out of service already; after the push deadline, restart it.
                return Decision(
                    Step.RESTART_POD,
                    f"the engine has not answered for {now - since:.0f}s during a push ({decision.reason}): "
                    "a blocked transfer only ends with the process",
                )
            if now - since > self.spec.update_strategy.timeouts.wake_seconds:
                self._fail(pod, "EngineUnreachable", decision.reason)
                self.memory.unreachable_since[pod] = now
            return decision
        self.memory.unreachable_since.pop(pod, None)
        if decision.step == Step.ENGINE_ERROR:
            # Not a network blip: a refused token, a malformed answer or an extension error is a failed
            # attempt with its own reason (and shows as such), not a wait for the network.
            assert state.fault is not None
            self._fail(pod, FAULT_REASONS.get(state.fault, "EngineError"), decision.reason)
        elif decision.step == Step.ENGINE_MISMATCH:
            self._fail(pod, "EngineMismatch", decision.reason)
        elif decision.step == Step.NO_RENDEZVOUS:
            self._fail(pod, "NoRendezvous", decision.reason)
        elif decision.step == Step.STAGE_FAILED:
            # The checkpoint could not be staged (the pod still serves): a failed attempt, retried by staging
            # again; past maxRetries the revision fails with no pod touched.
            self._fail(pod, "StageFailed", decision.reason)
            decision = Decision(Step.STAGE, decision.reason)
        elif decision.step == Step.STAGE_MISMATCH:
            # Staged bytes that do not verify are never committed: release them, then stage again.
            self._fail(pod, "StagedDigestMismatch", decision.reason)
            decision = Decision(Step.UNSTAGE, decision.reason)
        elif decision.step == Step.VERIFY_FAILED:
            # A mismatching digest is a failed attempt; the retry reloads the offending target.
            self._fail(pod, "VerifyFailed", decision.reason)
            target = Step.LOAD_VERIFIER if decision.reason.startswith("verifier") else Step.LOAD_DRAFT
            if decision.reason.startswith("frozen"):
                target = Step.RESTORE_DRAFT
            decision = Decision(target, decision.reason)
        return decision

    def _pushing(self) -> bool:
        """This pass moves pods to or from pushed weights (a push, or the rollback of one): an engine that
        stops answering may be blocked inside a transfer."""
        spec = self.rev.spec if self.rev is not None else None
        pushed_rev = spec is not None and (spec.verifier.pushed or (spec.draft is not None and spec.draft.pushed))
        return self.spec.weight_transfer is not None and (self.goal.pushed or pushed_rev)

    def _probe_spec(self) -> ParityProbe | None:
        if self.rev is None or self.rev.spec is None or self.sel.rolling_back:
            return None
        return self.rev.spec.parity_probe

    def _probe_gate_open(self) -> bool:
        return self._probe_spec() is None or self.memory.probe_passed.get(self.key, False)

    async def _parity_probe(self) -> None:
        """Once every canary serves the revision, check its processed logprobs against the trainer's."""
        spec = self._probe_spec()
        canaries = self.order[: self.plan.canary]
        if spec is None or self._probe_gate_open() or not canaries:
            return
        if not all(self.decisions.get(p, UNDECIDED).step == Step.DONE for p in canaries):
            return
        deadline = float(self.spec.update_strategy.timeouts.verify_seconds)
        self.probe_result, verdicts = await probe.run(spec, canaries, self.clients, deadline)
        if self.probe_result.passed:
            self.memory.probe_passed[self.key] = True
            return
        for verdict in verdicts:
            if verdict.why is None:
                continue
            if verdict.engine_error:
                self._fail(verdict.pod, "ParityProbeUnanswered", verdict.why)  # retried within maxRetries
            else:
                # A logprob mismatch is a property of the weights: no retry, the revision rolls back.
                self.memory.attempts[(self.key, verdict.pod)] = self.plan.max_retries
                self._fail(verdict.pod, "ParityProbeFailed", verdict.why)

    def _remember_states(self) -> None:
        """Hand the engine observations and the pods' steps to the fleet status (``reconcile.fleet``), with the
        pods they came from: before each of the pass's fleet-status writes and at its end, so a fleet-status
        write in between (the fleet's own handler) shows what the last one showed, never older."""
        if self.incarnations is None:  # read once: the pass's pods are the ones listed when it began
            self.incarnations = {p: pod_readiness.incarnation(b) for p, b in self.pods.bodies.items()}
        incarnations = self.incarnations
        states = {p: self.states[p] for p in self.order if p in self.states}
        states.update(self.chains)
        self.memory.remember(states, incarnations)
        self.memory.steps = {p: d.step.value for p, d in self.decisions.items()}

    def _step_ended(self, pod: str, _task: asyncio.Task[None]) -> None:
        # Whatever happened, its next decision is derived again. Added here, not when the step starts: a pod
        # in flight in ``changed`` was walked past by every ``_observe`` until its step ended (2 % of the CPU,
        # 1,024 pods, issue 18).
        self.changed.add(pod)
        self.ended.append(pod)
        self.step_done.set()
        self._mark("last step ended", again=True)

    def _all_done(self) -> bool:
        if self.pods.starting or len(self.order) < self.spec.replicas:
            return False
        # Asked at every iteration; the pod found not done last time usually still is, so it is tried before the
        # fleet is walked again (the walk was 1.9 % of the CPU at 1,024 pods, issue 18). Only a walk says True.
        hint = self._undone_hint
        if hint is not None and self.decisions.get(hint, UNDECIDED).step != Step.DONE:
            return False
        # From the hint on, then from the start: pods end in roughly the fleet's order, so the walk is short.
        start = self.rank[hint] if hint is not None else 0
        decisions, order = self.decisions, self.order
        self._undone_hint = next(
            (p for p in itertools.chain(order[start:], order[:start]) if decisions.get(p, UNDECIDED).step != Step.DONE),
            None,
        )
        return self._undone_hint is None

    def _complete(self) -> bool:
        """Every pod done and admitted (``None``: an engine image without admission, routed by its gate)."""
        return self._all_done() and all(self.states[p].admitted is not False for p in self.order)

    def _attempts(self, pod: str) -> int:
        return self.memory.attempts.get((self.key, pod), 0)

    def _failed(self) -> dict[str, int]:
        """The attempts of this revision's pods that failed a step: few, where the fleet is many."""
        return {p: n for (key, p), n in self.memory.attempts.items() if key == self.key}

    def _fail(self, pod: str, reason: str, message: str) -> None:
        self.memory.attempts[(self.key, pod)] = self._attempts(pod) + 1
        self.messages[pod] = f"{reason}: {message}"
        self.reasons[pod] = reason
        step = self.decisions.get(pod, UNDECIDED).step.value
        self.ctx.metrics.update_failures.labels(*self.fleet_labels, step, reason).inc()

    def _exhausted(self) -> list[str]:
        # Over the pods that failed (few), not the fleet: this runs at every iteration.
        failed = {p for p, n in self._failed().items() if n > self.plan.max_retries}
        return [p for p in self.order if p in failed] if failed else []

    async def _step(self, pod: str, decision: Decision) -> None:
        limit: asyncio.Semaphore | contextlib.nullcontext[None] = contextlib.nullcontext()
        if self.loads is not None and decision.step in transaction.LOAD_STEPS:
            limit = self.loads
        timeouts = self.spec.update_strategy.timeouts
        if decision.step == Step.PAUSE and pod not in self.routed_out:
            # Out of the Service first: new requests go to pods that keep serving while this one moves.
            await self._route(pod, False, "Updating", f"moving to revision {self.goal.revision}", pausing=True)
        self.routed_out.discard(pod)
        if decision.step == Step.RESTART_POD:
            await self._restart(pod, decision.reason)
            return
        membership = push.membership(self.group, pod)
        read_first: list[bool] = []  # whether a call-by-call resume read the engine first (``_still_ready``)
        opened_early = decision.step == Step.RESUME and pod in self.opened_early

        async def ready() -> bool:
            read_first.append(True)
            return await self._still_ready(pod)

        session = executor.SessionContext(
            epoch=self.pod_epoch.get(pod, 0),
            session=self.states[pod].session,
            init_info=push.init_info(self.spec, membership, self.goal.push.rendezvous),
            why=decision.reason,
            group=membership,
            known=self.states[pod],
            ready=ready,
        )
        # The steps that follow this one for certain go in the same request (``transaction.chain``): each
        # round trip inside a pause is time out of service, and each request the operator's CPU. Loads stay
        # one per step where the fleet limits them (``self.loads`` counts load steps).
        unlimited = self.plan.max_concurrent_loads is None
        # A Rolling pod's resume waits for no other pod: it follows its loads in their request, behind a check
        # that the engine holds the digests the revision names (``transaction.chain``, ``executor``): one request
        # and one iteration of this loop per pod fewer, and no round trip through the operator out of service.
        through = (
            self.plan.rollout == RolloutType.ROLLING
            and transaction.resumes_on_check(self.goal)
            and self.clients[pod].chains_resume
        )
        steps = transaction.chain(
            self.decided_goal or self.goal, self.states[pod], decision.step, loads=unlimited, through_resume=through
        )
        if len(steps) > 1:  # the status shows the step that takes the time (a load, a commit)
            self._set_decision(pod, Decision(transaction.shown_step(steps), decision.reason))
            # And what the engine holds meanwhile: a level-2 sleep released the weights it served before the
            # load began (the smoke soak saw a pod reported on them for 3.2 s under a slow load).
            self.chains[pod] = transaction.as_step_starts(self.decided_goal or self.goal, self.states[pod], steps)
        try:
            async with limit:
                done = await executor.execute_chain(self.clients[pod], steps, self.goal, timeouts, session)
        except executor.Held as held:
            # Resume only on what the engine says now: it changed since the decision (its guard, or the
            # read before a call-by-call resume, said so), so it is decided again from a full read.
            log.info("pod %s: not resumed: %s; reading it again", pod, held)
            self._leave_batch(pod)
            self.stale.add(pod)
            await self._close_unresumed(pod, opened_early, f"not resumed: {held}")
            return
        except executor.StepError as exc:
            self._leave_batch(pod)
            self._confirm(pod)  # a failed open: this pod has no session of the epoch to wait for
            self._set_decision(pod, Decision(exc.step, decision.reason))  # the step of a chain that failed
            self._fail(pod, exc.reason, str(exc))
            if decision.step in (Step.END_SESSION, Step.ABANDON_SESSION) and session.session is not None:
                outcome = "abandoned" if decision.step == Step.ABANDON_SESSION else "failed"
                self._count_session(session.session.target.value, outcome)
            self.stale.add(pod)  # after a failure, only the engine can say where it is
            self.verified.discard(pod)
            log.warning("pod %s: %s", pod, exc)
            await self._close_unresumed(pod, opened_early, f"{exc.reason}: {exc}")
            await asyncio.sleep(min(2.0, 0.1 * 2 ** self._attempts(pod)))  # back off before the retry
            return
        finally:
            self.pod_epoch.pop(pod, None)
        if decision.step in push.OPEN_STEPS:
            # The session's epoch and clock are the engine's: read them back. Its epoch stays unpublished
            # until then (``_confirm``): a status listing it without this pod would let the trainer mark
            # the epoch, and this session would then be ended with nothing received.
            self.stale.add(pod)
        for each in done:
            await self._acknowledge(pod, each, membership, read_first)

    async def _acknowledge(
        self, pod: str, done: executor.Done, membership: engine.GroupMembership | None, read_first: list[bool]
    ) -> None:
        """What one step that succeeded tells of the engine (its acknowledgement), its timing, and a resume's
        return to the Service."""
        step, result = done.step, done.result
        load = result if isinstance(result, engine.LoadResult) else None
        stage = result if isinstance(result, engine.StageState) else None
        if step == Step.END_SESSION and load is not None:
            self._count_session(load.target.value, "verified")
        if isinstance(result, tuple):  # a commit of both targets in one request: each acknowledged in turn
            for each in result:
                commit = Step.COMMIT_VERIFIER if each.target == engine.Target.VERIFIER else Step.COMMIT_DRAFT
                self._set_state(pod, transaction.acknowledged(self.states[pod], commit, self.goal, each))
        else:
            self._set_state(
                pod, transaction.acknowledged(self.states[pod], step, self.goal, load, membership, stage=stage)
            )
        # A step's answer is an observation of the stage too (a stage answers its phase, over budget at once;
        # the last commit releases it): what staging came to is known without waiting for the next read.
        self._record_staging(pod)
        if step == Step.RESUME:
            self._mark("last resume answered", again=True)
            if isinstance(result, executor.Resumed) and result.admitted is not None:
                # The resume's request admitted the process too (``executor``): ``_route`` only opens the gate.
                self.states[pod] = self.states[pod].evolve(admitted=result.admitted)
            if not read_first:
                self.reads += 1  # the resume's guard read what the engine holds, in the same request
            self.opened_early.discard(pod)  # opened and now resumed: its gate is what it serves
            self.verified.add(pod)
            await self._resumed_together(pod)
            await self._route(pod, True, "Serving", f"serves revision {self.goal.revision}, verified")
        if done.seconds is None:
            return
        self.memory.durations.setdefault(self.key, {}).setdefault(step.value, []).append(done.seconds)
        self.ctx.metrics.step_durations(*self.fleet_labels, step.value, self.plan.mode.value).observe(done.seconds)

    def _count_session(self, target: str, outcome: str) -> None:
        self.ctx.metrics.push_sessions.labels(*self.fleet_labels, target, outcome).inc()

    def _confirm(self, pod: str) -> None:
        """The pod's session (or its failed open) is known: its epoch is complete once every pod of it is."""
        for epoch in [e for e, pods in self.opening.items() if pod in pods]:
            self.opening[epoch].discard(pod)
            if not self.opening[epoch]:
                del self.opening[epoch]

    async def _restart(self, pod: str, why: str) -> None:
        """Delete the pod whose target a failed session destroyed (only a new engine process repairs it)."""
        body = self.pods.bodies.get(pod)
        if body is None:
            return
        namespace = str(body["metadata"]["namespace"])
        try:
            await self.ctx.kube.delete("v1", "Pod", namespace, pod)
        except KubeError as exc:
            self._fail(pod, "RestartFailed", f"could not delete the pod: {exc}")
            return
        self.restarted.add(pod)
        self.ctx.metrics.pods_restarted.labels(*self.fleet_labels).inc()
        log.warning("pod %s restarted: %s", pod, why)
        pod_ref = {"apiVersion": "v1", "kind": "Pod", "metadata": body["metadata"]}  # list items carry neither
        await self.ctx.kube.event(pod_ref, "Warning", "EngineRestarted", f"{why}; the pod is recreated and caught up")

    def _route_out_together(self, chosen: dict[str, Decision]) -> None:
        """AllAtOnce: every pod about to pause leaves the Service beside its pause, not before it.

        Rolling closes a pod's gate before it pauses so that new requests go to the pods still serving. An
        AllAtOnce fleet leaves as one: there is no pod to send them to, and the pause's own request withdraws
        the engine (its readiness probe fails) and holds what reaches it until the resume. Waiting for the
        fleet's gate writes first kept every engine serving for as long as they took, and the rollout that
        much longer: 1,024 patches took 10.9 s on 2 cores (bench/results/rollout_overhead.md).
        """
        pauses = [p for p, d in chosen.items() if d.step == Step.PAUSE and p not in self.routed_out]
        if self.plan.rollout != RolloutType.ALL_AT_ONCE or len(pauses) < 2:
            return
        why = f"moving to revision {self.goal.revision}"
        for pod in pauses:
            self._gate_beside(pod, False, "Updating", why)
        self.routed_out.update(pauses)
        self.paused_since = time.monotonic()

    def _open_at_barrier(self, pod: str, decision: Decision) -> None:
        """AllAtOnce, an engine with admission: the pod's gate opens as soon as it waits to resume on verified
        weights, so that the fleet's gate writes overlap the barrier and the resumes instead of following
        them (1,024 of them took 1.1 s on 16 cores, bench/results/rollout_overhead.md); closed again at once
        if its decision moves elsewhere (a resume that fails closes it in ``_step``).

        The gate then says what it means, weights ready: the pod holds the revision's pair, verified. The
        engine's admission keeps it out of the Service until it serves them: the pause withdrew it, and only
        the resume's own request admits it again, after the engine resumed on what its guard checked
        (``reconcile.executor``); a pod is Ready only with both. An engine without admission has only the
        gate, which then opens after the resume, as in Rolling.
        """
        if decision.step is Step.RESUME:
            state = self.states.get(pod)
            if (
                pod not in self.opened_early
                and self.plan.rollout == RolloutType.ALL_AT_ONCE
                and len(self.order) > 1
                and state is not None
                and state.admitted is not None
            ):
                self.opened_early.add(pod)
                self._gate_beside(pod, True, "Serving", f"serves revision {self.goal.revision}, verified")
        elif pod in self.opened_early:
            self.opened_early.discard(pod)
            self._gate_beside(pod, False, "NotServingFleetWeights", decision.reason or "not at the goal")

    async def _close_unresumed(self, pod: str, opened_early: bool, why: str) -> None:
        """A resume that did not happen: a gate opened at the barrier closes at once, not when the pod is next
        decided (a retried resume is decided Resume again, and would keep it open meanwhile)."""
        if opened_early:
            self.opened_early.discard(pod)
            await self._route(pod, False, "NotServingFleetWeights", why)

    def _gate_beside(self, pod: str, value: bool, reason: str, message: str) -> None:
        """Write the pod's gate without waiting for it; the pod's next ``_route`` waits for this write."""
        body, previous = self.pods.bodies.get(pod), self.gate_writes.get(pod)
        if body is None:
            return

        async def write() -> None:
            if previous is not None:
                await previous
            try:
                await gates.set_gate(self.ctx, body, value, reason, message)
            except KubeError as exc:  # the pod's next routing, or the end-of-pass sync, writes it again
                log.warning("pod %s: readiness gate not written: %s", pod, exc)

        self.gate_writes[pod] = asyncio.create_task(write())

    def _resume_together(self, chosen: dict[str, Decision]) -> None:
        """AllAtOnce: pods resumed together are routed back into the Service once all of them resumed.

        Engines with admission have their gates open already (``_open_at_barrier``):
        for them this only orders the step ends. On images without admission the gate opens after the
        resume, and the first pods' gate writes would otherwise compete with the later pods' resumes for the
        operator's (and the API server's) CPU and spread the fleet's resume, the end of its out-of-service
        window.
        """
        resumes = [p for p, d in chosen.items() if d.step == Step.RESUME]
        if self.plan.rollout != RolloutType.ALL_AT_ONCE or len(resumes) < 2:
            return
        batch = _Batch(set(resumes))
        for pod in resumes:
            self.resume_batch[pod] = batch

    async def _resumed_together(self, pod: str) -> None:
        """Wait (bounded) until every pod of this pod's resume batch resumed or failed to."""
        batch = self._leave_batch(pod)
        if batch is not None:
            await waits.event_set(batch.done, RESUME_BATCH_SECONDS)

    def _leave_batch(self, pod: str) -> _Batch | None:
        """The pod's resume is over (done or failed): the others of its batch no longer wait for it."""
        batch = self.resume_batch.pop(pod, None)
        if batch is not None:
            batch.pending.discard(pod)
            if not batch.pending:
                batch.done.set()
                self.paused_since = None
        return batch

    def _quiet_left(self) -> float:
        """Seconds until the quiet moment of a fleet paused together ends (0: not quiet): progress writes wait
        until then (``WINDOW_QUIET_SECONDS``)."""
        if self.paused_since is None:
            return 0.0
        return max(0.0, WINDOW_QUIET_SECONDS - (time.monotonic() - self.paused_since))

    async def _route(self, pod: str, value: bool, reason: str, message: str, *, pausing: bool = False) -> None:
        """Open or close the pod to traffic (its gate and its engine's admission: ``reconcile.gates``).
        ``pausing``: the gate only; the pause step withdraws the engine in the same request as the pause."""
        pending = self.gate_writes.pop(pod, None)
        if pending is not None:
            await pending
        body, state = self.pods.bodies.get(pod), self.states.get(pod)
        if body is None or state is None:
            return
        client = self.clients[pod]
        try:
            if value:
                state = await gates.open_for(self.ctx, body, client, state, reason, message)
            else:
                state = await gates.close_for(self.ctx, body, client, state, reason, message, withdraw=not pausing)
            self.states[pod] = state
        except KubeError as exc:  # the end-of-pass sync writes it again
            log.warning("pod %s: readiness gate not written: %s", pod, exc)

    async def _sync_gates(self) -> None:
        """Every pod's gate from what its engine was last seen doing (only differences are written)."""
        goals = [g for g in (self.goal, self.kept) if g is not None]
        if self.sel.rolling_back:
            goals = [self.goal]  # the revision failed: only what the fleet served before may serve
        moves = []
        for pod in self.order:
            state = self.states.get(pod)
            if state is None or pod in self.inflight:
                continue
            # A fleet still on its initial weights keeps them behind the Service until a pod moves.
            value = gates.serves(state, goals) or (self.sel.served is None and gates.serves_initial(state, self.goal))
            reason, message = (
                ("Serving", f"serves revision {state.verifier.revision}, verified")
                if value
                else (
                    "NotServingFleetWeights",
                    self.messages.get(pod) or self.decisions.get(pod, UNDECIDED).reason or "not at the goal",
                )
            )
            moves.append(self._route(pod, value, reason, message))
        await asyncio.gather(*moves)  # every pod at once: a pod whose gate is right costs nothing

    async def _write_status(self, force: bool = False) -> None:
        """Progress writes run beside the steps (never on the rollout's critical path); forced ones wait."""
        writer = self.writer
        if not force and self._quiet_left() > 0:
            return  # the next step that finishes after the quiet moment writes what is known then
        if not force:
            interval = max(STATUS_WRITE_INTERVAL, len(self.order) / PROGRESS_PODS_PER_SECOND)
            if (writer is not None and not writer.done()) or time.monotonic() - self.last_write < interval:
                return
            self.writer = asyncio.create_task(self._write_in_background())
            return
        if writer is not None:
            await asyncio.gather(writer, return_exceptions=True)
        await self._write_now()

    async def _write_in_background(self) -> None:
        try:
            await self._write_now()
        except Exception as exc:  # the next write (or the forced one at the end) carries the same truth
            log.warning("progress status write failed: %s", exc)

    async def _write_now(self) -> None:
        new = self._progress()
        if new is not None and self.rev is not None:
            await writes.write_revision(self.ctx, self.rev, new)

    def _progress(self) -> WeightRevisionStatus | None:
        """The revision's status as this pass knows it now (None without a revision), and the fleet's gauges."""
        self.last_write = time.monotonic()
        counts: dict[int | None, int] = {}
        for state in self.states.values():
            counts[state.verifier.revision] = counts.get(state.verifier.revision, 0) + 1
        meta = self.fleet_body["metadata"]
        gauge = self.ctx.metrics.pods_at_revision
        for rev_number, n in counts.items():
            gauge.labels(meta["namespace"], meta["name"], str(rev_number)).set(n)
        # A revision no pod holds any more leaves the gauge: one label set per revision ever rolled would
        # grow the operator's memory (and every scrape) for as long as it runs.
        for gone in self.memory.revision_labels - {str(r) for r in counts}:
            with contextlib.suppress(KeyError):
                gauge.remove(meta["namespace"], meta["name"], gone)
        self.memory.revision_labels = {str(r) for r in counts}
        if self.goal.pushed:
            for target in ("verifier", "draft"):
                open_now = sum(1 for s in self.states.values() if s.session and s.session.target.value == target)
                self.ctx.metrics.push_sessions_open.labels(*self.fleet_labels, target).set(open_now)
        if self.rev is None:
            return None
        new = revision_status.progressing(
            self.rev.status,
            goal=self.goal,
            order=self.order,
            states=self.states,
            decisions=self.decisions,
            attempts=self._failed(),  # (not a lookup per pod of the fleet at every progress write)
            messages=self.messages,
            durations=self.memory.durations.get(self.key, {}),
            total=max(self.spec.replicas, len(self.order)),
            rolling_back=self.sel.rolling_back,
            generation=writes.generation(self.rev.body),
            staging=self.staging if self.goal.stages else None,
            staging_status=staging.status(self.goal, self.staging, self.states),
            timings_memo=self.timings_memo,
        )
        if self.probe_result is not None:
            new = new.model_copy(update={"parity_probe": self.probe_result})
        if self.goal.pushed:
            new = revision_status.with_push(
                new,
                epoch=max((e for e in [self.push_epoch] if e not in self.opening), default=0),
                sessions=push.published_sessions(self.states, self.opening, self.pods.bodies, self.spec.port),
                generation=writes.generation(self.rev.body),
                group=None if self.group is None else push.with_formed(self.group, self.order, self.states),
            )
        return new

    async def _last_progress(self) -> WeightRevisionStatus | None:
        """The progress a final phase is written over, in the same request: one write instead of a forced
        progress write and then the phase's (at 1,024 pods each write of the revision is one more round trip
        between the last resume and Succeeded, issue 18). A progress write still running is waited for first:
        landing after the final one, it would set the phase back to Progressing."""
        if self.writer is not None:
            await asyncio.gather(self.writer, return_exceptions=True)
        return self._progress()

    def _schedule_fleet_status(self) -> None:
        """Show the engines' progress in the fleet's status.pods while the pass runs.

        At most one write per ``FLEET_STATUS_INTERVAL`` (longer for a large fleet: ``FLEET_STATUS_PODS_PER_SECOND``),
        and a change inside the interval is deferred, not dropped: a step that then runs for long (a slow
        load) must not leave the status behind meanwhile.
        """
        if self.fleet_writer is None or self.fleet_writer.done():
            self.fleet_writer = asyncio.create_task(self._fleet_status_soon())

    async def _stop_fleet_writer(self) -> None:
        """Cancel the fleet status write scheduled during the pass: the pass's caller writes it next. Done
        before the final writes too: at 1,024 pods a refresh building every pod's entry then took the event loop
        from under them (1.1 s between the revision's existence check and the fleet's record on 2 cores)."""
        if self.fleet_writer is not None:
            self.fleet_writer.cancel()
            await asyncio.gather(self.fleet_writer, return_exceptions=True)

    async def _fleet_status_soon(self) -> None:
        interval = max(FLEET_STATUS_INTERVAL, len(self.pods.bodies) / FLEET_STATUS_PODS_PER_SECOND)
        wait = max(interval - (time.monotonic() - self.last_fleet_write), self._quiet_left())
        if wait > 0:
            await asyncio.sleep(wait)
        self.last_fleet_write = time.monotonic()
        # The states as known now (acknowledged steps included), not as when the write was scheduled.
        self._remember_states()
        namespace, name = self.fleet_labels
        try:
            await fleet_reconcile.refresh_status(self.ctx, namespace, name)
        except KubeError as exc:  # the write at the end of the pass carries the same truth
            log.info("fleet status not refreshed during the pass: %s", exc)

    def _served_now(self) -> revisions.Served:
        """What every pod serves now that the goal is complete (digests as the engines reported them)."""
        goal = self.decided_goal or self.goal
        states = [self.states[p] for p in self.order]
        verifier = goal.verifier_digest or next((s.verifier.digest for s in states if s.verifier.digest), None)
        draft_digest = goal.draft_digest
        if (goal.draft_path is not None or goal.draft_pushed) and draft_digest is None:
            draft_digest = next((s.draft.digest for s in states if s.draft is not None and s.draft.digest), None)
        return revisions.Served(
            revision=goal.revision,
            verifier_path=goal.verifier_path,
            verifier_digest=verifier,
            draft_path=goal.draft_path,
            draft_digest=draft_digest,
            name=self.rev.name if self.rev is not None else None,
            verifier_pushed=goal.verifier_pushed,
            draft_pushed=goal.draft_pushed,
        )

    async def _finish(self) -> PassOutcome:
        rev = self.rev
        if rev is None:
            await self._write_status(force=True)  # the gauges of what each pod holds
            self.found_at_rest = True
            return PassOutcome()
        elapsed = time.monotonic() - self.memory.started.pop(self.key, time.monotonic())
        if self.sel.rolling_back:
            # Past tense now that it is over (the message was written when the rollback began).
            message = (rev.status.message or "rolled back").replace("rolling back to", "rolled back to", 1)
            progress = await self._last_progress()
            await writes.finalize(self.ctx, rev, Phase.ROLLED_BACK, "RolledBack", message, warn=True, over=progress)
            self.ctx.metrics.rollout_duration.labels(*self.fleet_labels, "RolledBack").observe(elapsed)
            return PassOutcome(again=True, idle=False)
        if not await writes.still_exists(self.ctx, rev):
            # Deleted (a GitOps prune) while its pods moved: it is cancelled, never recorded as served; the
            # next pass returns every pod to what the fleet serves.
            return PassOutcome(again=True, idle=False)
        # The fleet's record moves first: a crash before the revision's own write leaves a revision that is
        # exactly what is served, which the next pass finishes without touching a pod.
        served = writes.served_wire(self._served_now(), revision_status.timestamp())
        progress = await self._last_progress()
        await writes.patch_fleet(
            self.ctx, self.fleet_body, {"currentRevision": rev.number, "targetRevision": None, "served": served}
        )
        self._mark("fleet recorded")
        await writes.finalize(
            self.ctx,
            rev,
            Phase.SUCCEEDED,
            "AllPodsUpdated",
            f"{len(self.order)}/{len(self.order)} pods serve revision {rev.number}, digests verified",
            over=progress,
        )
        self._mark("succeeded")
        self.ctx.metrics.rollout_duration.labels(*self.fleet_labels, "Succeeded").observe(elapsed)
        return PassOutcome(again=True, idle=False)

    async def _give_up(self, failed: list[str]) -> PassOutcome:
        rev = self.rev
        pod_failures = [
            PodFailure(
                name=pod,
                step=self.decisions[pod].step.value if pod in self.decisions else "Unknown",
                reason=self.reasons.get(pod, "Failed"),
                message=self.messages.get(pod, ""),
                attempts=self._attempts(pod),
            )
            for pod in self.order
            if pod in self.messages
        ]
        summary = failures.summarize(pod_failures, total=len(self.order))
        if rev is None:
            log.warning("pods failing to reach the served revision: %s", summary)
            return PassOutcome(again=False, idle=False)
        if self.goal.stages and not self.sel.rolling_back and staging.untouched(self.decisions):
            # Staging failed while every pod still served: nothing to roll back (docs/staging.md).
            await writes.finalize(
                self.ctx,
                rev,
                Phase.FAILED,
                "StagingFailed",
                f"staging, no pod touched: {summary}"[:1024],
                warn=True,
                failures=failures.bounded(pod_failures),
            )
            return PassOutcome(again=True, idle=False)
        if self.sel.rolling_back:
            message = f"rollback failed, pods left paused: {summary}"
            await writes.finalize(self.ctx, rev, Phase.FAILED, "RollbackFailed", message, warn=True)
            return PassOutcome(again=False, idle=False)
        if self.sel.served is not None and self.sel.served.pushed:
            message = (
                f"{summary}; no rollback: revision {self.sel.current_number} was pushed by the trainer and no path "
                "can bring it back; pods that moved stay out of service until the next revision"
            )
            await writes.finalize(
                self.ctx,
                rev,
                Phase.FAILED,
                "RollbackImpossible",
                message[:1024],
                warn=True,
                failures=failures.bounded(pod_failures),
            )
            return PassOutcome(again=False, idle=False)
        self.ctx.metrics.rollbacks.labels(*self.fleet_labels).inc(len(self.order))
        new = revision_status.rolling_back(
            rev.status,
            f"rolling back to revision {self.sel.current_number}: {summary}",
            writes.generation(rev.body),
            failures.bounded(pod_failures),
        )
        await writes.write_revision(self.ctx, rev, new)
        await self.ctx.kube.event(writes.wrev_ref(rev.body), "Warning", revisions.ROLLING_BACK, new.message or summary)
        for pod in self.order:  # the rollback gets its own retry budget
            self.memory.attempts.pop((self.key, pod), None)
        return PassOutcome(again=True, idle=False)
