"""GPU tier (4): mode ``inflight`` with requests in flight, through the operator's transaction code.

Long greedy requests run on revision A; the transaction (pause keep → load verifier → load draft → set
version → resume, no sleep) moves the engine to B while they are frozen. They must all complete (no
abort, every token), start as A's output and diverge from it once B took over. Where the engine stamps
weight versions (vLLM ≥ 0.33: ``return_weight_versions``) the spans must read A's version then B's, split
where the tokens diverge; vLLM 0.26 cannot stamp, which is recorded instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import gpu_support
import pytest
from transaction_driver import converge, expected, goal_for

from rolloutfleet.adapters.engine import EngineClient

pytestmark = pytest.mark.gpu

MAX_TOKENS = 1800


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_inflight_update_with_requests_in_flight(
    server: gpu_support.Server,
    engine: EngineClient,
    revisions: gpu_support.Revisions,
    digests: dict[str, str],
    record: dict[str, Any],
) -> None:
    stamps = gpu_support.route_status(server.url, server.token, "GET", "/weight_info") == 200
    extra = {"return_weight_versions": True} if stamps else {}
    batch = gpu_support.prompts(4)
    goal_a = goal_for(revisions, digests, 400, use_b=False, sleep_mode=False)
    goal_b = goal_for(revisions, digests, 401, use_b=True, sleep_mode=False)
    await converge(engine, goal_a)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    only_a = await asyncio.gather(*(gpu_support.complete(server.url, p, MAX_TOKENS) for p in batch))
    a_seconds = loop.time() - t0
    reference = [body["choices"][0]["token_ids"] for _, body in only_a]

    pending = [asyncio.ensure_future(gpu_support.complete(server.url, p, MAX_TOKENS, **extra)) for p in batch]
    await asyncio.sleep(min(0.25, a_seconds / 4))
    steps = await converge(engine, goal_b)
    done = await asyncio.wait_for(asyncio.gather(*pending), 120)
    state = await engine.observe()

    results = []
    for (status, body), ref in zip(done, reference, strict=True):
        choice = body["choices"][0]
        tokens = choice.get("token_ids") or []
        results.append(
            {
                "status": status,
                "finish_reason": choice.get("finish_reason"),
                "tokens": len(tokens),
                "switch_at": common_prefix(tokens, ref),
                "weight_versions": choice.get("weight_versions"),
            }
        )
    record["inflight"] = {
        "a_only_seconds_for_batch": round(a_seconds, 3),
        "steps": steps,
        "engine_stamps_weight_versions": stamps,
        "requests": results,
    }
    plain = ["Pause", "LoadVerifier", "LoadDraft", "Resume"]  # the resume stamps the version (0.26: none)
    assert [s for s, _ in steps] == expected(plain)
    assert state.serving and state.pair == (401, 401)
    for r in results:
        assert r["status"] == 200 and r["finish_reason"] == "length" and r["tokens"] == MAX_TOKENS, r
    switched = [r for r in results if 0 < r["switch_at"] < MAX_TOKENS]
    assert switched, f"no request was in flight across the update: {results}"
    if stamps:
        for r in switched:
            spans = r["weight_versions"]
            assert [s["version"] for s in spans] == ["400", "401"], spans
            assert spans[0]["start"] == 0 and spans[-1]["end"] == MAX_TOKENS
            assert spans[0]["end"] <= r["switch_at"], (spans, r["switch_at"])
