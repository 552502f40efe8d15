"""Pure selection of what a fleet's engines should hold, from its WeightRevisions and its status.

Called by ``reconcile.revision`` at the start of every pass. Decides which revision is active (the newest
unfinished valid one), which are superseded, refused (invalid, duplicate, not newer) or finished, and
turns the chosen revision — or the previous one when rolling back — into a ``transaction.Goal``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rolloutfleet.api import validation
from rolloutfleet.api.fleet import DraftPolicy, PrefixCaching, RolloutFleetSpec, UpdateMode
from rolloutfleet.api.revision import Phase, WeightRevisionSpec, WeightRevisionStatus
from rolloutfleet.planning import rollout
from rolloutfleet.planning.transaction import INITIAL_REVISION, Goal

FINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.SUPERSEDED, Phase.ROLLED_BACK})
ROLLING_BACK = "RollingBack"


@dataclasses.dataclass
class Revision:
    """One WeightRevision as observed (its status is updated in place as a pass writes it)."""

    name: str
    created: str
    spec: WeightRevisionSpec | None
    status: WeightRevisionStatus
    parse_errors: tuple[validation.FieldError, ...] = ()
    body: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def number(self) -> int:
        return self.spec.revision if self.spec is not None else -1

    @property
    def final(self) -> bool:
        return self.status.phase in FINAL


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A revision to mark Failed without touching any engine."""

    revision: Revision
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a pass works on."""

    active: Revision | None
    rolling_back: bool
    goal: Goal | None
    superseded: tuple[Revision, ...]
    refused: tuple[Refusal, ...]
    current: Revision | None  # the revision the fleet serves (None: initial weights)


def _goal(fleet: RolloutFleetSpec, rev: Revision | None, mode: UpdateMode) -> Goal:
    return dataclasses.replace(_paths(fleet, rev, mode), reset_prefix_cache=prefix_caching_on(fleet))


def prefix_caching_on(fleet: RolloutFleetSpec) -> bool:
    """Whether engines cache prefixes (then every update resets the cache before serving again)."""
    if not fleet.parity.enabled:
        return "--enable-prefix-caching" in fleet.extra_args or "--no-enable-prefix-caching" not in fleet.extra_args
    return fleet.parity.prefix_caching == PrefixCaching.RESET_ON_UPDATE


def _paths(fleet: RolloutFleetSpec, rev: Revision | None, mode: UpdateMode) -> Goal:
    draft = fleet.draft
    frozen = draft.policy == DraftPolicy.FROZEN and draft.path is not None
    if rev is None or rev.spec is None:
        return Goal(
            revision=INITIAL_REVISION,
            verifier_path=fleet.verifier.path,
            sleep_mode=mode == UpdateMode.SLEEP,
            draft_path=None if frozen else draft.path,
            frozen_draft_path=draft.path if frozen else None,
            frozen_draft_digest=draft.digest,
        )
    spec = rev.spec
    return Goal(
        revision=spec.revision,
        verifier_path=spec.verifier.path,
        verifier_digest=spec.verifier.digest,
        sleep_mode=mode == UpdateMode.SLEEP,
        draft_path=None if frozen or spec.draft is None else spec.draft.path,
        draft_digest=None if spec.draft is None else spec.draft.digest,
        frozen_draft_path=draft.path if frozen else None,
        frozen_draft_digest=draft.digest,
    )


def mode_of(fleet: RolloutFleetSpec, rev: Revision | None) -> UpdateMode:
    """The update mode a revision rolls with (its override, else the fleet's)."""
    override = rev.spec.strategy if rev is not None and rev.spec is not None else None
    return (override.mode if override is not None and override.mode else None) or fleet.update_strategy.mode


def plan_budget(fleet: RolloutFleetSpec, rev: Revision | None, total: int) -> rollout.Budget:
    """The strategy in force for ``rev`` (the fleet's when there is no revision).

    A revision with a parity probe always has at least one canary: the probe runs on the canaries before
    the rest of the fleet moves.
    """
    override = rev.spec.strategy if rev is not None and rev.spec is not None else None
    plan = rollout.budget(fleet.update_strategy, override, total)
    if rev is not None and rev.spec is not None and rev.spec.parity_probe is not None and plan.canary < 1:
        plan = dataclasses.replace(plan, canary=min(1, total))
    return plan


def select(fleet: RolloutFleetSpec, current_revision: int | None, revisions: list[Revision]) -> Selection:
    """Choose the active revision and the goal of this pass."""
    refused: list[Refusal] = []
    current = next((r for r in revisions if r.status.phase == Phase.SUCCEEDED and r.number == current_revision), None)
    candidates: list[Revision] = []
    seen_numbers: dict[int, Revision] = {}
    for rev in sorted(revisions, key=lambda r: (r.created, r.name)):
        if rev.final:
            if rev.status.phase != Phase.FAILED and rev.spec is not None:
                seen_numbers.setdefault(rev.number, rev)
            continue
        if rev.spec is None:
            refused.append(Refusal(rev, "ValidationFailed", validation.summary(list(rev.parse_errors))))
            continue
        # The fleet's currentRevision moves before the revision's phase does (so that a crash between the
        # two writes never rolls pods backwards): an unfinished revision equal to it is finishing, not stale.
        finishing = rev.number == current_revision and rev.status.phase == Phase.PROGRESSING and current is None
        errors = validation.validate_revision(rev.spec, fleet, current_revision=None if finishing else current_revision)
        if errors:
            reason = "NotNewer" if all(e.path == "spec.revision" for e in errors) else "ValidationFailed"
            refused.append(Refusal(rev, reason, validation.summary(errors)))
            continue
        twin = seen_numbers.get(rev.number)
        if twin is not None:
            refused.append(
                Refusal(rev, "DuplicateRevision", f"spec.revision: {rev.number} is already used by {twin.name}")
            )
            continue
        seen_numbers[rev.number] = rev
        candidates.append(rev)
    candidates.sort(key=lambda r: r.number)
    active = candidates[-1] if candidates else None
    superseded = tuple(candidates[:-1])
    if active is not None:
        rolling_back = active.status.reason == ROLLING_BACK
        mode = mode_of(fleet, active)
        goal = _goal(fleet, current if rolling_back else active, mode)
        return Selection(active, rolling_back, goal, superseded, tuple(refused), current)
    # Nothing to roll: keep every pod (new ones too) on the current revision, if the fleet has one.
    keep = _goal(fleet, current, mode_of(fleet, current)) if current is not None else None
    return Selection(None, False, keep, superseded, tuple(refused), current)
