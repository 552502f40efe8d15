"""The operator's garbage-collector settings (``handlers.gc_tuning``) and their clock on /metrics.

Python's default young-generation threshold (700) made the cycle collector 18.6 % of the operator's CPU in a
1,024-pod rollout (bench/results/rollout_overhead.md, "Garbage collection"); ``rolloutfleet run`` freezes
what start-up loaded and collects less often. These tests hold the parsing of the override (a bad value
stops the operator with one line, before kopf starts), that the settings are applied, and that the time
the collector takes is counted and exported.
"""

from __future__ import annotations

import gc
import pathlib
from collections.abc import Iterator

import prometheus_client as prom
import pytest
import run_cli

from rolloutfleet.handlers import gc_tuning
from rolloutfleet.metrics import Metrics

pytestmark = pytest.mark.unit


@pytest.fixture
def restore_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_default_when_unset_or_empty() -> None:
    assert gc_tuning.threshold_from({}) == gc_tuning.DEFAULT_THRESHOLD
    assert gc_tuning.threshold_from({gc_tuning.ENV: "  "}) == gc_tuning.DEFAULT_THRESHOLD


def test_python_keeps_pythons_settings() -> None:
    assert gc_tuning.threshold_from({gc_tuning.ENV: "python"}) is None


def test_three_integers() -> None:
    assert gc_tuning.threshold_from({gc_tuning.ENV: "5000, 20,0"}) == (5000, 20, 0)


@pytest.mark.parametrize("raw", ["fast", "7000,10", "7000,10,10,10", "0,10,10", "7000,-1,10", "7000,ten,10"])
def test_bad_values_name_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=gc_tuning.ENV) as exc:
        gc_tuning.threshold_from({gc_tuning.ENV: raw})
    assert repr(raw) in str(exc.value)


@pytest.mark.usefixtures("restore_gc")
def test_apply_freezes_and_sets_the_thresholds() -> None:
    gc.unfreeze()
    gc_tuning.apply((4321, 9, 8))
    assert gc.get_threshold() == (4321, 9, 8)
    assert gc.get_freeze_count() > 0  # the objects alive now are out of every later collection


@pytest.mark.usefixtures("restore_gc")
def test_apply_none_changes_nothing() -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    gc_tuning.apply(None)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_the_clock_counts_collections_by_generation_and_is_exported() -> None:
    clock = gc_tuning.CollectorClock()
    metrics = Metrics(prom.CollectorRegistry())
    metrics.watch_gc(lambda: tuple(clock.seconds))
    clock.install()
    try:
        clock.install()  # twice is once: a second startup in one process must not double the counts
        assert gc.callbacks.count(clock) == 1
        garbage = [[] for _ in range(20_000)]  # something for a full collection to walk
        for inner in garbage:
            inner.append(inner)  # cycles: only the collector frees them
        del garbage
        gc.collect(2)
    finally:
        clock.remove()
    assert clock not in gc.callbacks
    assert clock.seconds[2] > 0
    full = clock.seconds[2]
    gc.collect(2)
    assert clock.seconds[2] == full  # removed: no longer counting
    exported = metrics.registry.get_sample_value("rolloutfleet_gc_seconds_total", {"generation": "2"})
    assert exported == pytest.approx(full)


def test_a_bad_threshold_stops_run_before_kopf_starts(tmp_path: pathlib.Path) -> None:
    line = run_cli.refused_line(tmp_path, {gc_tuning.ENV: "7000,10"})
    assert line.startswith(f"rolloutfleet run: {gc_tuning.ENV}='7000,10'")
