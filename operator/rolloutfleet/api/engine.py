"""The engine-state vocabulary: what one vLLM engine looks like to the planner, as plain frozen data.

``rolloutfleet.adapters.engine.EngineClient.observe()`` builds an :class:`EngineState` from four reads
(``/is_paused``, ``/is_sleeping``, ``/weight_info`` and our extension's ``rolloutfleet_state`` RPC); the
pure planner (``rolloutfleet.planning``) consumes it to derive each pod's next step. ``LoadResult`` is
what a ``rolloutfleet_load``/``rolloutfleet_restore_draft`` RPC reported. This module does no I/O and
imports nothing of the operator but the CRD vocabulary in ``api`` (import-linter keeps it that way).

How the sleep state is derived (vLLM exposes no sleep *level* over HTTP):

- ``/is_sleeping`` is true while the engine is asleep at any level **and also while it is merely paused**
  (vLLM pauses the scheduler to sleep and reports the paused scheduler as sleeping). So ``sleeping``
  mirrors ``/is_sleeping`` verbatim and must never be read as "asleep" on its own.
- The extension reports ``resident=False`` and no revision/digest while weights are unmapped (asleep at
  level 1 or 2) *and* after a level-2 sleep until both models are reloaded, so ``resident`` does not
  tell the level either.
- Hence :func:`derive_sleep_level` gives ``0`` when ``/is_sleeping`` is false and ``None`` (unknown:
  paused, or asleep at 1 or 2) otherwise. The planner acts on what it knows (revisions, digests,
  ``resident``): ``wake_up(tags=weights)`` is harmless on awake weights, and a load into unmapped weights
  fails with the extension's ``order`` code without touching anything, so "maybe asleep" resolves by
  waking before loading.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, cast

from rolloutfleet.api.fleet import DraftPolicy as DraftPolicy  # re-exported: one vocabulary, the CRD's


class Target(enum.StrEnum):
    """Which model of an engine a load addresses."""

    VERIFIER = "verifier"
    DRAFT = "draft"


class EngineFault(enum.StrEnum):
    """Why an engine could not be observed: each asks for different handling (a 401 is no network blip)."""

    UNREACHABLE = "unreachable"  # no connection, or no answer in time
    UNAUTHORIZED = "unauthorized"  # 401/403: the control token was refused
    PROTOCOL = "protocol"  # an answer that does not follow the contract (malformed body, unexpected status)
    EXTENSION = "extension"  # the worker extension answered ok=false
    INCONSISTENT = "inconsistent"  # tensor-parallel ranks disagree


@dataclasses.dataclass(frozen=True, slots=True)
class TargetState:
    """What one model (verifier or draft) holds, per the extension.

    ``revision``/``digest`` are ``None`` when unknown: never loaded through the extension (the weights
    ``vllm serve`` started with), asleep, discarded by a level-2 sleep, or left by a failed load (the
    extension fails closed). ``verified``: the digest was computed over exactly what was loaded.
    ``policy`` is set for drafts only.
    """

    revision: int | None = None
    digest: str | None = None
    path: str | None = None
    verified: bool = False
    policy: DraftPolicy | None = None
    destroyed: bool = False  # a weight-transfer session failed into it: never serve, repair first

    @property
    def known(self) -> bool:
        """True when the content is a verified checkpoint (a digest was computed over what was loaded)."""
        return self.digest is not None


@dataclasses.dataclass(frozen=True, slots=True)
class PushSession:
    """A weight-transfer session the extension reports open (docs/push.md): the trainer sends into it."""

    target: Target
    revision: int
    epoch: int
    age_s: float = 0.0  # seconds since it was opened, by the engine's clock
    tensors: int = 0  # received so far
    bytes: int = 0
    error: str | None = None  # an update into it failed: the session is over, its target destroyed


@dataclasses.dataclass(frozen=True, slots=True)
class GroupMembership:
    """The NCCL transfer group an engine process joined (the extension records it after the join)."""

    epoch: int
    rank_offset: int
    world_size: int  # the group's, trainer included


class StagePhase(enum.StrEnum):
    """Where an engine's staging area stands (docs/staging.md)."""

    STAGING = "staging"  # reader threads fill it while the engine serves
    STAGED = "staged"  # every byte in host memory and hashed: a staged load may commit it
    FAILED = "failed"  # the checkpoint could not be staged; nothing is held
    OVER_BUDGET = "over_budget"  # the checkpoints exceed the limit; nothing is held, loads read the files


@dataclasses.dataclass(frozen=True, slots=True)
class StagedTarget:
    """One checkpoint of a stage: ``digest`` of the staged bytes (None until staged)."""

    path: str
    digest: str | None = None
    bytes: int = 0
    tensors: int = 0
    committed: bool = False  # loaded into the model from the stage


