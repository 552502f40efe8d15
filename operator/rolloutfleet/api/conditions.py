"""Condition helpers per Kubernetes API conventions.

Called by reconcile when it builds a status. ``set_condition`` moves ``lastTransitionTime`` only when the
status flips, so a status rebuilt from the same observations compares equal and is not rewritten.
"""

from __future__ import annotations

import datetime

from rolloutfleet.api.common import Condition, ConditionStatus


def now() -> datetime.datetime:
    """The current time in UTC, truncated to seconds (the API server stores seconds)."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def find(conditions: list[Condition], type_: str) -> Condition | None:
    """The condition of that type, if any."""
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: ConditionStatus | bool,
    reason: str,
    message: str = "",
    *,
    observed_generation: int | None = None,
    at: datetime.datetime | None = None,
) -> list[Condition]:
    """A new list with the condition set; its transition time moves only when its status changes."""
    if isinstance(status, bool):
        status = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    previous = find(conditions, type_)
    transition = previous.last_transition_time if previous is not None and previous.status == status else (at or now())
    updated = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=observed_generation,
        last_transition_time=transition,
    )
    out = [c for c in conditions if c.type != type_]
    out.append(updated)
    return sorted(out, key=lambda c: c.type)


def remove_condition(conditions: list[Condition], type_: str) -> list[Condition]:
    """The list without a condition of that type (the same list when it has none, so nothing is rewritten)."""
    if find(conditions, type_) is None:
        return conditions
    return [c for c in conditions if c.type != type_]


def is_true(conditions: list[Condition], type_: str) -> bool:
    """Whether the condition exists and is True."""
    cond = find(conditions, type_)
    return cond is not None and cond.status == ConditionStatus.TRUE
