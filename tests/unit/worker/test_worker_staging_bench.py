"""The pure parts of bench/staged_update.py (the staged section of bench/gpu_update.py), on CPU.

The bench itself needs the H200 and vLLM; what it computes from its measurements must not be what breaks a
device run, so the log parsing (against the worker's real log lines), the throughput windows, the summary
and the report are checked here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from worker_fakes import WorkerV1, write_eagle, write_verifier

from rolloutfleet_worker import staging

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import staged_update  # noqa: E402


def test_the_worker_log_lines_parse(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The bench reads the worker's own account of each stage and commit from the engine log: the regexes
    must match the lines the worker really writes."""
    v, d = write_verifier(tmp_path / "v", seed=1), write_eagle(tmp_path / "d", seed=1)
    w = WorkerV1()
    caplog.set_level(logging.INFO, logger="vllm.rolloutfleet")
    assert w.rolloutfleet_stage(5, str(v), str(d))["ok"]
    deadline = time.monotonic() + 20
    while (st := staging.report(w)) is not None and st["phase"] == "staging":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert w.rolloutfleet_load("verifier", str(v), 5, staged=True)["ok"]
    assert w.rolloutfleet_load("draft", str(d), 5, staged=True)["ok"]
    assert w.rolloutfleet_load("verifier", str(v), 6)["ok"]  # a load from files is not a commit
    parsed = staged_update.worker_lines(caplog.text)
    assert [s["revision"] for s in parsed["stages"]] == ["5"]
    assert parsed["stages"][0]["threads"] == 4.0 and parsed["stages"][0]["gb"] >= 0
    assert [(c["target"], c["revision"]) for c in parsed["commits"]] == [("verifier", "5"), ("draft", "5")]
    assert all({"s", "gbps", "model", "waiting", "finish"} <= c.keys() for c in parsed["commits"])


def test_throughput_counts_completions_inside_the_window() -> None:
    completions = [(0.5, 64), (1.0, 64), (1.5, 32), (3.0, 64)]
    assert staged_update.tokens_per_second(completions, 1.0, 2.0) == 96.0
    assert staged_update.tokens_per_second(completions, 2.0, 2.0) == 0.0
    assert staged_update.spread([None, 3.0, 1.0, 2.0]) == {"n": 3, "min": 1.0, "median": 2.0, "max": 3.0}
    assert staged_update.spread([None]) is None


def _run() -> dict[str, Any]:
    return {
        "ceiling": {"pinned_per_tensor_GBps": 50.0},
        "ours": [{"pause_window_s": 0.30}, {"pause_window_s": 0.34}, {"error": "boom"}],
        "staged_in_process": {
            "staging": [
                {"threads": None, "wall_s": 1.0, "GBps": 3.76, "bytes_total": 3_760_000_000},
                {"threads": 16, "wall_s": 0.5, "GBps": 7.52, "bytes_total": 3_760_000_000},
                {"threads": 16, "error": "stage ended failed"},
            ],
            "commit": {"GBps_best": 45.0, "GBps_median": 44.0},
        },
        "staged_engine": {
            "sleep_mode": [{"pause_window_s": 0.12}, {"pause_window_s": 0.14}],
            "inflight": [
                {"staged": False, "pause_window_s": 0.25},
                {"staged": True, "pause_window_s": 0.10},
                {"error": "EngineRPCError: not_staged"},
            ],
            "idle": {"tokens_per_s": 1000.0},
            "staging_while_serving": {"stage_s": [1.2, 1.1], "tokens_per_s": 900.0},
        },
    }


def test_the_summary_compares_staged_with_today() -> None:
    s = staged_update.summarize(_run())
    assert s["commit_ratio_vs_ceiling"] == pytest.approx(0.9)
    assert s["pause_window_sleep_mode_s"] == {"unstaged": pytest.approx(0.32), "staged": pytest.approx(0.13)}
    assert s["inflight_speedup"] == pytest.approx(2.5)
    assert s["serving_ratio_while_staging"] == pytest.approx(0.9)
    assert s["staging_in_process"]["16"]["seconds"]["n"] == 1  # the failed run is not averaged in
    assert s["stage_while_serving_s"]["median"] == pytest.approx(1.15)


def test_the_report_shows_numbers_and_every_error() -> None:
    out = _run()
    out["staged_summary"] = staged_update.summarize(out)
    text = "\n".join(staged_update.report_lines(out))
    assert "0.90 x the pinned ceiling" in text and "2.50x" in text
    assert "staged_engine.inflight[2]: EngineRPCError: not_staged" in text
    assert "staged_in_process.staging[2]: stage ended failed" in text
    assert "ours" not in text.split("Errors recorded")[1]  # only the staged parts' errors


