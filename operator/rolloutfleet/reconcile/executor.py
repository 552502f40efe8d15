"""Carry out one step of the per-pod transaction against one engine, each call with its spec deadline.

Called by ``reconcile.revision`` for each admitted ``transaction.Decision``. Each step is one or a few
engine calls (the bracketed compositions of ``planning.transaction``). This is the one place that maps a
step's calls to the fleet's ``updateStrategy.timeouts``: every call is given exactly its deadline, which
the client uses as its HTTP timeout (retries included), so nothing waits longer or shorter than the spec
says. A failure raises ``StepError`` with a CamelCase reason; the caller counts attempts and decides
between retrying and rolling back.

A step's calls go out in one request where the engine's image takes sequences (``EngineClient.sequence``):
the resume (guarded: it runs only on the process and weights the decision saw, else ``Held``) and a staged
commit of both targets; otherwise call by call, as before.

Resume is fail-closed: the prefix cache is reset *before* the engine resumes, in both modes, and a reset
that does not go through fails the step while the engine is still paused (the planner derives RESUME
again and retries it). Requests frozen by ``pause(keep)`` hold KV blocks, which makes vLLM refuse a plain
reset, so the reset preempts them (``reset_running_requests``): their KV came from the old weights anyway,
and vLLM recomputes it with the new ones when they are scheduled after the resume.

Staging steps (docs/staging.md): ``Stage`` only starts the engine's readers (it answers at once, with the
stage's first state); ``Unstage`` releases the staging area; a commit is a load with ``staged=True``, under
the load deadline like any load.

Session steps (pushed weights, docs/push.md): opening brackets vLLM's ``/start_weight_update`` (or the
draft's) with the extension's ``rolloutfleet_push_begin`` under the pass's epoch; ending calls vLLM's
``/finish_weight_update`` and then ``rolloutfleet_push_end``, which verifies what was received. A session
whose update failed is already gone from vLLM: only the extension's side is closed (and reports the
failure). Abandoning closes both and always fails the step: the target is destroyed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rolloutfleet.adapters import engine_wire
from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.api.engine import EngineState, GroupMembership, LoadResult, PushSession, StageState, Target
from rolloutfleet.api.fleet import StepTimeouts
from rolloutfleet.planning.transaction import (
    COMMIT_STEPS,
    LOAD_STEPS,
    SESSION_STEPS,
    Goal,
    Step,
    committable,
    expected_after,
)

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step did not complete; ``reason`` is a CamelCase code for metrics and conditions."""

    def __init__(self, step: Step, reason: str, message: str) -> None:
        super().__init__(f"{step.value}: {message}")
        self.step = step
        self.reason = reason


def reason_of(exc: engine_wire.EngineError) -> str:
    """The CamelCase reason of an engine error (an extension code ``load_failed`` → ``ExtensionLoadFailed``).

    ``StepTimeout``: a call outlived the deadline the spec gives its step. ``LoadOutcomeUnknown``: a load was
    not sent because an earlier one may still be running (observe the engine, then retry).
    """
    if isinstance(exc, engine_wire.EngineRPCError):
        return "Extension" + "".join(p.title() for p in re.split(r"[^0-9A-Za-z]+", exc.code) if p)
    if isinstance(exc, engine_wire.LoadOutcomeUnknown):
        return "LoadOutcomeUnknown"
    if isinstance(exc, engine_wire.EngineTimeout):
        return "StepTimeout"
    if isinstance(exc, engine_wire.EngineUnreachable):
        return "EngineUnreachable"
    if isinstance(exc, engine_wire.EngineHTTPError):
        return "EngineHTTPError"
    if isinstance(exc, engine_wire.EngineInconsistent):
        return "EngineInconsistent"
    if isinstance(exc, engine_wire.EngineProtocolError):
        return "EngineProtocolError"
    return "EngineError"


class Held(RuntimeError):  # noqa: N818 - not a failure: the engine changed, decide again from a read
    """A resume's guard found the engine no longer as the decision saw it (another process, other weights):
    nothing ran."""


