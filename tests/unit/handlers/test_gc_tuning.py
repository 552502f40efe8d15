"""The operator's garbage-collector settings (``handlers.gc_tuning``) and their clock on /metrics.

Python's default young-generation threshold (700) made the cycle collector 18.6 % of the operator's CPU in a
1,024-pod rollout (bench/results/rollout_overhead.md, "Garbage collection"); ``rolloutfleet run`` freezes
what start-up loaded and collects less often. These tests hold the parsing of the override (a bad value
stops the operator with one line, before kopf starts), that the settings are applied, and that the time
the collector takes is counted and exported.
"""

from __future__ import annotations

import asyncio
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


# --- full collections put off while a revision pass runs (``FullCollections``) -----------------------------------
# A full pass walks every object the process holds, a large fleet's settled pods among them: at 8,192-16,384 pods
# they were 10-15 % of the operator's CPU during a revision and stalled its event loop for seconds
# (bench/results/rollout_overhead_16_cores.md). Held here: while any pass runs, no full pass comes from
# allocations and young ones still do; the thresholds come back as they were when the last pass ends; a deferral
# never outlasts its limit, even under passes that always overlap.


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _full_passes_during(allocations: int) -> tuple[int, int]:
    """(young, full) collections that ``allocations`` self-referencing lists started, all kept alive until the end
    (so that they reach the oldest generation in numbers, as a revision's objects in flight do)."""
    gc.collect()  # the same start for every call: nothing pending in the oldest generation
    counted = [0, 0]
    kept: list[object] = []

    def count(phase: str, info: dict[str, object]) -> None:
        if phase == "start":
            counted[1 if info["generation"] == 2 else 0] += 1

    gc.callbacks.append(count)
    try:
        for _ in range(allocations):
            cycle: list[object] = []
            cycle.append(cycle)
            kept.append(cycle)
    finally:
        gc.callbacks.remove(count)
    return counted[0], counted[1]


@pytest.mark.usefixtures("restore_gc")
def test_no_full_pass_while_a_pass_runs_and_the_thresholds_come_back() -> None:
    gc.set_threshold(700, 2, 2)  # small, so that full passes come quickly from allocations
    young, full = _full_passes_during(300_000)
    assert young > 0 and full > 0  # the control: these allocations start full passes

    passes = gc_tuning.FullCollections(clock=FakeClock())
    passes.enter()
    passes.enter()  # a second fleet's pass, overlapping
    young, full = _full_passes_during(300_000)
    assert young > 0 and full == 0, (young, full)
    passes.leave()
    assert passes.deferring and gc.get_threshold()[2] > 1000  # one pass still runs
    passes.leave()
    assert not passes.deferring and gc.get_threshold() == (700, 2, 2)
    young, full = _full_passes_during(300_000)
    assert full > 0  # and full passes come again between passes


@pytest.mark.usefixtures("restore_gc")
def test_passes_that_run_on_get_one_full_pass_per_limit() -> None:
    # A long Rolling revision, or fleets whose passes always overlap: what waits for a full pass must not wait for
    # ever, and such passes should not meet a full pass whenever allocations ask either. One at each limit, then
    # the deferral starts over (run 4 of the 4,096-pod A/B in bench/results/rollout_overhead.md: a 131 s revision).
    clock = FakeClock()
    gc.set_threshold(7000, 10, 10)
    collected: list[float] = []
    passes = gc_tuning.FullCollections(clock=clock, max_seconds=120, collect=lambda: collected.append(clock.now))
    passes.enter()
    clock.now += 60
    passes.enter()  # another fleet's pass: the same deferral goes on
    assert passes.deferrals == 1 and passes.deferring and collected == []
    clock.now += 61
    passes.leave()  # 121 s deferred, a pass still running: one full pass, and deferred again
    assert collected == [clock.now] and passes.deferring and passes.deferrals == 2
    assert gc.get_threshold()[:2] == (7000, 10) and gc.get_threshold()[2] > 10
    clock.now += 119
    passes.enter()
    assert len(collected) == 1  # not yet 120 s since the last one
    clock.now += 1
    passes.leave()
    assert len(collected) == 2 and passes.collected == 2
    passes.leave()  # none runs: the thresholds are back, nothing else collected
    assert not passes.deferring and gc.get_threshold() == (7000, 10, 10) and len(collected) == 2


async def test_a_pass_that_never_ends_gets_its_full_pass_from_the_loop_s_timer() -> None:
    threshold = gc.get_threshold()
    collected: list[int] = []
    second = asyncio.Event()

    def collect() -> None:
        collected.append(1)
        if len(collected) >= 2:
            second.set()

    passes = gc_tuning.FullCollections(max_seconds=0.05, collect=collect)
    try:
        passes.enter()
        assert passes.deferring
        # Nothing calls enter() or leave(): only the loop's timer can run the full passes, again and again.
        await asyncio.wait_for(second.wait(), timeout=10)
        assert passes.deferring
        passes.leave()
        assert not passes.deferring and gc.get_threshold() == threshold
        after = len(collected)
        await asyncio.sleep(0.2)  # four limits' worth of time: a timer left behind would have fired
        assert len(collected) == after
    finally:
        gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restore_gc")
def test_off_with_pythons_own_settings() -> None:
    assert gc_tuning.tuned({}) and not gc_tuning.tuned({gc_tuning.ENV: "python"})
    before = gc.get_threshold()
    passes = gc_tuning.FullCollections(enabled=False)
    passes.enter()
    assert not passes.deferring and gc.get_threshold() == before
    passes.leave()
