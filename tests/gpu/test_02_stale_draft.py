"""GPU tier (2): the stale-draft failure, through OUR extension and the operator's engine client.

Greedy decoding with a ``draft_model`` speculator that equals the verifier accepts almost every drafted
token. Updating only the verifier (the draft left at the old revision) collapses acceptance; updating
the draft too brings it back. At each step the digests the engine reports equal the publisher's digests
of the files (``digest_directory``). Acceptance comes from ``/metrics`` deltas.
"""

from __future__ import annotations

from typing import Any

import gpu_support
import pytest
from transaction_driver import STAGING, load, staged

from rolloutfleet.adapters.engine import EngineClient

pytestmark = pytest.mark.gpu


async def test_stale_draft_collapses_and_recovers(
    server: gpu_support.Server,
    engine: EngineClient,
    revisions: gpu_support.Revisions,
    digests: dict[str, str],
    record: dict[str, Any],
) -> None:
    batch = gpu_support.prompts(4)
    r = revisions

    async def loaded(verifier: str, draft: str) -> None:
        state = await engine.extension_state()
        assert state[0]["verifier"]["digest"] == digests[verifier]
        assert state[0]["draft"] is not None and state[0]["draft"]["digest"] == digests[draft]

    # With staging on (ROLLOUTFLEET_GPU_STAGING=1) each pair is staged while serving and the loads are commits.
    if STAGING:
        await staged(engine, 101, r.verifier_a, r.draft_a)
    await engine.pause(mode="keep", clear_cache=False)
    await load(engine, "verifier", r.verifier_a, 101)
    await load(engine, "draft", r.draft_a, 101)
    await engine.resume()
    await loaded(r.verifier_a, r.draft_a)
    same = await gpu_support.acceptance(server.url, batch)

    if STAGING:
        await staged(engine, 102, r.verifier_b, r.draft_b)
    await engine.pause(mode="keep", clear_cache=False)
    await load(engine, "verifier", r.verifier_b, 102)  # draft left at revision 101: the stale draft
    await engine.resume()
    await loaded(r.verifier_b, r.draft_a)
    stale = await gpu_support.acceptance(server.url, batch)

    await engine.pause(mode="keep", clear_cache=False)
    await load(engine, "draft", r.draft_b, 102)  # staging on: the same stage's draft, still held
    await engine.resume()
    await loaded(r.verifier_b, r.draft_b)
    fixed = await gpu_support.acceptance(server.url, batch)

    record["stale_draft"] = {"draft=verifier (A)": same, "verifier B, draft A": stale, "both B": fixed}
    assert same["rate"] > 0.9, same
    assert stale["rate"] < 0.2, stale
    assert fixed["rate"] > 0.9, fixed
