"""``EngineState.evolve``: the operator's fast ``dataclasses.replace`` for its hottest value type.

It copies fields without running ``__init__``; these tests hold it to ``replace``'s result for every field,
so that a field added later, or a ``__post_init__`` that would be skipped, shows up here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rolloutfleet.api import engine
from rolloutfleet.api.engine import EngineState, TargetState

# A snapshot with no field at its default, so that a field evolve forgot to copy would show.
FULL = EngineState(
    reachable=True,
    paused=True,
    sleeping=True,
    sleep_level=None,
    resident=True,
    verifier=TargetState(revision=3, digest="v3", path="/p/v3", verified=True),
    draft=TargetState(revision=3, digest="d3", path="/p/d3", verified=True, policy=engine.DraftPolicy.CO_UPDATE),
    weight_version="step-3",
    versioned=False,
    mapped=None,
    draft_method="eagle",
    shared_tensors=("lm_head.weight",),
    ranks=2,
    error="why",
    fault=engine.EngineFault.PROTOCOL,
    admitted=False,
    session=engine.PushSession(engine.Target.VERIFIER, 4, epoch=2),
    instance="pid-7",
    group=engine.GroupMembership(epoch=2, rank_offset=1, world_size=3),
    staged=engine.StageState(4, engine.StagePhase.STAGED, engine.StagedTarget("/p/v4")),
)
DEFAULTS = EngineState(reachable=False)


def test_every_field_of_the_full_snapshot_differs_from_its_default() -> None:
    same = [f.name for f in dataclasses.fields(EngineState) if getattr(FULL, f.name) == getattr(DEFAULTS, f.name)]
    assert same == []  # else a field evolve failed to copy could go unnoticed below


def test_evolve_without_changes_equals_the_original() -> None:
    copy = FULL.evolve()
    assert copy == FULL
    assert copy is not FULL


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EngineState)])
def test_evolve_changes_one_field_as_replace_does(field: str) -> None:
    value: Any = getattr(DEFAULTS, field)
    evolved = FULL.evolve(**{field: value})
    assert evolved == dataclasses.replace(FULL, **{field: value})
    assert getattr(evolved, field) == value
    assert getattr(FULL, field) != value  # the original is untouched


def test_evolve_refuses_a_field_the_class_does_not_have() -> None:
    with pytest.raises(TypeError, match="no field 'pausd'"):
        FULL.evolve(pausd=True)


def test_evolved_snapshots_stay_frozen_and_hashable_like_constructed_ones() -> None:
    evolved = FULL.evolve(paused=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolved.paused = True  # type: ignore[misc]
    assert hash(evolved) == hash(dataclasses.replace(FULL, paused=False))


def test_the_class_has_no_post_init_that_evolve_would_skip() -> None:
    assert not hasattr(EngineState, "__post_init__")
