"""The staging contract (docs/staging.md): the next revision's bytes move while the engine serves.

Written once, run against the simulator in CI and against real vLLM with our extension on the GPU (see
conftest.py); a difference between the two is a simulator bug. What the operator builds on: a stage
answers at once and fills in the background while completions and RPCs go on; its digests equal the
publisher's (``rolloutfleet digest``), so they can be checked on every pod before any pod pauses; a staged
load commits exactly the stage (``not_staged`` otherwise, changing nothing) and the stage is released
after its last commit; a level-2 sleep keeps it; what cannot be staged says so (``over_budget``,
``failed``) and leaves loads from the files working.

A real engine is shared by every test, so each test starts by unstaging whatever an earlier one left.
Waits poll the engine's state with a deadline: an engine offers no event for "staged".
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import struct

import pytest
from contract_support import Target, Weights, complete, header_totals, write_checkpoint

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import EngineRPCError, load_result_from_wire
from rolloutfleet.api import engine as api
from rolloutfleet.api.engine import StagePhase, StageState
from rolloutfleet_digest import digest_directory

pytestmark = pytest.mark.contract

STAGE_WAIT_SECONDS = 120.0  # a real engine stages the test checkpoints in seconds; this only bounds a hang


async def fresh(engine: EngineClient) -> None:
    """No stage held (a shared real engine may hold an earlier test's)."""
    await engine.unstage()


async def settled(engine: EngineClient, *, within: float = STAGE_WAIT_SECONDS) -> StageState:
    """The engine's stage once it is no longer ``staging``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        stage = (await engine.observe()).staged
        assert stage is not None, "the stage vanished while it was staging"
        if stage.phase != StagePhase.STAGING:
            return stage
        if loop.time() >= end:
            raise AssertionError(f"still staging after {within:g}s: {stage}")
        await asyncio.sleep(0.01)


async def staged_b(engine: EngineClient, w: Weights) -> StageState:
    """Where most tests start: revision 1 (pair A) loaded, revision 2 (pair B) staged and settled."""
    await fresh(engine)
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.stage(2, w.verifier_b, w.draft_b)
    return await settled(engine)


async def load_pair(engine: EngineClient, verifier: str, draft: str, revision: int) -> None:
    await engine.load("verifier", verifier, revision)
    await engine.load("draft", draft, revision)


async def greedy_tokens(target: Target) -> list[int]:
    """The greedy continuation of a fixed prompt: a function of the weights served."""
    status, body = await complete(target, max_tokens=16, return_token_ids=True)
    assert status == 200, body
    tokens: list[int] = body["choices"][0]["token_ids"]
    return tokens


async def refused(engine: EngineClient, target: str, path: str, revision: int) -> str:
    """The code a staged load of ``target`` answers (it must be refused)."""
    with pytest.raises(EngineRPCError) as err:
        await engine.load(target, path, revision, staged=True)
    return err.value.code


async def test_a_stage_answers_at_once_and_stages_the_publishers_digests(target: Target, engine: EngineClient) -> None:
    w = target.weights
    await fresh(engine)
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    before = await engine.observe()
    answer = await engine.stage(2, w.verifier_b, w.draft_b)
    # At once: headers only, so the sizes are known and the reading has (at most) begun.
    assert answer.revision == 2 and answer.phase in (StagePhase.STAGING, StagePhase.STAGED)
    assert answer.draft is not None and (answer.verifier.path, answer.draft.path) == (w.verifier_b, w.draft_b)
    assert (answer.verifier.tensors, answer.verifier.bytes) == header_totals(w.verifier_b)
    assert (answer.draft.tensors, answer.draft.bytes) == header_totals(w.draft_b)
    assert answer.bytes_total == answer.verifier.bytes + answer.draft.bytes and answer.limit_bytes is None
    stage = await settled(engine)
    assert stage.phase == StagePhase.STAGED and stage.error_code is None
    # The digest of docs/digest.md over every tensor: what the publisher pinned, what a load reports.
    assert stage.verifier.digest == digest_directory(w.verifier_b)
    assert stage.draft is not None and stage.draft.digest == digest_directory(w.draft_b)
    assert stage.bytes_done == stage.bytes_total
    assert not stage.verifier.committed and not stage.draft.committed
    # Staging touched nothing the planner reads: weights, claims, pause and sleep state are as they were.
    assert dataclasses.replace(await engine.observe(), staged=None) == before


async def test_restaging_answers_the_held_stage_unchanged_and_anything_else_replaces_it(
    target: Target, engine: EngineClient
) -> None:
    """The operator re-sends a stage after its own restart: that must not throw the staged bytes away."""
    w = target.weights
    await fresh(engine)
    await engine.stage(2, w.verifier_b, w.draft_b)
    staged = await settled(engine)
    assert await engine.stage(2, w.verifier_b, w.draft_b) == staged  # a new stage would answer "staging"
    assert (await engine.observe()).staged == staged
    other = await engine.stage(1, w.verifier_a, w.draft_a)
    assert other.revision == 1 and other.phase in (StagePhase.STAGING, StagePhase.STAGED)
    replaced = await settled(engine)
    assert replaced.revision == 1 and replaced.phase == StagePhase.STAGED
    assert replaced.verifier.digest == digest_directory(w.verifier_a)
    assert replaced.draft is not None and replaced.draft.digest == digest_directory(w.draft_a)


async def test_the_engine_serves_while_it_stages(target: Target, engine: EngineClient) -> None:
    """The point of staging: the bytes move without a pause, so completions keep their weights and speed."""
    w = target.weights
    await fresh(engine)
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    expected = await greedy_tokens(target)
    await engine.stage(2, w.verifier_b, w.draft_b)
    served_while_staging = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + STAGE_WAIT_SECONDS
    while True:
        assert await greedy_tokens(target) == expected  # the served weights are untouched by staging
        stage = (await engine.observe()).staged
        assert stage is not None
        if stage.phase != StagePhase.STAGING:
            break
        served_while_staging += 1  # this completion ended while the stage was still filling
        assert loop.time() < end, f"still staging after {STAGE_WAIT_SECONDS:g}s"
    assert stage.phase == StagePhase.STAGED
    if not target.real:
        # The simulated stage outlasts a completion (conftest's stage latency); a real one may stage the
        # tiny test checkpoints faster than one completion, so only the simulator can pin the overlap.
        assert served_while_staging >= 1


async def test_a_staged_load_commits_the_stage_and_the_last_commit_releases_it(
    target: Target, engine: EngineClient
) -> None:
    w = target.weights
    stage = await staged_b(engine, w)
    assert stage.draft is not None
    await engine.pause(mode="keep", clear_cache=False)
    # Every rule of a load holds for a commit: the draft only after the verifier holds its revision.
    assert await refused(engine, "draft", w.draft_b, 2) == "order"
    v = await engine.load("verifier", w.verifier_b, 2, staged=True)
    assert v.staged and (v.revision, v.path) == (2, w.verifier_b)
    assert v.digest == stage.verifier.digest == digest_directory(w.verifier_b)
    half = (await engine.observe()).staged
    assert half is not None and half.draft is not None  # the draft's bytes are still needed
    assert half.verifier.committed and not half.draft.committed
    d = await engine.load("draft", w.draft_b, 2, staged=True)
    assert d.staged and d.digest == stage.draft.digest == digest_directory(w.draft_b)
    state = await engine.observe()
    assert state.staged is None  # a second copy of the model in pinned memory buys nothing now
    assert state.pair == (2, 2) and state.draft is not None
    assert (state.verifier.digest, state.draft.digest) == (v.digest, d.digest)
    assert state.verifier.verified and state.draft.verified
    plain = await engine.load("verifier", w.verifier_a, 1)
    assert plain.staged is False  # a load from the files says so
    await engine.load("draft", w.draft_a, 1)


async def test_a_staged_load_of_anything_but_the_stage_is_not_staged_and_changes_nothing(
    target: Target, engine: EngineClient
) -> None:
    w = target.weights
    await fresh(engine)
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    before = await engine.observe()
    assert await refused(engine, "verifier", w.verifier_b, 2) == "not_staged"  # nothing staged
    assert await engine.observe() == before
    await engine.stage(2, w.verifier_b, w.draft_b)
    await settled(engine)
    before = await engine.observe()
    for tgt, path, revision in (
        ("verifier", w.verifier_b, 3),  # another revision
        ("verifier", w.verifier_a, 2),  # another path
        ("verifier", w.draft_b, 2),  # the draft's checkpoint into the verifier
        ("draft", w.draft_a, 2),
    ):
        assert await refused(engine, tgt, path, revision) == "not_staged", (tgt, path, revision)
    assert await engine.observe() == before  # the weights, their claims and the stage alike


async def test_over_budget_holds_nothing_and_loads_read_the_files(target: Target, engine: EngineClient) -> None:
    w = target.weights
    await fresh(engine)
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    answer = await engine.stage(2, w.verifier_b, w.draft_b, limit_bytes=1)
    assert answer.phase == StagePhase.OVER_BUDGET and answer.limit_bytes == 1
    assert answer.bytes_total == header_totals(w.verifier_b)[1] + header_totals(w.draft_b)[1]
    assert answer.bytes_done == 0 and answer.verifier.digest is None  # nothing was read
    observed = (await engine.observe()).staged
    assert observed is not None and observed.phase == StagePhase.OVER_BUDGET  # the operator records the fallback
    assert await refused(engine, "verifier", w.verifier_b, 2) == "not_staged"
    v = await engine.load("verifier", w.verifier_b, 2)
    d = await engine.load("draft", w.draft_b, 2)
    assert not v.staged and not d.staged and v.digest == digest_directory(w.verifier_b)
    assert (await engine.observe()).pair == (2, 2)


async def test_bad_stages_answer_the_load_codes_at_once_and_keep_the_held_stage(
    target: Target, engine: EngineClient
) -> None:
    w = target.weights
    await fresh(engine)
    await engine.stage(2, w.verifier_b, w.draft_b)
    held = await settled(engine)
    cases: list[tuple[int, str, str | None, str]] = [
        (2, "/nonexistent/rolloutfleet/checkpoint", w.draft_b, "invalid_path"),
        (2, "relative/path", None, "invalid_path"),
        (2, w.verifier_b + "/../verifier-b", None, "invalid_path"),
        (2, w.verifier_b, "/nonexistent/rolloutfleet/draft", "invalid_path"),
        (-1, w.verifier_b, w.draft_b, "invalid_revision"),
    ]
    if w.empty is not None:
        cases.append((2, w.empty, None, "invalid_path"))  # a directory without checkpoint files
    for revision, verifier, draft, code in cases:
        with pytest.raises(EngineRPCError) as err:
            await engine.stage(revision, verifier, draft)
        assert err.value.code == code, (revision, verifier, draft, err.value)
    # A refused request is no reason to throw away good staged bytes.
    assert (await engine.observe()).staged == held


async def test_unstage_releases_the_stage(target: Target, engine: EngineClient) -> None:
    w = target.weights
    held = await staged_b(engine, w)
    assert await engine.unstage() >= held.bytes_total
    assert (await engine.observe()).staged is None
    assert await refused(engine, "verifier", w.verifier_b, 2) == "not_staged"
    assert await engine.unstage() == 0  # nothing left to release


async def test_a_stage_survives_a_level2_sleep_and_its_commit_serves_the_new_revision(
    target: Target, engine: EngineClient
) -> None:
    """The staged transaction: sleep(2) frees the GPU, the commit fills it from host memory."""
    w = target.weights
    await fresh(engine)
    await load_pair(engine, w.verifier_b, w.draft_b, 2)
    expected = await greedy_tokens(target)  # revision 2 loaded from its files: the reference
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    if not target.real:
        assert await greedy_tokens(target) != expected  # else the last assertion proves nothing
    await engine.stage(2, w.verifier_b, w.draft_b)
    stage = await settled(engine)
    await engine.pause(mode="keep", clear_cache=False)
    await engine.sleep(2)
    assert (await engine.observe()).staged == stage  # pinned host memory: a level-2 sleep frees the GPU only
    await engine.wake_up(["weights"])
    await engine.load("verifier", w.verifier_b, 2, staged=True)
    await engine.load("draft", w.draft_b, 2, staged=True)
    await engine.wake_up(["kv_cache"])
    assert await engine.reset_prefix_cache()
    await engine.resume()
    state = await engine.observe()
    assert state.serving and state.resident and state.pair == (2, 2) and state.staged is None
    assert await greedy_tokens(target) == expected


def _damaged(directory: pathlib.Path, how: str) -> str:
    """A small checkpoint whose only file is damaged: ``truncated`` keeps a header that parses but cuts
    the last tensor short; ``garbled`` keeps the file's length but not a parseable header."""
    path = write_checkpoint(directory, 7, layers=1)
    shard = directory / "model.safetensors"
    raw = shard.read_bytes()
    if how == "truncated":
        shard.write_bytes(raw[:-16])
    else:
        (length,) = struct.unpack("<Q", raw[:8])
        shard.write_bytes(raw[:8] + b"!" * length + raw[8 + length :])
    return path


@pytest.mark.parametrize("how", ["truncated", "garbled"])
async def test_a_corrupt_checkpoint_fails_its_stage(
    target: Target, engine: EngineClient, tmp_path: pathlib.Path, how: str
) -> None:
    """Found while the fleet serves, not inside a pause; the engine holds nothing of it."""
    w = target.weights
    await fresh(engine)
    path = _damaged(tmp_path / f"corrupt-{how}", how)
    answer = await engine.stage(2, path, w.draft_b)
    assert answer.phase in (StagePhase.STAGING, StagePhase.FAILED)
    stage = await settled(engine)
    assert stage.phase == StagePhase.FAILED and stage.error_code == "io" and stage.error_message
    assert stage.verifier.digest is None
    assert await refused(engine, "verifier", path, 2) == "not_staged"
    assert await engine.unstage() == 0  # a failed stage holds no memory


async def test_one_sequence_commits_the_verifier_then_the_draft(target: Target, engine: EngineClient) -> None:
    """Issue 17: the commit of both targets in one request, the draft only after the verifier's commit."""
    w = target.weights
    stage = await staged_b(engine, w)
    assert stage.draft is not None
    await engine.pause(mode="keep", clear_cache=False)
    # A verifier commit that is refused (not the staged path) stops the sequence: the draft is not committed.
    wrong = [
        engine.commit_call(api.Target.VERIFIER, w.verifier_a, 2, deadline=60),
        engine.commit_call(api.Target.DRAFT, w.draft_b, 2, deadline=60),
    ]
    answer = await engine.sequence(wrong, loads=True, deadline=120)
    assert answer is not None and len(answer.parts) == 1
    with pytest.raises(EngineRPCError) as err:
        load_result_from_wire(engine.rpc_part(answer, 0, wrong[0]), url=engine.base_url, step=wrong[0].step)
    assert err.value.code == "not_staged"
    held = (await engine.observe()).staged
    assert held is not None and held.draft is not None and not held.verifier.committed and not held.draft.committed
    both = [
        engine.commit_call(api.Target.VERIFIER, w.verifier_b, 2, deadline=60),
        engine.commit_call(api.Target.DRAFT, w.draft_b, 2, deadline=60),
    ]
    answer = await engine.sequence(both, loads=True, deadline=120)
    assert answer is not None and len(answer.parts) == 2
    v, d = (
        load_result_from_wire(engine.rpc_part(answer, i, c), url=engine.base_url, step=c.step)
        for i, c in enumerate(both)
    )
    assert (v.target, d.target) == (api.Target.VERIFIER, api.Target.DRAFT) and v.staged and d.staged
    assert v.digest == stage.verifier.digest == digest_directory(w.verifier_b)
    assert d.digest == stage.draft.digest == digest_directory(w.draft_b)
    state = await engine.observe()
    assert state.pair == (2, 2) and state.staged is None
    await load_pair(engine, w.verifier_a, w.draft_a, 1)
    await engine.resume()
