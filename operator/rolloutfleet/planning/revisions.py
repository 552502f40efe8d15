"""Pure selection of what a fleet's engines should hold, from its WeightRevisions and its status.

Called by ``reconcile.revision`` at the start of every pass. Decides which revision is active (the newest
unfinished valid one), which are superseded, refused (invalid, duplicate, not newer) or finished, and
turns the chosen revision — or the previous one when rolling back — into a ``transaction.Goal``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rolloutfleet.api import validation
from rolloutfleet.api.fleet import DraftMethod, DraftPolicy, PrefixCaching, RolloutFleetSpec, UpdateMode
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
    deleted: bool = False  # its object went away while a pass worked on it (a 404 on a status write)
    # ``status`` as last written, in wire form, and the status object it is of (``reconcile.status_writes``):
    # each progress write compares against it instead of serialising the stored status again.
    written_wire: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    written_of: WeightRevisionStatus | None = dataclasses.field(default=None, compare=False, repr=False)

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
class Served:
    """What the fleet serves, as recorded in its status when a revision completed (``status.served``).

    Steady state and rollbacks target this record, never the WeightRevision objects: deleting or pruning
    them (Argo CD, Flux) must not change what is served. ``None`` stands for the fleet's initial weights.
    The digests are the ones every engine reported when the revision completed.
    """

    revision: int
    verifier_path: str | None  # None: the trainer pushed it (nothing on a volume to re-read)
    verifier_digest: str | None = None
    draft_path: str | None = None
    draft_digest: str | None = None
    name: str | None = None
    verifier_pushed: bool = False
    draft_pushed: bool = False

    @property
    def pushed(self) -> bool:
        """Some of it only the trainer can send again (a rollback to it, or a catch-up, needs the trainer)."""
        return self.verifier_pushed or self.draft_pushed


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a pass works on."""

    active: Revision | None
    rolling_back: bool
    goal: Goal | None
    superseded: tuple[Revision, ...]
    refused: tuple[Refusal, ...]
    served: Served | None  # what the fleet serves (None: its initial weights)
    already_served: tuple[Revision, ...] = ()  # unfinished revisions that are exactly what is served

    @property
    def current_number(self) -> int:
        """The revision number the fleet serves (0: its initial weights)."""
        return self.served.revision if self.served is not None else INITIAL_REVISION


def _goal(fleet: RolloutFleetSpec, source: Revision | Served | None, mode: UpdateMode) -> Goal:
    goal = dataclasses.replace(_paths(fleet, source, mode), reset_prefix_cache=prefix_caching_on(fleet))
    method = fleet.draft.method
    return dataclasses.replace(
        goal, draft_method=None if method == DraftMethod.NONE else method.value, stage_limit=stage_limit(fleet)
    )


