"""The per-pod weight-update transaction as a pure function of what the engine reports.

Called by ``reconcile.revision`` before every step of every pod: ``next_step(goal, state)`` says what to
do next to bring one engine to ``goal``. It never reads a stored cursor: pause, sleep, loads, verification
and the weight version are all read back from the engine (``api.engine.EngineState``), so an operator
restart, a retried step or a manual poke converges from wherever the engine is.

Mode ``sleep``:    pause(keep) → sleep(2) → wake(weights) → load verifier → load draft → verify →
                   [set weight version + wake(kv_cache) + reset prefix cache + resume]
Mode ``inflight``: pause(keep) → load verifier → load draft → verify →
                   [set weight version + reset prefix cache + resume]

Staged goals (docs/staging.md, the fleet stages path revisions): while the pod still serves, the engine
stages the revision into host memory (``Stage`` → ``AwaitStage``) and the staged digests are checked
(``StageFailed``/``StageMismatch`` verdicts come before any pause); only then ``Pause``, and the loads become
commits from the staging area (``CommitVerifier``/``CommitDraft``; where the engine takes a sequence of
calls in one request, ``CommitVerifier`` commits the draft right after the verifier, since the commit itself
checks that what landed hashes to the staged digest that was verified before the pause). A stage over the
fleet's limit falls back to the loads above; a stage of another revision left on a pod at its goal is
released (``Unstage``).

Pushed targets (docs/push.md) take a weight-transfer session instead of a load: open the session
(``OpenVerifierSession``/``OpenDraftSession``) → wait for the trainer (``AwaitPush``) → end it
(``EndSession``: finish, digest, every parameter received) — or, past the push deadline or on the
trainer's error mark, ``AbandonSession``. A target a session failed into is destroyed: the pod is restarted
(``RestartPod``) and caught up like a new one; it never resumes on it.

A step and the steps that follow it for certain (``chain``: up to and including the first load or commit)
go to the engine in one request. The bracketed step is one composition (the scheduler must not run between
them; ``Resume`` stamps the weight version first, so a fleet resumed together spends one request round less
out of service). Weights are woken only
when the extension reports them unmapped: on vLLM 0.26 a wake of awake weights resumes a paused
scheduler (measured on the H200), which would serve between the verifier and the draft loads. Engines
without weight-version routes (vLLM 0.26) skip the version stamp. The draft is loaded only once the
verifier holds (and has a digest for) the same revision; a frozen draft is only ever restored.
"""

from __future__ import annotations

import dataclasses
import enum

from rolloutfleet.api.engine import (
    EngineFault,
    EngineState,
    GroupMembership,
    LoadResult,
    PushSession,
    StagePhase,
    StageState,
    Target,
    TargetState,
)

INITIAL_REVISION = 0  # the weights a fleet starts with (spec.verifier.path / spec.draft.path)


class Step(enum.StrEnum):
    """What to do next to one engine (the first group are actions, the rest are verdicts)."""

    PAUSE = "Pause"
    SLEEP = "Sleep"
    WAKE_WEIGHTS = "WakeWeights"
    LOAD_VERIFIER = "LoadVerifier"
    LOAD_DRAFT = "LoadDraft"
    RESTORE_DRAFT = "RestoreDraft"
    RESUME = "Resume"
    JOIN_GROUP = "JoinGroup"  # NCCL: the engine joins the transfer group (the trainer is rank 0)
    OPEN_VERIFIER_SESSION = "OpenVerifierSession"
    OPEN_DRAFT_SESSION = "OpenDraftSession"
    END_SESSION = "EndSession"
    ABANDON_SESSION = "AbandonSession"
    RESTART_POD = "RestartPod"
    STAGE = "Stage"  # staging: read and hash the revision into host memory while the pod serves
    UNSTAGE = "Unstage"  # release a stage that cannot be used (mismatching, or of another revision)
    COMMIT_VERIFIER = "CommitVerifier"  # load the verifier from the staging area (in the pause)
    COMMIT_DRAFT = "CommitDraft"
    DONE = "Done"
    AWAIT_PUSH = "AwaitPush"  # a session waits for the trainer, or a pushed goal waits for the next one
    VERIFY_FAILED = "VerifyFailed"
    UNREACHABLE = "Unreachable"
    ENGINE_MISMATCH = "EngineMismatch"  # the engine is not the pair the fleet declares: no step can fix it
    NO_RENDEZVOUS = "NoRendezvous"  # NCCL: the trainer did not publish where to join its group in time
    ENGINE_ERROR = "EngineError"  # the engine answered, but not usably (401, a malformed body, an RPC error)
    AWAIT_STAGE = "AwaitStage"  # the engine is staging the revision (still serving)
    STAGE_FAILED = "StageFailed"  # the engine could not stage the revision's checkpoints
    STAGE_MISMATCH = "StageMismatch"  # the staged bytes do not hash to the revision's (or the majority's) digest