@dataclasses.dataclass(frozen=True)
class SessionContext:
    """What steps need beyond the goal: the pass's epoch, the engine's open session, the backend's
    ``init_info`` and ``group`` (NCCL's JoinGroup: what ``/init_weight_transfer_engine`` takes and the
    membership then recorded), why an abandon happens, the state the decision was made on (``known``: a
    resume's guard, a commit of both targets) and, for engines that cannot take a sequence, the read a
    resume waits for first (``ready``: False holds the resume)."""

    epoch: int = 0
    session: PushSession | None = None
    init_info: dict[str, Any] | None = None
    why: str = ""
    group: GroupMembership | None = None  # JoinGroup: the membership the extension records once joined
    known: EngineState | None = None
    ready: Callable[[], Awaitable[bool]] | None = None


async def _session(
    engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts, ctx: SessionContext
) -> LoadResult | None:
    control = float(timeouts.pause_seconds)
    if step == Step.JOIN_GROUP:
        if ctx.init_info is None or ctx.group is None:
            raise StepError(step, "NoRendezvous", "no rendezvous or no rank for this pod in the transfer group")
        # Collective: returns once every rank (the trainer too) joined; vLLM's own store waits up to 300 s.
        await engine.init_weight_transfer(ctx.init_info, deadline=float(timeouts.push_seconds))
        group = ctx.group
        await engine.push_group(group.epoch, group.rank_offset, group.world_size, deadline=control)
        return None
    if step in (Step.OPEN_VERIFIER_SESSION, Step.OPEN_DRAFT_SESSION):
        target = Target.VERIFIER if step == Step.OPEN_VERIFIER_SESSION else Target.DRAFT
        await engine.push_begin(target, goal.revision, ctx.epoch, deadline=control)
        try:
            await engine.start_weight_update(target, deadline=control)
        except engine_wire.EngineError:
            # vLLM did not open its side: close ours, so the engine is not left waiting for a sender.
            with contextlib.suppress(engine_wire.EngineError):
                await engine.push_end(abandon=True, deadline=control)
            raise
        return None
    if step == Step.END_SESSION:
        if ctx.session is None or ctx.session.error is None:
            await engine.finish_weight_update(deadline=float(timeouts.load_seconds))
        return await engine.push_end(deadline=float(timeouts.verify_seconds))
    if step == Step.ABANDON_SESSION:
        with contextlib.suppress(engine_wire.EngineError):  # vLLM's side may be gone already
            await engine.finish_weight_update(deadline=control)
        with contextlib.suppress(engine_wire.EngineRPCError):  # "abandoned" is the expected answer
            await engine.push_end(abandon=True, deadline=control)
        raise StepError(step, "PushAbandoned", ctx.why or "the session was abandoned")
    raise ValueError(f"{step} is not a session step")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A resume's answer: whether the engine process is admitted now (the resume's request admits it where the
    engine has admission and takes sequences; None: not known from the answer, the Service sync admits it)."""

    admitted: bool | None


# A load's (commit's, session's) result, both commits' results, a stage's state, a resume's admission, or nothing.
Result = LoadResult | tuple[LoadResult, ...] | StageState | Resumed | None


def _resume_calls(goal: Goal, known: EngineState | None) -> list[engine_wire.Call]:
    """The resume's calls: stamp the weight version (where the engine has versions and another one), wake
    the KV cache (sleep mode), reset the prefix cache (preempting frozen requests), resume, and admit the
    process (where it has admission and is withdrawn): the guard verified its process and weights, which is
    what an admission says, and the pod still receives no traffic before its readiness gate opens."""
    calls = []
    if known is not None and known.versioned and known.weight_version != goal.weight_version:
        stamp = {"new_version": goal.weight_version}
        calls.append(engine_wire.Call("/update_weight_version", "update_weight_version", json=stamp))
    if goal.sleep_mode:
        calls.append(engine_wire.Call("/wake_up", "wake_up:kv_cache", query=(("tags", "kv_cache"),)))
    if goal.reset_prefix_cache:
        query = (("reset_running_requests", "true"),)
        # vLLM refuses a reset with 200 {"success": false}: the expectation ends the sequence before the resume.
        reset = engine_wire.Call("/reset_prefix_cache", "reset_prefix_cache", query=query, expect={"success": True})
        calls.append(reset)
    calls.append(engine_wire.Call("/resume", "resume"))
    if known is not None and known.admitted is False:
        admit = {"revision": goal.revision, "instance": known.instance}
        calls.append(engine_wire.Call("/rolloutfleet/admit", "admit", json=admit))
    return calls


async def _resume(engine: EngineClient, goal: Goal, timeouts: StepTimeouts, ctx: SessionContext) -> Resumed:
    """Resume in one guarded request where the engine takes sequences, else call by call after ``ready``.

    The guard (the process and the weights ``ctx.known`` holds) replaces the read that used to precede
    every resume: inside an AllAtOnce pause each request round is time the whole fleet is out of service.
    """
    plan = _resume_plan(goal, timeouts, ctx.known)
    calls, total = [call for call, _ in plan], sum(deadline for _, deadline in plan)
    answer = None
    if ctx.known is not None and ctx.known.instance is not None:
        answer = await engine.sequence(calls, known=ctx.known, deadline=total)
    if answer is not None:
        if answer.held is not None:
            raise Held(f"the engine changed since it was read ({answer.held})")
        return _resumed(engine, answer, calls, 0)
    if ctx.ready is not None and not await ctx.ready():
        raise Held("the engine changed since it was read")
    for call, deadline in plan:  # each with the deadline the sequence would give it
        if call.step in ("resume", "admit"):  # the admission is the Service sync's here (``gates.open_for``)
            continue
        if call.step == "update_weight_version":
            await engine.update_weight_version(goal.weight_version, deadline=deadline)
        elif call.step == "wake_up:kv_cache":
            await engine.wake_up(["kv_cache"], deadline=deadline)
        elif not await engine.reset_prefix_cache(reset_running_requests=True, deadline=deadline):
            raise StepError(Step.RESUME, "PrefixCacheNotReset", "the prefix cache could not be reset: not resumed")
    await engine.resume(deadline=float(timeouts.pause_seconds))
    return Resumed(None)


def _resume_plan(goal: Goal, timeouts: StepTimeouts, known: EngineState | None) -> list[tuple[engine_wire.Call, float]]:
    """The resume's calls (``_resume_calls``), each with its deadline."""
    pause, wake = float(timeouts.pause_seconds), float(timeouts.wake_seconds)
    deadline = {"update_weight_version": float(timeouts.verify_seconds), "wake_up:kv_cache": wake}
    return [(call, deadline.get(call.step, pause)) for call in _resume_calls(goal, known)]