@dataclasses.dataclass(frozen=True, slots=True)
class StageState:
    """The next revision's checkpoints in the engine's pinned host memory (``rolloutfleet_state().staged``)."""

    revision: int
    phase: StagePhase
    verifier: StagedTarget
    draft: StagedTarget | None = None
    bytes_total: int = 0
    bytes_done: int = 0
    limit_bytes: int | None = None
    seconds: float = 0.0
    error_code: str | None = None
    error_message: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineState:
    """One snapshot of one engine. ``reachable=False`` means every other field is a default, not a fact."""

    reachable: bool
    paused: bool = False
    sleeping: bool = False  # vLLM's /is_sleeping verbatim: also true while merely paused
    sleep_level: int | None = 0  # 0 awake; None when it cannot be told (derive_sleep_level)
    resident: bool = False  # weights mapped and not lost (False while asleep, and after sleep(2) until reloaded)
    verifier: TargetState = dataclasses.field(default_factory=TargetState)
    draft: TargetState | None = None  # None: the engine has no draft model
    weight_version: str | None = None
    versioned: bool = True  # the engine has /weight_info and /update_weight_version (vLLM 0.26 does not)
    mapped: bool | None = True  # weights' memory mapped (False asleep); None: the extension does not say
    draft_method: str | None = None
    shared_tensors: tuple[str, ...] = ()
    ranks: int = 1  # how many workers (tensor-parallel ranks) answered, all agreeing
    error: str | None = None  # why it could not be observed, for events/status (never holds secrets)
    fault: EngineFault | None = None  # set exactly when reachable is False
    admitted: bool | None = None  # the process's readiness probe passes; None: an image without admission
    session: PushSession | None = None  # an open weight-transfer session (pushed revisions)
    instance: str | None = None  # the engine process that answered (admission names it; None: not named)
    group: GroupMembership | None = None  # NCCL: the transfer group this process joined (None: none)
    staged: StageState | None = None  # the engine's staging area (docs/staging.md; None: nothing staged)

    @classmethod
    def unreachable(cls, error: str) -> EngineState:
        """The snapshot of an engine that did not answer."""
        return cls(reachable=False, error=error, fault=EngineFault.UNREACHABLE)

    @classmethod
    def failed(cls, fault: EngineFault, error: str) -> EngineState:
        """The snapshot of an engine that could not be observed for ``fault``."""
        return cls(reachable=False, error=error, fault=fault)

    def evolve(self, **changes: Any) -> EngineState:
        """``dataclasses.replace(self, **changes)``, about four times faster.

        The operator derives a new snapshot from the last one at every acknowledged step and in the planner's
        look-ahead (``planning.transaction``): ~21 per pod per revision, 6 % of its CPU at 1,024 pods with
        ``replace`` (which builds the keyword arguments of every field and runs the frozen ``__init__``). This
        copies the fields as they are (``_copy_fields``): right because the class has no ``__post_init__`` and
        its defaults only matter to new objects (``tests/unit/engine/test_engine_state.py`` holds both, against
        ``replace``).
        """
        new = _new(EngineState)
        _copy_fields(self, new)
        for name, value in changes.items():
            if name not in _STATE_FIELD_SET:
                raise TypeError(f"EngineState has no field {name!r}")
            _set(new, name, value)
        return new

    @property
    def pair(self) -> tuple[int | None, int | None]:
        """(verifier revision, draft revision): the pair this engine would serve if resumed."""
        return (self.verifier.revision, self.draft.revision if self.draft is not None else None)

    @property
    def destroyed(self) -> bool:
        """A failed weight-transfer session left a target unusable: the engine must not serve until repaired."""
        return self.verifier.destroyed or (self.draft is not None and self.draft.destroyed)

    @property
    def serving(self) -> bool:
        """True when the engine is reachable, not paused and not asleep: requests are being served."""
        return self.reachable and not self.paused and not self.sleeping


_STATE_FIELDS = tuple(field.name for field in dataclasses.fields(EngineState))
_STATE_FIELD_SET = frozenset(_STATE_FIELDS)
_new = object.__new__
_set = object.__setattr__  # a frozen dataclass's own __init__ sets its fields this way


def _field_copier() -> Callable[[EngineState, EngineState], None]:
    """``copy(source, target)``: every field of ``source`` set on ``target``, one statement per field through
    the slot's own setter (made once, as ``dataclasses`` makes ``__init__``). A loop of ``getattr`` and
    ``object.__setattr__`` over the field names took twice as long: 2.2 µs against 1.1 per ``evolve``, which
    runs ~21 times per pod per revision (issue 18)."""
    setters = {f"_set_{name}": EngineState.__dict__[name].__set__ for name in _STATE_FIELDS}
    body = "".join(f"    _set_{name}(target, source.{name})\n" for name in _STATE_FIELDS)
    namespace: dict[str, Any] = dict(setters)
    # Named for profiles and tracebacks: ``copy_fields (<EngineState.evolve>:1)``.
    code = compile(f"def copy_fields(source, target):\n{body}", "<EngineState.evolve>", "exec")
    exec(code, namespace)  # noqa: S102 - the text is field names only
    return cast(Callable[[EngineState, EngineState], None], namespace["copy_fields"])


_copy_fields = _field_copier()


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    """What the extension reported for one successful load (or restore) on every rank, agreeing."""

    target: Target
    revision: int | None
    path: str | None  # None: received through a weight-transfer session
    digest: str
    bytes: int
    seconds: float
    tensors: int
    skipped: tuple[str, ...] = ()
    staged: bool = False  # committed from the staging area instead of read from the files


def derive_sleep_level(*, is_sleeping: bool) -> int | None:
    """0 when vLLM says it is not sleeping; None (paused, or asleep at an unknown level) otherwise."""
    return 0 if not is_sleeping else None


@dataclasses.dataclass(frozen=True, slots=True)
class PreflightResult:
    """What the extension's ``rolloutfleet_preflight`` reported on every rank, agreeing: a load of ``target``
    from ``path`` passed every check that headers and sizes allow (nothing was loaded or changed).

    ``tensors``: tensors in the checkpoint (shared ones included); ``bytes``: what a load would read and hash.
    """

    target: Target
    path: str
    tensors: int
    bytes: int