ACTIONS = frozenset(
    {
        Step.PAUSE,
        Step.SLEEP,
        Step.WAKE_WEIGHTS,
        Step.LOAD_VERIFIER,
        Step.LOAD_DRAFT,
        Step.RESTORE_DRAFT,
        Step.RESUME,
        Step.JOIN_GROUP,
        Step.OPEN_VERIFIER_SESSION,
        Step.OPEN_DRAFT_SESSION,
        Step.END_SESSION,
        Step.ABANDON_SESSION,
        Step.RESTART_POD,
        Step.STAGE,
        Step.UNSTAGE,
        Step.COMMIT_VERIFIER,
        Step.COMMIT_DRAFT,
    }
)
# Loads read the checkpoint files (``maxConcurrentLoads`` protects shared storage from them); a commit reads
# pinned host memory only, so it is not one of them.
LOAD_STEPS = frozenset({Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.RESTORE_DRAFT})
COMMIT_STEPS = frozenset({Step.COMMIT_VERIFIER, Step.COMMIT_DRAFT})
# Steps and verdicts of the staging that precedes the pause: the pod still serves through all of them.
STAGING_STEPS = frozenset({Step.STAGE, Step.UNSTAGE, Step.AWAIT_STAGE, Step.STAGE_FAILED, Step.STAGE_MISMATCH})
IN_SERVICE_STEPS = STAGING_STEPS | {Step.PAUSE}
SESSION_STEPS = frozenset(
    {Step.JOIN_GROUP, Step.OPEN_VERIFIER_SESSION, Step.OPEN_DRAFT_SESSION, Step.END_SESSION, Step.ABANDON_SESSION}
)


@dataclasses.dataclass(frozen=True)
class PushMarks:
    """What the trainer said about a pushed revision (its annotations, docs/push.md), and the session rules.

    ``verifier_epoch``/``draft_epoch``: the highest epoch of sessions the trainer sent into (None: none yet);
    ``error``: the trainer could not send; it ends the sessions it is about: of ``error_target`` up to
    ``error_epoch`` when the trainer said so (``"<target> epoch <N>: ..."``), else every open session;
    ``deadline_s``: how long a session waits for the trainer; ``can_open``: sessions may be opened (an
    active revision whose trainer is there, not a catch-up of a served pushed revision, which only the
    next revision can bring).
    """

    verifier_epoch: int | None = None
    draft_epoch: int | None = None
    error: str | None = None
    error_target: Target | None = None
    error_epoch: int | None = None
    deadline_s: float = 120.0
    can_open: bool = True
    # NCCL only (None for IPC): the transfer group every session needs, the trainer's rendezvous for it
    # ("host:port"; None: not published yet) and how long pods have waited for it (the deadline applies).
    group_epoch: int | None = None
    rendezvous: str | None = None
    rendezvous_expired: bool = False

    def failed(self, session: PushSession) -> bool:
        """The trainer's error is about this session (a later session, e.g. a retry, is not affected)."""
        if self.error is None:
            return False
        if self.error_target is None or self.error_epoch is None:
            return True
        return session.target == self.error_target and session.epoch <= self.error_epoch

    def sent(self, target: Target, epoch: int) -> bool:
        """The trainer marked ``epoch`` (or a later one) of ``target`` as sent."""
        marked = self.verifier_epoch if target == Target.VERIFIER else self.draft_epoch
        return marked is not None and marked >= epoch


