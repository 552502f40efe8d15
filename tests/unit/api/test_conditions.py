"""Condition timestamps move only when a status flips."""

from __future__ import annotations

import datetime

from rolloutfleet.api import conditions
from rolloutfleet.api.common import ConditionStatus

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def test_transition_time_moves_only_on_flip() -> None:
    c = conditions.set_condition([], "Available", True, "AllReady", at=T0)
    c2 = conditions.set_condition(c, "Available", True, "AllReady", "new message", at=T1)
    assert c2[0].last_transition_time == T0 and c2[0].message == "new message"
    c3 = conditions.set_condition(c2, "Available", False, "PodsNotReady", at=T1)
    assert c3[0].last_transition_time == T1 and c3[0].status == ConditionStatus.FALSE


def test_same_observation_builds_equal_status() -> None:
    a = conditions.set_condition([], "Degraded", False, "AsExpected", at=T0)
    b = conditions.set_condition(a, "Degraded", False, "AsExpected", at=T1)
    assert a == b
    assert conditions.is_true(conditions.set_condition(b, "Ready", True, "Done", at=T1), "Ready")
