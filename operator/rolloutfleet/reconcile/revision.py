"""``reconcile_revisions``: one pass of a fleet's weight-update loop.

Called by the per-fleet daemon in ``handlers.wiring`` (and by the crash/benchmark harnesses). A pass:
observe the fleet's WeightRevisions → select the goal (``planning.revisions``) → read every engine's state
→ decide each pod's next step (``planning.transaction``) → admit steps under the budget
(``planning.rollout``) → execute them (``executor``), each pod going on as soon as its own step finished
→ re-observe what must be, until every pod is at the goal, a barrier or budget makes it wait, a failure
changes the plan, or a newer revision interrupts. Statuses are written as it goes (throttled, only when
changed). Nothing here is a cursor: the next pass, in this process or a restarted one, derives everything
again from the engines.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from rolloutfleet.adapters.engine import EnginePool
from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.api import common, engine, validation
from rolloutfleet.api.fleet import RolloutFleetSpec
from rolloutfleet.api.revision import ParityProbe, ParityProbeResult, Phase, PodFailure, WeightRevisionStatus
from rolloutfleet.planning import revision_status, revisions, rollout, transaction, verification
from rolloutfleet.planning.transaction import Decision, Goal, Step
from rolloutfleet.reconcile import executor
from rolloutfleet.reconcile.context import FleetMemory, OperatorContext
from rolloutfleet.reconcile.fleet import spec_or_none
from rolloutfleet.resources import labels

Manifest = dict[str, Any]
log = logging.getLogger(__name__)
STATUS_WRITE_INTERVAL = 0.5


@dataclasses.dataclass
class PassOutcome:
    """What a pass ended with; ``again`` asks the loop to run the next pass right away."""

    again: bool = False
    idle: bool = True


def _parse(body: Manifest) -> revisions.Revision:
    parsed, errors = validation.parse_revision_spec(body.get("spec") or {})
    try:
        status = WeightRevisionStatus.model_validate(body.get("status") or {})
    except ValueError:
        status = WeightRevisionStatus()
    return revisions.Revision(
        name=body["metadata"]["name"],
        created=str(body["metadata"].get("creationTimestamp") or ""),
        spec=parsed,
        status=status,
        parse_errors=tuple(errors),
        body=body,
    )


def _ordinal(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


async def _token(ctx: OperatorContext, namespace: str, fleet: str) -> str | None:
    secret = await ctx.kube.get("v1", "Secret", namespace, labels.token_secret_name(fleet))
    data = (secret or {}).get("data") or {}
    raw = data.get(labels.TOKEN_KEY)
    return base64.b64decode(raw).decode() if raw else None


ENGINE_CONNECTIONS = 4096  # per fleet; `rolloutfleet run` raises the open-files limit to fit


async def _pool(ctx: OperatorContext, memory: FleetMemory, token: str) -> EnginePool:
    if memory.pool is None or memory.pool_token != token:
        if memory.pool is not None:
            await memory.pool.close()
        metrics = ctx.metrics

        def on_latency(step: str, seconds: float, outcome: str) -> None:
            metrics.engine_request_seconds.labels(step.split(":", 1)[0], outcome).observe(seconds)

        # Room for every pod's concurrent reads on kept-alive connections: with fewer, a 1,024-pod fleet
        # churned connections (measured: 1.1 s more operator CPU per rollout at limit=1024).
        memory.pool = EnginePool(token=token, limit=ENGINE_CONNECTIONS, on_latency=on_latency)
        await memory.pool.start()
        memory.pool_token = token
    return memory.pool


async def reconcile_revisions(
    ctx: OperatorContext, namespace: str, fleet_name: str, memory: FleetMemory, interrupted: Callable[[], bool]
) -> PassOutcome:
    """One pass over a fleet's revisions and engines.

    The fleet is read afresh from the API server: a watch-fed copy may still show the previous
    ``currentRevision`` right after this loop advanced it, and acting on that would roll pods backwards.
    """
    fleet_body = await ctx.kube.get(common.API_VERSION, "RolloutFleet", namespace, fleet_name)
    if fleet_body is None or fleet_body["metadata"].get("deletionTimestamp"):
        return PassOutcome()
    spec = spec_or_none(fleet_body)
    if spec is None:
        return PassOutcome()
    current = (fleet_body.get("status") or {}).get("currentRevision")
    bodies = await ctx.kube.list(common.API_VERSION, "WeightRevision", namespace)
    revs = [_parse(b) for b in bodies if ((b.get("spec") or {}).get("fleetRef") or {}).get("name") == fleet_name]
    sel = revisions.select(spec, current, revs)
    for refusal in sel.refused:
        await _finalize(ctx, refusal.revision, Phase.FAILED, refusal.reason, refusal.message, warn=True)
    for old in sel.superseded:
        await _finalize(
            ctx,
            old,
            Phase.SUPERSEDED,
            "Superseded",
            f"superseded by {sel.active.name if sel.active else 'a newer one'}",
        )
    target = sel.active.number if sel.active is not None else None
    await _patch_fleet(ctx, fleet_body, {"targetRevision": target})
    if sel.goal is None:
        return PassOutcome()
    token = await _token(ctx, namespace, fleet_name)
    if token is None:
        return PassOutcome()  # the fleet reconcile has not made the Secret yet
    pool = await _pool(ctx, memory, token)
    pods = [
        p
        for p in await ctx.kube.list("v1", "Pod", namespace, labels.selector_string(fleet_name))
        if (p.get("status") or {}).get("podIP")
        and not p["metadata"].get("deletionTimestamp")
        and (p.get("status") or {}).get("phase") == "Running"
    ]
    order = sorted((p["metadata"]["name"] for p in pods), key=_ordinal)
    clients = {p["metadata"]["name"]: pool.for_address(p["status"]["podIP"], spec.port) for p in pods}
    runner = _Pass(ctx, spec, fleet_body, memory, sel, order, clients, interrupted)
    return await runner.run()


async def _patch_fleet(ctx: OperatorContext, fleet_body: Manifest, fields: dict[str, Any]) -> None:
    if not isinstance(fleet_body.get("status"), dict):
        fleet_body["status"] = {}  # a fleet not yet reconciled: keep what this pass writes comparable
    status = fleet_body["status"]
    changed = {k: v for k, v in fields.items() if status.get(k) != v}
    if changed:
        meta = fleet_body["metadata"]
        await ctx.kube.patch_status(common.API_VERSION, "RolloutFleet", meta["namespace"], meta["name"], changed)
        status.update(changed)


async def _finalize(
    ctx: OperatorContext, rev: revisions.Revision, phase: Phase, reason: str, message: str, *, warn: bool = False
) -> None:
    if rev.status.phase == phase and rev.status.reason == reason:
        return
    new = revision_status.finalized(rev.status, phase, reason, message, _generation(rev.body))
    await _write_revision(ctx, rev, new)
    await ctx.kube.event(_wrev_ref(rev.body), "Warning" if warn else "Normal", reason, message)
    spec = rev.spec
    fleet = spec.fleet_ref.name if spec is not None else ""
    ctx.metrics.revisions.labels(rev.body["metadata"]["namespace"], fleet, phase.value).inc()


def _generation(body: Manifest) -> int:
    return int(body["metadata"].get("generation") or 0)


def _wrev_ref(body: Manifest) -> Manifest:
    return {"apiVersion": common.API_VERSION, "kind": "WeightRevision", "metadata": body["metadata"]}


async def _write_revision(ctx: OperatorContext, rev: revisions.Revision, new: WeightRevisionStatus) -> bool:
    old_wire, new_wire = rev.status.to_wire(), new.to_wire()
    changed = {k: v for k, v in new_wire.items() if old_wire.get(k) != v}
    if not changed:
        return False
    meta = rev.body["metadata"]
    await ctx.kube.patch_status(common.API_VERSION, "WeightRevision", meta["namespace"], meta["name"], changed)
    rev.status = new  # later writes of this pass compare against what is stored now
    return True


class _Pass:
    """The steps of one pass (a class only to keep the many collaborators out of argument lists)."""

    def __init__(
        self,
        ctx: OperatorContext,
        spec: RolloutFleetSpec,
        fleet_body: Manifest,
        memory: FleetMemory,
        sel: revisions.Selection,
        order: list[str],
        clients: dict[str, Any],
        interrupted: Callable[[], bool],
    ) -> None:
        self.ctx, self.spec, self.fleet_body, self.memory, self.sel = ctx, spec, fleet_body, memory, sel
        self.order, self.clients, self.interrupted = order, clients, interrupted
        assert sel.goal is not None
        self.goal: Goal = sel.goal
        self.rev = sel.active
        self.plan = revisions.plan_budget(spec, sel.active or sel.current, max(1, len(order)))
        self.loads = asyncio.Semaphore(self.plan.max_concurrent_loads or max(1, len(order)))
        self.key = self.rev.name if self.rev is not None else f"current-{self.goal.revision}"
        self.states: dict[str, engine.EngineState] = {}
        self.stale: set[str] = set(order)  # pods whose state must be read from the engine
        self.changed: set[str] = set(order)  # pods whose decision must be derived again
        self.inflight: dict[str, asyncio.Task[None]] = {}  # pods with a step running
        self.decided_goal: Goal | None = None  # the goal (with reference digests) decisions were made for
        self.verified: set[str] = set()  # pods read from the engine when they were ready to resume or done
        self.decisions: dict[str, Decision] = {}
        self.messages: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.last_write = 0.0
        self.writer: asyncio.Task[None] | None = None
        meta = fleet_body["metadata"]
        self.fleet_labels = (str(meta["namespace"]), str(meta["name"]))
        self.probe_result: ParityProbeResult | None = None
        self.timing = {"start": time.monotonic(), "iterations": 0, "observe": 0.0, "steps": 0.0, "status": 0.0}
        if self.rev is not None:
            for pod in self.rev.status.pods:  # attempts survive operator restarts through the status
                prev = memory.attempts.get((self.key, pod.name), 0)
                memory.attempts[(self.key, pod.name)] = max(prev, pod.attempts)
            memory.started.setdefault(self.key, time.monotonic())

    async def run(self) -> PassOutcome:
        if self.rev is not None and self.rev.status.phase == Phase.PENDING:
            await self.ctx.kube.event(
                _wrev_ref(self.rev.body),
                "Normal",
                "RolloutStarted",
                f"moving {len(self.order)} pods to revision {self.goal.revision} "
                f"({self.plan.mode.value}, {self.plan.rollout.value})",
            )
        try:
            return await self._rounds()
        finally:
            for task in self.inflight.values():  # only after an error: every normal exit drains first
                task.cancel()
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            if self.writer is not None:
                await asyncio.gather(self.writer, return_exceptions=True)
            with contextlib.suppress(KubeError):
                await self._publish_fleet_pods()
            t = self.timing
            log.info(
                "pass %s: %d iterations in %.2fs (observe %.2fs, waiting on steps %.2fs, status %.2fs)",
                self.key,
                t["iterations"],
                time.monotonic() - t["start"],
                t["observe"],
                t["steps"],
                t["status"],
            )

    async def _rounds(self) -> PassOutcome:
        """Each pod moves on as soon as its own step finished (no lock-step rounds across the fleet): a
        slow pod delays only itself, and the strategy's barrier and budget still hold (``rollout.admit``).
        """
        while True:
            self.timing["iterations"] += 1
            mark = time.monotonic()
            read = await self._observe()
            self.timing["observe"] += time.monotonic() - mark
            # Verify from the engines themselves before resuming a pod or calling it done.
            # (A pod read right before its resume is verified; the resume's acknowledgement keeps it so.)
            settled = {p: d for p, d in self.decisions.items() if p not in self.inflight}
            unverified = {p for p, d in settled.items() if d.step == Step.RESUME} - read
            unverified |= {p for p, d in settled.items() if d.step == Step.DONE} - read - self.verified
            self.verified |= {p for p in read if self.decisions[p].step in (Step.RESUME, Step.DONE)}
            if unverified:
                self.stale |= unverified
                continue
            if self._complete():
                await self._write_status(force=True)
                return await self._finish()
            await self._parity_probe()
            failed = self._exhausted()
            if failed:
                await self._drain()
                await self._write_status(force=True)
                return await self._give_up(failed)
            chosen = rollout.admit(
                self.decisions, self.order, self.plan, gate_open=self._probe_gate_open(), inflight=self.inflight
            )
            for pod, decision in chosen.items():
                self.inflight[pod] = asyncio.create_task(self._step(pod, decision))
            if not self.inflight:
                await self._write_status(force=True)
                return PassOutcome(again=False, idle=False)
            mark = time.monotonic()
            await asyncio.wait(self.inflight.values(), return_when=asyncio.FIRST_COMPLETED)
            for pod in [p for p, task in self.inflight.items() if task.done()]:
                self.inflight.pop(pod).result()  # _step handles step errors; anything else is a bug: raise
            self.timing["steps"] += time.monotonic() - mark
            mark = time.monotonic()
            await self._write_status()
            self.timing["status"] += time.monotonic() - mark
            if self.interrupted():
                await self._drain()
                await self._write_status(force=True)
                return PassOutcome(again=True, idle=False)

    async def _drain(self) -> None:
        """Let the steps still running finish (a step is never abandoned half way by the pass)."""
        while self.inflight:
            pod, task = next(iter(self.inflight.items()))
            await task
            del self.inflight[pod]

    async def _observe(self) -> set[str]:
        """Read the engines whose state is not known from an acknowledgement; decide every pod's step.

        Returns the pods read. A step's success is an observation too (``transaction.acknowledged``), so
        after the first round only pods that failed (or that must be verified before resuming) are read.
        """

        async def one(pod: str) -> tuple[str, engine.EngineState]:
            try:
                return pod, await self.clients[pod].observe()
            except Exception as exc:  # an engine answering garbage is unusable, not fatal to the pass
                return pod, engine.EngineState.unreachable(f"{type(exc).__name__}: {exc}")

        read = [p for p in self.order if p in self.stale and p not in self.inflight]
        for pod, state in await asyncio.gather(*(one(p) for p in read)):
            self.states[pod] = state
        self.stale.difference_update(read)
        self.changed.update(read)
        now = time.monotonic()
        goal = verification.with_reference_digests(self.goal, list(self.states.values()))
        # Decide again only where something changed (a read, a finished step), unless the reference
        # digests moved: then every settled pod's verdict may have.
        again = self.order if goal != self.decided_goal else [p for p in self.order if p in self.changed]
        self.decided_goal = goal
        for pod in again:
            if pod in self.inflight:
                continue  # its decision is the step it is running
            self.changed.discard(pod)
            state = self.states[pod]
            decision = transaction.next_step(goal, state)
            if decision.step == Step.UNREACHABLE:
                self.stale.add(pod)
                since = self.memory.unreachable_since.setdefault(pod, now)
                if now - since > self.spec.update_strategy.timeouts.wake_seconds:
                    self._fail(pod, "EngineUnreachable", decision.reason)
                    self.memory.unreachable_since[pod] = now
            else:
                self.memory.unreachable_since.pop(pod, None)
            if decision.step == Step.VERIFY_FAILED:
                # A mismatching digest is a failed attempt; the retry reloads the offending target.
                self._fail(pod, "VerifyFailed", decision.reason)
                target = Step.LOAD_VERIFIER if decision.reason.startswith("verifier") else Step.LOAD_DRAFT
                if decision.reason.startswith("frozen"):
                    target = Step.RESTORE_DRAFT
                decision = Decision(target, decision.reason)
            self.decisions[pod] = decision
        self.memory.engine_view = {p: self.states[p] for p in self.order}
        self.memory.steps = {p: d.step.value for p, d in self.decisions.items()}
        return set(read)

    async def _publish_fleet_pods(self) -> None:
        """Show each pod's revisions on the fleet now (the fleet's own resync would take up to its period)."""
        pods = (self.fleet_body.get("status") or {}).get("pods") or []
        updated = []
        for entry in pods:
            state = self.memory.engine_view.get(entry.get("name", ""))
            if state is not None and state.reachable:
                entry = {
                    k: v for k, v in entry.items() if k not in ("revision", "draftRevision", "step", "weightVersion")
                }
                fields = {
                    "revision": state.verifier.revision,
                    "draftRevision": state.draft.revision if state.draft is not None else None,
                    "step": self.memory.steps.get(entry["name"]),
                    "weightVersion": state.weight_version,
                }
                entry.update({k: v for k, v in fields.items() if v is not None})
            updated.append(entry)
        await _patch_fleet(self.ctx, self.fleet_body, {"pods": updated})

    def _probe_spec(self) -> ParityProbe | None:
        if self.rev is None or self.rev.spec is None or self.sel.rolling_back:
            return None
        return self.rev.spec.parity_probe

    def _probe_gate_open(self) -> bool:
        return self._probe_spec() is None or self.memory.probe_passed.get(self.key, False)

    async def _parity_probe(self) -> None:
        """Once every canary serves the revision, check its processed logprobs against the trainer's."""
        probe = self._probe_spec()
        canaries = self.order[: self.plan.canary]
        if probe is None or self._probe_gate_open() or not canaries:
            return
        if not all(self.decisions[p].step == Step.DONE for p in canaries):
            return
        expected = list(probe.expected_logprobs)

        async def one(pod: str) -> tuple[str, float, str | None]:
            try:
                seen = await self.clients[pod].greedy_logprobs(probe.prompt_token_ids, len(expected))
            except Exception as exc:  # an engine error is a failed probe, with its message
                return pod, float("inf"), f"{type(exc).__name__}: {exc}"
            worst, why = verification.probe_verdict(expected, seen, probe.tolerance)
            return pod, worst, why

        results = await asyncio.gather(*(one(p) for p in canaries))
        worst = max(r[1] for r in results)
        failures = [(pod, why) for pod, _, why in results if why is not None]
        message = "; ".join(f"{pod}: {why}" for pod, why in failures) or f"{len(canaries)} canaries match"
        self.probe_result = ParityProbeResult(
            passed=not failures,
            max_abs_diff=None if worst == float("inf") else round(worst, 6),
            tolerance=probe.tolerance,
            pods=list(canaries),
            message=message[:1024],
        )
        if not failures:
            self.memory.probe_passed[self.key] = True
            return
        for pod, why in failures:
            # A logprob mismatch is not transient: no retry, the revision rolls back.
            self.memory.attempts[(self.key, pod)] = self.plan.max_retries
            self._fail(pod, "ParityProbeFailed", why or "mismatch")

    def _complete(self) -> bool:
        return len(self.order) >= self.spec.replicas and all(d.step == Step.DONE for d in self.decisions.values())

    def _attempts(self, pod: str) -> int:
        return self.memory.attempts.get((self.key, pod), 0)

    def _fail(self, pod: str, reason: str, message: str) -> None:
        self.memory.attempts[(self.key, pod)] = self._attempts(pod) + 1
        self.messages[pod] = f"{reason}: {message}"
        self.reasons[pod] = reason
        step = self.decisions.get(pod, Decision(Step.PAUSE)).step.value
        self.ctx.metrics.update_failures.labels(*self.fleet_labels, step, reason).inc()

    def _exhausted(self) -> list[str]:
        return [p for p in self.order if self._attempts(p) > self.plan.max_retries]

    async def _step(self, pod: str, decision: Decision) -> None:
        limit = self.loads if decision.step in transaction.LOAD_STEPS else contextlib.nullcontext()
        timeouts = self.spec.update_strategy.timeouts
        self.changed.add(pod)  # whatever happens, its next decision is derived again once it is done
        try:
            async with limit:
                seconds, load = await executor.execute(self.clients[pod], decision.step, self.goal, timeouts)
        except executor.StepError as exc:
            self._fail(pod, exc.reason, str(exc))
            self.stale.add(pod)  # after a failure, only the engine can say where it is
            self.verified.discard(pod)
            log.warning("pod %s: %s", pod, exc)
            await asyncio.sleep(min(2.0, 0.1 * 2 ** self._attempts(pod)))  # back off before the retry
            return
        self.states[pod] = transaction.acknowledged(self.states[pod], decision.step, self.goal, load)
        self.memory.durations.setdefault(self.key, {}).setdefault(decision.step.value, []).append(seconds)
        self.ctx.metrics.step_duration.labels(*self.fleet_labels, decision.step.value, self.plan.mode.value).observe(
            seconds
        )

    async def _write_status(self, force: bool = False) -> None:
        """Progress writes run beside the steps (never on the rollout's critical path); forced ones wait."""
        writer = self.writer
        if not force:
            if (writer is not None and not writer.done()) or time.monotonic() - self.last_write < STATUS_WRITE_INTERVAL:
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
        self.last_write = time.monotonic()
        counts: dict[int | None, int] = {}
        for state in self.states.values():
            counts[state.verifier.revision] = counts.get(state.verifier.revision, 0) + 1
        meta = self.fleet_body["metadata"]
        for rev_number, n in counts.items():
            self.ctx.metrics.pods_at_revision.labels(meta["namespace"], meta["name"], str(rev_number)).set(n)
        if self.rev is None:
            return
        new = revision_status.progressing(
            self.rev.status,
            goal=self.goal,
            order=self.order,
            states=self.states,
            decisions=self.decisions,
            attempts={p: self._attempts(p) for p in self.order},
            messages=self.messages,
            durations=self.memory.durations.get(self.key, {}),
            total=max(self.spec.replicas, len(self.order)),
            rolling_back=self.sel.rolling_back,
            generation=_generation(self.rev.body),
        )
        if self.probe_result is not None:
            new = new.model_copy(update={"parity_probe": self.probe_result})
        await _write_revision(self.ctx, self.rev, new)

    async def _finish(self) -> PassOutcome:
        rev = self.rev
        if rev is None:
            return PassOutcome()
        elapsed = time.monotonic() - self.memory.started.pop(self.key, time.monotonic())
        if self.sel.rolling_back:
            message = rev.status.message or "rolled back"
            await _finalize(self.ctx, rev, Phase.ROLLED_BACK, "RolledBack", message, warn=True)
            self.ctx.metrics.rollout_duration.labels(*self.fleet_labels, "RolledBack").observe(elapsed)
            return PassOutcome(again=True, idle=False)
        await _patch_fleet(self.ctx, self.fleet_body, {"currentRevision": rev.number, "targetRevision": None})
        await _finalize(
            self.ctx,
            rev,
            Phase.SUCCEEDED,
            "AllPodsUpdated",
            f"{len(self.order)}/{len(self.order)} pods serve revision {rev.number}, digests verified",
        )
        self.ctx.metrics.rollout_duration.labels(*self.fleet_labels, "Succeeded").observe(elapsed)
        return PassOutcome(again=True, idle=False)

    async def _give_up(self, failed: list[str]) -> PassOutcome:
        rev = self.rev
        detail = "; ".join(f"{p}: {self.messages.get(p, 'failed')}" for p in failed[:5])
        if rev is None:
            log.warning("pods failing to reach the current revision: %s", detail)
            return PassOutcome(again=False, idle=False)
        if self.sel.rolling_back:
            await _finalize(
                self.ctx, rev, Phase.FAILED, "RollbackFailed", f"rollback failed, pods left paused: {detail}", warn=True
            )
            return PassOutcome(again=False, idle=False)
        self.ctx.metrics.rollbacks.labels(*self.fleet_labels).inc(len(self.order))
        failures = [
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
        new = revision_status.rolling_back(
            rev.status, f"rolling back to the previous revision: {detail}", _generation(rev.body), failures
        )
        await _write_revision(self.ctx, rev, new)
        await self.ctx.kube.event(_wrev_ref(rev.body), "Warning", revisions.ROLLING_BACK, new.message or detail)
        for pod in self.order:  # the rollback gets its own retry budget
            self.memory.attempts.pop((self.key, pod), None)
        return PassOutcome(again=True, idle=False)


async def report_orphan(ctx: OperatorContext, body: Manifest) -> None:
    """Mark a revision whose fleet is missing as Pending/FleetNotFound (nothing is touched; it waits)."""
    rev = _parse(body)
    if rev.final or rev.spec is None:
        return
    meta = body["metadata"]
    fleet = await ctx.kube.get(common.API_VERSION, "RolloutFleet", meta["namespace"], rev.spec.fleet_ref.name)
    if fleet is not None:
        return
    message = f"spec.fleetRef.name: RolloutFleet {rev.spec.fleet_ref.name!r} not found in this namespace"
    new = revision_status.waiting_for_fleet(rev.status, message, _generation(body))
    if await _write_revision(ctx, rev, new):
        await ctx.kube.event(_wrev_ref(body), "Warning", "FleetNotFound", message)