@dataclasses.dataclass(frozen=True)
class Goal:
    """The weights one engine must end up serving."""

    revision: int
    verifier_path: str | None  # None: pushed by the trainer (verifier_pushed)
    sleep_mode: bool
    verifier_digest: str | None = None
    draft_path: str | None = None  # co-updated draft checkpoint; None: no draft, a frozen or a pushed one
    draft_digest: str | None = None
    verifier_pushed: bool = False  # the trainer sends the verifier into a weight-transfer session
    draft_pushed: bool = False  # the trainer sends the co-updated draft
    frozen_draft_path: str | None = None  # set when the fleet's draft is frozen
    frozen_draft_digest: str | None = None
    reset_prefix_cache: bool = False  # prefix caching is on: a cache must not serve KV of old weights
    draft_method: str | None = None  # the fleet's speculative method; None: the fleet runs without a draft
    push: PushMarks = PushMarks()  # pushed targets only: the trainer's marks and the session rules
    stage_limit: int | None = None  # the fleet stages (docs/staging.md): bytes each worker may pin; None: off

    @property
    def pushed(self) -> bool:
        """Some target comes from the trainer through a weight-transfer session."""
        return self.verifier_pushed or self.draft_pushed

    @property
    def co_updates_draft(self) -> bool:
        """The goal brings draft weights of this revision (from a path or pushed)."""
        return self.draft_path is not None or self.draft_pushed

    @property
    def expects_draft(self) -> bool:
        """The pair includes a draft: the fleet declares a method, or a draft checkpoint to hold."""
        return self.draft_method is not None or self.co_updates_draft or self.frozen_draft_path is not None

    @property
    def stages(self) -> bool:
        """The goal's checkpoints are staged before the pause (staging on, and a verifier path to stage)."""
        return self.stage_limit is not None and self.verifier_path is not None

    @property
    def weight_version(self) -> str:
        """The weight version stamped on outputs: the revision number."""
        return str(self.revision)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The next step for one engine and why."""

    step: Step
    reason: str = ""


def verifier_ok(goal: Goal, state: EngineState) -> bool:
    """The verifier holds the goal's checkpoint, loaded through the extension (so it has a digest)."""
    v = state.verifier
    if v.revision != goal.revision or v.digest is None:
        return False
    return goal.verifier_digest is None or v.digest == goal.verifier_digest


def _same_method(declared: str, reported: str | None) -> bool:
    # vLLM names some MTP variants after their model family (e.g. "deepseek_mtp"); the fleet says "mtp".
    return reported == declared or (declared == "mtp" and reported is not None and reported.endswith("mtp"))


def engine_mismatch(goal: Goal, state: EngineState) -> str | None:
    """Why this engine cannot serve the goal's pair whatever is loaded into it, if it cannot.

    An engine started without the fleet's draft (or with another speculative method) would pass every
    digest check of the verifier and serve without the draft the pair declares; no load can fix that.
    """
    if not goal.expects_draft:
        return None
    if state.draft is None:
        return "the engine has no draft model, but the fleet's pair includes one"
    declared, reported = goal.draft_method, state.draft_method
    if declared is not None and reported is not None and not _same_method(declared, reported):
        return f"the engine's speculative method is {reported!r}, the fleet declares {declared!r}"
    return None