def stage_limit(fleet: RolloutFleetSpec) -> int | None:
    """Bytes each engine worker may stage (docs/staging.md); None: the fleet does not stage.

    Every tensor-parallel worker of a pod stages whole checkpoints (each rank's ``load_weights`` takes its
    own slices from the full tensors), so the pod's limit is split between them.
    """
    staging = fleet.update_strategy.staging
    if not staging.enabled:
        return None
    return max(1, staging.limit_bytes // fleet.tensor_parallel_size)


def prefix_caching_on(fleet: RolloutFleetSpec) -> bool:
    """Whether engines cache prefixes (then every update resets the cache before serving again)."""
    if not fleet.parity.enabled:
        return "--enable-prefix-caching" in fleet.extra_args or "--no-enable-prefix-caching" not in fleet.extra_args
    return fleet.parity.prefix_caching == PrefixCaching.RESET_ON_UPDATE


def _paths(fleet: RolloutFleetSpec, source: Revision | Served | None, mode: UpdateMode) -> Goal:
    draft = fleet.draft
    frozen = draft.policy == DraftPolicy.FROZEN and draft.path is not None
    sleep_mode = mode == UpdateMode.SLEEP
    if isinstance(source, Served):
        own_draft = not frozen and draft.method != DraftMethod.NONE
        return Goal(
            revision=source.revision,
            verifier_path=source.verifier_path,
            verifier_digest=source.verifier_digest,
            verifier_pushed=source.verifier_pushed,
            sleep_mode=sleep_mode,
            draft_path=source.draft_path if own_draft else None,
            draft_digest=source.draft_digest if own_draft else None,
            draft_pushed=source.draft_pushed and own_draft,
            frozen_draft_path=draft.path if frozen else None,
            frozen_draft_digest=draft.digest,
        )
    if source is None or source.spec is None:
        return Goal(
            revision=INITIAL_REVISION,
            verifier_path=fleet.verifier.path,
            sleep_mode=sleep_mode,
            draft_path=None if frozen else draft.path,
            frozen_draft_path=draft.path if frozen else None,
            frozen_draft_digest=draft.digest,
        )
    spec = source.spec
    return Goal(
        revision=spec.revision,
        verifier_path=spec.verifier.path,
        verifier_digest=spec.verifier.digest,
        verifier_pushed=spec.verifier.pushed,
        sleep_mode=sleep_mode,
        draft_path=None if frozen or spec.draft is None else spec.draft.path,
        draft_digest=None if spec.draft is None else spec.draft.digest,
        draft_pushed=not frozen and spec.draft is not None and spec.draft.pushed,
        frozen_draft_path=draft.path if frozen else None,
        frozen_draft_digest=draft.digest,
    )


def initial_goal(fleet: RolloutFleetSpec) -> Goal:
    """The goal of the fleet's initial weights (what every engine starts on)."""
    return _goal(fleet, None, fleet.update_strategy.mode)


def served_goal(fleet: RolloutFleetSpec, served: Served | None) -> Goal | None:
    """The goal of keeping what the fleet serves (None on the initial weights: nothing to keep)."""
    return _goal(fleet, served, fleet.update_strategy.mode) if served is not None else None


def serves_exactly(served: Served | None, spec: WeightRevisionSpec) -> bool:
    """The revision is what the fleet serves: same number, same sources, digests (where pinned) equal."""
    if served is None or spec.revision != served.revision or spec.verifier.path != served.verifier_path:
        return False
    if spec.verifier.pushed != served.verifier_pushed:
        return False
    if spec.verifier.digest is not None and spec.verifier.digest != served.verifier_digest:
        return False
    draft_path = spec.draft.path if spec.draft is not None else None
    if draft_path != served.draft_path or (spec.draft is not None and spec.draft.pushed) != served.draft_pushed:
        return False
    return spec.draft is None or spec.draft.digest is None or spec.draft.digest == served.draft_digest


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


def select(fleet: RolloutFleetSpec, served: Served | None, revisions: list[Revision]) -> Selection:
    """Choose the active revision and the goal of this pass.

    GitOps semantics (docs/gitops/README.md): an unfinished revision that is exactly what the fleet serves
    (re-applied after a prune, or finishing after an operator crash between the two status writes) is
    ``already_served``: Ready at once, no pod touched. One with the served number but other sources, or an
    older number, is refused ``NotNewer`` unless it sets ``allowOlder`` (a deliberate rollback). Deleting a
    revision that has not completed cancels it: the goal falls back to ``served``.
    """
    refused: list[Refusal] = []
    already: list[Revision] = []
    current_number = served.revision if served is not None else None
    candidates: list[Revision] = []
    seen_numbers: dict[int, Revision] = {}
    for rev in sorted(revisions, key=lambda r: (r.created, r.name)):
        if rev.final:
            continue
        if rev.spec is None:
            refused.append(Refusal(rev, "ValidationFailed", validation.summary(list(rev.parse_errors))))
            continue
        if serves_exactly(served, rev.spec) and rev.status.reason != ROLLING_BACK:
            already.append(rev)
            continue
        errors = validation.validate_revision(rev.spec, fleet, current_revision=current_number)
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
        goal = _goal(fleet, served if rolling_back else active, mode)
        return Selection(active, rolling_back, goal, superseded, tuple(refused), served, tuple(already))
    # Nothing to roll: keep every pod (new ones too) on what the fleet serves. On its initial weights there
    # is nothing to keep: every engine starts on them (and reports no revision, having loaded nothing).
    keep = _goal(fleet, served, mode_of(fleet, None)) if served is not None else None
    return Selection(None, False, keep, superseded, tuple(refused), served, tuple(already))