def _resumed(
    engine: EngineClient, answer: engine_wire.SequenceAnswer, calls: list[engine_wire.Call], start: int
) -> Resumed:
    """What the resume's ``calls``, the parts of ``answer`` from ``start`` on, say: resumed (and admitted, or
    not), or ``StepError`` (the engine's own error, a reset that did not go through: still paused)."""
    for offset, call in enumerate(calls):
        index = start + offset
        if call.step == "admit":  # resumed: an admission refused is the Service sync's to retry (fail-closed)
            part = answer.parts[index] if index < len(answer.parts) else {}
            body = part.get("body")
            admitted = 200 <= part.get("status", 0) < 300 and isinstance(body, dict) and body.get("admitted")
            if not admitted:
                log.warning("%s: resumed, not admitted: %s", engine.base_url, part or "the admit did not run")
            return Resumed(bool(admitted))
        if index >= len(answer.parts):
            raise StepError(Step.RESUME, "EngineProtocolError", f"the sequence stopped before {call.step}")
        body = engine.part(answer, index, call)  # raises the call's own error
        if call.step == "reset_prefix_cache" and not (isinstance(body, dict) and body.get("success") is True):
            # The reset did not go through (vLLM answers success false while KV blocks are held): the
            # sequence ended there, the engine is still paused, and the step is retried.
            raise StepError(Step.RESUME, "PrefixCacheNotReset", "the prefix cache could not be reset: not resumed")
    return Resumed(None)


PAUSE_CALL = engine_wire.Call("/pause", "pause", query=(("mode", "keep"), ("clear_cache", "false")))
WITHDRAW_CALL = engine_wire.Call("/rolloutfleet/withdraw", "withdraw")


