"""The bench's followers acknowledge applied latencies each in a file of their own (``bench/rollout_overhead.py``).

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