def test_a_run_where_everything_failed_still_reports() -> None:
    """Each measurement is guarded: the summary and the report must cope with nothing measured."""
    out: dict[str, Any] = {
        "ceiling": {"pinned_per_tensor_GBps": 50.0},
        "staged_in_process": {"error": "RuntimeError: no CUDA"},
        "staged_engine": {"error": "EngineHTTPError: 404"},
    }
    out["staged_summary"] = staged_update.summarize(out)
    text = "\n".join(staged_update.report_lines(out))
    assert "n/a" in text and "staged_in_process: RuntimeError: no CUDA" in text

    async def boom() -> None:
        raise ValueError("nope")

    assert asyncio.run(staged_update.guarded(boom())) == {"error": "ValueError: nope"}
    assert staged_update.guarded_sync(lambda: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}


def test_latency_percentiles_of_the_window() -> None:
    requests = [(0.5, 9.0)] + [(1.0 + i / 100, 0.1 + i / 1000) for i in range(100)] + [(3.0, 9.0)]
    got = staged_update.latency(requests, 1.0, 2.0)
    assert got is not None and got["n"] == 100
    assert got["p50"] == pytest.approx(0.149) and got["p99"] == pytest.approx(0.198) and got["max"] == 0.199
    assert staged_update.latency(requests, 5.0, 6.0) is None


class _FakeClient:
    """The operator client's calls the sweep makes: a stage is staged at once, one tuning is refused."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.staged: dict[str, Any] | None = None

    async def collective_rpc(self, method: str, kwargs: dict[str, Any], idempotent: bool = False) -> list[Any]:
        assert method == "rolloutfleet_stage" and idempotent
        await asyncio.sleep(0.01)  # a stage takes time: the window holds a few
        self.sent.append(kwargs)
        if kwargs["threads"] == 1:
            return [{"ok": False, "error": {"code": "internal", "message": "no"}}]
        self.staged = {"revision": kwargs["revision"], "phase": "staged", "seconds": 0.01, "bytes_total": 10**9}
        return [{"ok": True, "stage": self.staged}]

    async def extension_state(self) -> list[dict[str, Any]]:
        return [{"staged": self.staged}]

    async def unstage(self) -> int:
        self.staged = None
        return 0


def test_the_sweep_sends_each_tuning_and_records_a_refusal() -> None:
    client = _FakeClient()
    load = staged_update.SteadyLoad("http://unused", [], 8)
    now = time.perf_counter()
    load.completions = [(now + 0.01 * i, 8) for i in range(300)]
    load.latencies = [(now + 0.01 * i, 0.2) for i in range(300)]
    goals = [{"verifier": "/v", "draft": "/d"}]
    rows = asyncio.run(staged_update._sweep(client, load, goals, itertools.count(1), 0.05, gap_s=0.0))
    assert [r["name"] for r in rows] == [s["name"] for s in staged_update.SWEEP]
    assert {(k["threads"], k["gbps"], k["pin_chunk_bytes"]) for k in client.sent} == {
        (s["threads"], s["gbps"], s["pin_chunk_bytes"]) for s in staged_update.SWEEP
    }
    refused = [r for r in rows if r["threads"] == 1]
    assert len(refused) == 1 and "refused" in refused[0]["result"]["error"]
    ok = [r for r in rows if r["threads"] != 1]
    assert all(r["result"]["stage_s"] and r["result"]["latency_s"]["p50"] == 0.2 for r in ok)

    out = _run()
    out["staged_engine"]["staging_sweep"] = rows
    out["staged_engine"]["idle"]["latency_s"] = {"p50": 0.15, "p99": 0.3}
    out["staged_summary"] = staged_update.summarize(out)
    sweep = out["staged_summary"]["staging_sweep"]
    assert [r["name"] for r in sweep] == [s["name"] for s in staged_update.SWEEP]
    assert sweep[0]["latency_p50_s"] == 0.2 and sweep[0]["stage_s_median"] is not None
    text = "\n".join(staged_update.report_lines(out))
    assert "| t4-uncapped-pin256MiB | 4 | none | 256 MiB |" in text and "| t2-cap1 | 2 | 1 | whole area |" in text
    assert "t1-uncapped" in text and "error: RuntimeError" in text