def draft_ok(goal: Goal, state: EngineState) -> bool:
    """The draft holds what the goal says: the same revision (co-update) or the frozen checkpoint."""
    draft = state.draft
    if draft is None:
        return not goal.expects_draft  # no draft model: right only where the fleet has none
    if goal.frozen_draft_path is not None:
        if draft.digest is None:
            # Untouched since start-up (never discarded) only counts where nothing ever slept.
            return not goal.sleep_mode and draft.revision is None and state.resident
        return goal.frozen_draft_digest is None or draft.digest == goal.frozen_draft_digest
    if not goal.co_updates_draft:
        return True  # a draft without weights of its own (MTP): nothing to load
    if draft.revision != goal.revision or draft.digest is None:
        return False
    return goal.draft_digest is None or draft.digest == goal.draft_digest


def digest_mismatch(goal: Goal, state: EngineState) -> str | None:
    """Why the loaded revision does not verify against the expected digests, if it does not."""
    v, d = state.verifier, state.draft
    if v.revision == goal.revision and v.digest is not None and goal.verifier_digest not in (None, v.digest):
        return f"verifier digest {v.digest} != expected {goal.verifier_digest}"
    if (
        d is not None
        and goal.co_updates_draft
        and d.revision == goal.revision
        and d.digest is not None
        and goal.draft_digest not in (None, d.digest)
    ):
        return f"draft digest {d.digest} != expected {goal.draft_digest}"
    if (
        d is not None
        and goal.frozen_draft_path is not None
        and d.digest is not None
        and goal.frozen_draft_digest not in (None, d.digest)
    ):
        return f"frozen draft digest {d.digest} != recorded {goal.frozen_draft_digest}"
    return None


def holds_pair(goal: Goal, state: EngineState) -> bool:
    """Holds the goal's pair, verified (stamped with its weight version or not: the resume stamps it)."""
    return (
        state.reachable and engine_mismatch(goal, state) is None and verifier_ok(goal, state) and draft_ok(goal, state)
    )


def stamped(goal: Goal, state: EngineState) -> bool:
    """The engine's weight version is the goal's (or the engine has no weight versions: vLLM 0.26)."""
    return state.weight_version == goal.weight_version or not state.versioned


def at_goal(goal: Goal, state: EngineState) -> bool:
    """Holds the goal's pair, verified, stamped with its weight version (whether or not it serves yet)."""
    return holds_pair(goal, state) and stamped(goal, state)


def next_step(goal: Goal, state: EngineState) -> Decision:
    """The next step that moves this engine toward ``goal`` (pure; derived from ``state`` alone)."""
    if not state.reachable:
        if state.fault is not None and state.fault != EngineFault.UNREACHABLE:
            return Decision(Step.ENGINE_ERROR, f"{state.fault.value}: {state.error or 'no detail'}")
        return Decision(Step.UNREACHABLE, state.error or "engine did not answer")
    mismatch = engine_mismatch(goal, state)
    if mismatch is not None:
        return Decision(Step.ENGINE_MISMATCH, mismatch)
    in_service = not state.paused and not state.sleeping
    if state.session is None and not state.destroyed and holds_pair(goal, state):
        if not in_service:
            # The resume stamps the weight version first (one step: one request round less in the pause).
            return Decision(Step.RESUME, "loaded and verified")
        if stamped(goal, state):
            if stale_stage(goal, state.staged):
                assert state.staged is not None
                why = f"release the stage of revision {state.staged.revision}: nothing will use it"
                return Decision(Step.UNSTAGE, why)
            return Decision(Step.DONE, "loaded and verified")
    if in_service:
        return _before_pause(goal, state.staged) or Decision(Step.PAUSE, "serving other weights")
    if state.session is not None:
        return _session_step(goal, state.session)
    if state.destroyed:
        return Decision(Step.RESTART_POD, "a failed weight-transfer session destroyed a target: restart the pod")
    mismatch = digest_mismatch(goal, state)
    if mismatch is not None:
        return Decision(Step.VERIFY_FAILED, mismatch)
    if not verifier_ok(goal, state):
        if goal.sleep_mode and state.resident:
            return Decision(Step.SLEEP, "weights still resident: free them (level 2) before the load")
        if state.mapped is False or (state.mapped is None and goal.sleep_mode and not state.resident):
            return Decision(Step.WAKE_WEIGHTS, "weights asleep: map them before the load")
        if goal.verifier_pushed:
            return _open(goal, Step.OPEN_VERIFIER_SESSION, f"verifier holds revision {state.verifier.revision}", state)
        if committable(goal, state.staged, Target.VERIFIER):
            return Decision(Step.COMMIT_VERIFIER, f"verifier holds revision {state.verifier.revision}; staged")
        return Decision(Step.LOAD_VERIFIER, f"verifier holds revision {state.verifier.revision}")
    if not draft_ok(goal, state):
        if goal.frozen_draft_path is not None:
            return Decision(Step.RESTORE_DRAFT, "frozen draft discarded by the sleep")
        if goal.draft_pushed:
            return _open(goal, Step.OPEN_DRAFT_SESSION, "verifier verified; draft behind", state)
        if committable(goal, state.staged, Target.DRAFT):
            return Decision(Step.COMMIT_DRAFT, "verifier verified; draft behind; staged")
        return Decision(Step.LOAD_DRAFT, "verifier verified; draft behind")
    raise AssertionError("unreachable: a verified pair out of service resumes, in service it is done or pauses")


