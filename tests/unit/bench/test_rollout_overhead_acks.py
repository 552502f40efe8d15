"""The bench's followers acknowledge applied latencies each in a file of their own (``bench/rollout_overhead.py``).

With several follower processes (``--engine-procs``) a shared temporary file let one follower's rename find
it gone, which killed that follower's watch: the bench then timed out waiting for a quarter of the engines.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.unit

_PATH = pathlib.Path(__file__).resolve().parents[3] / "bench" / "rollout_overhead.py"
_spec = importlib.util.spec_from_file_location("rollout_overhead", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["rollout_overhead"] = bench
_spec.loader.exec_module(bench)


def test_each_follower_writes_through_its_own_temporary_file(tmp_path: pathlib.Path) -> None:
    latency_file = tmp_path / "latencies.json"
    acks = [bench.ack_path(latency_file, i) for i in range(4)]
    temporaries = {bench._temporary(a) for a in acks}
    assert len(set(acks)) == 4 and len(temporaries) == 4
    assert all(t.parent == tmp_path and t not in acks and t != latency_file for t in temporaries)