async def _pause(engine: EngineClient, deadline: float, known: EngineState | None) -> None:
    """Withdraw the engine's admission (its readiness probe fails from then on) and pause(keep), in one request
    where the engine takes sequences. The pod's readiness gate is already False (``reconcile.gates``), so the
    withdrawal is the second switch: a withdrawal that fails alone is logged, as ``gates.close_for`` does."""
    pause = PAUSE_CALL
    if _withdraws(known):
        calls = [WITHDRAW_CALL, pause]
        answer = await engine.sequence(calls, deadline=2 * deadline)
        if answer is not None and len(answer.parts) == 2:
            engine.part(answer, 1, pause)  # the pause's own error, if it failed
            return
        if answer is not None:  # the withdrawal failed, and the sequence stopped before the pause
            log.warning("%s: not withdrawn: %s", engine.base_url, answer.parts[0] if answer.parts else "no answer")
        else:
            try:
                await engine.withdraw(deadline=deadline)
            except engine_wire.EngineError as exc:
                log.warning("%s: not withdrawn: %s", engine.base_url, exc)
    await engine.pause(mode="keep", clear_cache=False, deadline=deadline)


def _withdraws(known: EngineState | None) -> bool:
    """The pause withdraws the engine's admission first (unless the engine was seen withdrawn already)."""
    return known is not None and known.admitted is not False


def _commits_both(goal: Goal, known: EngineState | None) -> bool:
    """A verifier commit takes the draft's commit with it: the draft is staged for this goal too."""
    return (
        known is not None
        and goal.draft_path is not None
        and goal.co_updates_draft
        and committable(goal, known.staged, Target.DRAFT)
    )


def _commit_calls(engine: EngineClient, goal: Goal, load: float, known: EngineState | None) -> list[engine_wire.Call]:
    assert goal.verifier_path is not None
    calls = [engine.commit_call(Target.VERIFIER, goal.verifier_path, goal.revision, deadline=load)]
    if _commits_both(goal, known):
        assert goal.draft_path is not None
        calls.append(engine.commit_call(Target.DRAFT, goal.draft_path, goal.revision, deadline=load))
    return calls


async def _commit(engine: EngineClient, goal: Goal, timeouts: StepTimeouts, ctx: SessionContext) -> Result:
    """Commit the verifier from the stage, and the draft right after it in the same request where the draft
    is committable too and the engine takes sequences: the commit checks that what landed hashes to the
    staged digest, which was verified before the pause, so the draft never follows an unverified verifier
    (and a refused verifier commit stops the sequence before the draft's)."""
    assert goal.verifier_path is not None
    load = float(timeouts.load_seconds)
    calls = _commit_calls(engine, goal, load, ctx.known)
    if len(calls) > 1:
        answer = await engine.sequence(calls, loads=True, deadline=len(calls) * load)
        if answer is not None:
            return tuple(engine.load_part(answer, index, call) for index, call in enumerate(calls[: len(answer.parts)]))
    return await engine.load(Target.VERIFIER, goal.verifier_path, goal.revision, staged=True, deadline=load)


async def _run(engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts, session: SessionContext) -> Result:
    if step in SESSION_STEPS:
        return await _session(engine, step, goal, timeouts, session)
    pause = float(timeouts.pause_seconds)  # pause(keep) and the resume composition's reset and resume
    wake = float(timeouts.wake_seconds)  # each wake_up
    load = float(timeouts.load_seconds)  # each load or restore
    if step == Step.PAUSE:
        await _pause(engine, pause, session.known)
    elif step == Step.SLEEP:
        await engine.sleep(2, deadline=float(timeouts.sleep_seconds))
    elif step == Step.WAKE_WEIGHTS:
        await engine.wake_up(["weights"], deadline=wake)
    elif step == Step.STAGE:
        assert goal.verifier_path is not None
        return await engine.stage(goal.revision, goal.verifier_path, goal.draft_path, goal.stage_limit, deadline=pause)
    elif step == Step.UNSTAGE:
        await engine.unstage(deadline=pause)
    elif step == Step.COMMIT_VERIFIER:
        return await _commit(engine, goal, timeouts, session)
    elif step == Step.LOAD_VERIFIER:
        assert goal.verifier_path is not None
        return await engine.load(Target.VERIFIER, goal.verifier_path, goal.revision, deadline=load)
    elif step in (Step.LOAD_DRAFT, Step.COMMIT_DRAFT):
        assert goal.draft_path is not None
        staged = step == Step.COMMIT_DRAFT
        return await engine.load(Target.DRAFT, goal.draft_path, goal.revision, staged=staged, deadline=load)
    elif step == Step.RESTORE_DRAFT:
        assert goal.frozen_draft_path is not None
        return await engine.restore_draft(goal.frozen_draft_path, deadline=load)
    elif step == Step.RESUME:
        return await _resume(engine, goal, timeouts, session)
    else:
        raise ValueError(f"{step} is not an action")
    return None