def stage_for(goal: Goal, stage: StageState | None) -> bool:
    """The engine's stage holds (or is filling with) the goal's checkpoints, under the goal's limit."""
    if stage is None or not goal.stages or stage.revision != goal.revision:
        return False
    if stage.verifier.path != goal.verifier_path or (stage.draft.path if stage.draft else None) != goal.draft_path:
        return False
    # A fallback decided under another limit is decided again (the fleet's limit was changed meanwhile).
    return stage.phase != StagePhase.OVER_BUDGET or stage.limit_bytes == goal.stage_limit


def staged_mismatch(goal: Goal, stage: StageState) -> str | None:
    """Why the staged bytes are not the goal's (the expected digests: pinned, or the pods' majority)."""
    pairs = [(Target.VERIFIER, stage.verifier, goal.verifier_digest)]
    if stage.draft is not None:
        pairs.append((Target.DRAFT, stage.draft, goal.draft_digest))
    for target, staged, expected in pairs:
        if expected is not None and staged.digest is not None and staged.digest != expected:
            return f"staged {target.value} digest {staged.digest} != expected {expected}"
    return None


def stale_stage(goal: Goal, stage: StageState | None) -> bool:
    """A stage holding host memory that no commit toward ``goal`` will use: release it."""
    if stage is None or stage.phase not in (StagePhase.STAGING, StagePhase.STAGED):
        return False
    return not stage_for(goal, stage)


def _before_pause(goal: Goal, stage: StageState | None) -> Decision | None:
    """While the pod serves: what staging still has to do before it may pause (None: pause)."""
    if not goal.stages:
        return None
    if stage is None or not stage_for(goal, stage):
        return Decision(Step.STAGE, f"stage revision {goal.revision} in host memory while serving")
    if stage.phase == StagePhase.STAGING:
        return Decision(
            Step.AWAIT_STAGE,
            f"staging revision {goal.revision}: {stage.bytes_done / 1e9:.2f}/{stage.bytes_total / 1e9:.2f} GB",
        )
    if stage.phase == StagePhase.FAILED:
        return Decision(Step.STAGE_FAILED, f"{stage.error_code or 'failed'}: {stage.error_message or 'no detail'}")
    if stage.phase == StagePhase.OVER_BUDGET:
        return None  # fallback: the loads read the files in the pause, as without staging
    mismatch = staged_mismatch(goal, stage)
    return Decision(Step.STAGE_MISMATCH, mismatch) if mismatch is not None else None


def committable(goal: Goal, stage: StageState | None, target: Target) -> bool:
    """``target`` can be committed from the stage: staged for the goal, verified, not committed yet."""
    if stage is None or stage.phase != StagePhase.STAGED or not stage_for(goal, stage):
        return False
    staged = stage.verifier if target == Target.VERIFIER else stage.draft
    return staged is not None and not staged.committed and staged_mismatch(goal, stage) is None


