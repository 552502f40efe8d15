"""The bench's follower processes (``bench/rollout_overhead.py``): their acknowledgements, and how many there are.

With several follower processes (``--engine-procs``) a shared temporary file let one follower's rename find
it gone, which killed that follower's watch: the bench then timed out waiting for a quarter of the engines.
"""

from __future__ import annotations

import pathlib

import bench_modules
import pytest

pytestmark = pytest.mark.unit

bench = bench_modules.load("rollout_overhead")


def test_each_follower_writes_through_its_own_temporary_file(tmp_path: pathlib.Path) -> None:
    latency_file = tmp_path / "latencies.json"
    acks = [bench.ack_path(latency_file, i) for i in range(4)]
    temporaries = {bench._temporary(a) for a in acks}
    assert len(set(acks)) == 4 and len(temporaries) == 4
    assert all(t.parent == tmp_path and t not in acks and t != latency_file for t in temporaries)


@pytest.mark.parametrize(("cores", "procs"), [(1, 1), (2, 1), (4, 2), (16, 8), (64, 8)])
def test_engine_processes_default_to_half_the_cores(cores: int, procs: int) -> None:
    """One follower serving 1,024 engines on the 16-core device inflated every step it answered (the bench's
    lower bound assumes engines on time); on 2 cores a second one would only share them."""
    assert bench.default_engine_procs(cores) == procs
