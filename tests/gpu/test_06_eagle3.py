"""GPU tier (6): the same per-pod transaction with an EAGLE-3 head as the draft.

A second server serves verifier A with an EAGLE-3 head made on the fly (``gpu_support.write_eagle3_head``:
one ``midlayer``, ``fc`` over three of the verifier's hidden states, its own LM head, ``d2t``/``t2d``, no
embedding — vLLM shares the verifier's). Level-2 sleep cycles to B, A and B again through the operator's
planner and executor must load the verifier and then the head, verify both digests, and serve greedy
output equal to the verifier's (speculative decoding is lossless, so a random head changes only the
acceptance, recorded). The negative control (sleep 2 + wake without reload) must be caught by the state
check for the head as well, and repaired by the transaction.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import gpu_support
import pytest
from transaction_driver import converge

from rolloutfleet.adapters.engine import EngineClient, EnginePool, ResetPolicy, RetryPolicy
from rolloutfleet.planning import transaction
from rolloutfleet_digest import digest_directory

pytestmark = pytest.mark.gpu

SLEEP_STEPS = ["Pause", "Sleep", "WakeWeights", "LoadVerifier", "LoadDraft", "Resume"]


@pytest.fixture(scope="module")
def heads(revisions: gpu_support.Revisions, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """EAGLE-3 heads for the A and B verifiers (different seeds)."""
    root = tmp_path_factory.mktemp("eagle3")
    shape = gpu_support.LlamaShape()
    return {
        "a": str(gpu_support.write_eagle3_head(root / "eagle3-a", shape, seed=11)),
        "b": str(gpu_support.write_eagle3_head(root / "eagle3-b", shape, seed=12)),
    }


@pytest.fixture(scope="module")
def eagle3_server(
    revisions: gpu_support.Revisions,
    heads: dict[str, str],
    results_dir: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
    record: dict[str, Any],
) -> Iterator[gpu_support.Server]:
    srv = gpu_support.start_server(
        revisions.verifier_a,
        heads["a"],
        tmp_path_factory.mktemp("vllm-eagle3"),
        results_dir / "vllm-eagle3.log",
        gpu_memory_utilization=0.2,
        spec_method="eagle3",
    )
    try:
        record.setdefault("eagle3", {})["server_start_s"] = round(srv.started_s, 1)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def eagle3_engine(eagle3_server: gpu_support.Server) -> AsyncIterator[EngineClient]:
    async with EnginePool(
        token=eagle3_server.token, retry=RetryPolicy(attempts=2, base_delay=0.05), reset=ResetPolicy(attempts=50)
    ) as pool:
        client = pool.client(eagle3_server.url)
        yield client
        await client.wake_up()
        await client.resume()


def _goal(revisions: gpu_support.Revisions, heads: dict[str, str], revision: int, use_b: bool) -> transaction.Goal:
    verifier = revisions.verifier_b if use_b else revisions.verifier_a
    head = heads["b" if use_b else "a"]
    return transaction.Goal(
        revision=revision,
        verifier_path=verifier,
        sleep_mode=True,
        verifier_digest=digest_directory(verifier),
        draft_path=head,
        draft_digest=digest_directory(head),
    )


async def test_eagle3_head_through_level2_sleep_cycles(
    eagle3_server: gpu_support.Server,
    eagle3_engine: EngineClient,
    revisions: gpu_support.Revisions,
    heads: dict[str, str],
    record: dict[str, Any],
) -> None:
    batch = gpu_support.prompts()
    fresh_a = await gpu_support.generate(eagle3_server.url, batch)
    first = await eagle3_engine.observe()
    out: dict[str, Any] = record.setdefault("eagle3", {})
    out["draft_method"] = first.draft_method
    out["shared_tensors"] = list(first.shared_tensors)
    if "fresh_outputs_a" in record:  # the draft_model server's fresh output, when the session ran it
        out["greedy_equals_the_draft_model_server"] = fresh_a == record["fresh_outputs_a"]
    out["acceptance_fresh"] = await gpu_support.acceptance(eagle3_server.url, batch)
    assert first.draft_method == "eagle3"
    # vLLM shares the verifier's embedding with a head that has none: the extension must report it.
    assert any("embed_tokens" in name for name in first.shared_tensors), first.shared_tensors

    cycles = []
    outputs_by_pair: dict[str, list[list[list[int]]]] = {"A": [], "B": []}
    for k, use_b in enumerate((True, False, True)):
        goal = _goal(revisions, heads, 601 + k, use_b)
        steps = await converge(eagle3_engine, goal)
        state = await eagle3_engine.observe()
        outputs = await gpu_support.generate(eagle3_server.url, batch)
        pair = "B" if use_b else "A"
        outputs_by_pair[pair].append(outputs)
        cycles.append(
            {
                "revision": goal.revision,
                "pair": pair,
                "steps": steps,
                "acceptance": await gpu_support.acceptance(eagle3_server.url, batch),
            }
        )
        assert [s for s, _ in steps] == SLEEP_STEPS, steps
        assert state.serving and state.resident and state.pair == (goal.revision, goal.revision)
        assert state.verifier.digest == goal.verifier_digest
        assert state.draft is not None and state.draft.digest == goal.draft_digest
    out["cycles"] = cycles
    # Lossless: the verifier alone decides greedy output, whatever the head proposes.
    assert outputs_by_pair["A"] == [fresh_a]
    assert outputs_by_pair["B"][0] == outputs_by_pair["B"][1] != fresh_a


async def test_eagle3_wake_without_reload_is_caught(
    eagle3_server: gpu_support.Server,
    eagle3_engine: EngineClient,
    revisions: gpu_support.Revisions,
    heads: dict[str, str],
    record: dict[str, Any],
) -> None:
    batch = gpu_support.prompts()
    goal = _goal(revisions, heads, 700, use_b=False)
    await converge(eagle3_engine, goal)
    before = await gpu_support.generate(eagle3_server.url, batch)

    await eagle3_engine.pause(mode="keep", clear_cache=False)
    await eagle3_engine.sleep(2)
    await eagle3_engine.wake_up()  # every tag, no reload
    state = await eagle3_engine.observe()
    decision = transaction.next_step(goal, state)
    record.setdefault("eagle3", {})["negative_control"] = {
        "resident": state.resident,
        "pair": state.pair,
        "draft_digest": state.draft.digest if state.draft else None,
        "next_step": [decision.step.value, decision.reason],
    }
    assert not state.resident and state.pair == (None, None)
    assert state.draft is not None and state.draft.digest is None
    assert decision.step != transaction.Step.DONE

    await eagle3_engine.resume()
    repair = await converge(eagle3_engine, goal)
    record["eagle3"]["negative_control"]["repair_steps"] = repair
    assert await gpu_support.generate(eagle3_server.url, batch) == before