def stage_eta(stage: StageState) -> float | None:
    """Seconds until a running stage should be done, from its rate so far (None: no rate yet)."""
    if stage.phase != StagePhase.STAGING or stage.bytes_done <= 0 or stage.seconds <= 0:
        return None
    rate = stage.bytes_done / stage.seconds
    return max(0.0, (stage.bytes_total - stage.bytes_done) / rate)


def _open(goal: Goal, step: Step, why: str, state: EngineState) -> Decision:
    push = goal.push
    if not push.can_open:
        return Decision(Step.AWAIT_PUSH, "pushed weights: only the trainer's next revision can bring this pod")
    if push.group_epoch is not None:
        # NCCL: a session is fed by one broadcast from the trainer, rank 0 of the group: wait until the
        # trainer said it is (its rendezvous for this group), then make sure this process is in it.
        if push.rendezvous is None:
            if push.rendezvous_expired:
                return Decision(
                    Step.NO_RENDEZVOUS,
                    f"the trainer published no rendezvous for transfer group {push.group_epoch} in "
                    f"{push.deadline_s:g}s",
                )
            return Decision(Step.AWAIT_PUSH, f"{why}: waiting for the trainer's rendezvous of group {push.group_epoch}")
        if state.group is None or state.group.epoch != push.group_epoch:
            return Decision(Step.JOIN_GROUP, f"{why}: join transfer group {push.group_epoch} at {push.rendezvous}")
    return Decision(step, f"{why}: open a session for the trainer")


def _session_step(goal: Goal, session: PushSession) -> Decision:
    """What to do with an open session: end it once the trainer marked its epoch, abandon it when it cannot
    be fed any more (its update failed, another revision, the trainer's error, the deadline), else wait."""
    where = f"{session.target} session of epoch {session.epoch}"
    if session.error is not None:
        return Decision(Step.END_SESSION, f"the update into the {where} failed: {session.error}")
    if session.revision != goal.revision:
        return Decision(Step.ABANDON_SESSION, f"the {where} is for revision {session.revision}")
    if goal.push.sent(session.target, session.epoch):
        return Decision(Step.END_SESSION, f"the trainer sent into the {where}")
    if goal.push.failed(session):
        return Decision(Step.ABANDON_SESSION, f"the trainer could not send: {goal.push.error}")
    if session.age_s >= goal.push.deadline_s:
        return Decision(Step.ABANDON_SESSION, f"the trainer sent nothing into the {where} in {goal.push.deadline_s:g}s")
    return Decision(Step.AWAIT_PUSH, f"the {where} waits for the trainer ({session.tensors} tensors so far)")


def ready_to_resume(goal: Goal, state: EngineState) -> bool:
    """Loaded, verified and stamped, but still paused: what the AllAtOnce barrier waits for."""
    return next_step(goal, state).step == Step.RESUME


# A step whose success leaves the engine exactly as ``acknowledged`` says, whatever its answer holds: the step
# after it is known before it ran. A load's or commit's answer carries the digest that decides what follows (a
# mismatch is a verdict), and a resume has its own guard: a chain ends at them, but for the draft's load after
# the verifier's (``chain``).
CHAIN_THROUGH = frozenset({Step.PAUSE, Step.SLEEP, Step.WAKE_WEIGHTS})
CHAIN_TO = frozenset(
    {Step.SLEEP, Step.WAKE_WEIGHTS, Step.LOAD_VERIFIER, Step.LOAD_DRAFT, Step.COMMIT_VERIFIER, Step.COMMIT_DRAFT}
)
_AS_REFERENCED = "as-referenced"  # a verifier digest that verifies against a goal whose reference is not known yet