async def execute(
    engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts, session: SessionContext | None = None
) -> tuple[float, Result]:
    """Run one step; return its duration in seconds and a load's (a commit's, a session's) result or a
    stage's state, or raise ``StepError``."""
    started = time.perf_counter()
    try:
        load = await _run(engine, step, goal, timeouts, session or SessionContext())
    except engine_wire.EngineError as exc:
        raise StepError(step, reason_of(exc), str(exc)) from exc
    return time.perf_counter() - started, load


@dataclasses.dataclass(frozen=True)
class Done:
    """One step of a chain that succeeded: its result, and its seconds (None where the engine answered the
    chain in one request without timing its calls apart)."""

    step: Step
    seconds: float | None
    result: Result


def _chain_calls(
    engine: EngineClient, step: Step, goal: Goal, timeouts: StepTimeouts, known: EngineState | None
) -> list[tuple[engine_wire.Call, float]]:
    """The calls of one step of a chain (``transaction.CHAIN_THROUGH``/``CHAIN_TO``), each with its deadline:
    the calls ``_run`` sends for the same step."""
    pause, wake, load = float(timeouts.pause_seconds), float(timeouts.wake_seconds), float(timeouts.load_seconds)
    if step == Step.PAUSE:
        return [(WITHDRAW_CALL, pause), (PAUSE_CALL, pause)] if _withdraws(known) else [(PAUSE_CALL, pause)]
    if step == Step.SLEEP:
        return [(engine_wire.Call("/sleep", "sleep", query=(("level", "2"),)), float(timeouts.sleep_seconds))]
    if step == Step.WAKE_WEIGHTS:
        return [(engine_wire.Call("/wake_up", "wake_up:weights", query=(("tags", "weights"),)), wake)]
    if step == Step.COMMIT_VERIFIER:
        return [(call, load) for call in _commit_calls(engine, goal, load, known)]
    if step in (Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.COMMIT_DRAFT):
        target = Target.VERIFIER if step == Step.LOAD_VERIFIER else Target.DRAFT
        path = goal.verifier_path if target == Target.VERIFIER else goal.draft_path
        assert path is not None
        staged = step == Step.COMMIT_DRAFT
        return [(engine.load_call(target, path, goal.revision, staged=staged, deadline=load), load)]
    raise ValueError(f"{step} cannot be part of a chain")


def _checked_resume(
    engine: EngineClient, goal: Goal, timeouts: StepTimeouts, expected: EngineState
) -> list[tuple[engine_wire.Call, float]]:
    """A chained resume's calls: the state check (every rank holds ``expected``: the goal's revision and digests
    after the loads), then the resume's own calls (``_resume_calls`` for the engine as the loads leave it)."""
    pause = float(timeouts.pause_seconds)
    return [(engine.state_check_call(expected, deadline=pause), pause), *_resume_plan(goal, timeouts, expected)]


def _chained_resume(
    engine: EngineClient, answer: engine_wire.SequenceAnswer, index: int, calls: list[engine_wire.Call]
) -> Done | None:
    """The chained resume's part of ``answer`` (its state check at ``index``, then the resume's calls): Done, or
    None where the check ended the sequence (the engine holds something else than the goal's pair, or its image
    compares the check with the RPC's whole body: noted, and its later resumes go apart). Nothing resumed
    then; the pass decides the pod's next step from the loads' answers and reads, as without the chain."""
    check, rest = calls[0], calls[1:]
    if index >= len(answer.parts):
        raise StepError(Step.RESUME, "EngineProtocolError", f"the sequence stopped before {check.step}")
    held = engine.state_check_held(answer, index, check)
    if len(answer.parts) == index + 1:
        if held:
            log.info(
                "%s: the image ends a sequence at a state check every rank holds: resumes go apart", engine.base_url
            )
            engine.note_resume_apart()
        return None
    if not held:  # never by the engine's rule: a resume ran on a state that failed its check
        raise StepError(Step.RESUME, "EngineProtocolError", "the engine ran the resume after a state check that failed")
    try:
        resumed = _resumed(engine, answer, rest, index + 1)
    except engine_wire.EngineError as exc:
        raise StepError(Step.RESUME, reason_of(exc), str(exc)) from exc
    return Done(Step.RESUME, _seconds(answer.parts[index:]), resumed)