def chain(
    goal: Goal, state: EngineState, first: Step, *, loads: bool = True, through_resume: bool = False
) -> tuple[Step, ...]:
    """``first`` and the steps that follow it for certain: the decisions this planner would make from each
    step's acknowledgement, up to and including the first load or commit (``CHAIN_THROUGH``/``CHAIN_TO``), and
    the draft's load after the verifier's.

    The executor sends them in one request (``reconcile.executor.execute_chain``): a sleep-mode pause, sleep,
    wake(weights) and both loads are one request instead of five round trips through the operator, which cost
    the fleet time out of service and the operator CPU per pod. They are the steps the step-by-step pass takes,
    in the same order, stopping at the first failure as it would. One departure: the draft's load follows the
    verifier's whatever digest the verifier's answer carries, where the pass would load the verifier again
    after a digest that does not verify. The draft's load does not depend on that digest, the pass still judges
    it from the answer (a verdict, a retry of the verifier alone: the draft it loaded is kept), and nothing
    resumes on it (the resume's guard checks both). ``loads=False`` (the fleet limits concurrent loads, which
    the executor enforces per load step) ends the chain before a load.

    ``through_resume`` (a Rolling pod, whose resume waits for no other pod): the resume follows the loads in
    the same request where the goal names the digests both loads must verify to (``resumes_on_check``). The
    executor puts a check of the engine's state between them that every rank must hold (``expected_after``
    the loads: the goal's revision and digests), so the resume runs only on the pair the pass would have
    verified before resuming it, and a pod's update is one request instead of two and an iteration of the pass.
    """
    steps = [first]
    while True:
        last = steps[-1]
        if last in CHAIN_THROUGH or last == Step.LOAD_VERIFIER or (last == Step.LOAD_DRAFT and through_resume):
            state = _as_acknowledged(goal, state, last)
        else:
            break
        following = next_step(goal, state).step
        if following == Step.RESUME and last in (Step.LOAD_VERIFIER, Step.LOAD_DRAFT):
            if through_resume and resumes_on_check(goal):
                steps.append(Step.RESUME)
            break
        if last == Step.LOAD_DRAFT:  # (acknowledged only to see whether the resume follows)
            break
        if following not in CHAIN_TO or (following in LOAD_STEPS and not loads):
            break
        if last == Step.LOAD_VERIFIER and following != Step.LOAD_DRAFT:
            break
        steps.append(following)
    return tuple(steps)


def resumes_on_check(goal: Goal) -> bool:
    """A resume may follow this goal's loads in their request: the goal names every digest its loads must
    verify to (``verifier_ok``, ``draft_ok``), so one check of the engine's state says what the pass's own
    verification would. Not for a frozen draft (restored, not loaded), staged commits or pushed weights."""
    return (
        goal.verifier_digest is not None
        and (not goal.co_updates_draft or goal.draft_digest is not None)
        and goal.frozen_draft_path is None
        and not goal.pushed
        and not goal.stages
    )


def expected_after(goal: Goal, state: EngineState, steps: tuple[Step, ...]) -> EngineState:
    """The engine's state once ``steps`` (a chain's steps before its resume) all succeeded with the answers
    the goal expects: what the check before a chained resume requires of every rank (``adapters.engine.guard_of``)."""
    for step in steps:
        state = _as_acknowledged(goal, state, step)
    return state


def _as_acknowledged(goal: Goal, state: EngineState, step: Step) -> EngineState:
    """``state`` after ``step`` succeeded, a load answering as it should (``_as_expected``)."""
    if step == Step.LOAD_VERIFIER:
        return acknowledged(state, step, goal, _as_expected(goal, Target.VERIFIER))
    if step == Step.LOAD_DRAFT:
        return acknowledged(state, step, goal, _as_expected(goal, Target.DRAFT))
    return acknowledged(state, step, goal)


def _as_expected(goal: Goal, target: Target) -> LoadResult:
    """A load of ``target`` as it should answer: the goal's revision, with a digest that verifies (the goal's,
    or a placeholder where it names none yet)."""
    if target == Target.DRAFT:
        digest, path = goal.draft_digest or _AS_REFERENCED, goal.draft_path
    else:
        digest, path = goal.verifier_digest or _AS_REFERENCED, goal.verifier_path
    return LoadResult(target, goal.revision, path, digest, bytes=0, seconds=0.0, tensors=0)


def shown_step(steps: tuple[Step, ...]) -> Step:
    """The step a chain's pod is shown at while it runs: its first load or commit (the one that takes the time),
    else its last."""
    return next((step for step in steps if step not in CHAIN_THROUGH), steps[-1])


def as_step_starts(goal: Goal, state: EngineState, steps: tuple[Step, ...]) -> EngineState:
    """The engine's state once every step of a chain before its ``shown_step`` succeeded: what it holds while
    that step runs. The status shows that meanwhile, not the state before the chain."""
    for step in steps:
        if step not in CHAIN_THROUGH:
            break
        state = acknowledged(state, step, goal)
    return state


def _committed(stage: StageState | None, target: Target) -> StageState | None:
    """The stage after ``target`` was committed from it: released after its last target (the engine frees it)."""
    if stage is None:
        return None
    if target == Target.DRAFT or stage.draft is None:
        return None
    return dataclasses.replace(stage, verifier=dataclasses.replace(stage.verifier, committed=True))


def acknowledged(
    state: EngineState,
    step: Step,
    goal: Goal,
    load: LoadResult | None = None,
    group: GroupMembership | None = None,
    stage: StageState | None = None,
) -> EngineState:
    """The engine's state after it acknowledged ``step`` with a success (HTTP 200 / an ok RPC result).

    The acknowledgement is itself an observation by the engine: a load's result carries the revision and
    digest the extension computed over what it loaded. ``reconcile.revision`` uses this between full
    observations, and always re-reads every engine before resuming it and before calling a pod done.
    """
    if step == Step.STAGE and stage is not None:
        return state.evolve(staged=stage)
    if step == Step.UNSTAGE:
        return state.evolve(staged=None)
    if step == Step.PAUSE:  # the pause withdrew the engine's admission first (where it has one)
        admitted = None if state.admitted is None else False
        return state.evolve(paused=True, sleeping=True, admitted=admitted)
    if step == Step.SLEEP:
        draft = None if state.draft is None else TargetState(policy=state.draft.policy)
        return state.evolve(resident=False, mapped=False, verifier=TargetState(), draft=draft, sleep_level=None)
    if step == Step.WAKE_WEIGHTS:
        return state.evolve(mapped=True)
    if step in (Step.LOAD_VERIFIER, Step.COMMIT_VERIFIER) and load is not None:
        verifier = TargetState(revision=load.revision, digest=load.digest, path=load.path, verified=True)
        resident = state.draft is None or state.draft.digest is not None
        staged = _committed(state.staged, Target.VERIFIER) if step == Step.COMMIT_VERIFIER else state.staged
        return state.evolve(verifier=verifier, resident=resident, staged=staged)
    if step in (Step.LOAD_DRAFT, Step.RESTORE_DRAFT, Step.COMMIT_DRAFT) and load is not None:
        policy = state.draft.policy if state.draft is not None else None
        draft = TargetState(revision=load.revision, digest=load.digest, path=load.path, verified=True, policy=policy)
        staged = _committed(state.staged, Target.DRAFT) if step == Step.COMMIT_DRAFT else state.staged
        return state.evolve(draft=draft, resident=True, staged=staged)
    if step == Step.END_SESSION and load is not None and state.session is not None:
        received = TargetState(revision=load.revision, digest=load.digest, verified=True)
        if load.target == Target.VERIFIER:
            return state.evolve(session=None, verifier=received)
        policy = state.draft.policy if state.draft is not None else None
        return state.evolve(session=None, draft=dataclasses.replace(received, policy=policy))
    if step == Step.RESUME:  # the resume stamped the weight version where the engine has versions
        version = goal.weight_version if state.versioned else state.weight_version
        return state.evolve(paused=False, sleeping=False, sleep_level=0, weight_version=version)
    if step == Step.JOIN_GROUP and goal.push.group_epoch is not None and group is not None:
        return state.evolve(group=group)
    return state