def _seconds(parts: Sequence[dict[str, Any]]) -> float | None:
    """A step's time from its calls' answers in a sequence: the sum of their own ``seconds``, or None where an
    engine did not time them."""
    total = 0.0
    for part in parts:
        took = part.get("seconds")
        if not isinstance(took, int | float):
            return None
        total += float(took)
    return total


async def _one_by_one(
    engine: EngineClient, steps: list[Step], goal: Goal, timeouts: StepTimeouts, session: SessionContext
) -> list[Done]:
    out = []
    for step in steps:
        seconds, result = await execute(engine, step, goal, timeouts, session)
        out.append(Done(step, seconds, result))
    return out


async def execute_chain(
    engine: EngineClient,
    steps: tuple[Step, ...],
    goal: Goal,
    timeouts: StepTimeouts,
    session: SessionContext | None = None,
) -> list[Done]:
    """Run ``steps`` (``transaction.chain``: a step and those that follow it for certain) in one request where
    the engine takes sequences, else one by one; every step succeeded, or ``StepError`` names the one that
    failed (those before it succeeded, those after it did not run: the caller reads the engine either way).

    The request's deadline is the sum of its calls' (each the one the spec gives its step); loads in it are
    guarded like any load. A withdrawal that fails stops the sequence before the pause, as a pause on its own
    does: it is logged and the steps go out one by one.
    """
    session = session or SessionContext()
    # A resume chained after the loads (``transaction.chain(through_resume=True)``) runs only inside their request,
    # behind its state check: anywhere else it is the pass's to decide again, from what the loads answered.
    resumes = len(steps) > 1 and steps[-1] == Step.RESUME
    before = steps[:-1] if resumes else steps
    if len(steps) == 1 or (resumes and session.known is None):
        return await _one_by_one(engine, list(before), goal, timeouts, session)
    plan = [(step, _chain_calls(engine, step, goal, timeouts, session.known)) for step in before]
    if resumes:
        assert session.known is not None
        plan.append((Step.RESUME, _checked_resume(engine, goal, timeouts, expected_after(goal, session.known, before))))
    calls = [call for _, each in plan for call, _ in each]
    loads = any(step in LOAD_STEPS or step in COMMIT_STEPS for step in steps)
    started = time.perf_counter()
    try:
        answer = await engine.sequence(calls, loads=loads, deadline=sum(d for _, each in plan for _, d in each))
    except engine_wire.EngineError as exc:
        # The request as a whole failed (a timeout, a lost connection): which step it reached is the engine's to say.
        # (Named after its last step before a chained resume: the load, which takes the time.)
        chained = "+".join(step.value for step in steps)
        raise StepError(before[-1], reason_of(exc), f"in one request of {chained}: {exc}") from exc
    if answer is None:
        return await _one_by_one(engine, list(before), goal, timeouts, session)
    out: list[Done] = []
    index = 0
    for step, each in plan:
        if step == Step.RESUME:
            resumed = _chained_resume(engine, answer, index, [call for call, _ in each])
            if resumed is not None:
                out.append(resumed)
            break
        results: list[LoadResult] = []
        first = index
        for call, _ in each:
            if index >= len(answer.parts):
                raise StepError(step, "EngineProtocolError", f"the sequence stopped before {call.step}")
            part = answer.parts[index]
            if call is WITHDRAW_CALL and not 200 <= part["status"] < 300:
                log.warning("%s: not withdrawn: %s", engine.base_url, part)
                known = session.known.evolve(admitted=False) if session.known is not None else None
                rest: list[Step] = [s for s, _ in plan[len(out) :] if s != Step.RESUME]
                return out + await _one_by_one(engine, rest, goal, timeouts, dataclasses.replace(session, known=known))
            try:
                if call.path == "/collective_rpc":
                    results.append(engine.load_part(answer, index, call))
                else:
                    engine.part(answer, index, call)
            except engine_wire.EngineError as exc:
                raise StepError(step, reason_of(exc), str(exc)) from exc
            index += 1
        timed = _seconds(answer.parts[first:index])
        out.append(Done(step, timed, None if not results else results[0] if len(results) == 1 else tuple(results)))
    if all(done.seconds is None for done in out):  # an engine that does not time its calls: the load took it
        out[-1] = dataclasses.replace(out[-1], seconds=time.perf_counter() - started)
    return out
