"""The simulator's side of our extension's push RPCs (docs/push.md "Engine side"): ``rolloutfleet_push_begin``
and ``rolloutfleet_push_end`` around vLLM's sessions, the session in ``rolloutfleet_state``, ``destroyed``
per target, and the digest of exactly what was received. Codes and payloads as
``rolloutfleet_worker.payloads``; vLLM's routes themselves are in ``test_sim_transfer.py``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest
from transfer_support import (
    Checkpoints,
    names_of,
    post,
    rpc,
    session,
    state,
    update_info,
    write_checkpoint,
)

from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.engine_wire import EngineRPCError
from rolloutfleet.sim import EngineSpec, SimulatedEngine, SimulatedFleet
from rolloutfleet_digest import digest_directory

# None of these tests is about a timeout (conftest.py).
ROOMY_DEADLINES = True


@pytest.fixture
def spec(ckpts: Checkpoints) -> EngineSpec:
    return EngineSpec(verifier_path=ckpts.verifier_a, draft_path=ckpts.draft_a, weight_transfer={"backend": "ipc"})


async def push(sim: SimulatedEngine, target: str, checkpoint: str, revision: int, epoch: int) -> dict[str, Any]:
    """The operator's bracket around one trainer send: begin, vLLM's session, end."""
    assert (await rpc(sim, "rolloutfleet_push_begin", target=target, revision=revision, epoch=epoch))["ok"]
    start = "/start_draft_weight_update" if target == "draft" else "/start_weight_update"
    assert await session(sim, start, update_info(checkpoint)) == (200, 200, 200)
    return await rpc(sim, "rolloutfleet_push_end")


def code(result: dict[str, Any]) -> str:
    assert result["ok"] is False, result
    return str(result["error"]["code"])


async def test_a_good_push_verifies_the_digest_of_exactly_what_was_received(
    sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    begun = await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=7, epoch=3)
    assert begun == {"ok": True, "target": "verifier", "revision": 7, "epoch": 3, "rank": 0}
    opened = await state(sim)
    assert opened["verifier"]["revision"] is None  # its content is about to change: nothing claimed
    assert opened["session"] | {"age_s": 0} == {
        "target": "verifier",
        "revision": 7,
        "epoch": 3,
        "age_s": 0,
        "tensors": 0,
        "bytes": 0,
        "error": None,
    }
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert (await post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)}))[0] == 200
    sending = (await state(sim))["session"]
    assert (sending["tensors"], sending["bytes"]) == (3, 32 * 8 * 4 + 2 * 8 * 8 * 4)
    assert (await post(sim, "/finish_weight_update"))[0] == 200
    ended = await rpc(sim, "rolloutfleet_push_end")
    assert ended | {"seconds": 0} == {
        "ok": True,
        "target": "verifier",
        "revision": 7,
        "epoch": 3,
        "path": None,
        "digest": digest_directory(ckpts.verifier_b),  # what `rolloutfleet digest` says of the same tensors
        "bytes": sending["bytes"],
        "seconds": 0,
        "tensors": 3,
        "skipped": [],
        "rank": 0,
    }
    after = await state(sim)
    assert after["session"] is None
    assert after["verifier"] == {
        "revision": 7,
        "digest": ended["digest"],
        "path": None,
        "verified": True,
        "destroyed": False,
    }
    # The draft's turn: its order rule is met by the pushed verifier.
    drafted = await push(sim, "draft", ckpts.draft_b, 7, 4)
    assert drafted["ok"] and drafted["digest"] == digest_directory(ckpts.draft_b)
    pair = sim.core.pair()  # what serves next: both pushed at revision 7, a matched pair
    assert (pair["verifier"], pair["draft"], pair["verifier_content"], pair["draft_content"], pair["mixed"]) == (
        7,
        7,
        "pushed",
        "pushed",
        False,
    )


async def test_the_operators_client_drives_a_push(
    sim: SimulatedEngine, client: EngineClient, ckpts: Checkpoints
) -> None:
    await client.init_weight_transfer({})
    await client.push_begin("verifier", 2, 1)
    observed = await client.observe()
    assert observed.session is not None and observed.session.epoch == 1 and observed.session.error is None
    await client.start_weight_update("verifier")
    assert (await post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)}))[0] == 200
    await client.finish_weight_update()
    result = await client.push_end()
    assert result.path is None and result.revision == 2 and result.digest == digest_directory(ckpts.verifier_b)
    observed = await client.observe()
    assert observed.session is None and observed.verifier.verified and not observed.verifier.destroyed
    with pytest.raises(EngineRPCError) as err:
        await client.push_end()
    assert err.value.code == "no_session"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"target": "embedding", "revision": 1, "epoch": 1}, "invalid_target"),
        ({"target": "verifier", "revision": -1, "epoch": 1}, "invalid_revision"),
        ({"target": "verifier", "revision": 1, "epoch": True}, "invalid_epoch"),
        ({"target": "draft", "revision": 1, "epoch": 1}, "order"),  # the verifier holds nothing verified
    ],
)
async def test_push_begin_refuses_bad_arguments_and_the_draft_first(
    sim: SimulatedEngine, kwargs: dict[str, Any], expected: str
) -> None:
    assert code(await rpc(sim, "rolloutfleet_push_begin", **kwargs)) == expected
    assert (await state(sim))["session"] is None


async def test_push_begin_refuses_while_a_session_is_open(sim: SimulatedEngine, client: EngineClient) -> None:
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=1, epoch=1))["ok"]
    assert code(await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=1, epoch=2)) == "busy"
    assert (await state(sim))["session"]["epoch"] == 1  # the open session is untouched
    assert code(await rpc(sim, "rolloutfleet_push_end", abandon=True)) == "abandoned"
    # A bare vLLM session (someone else's) is as busy; and a path load waits for no session either.
    fresh = await post(sim, "/start_draft_weight_update")
    assert fresh[0] == 200
    assert code(await rpc(sim, "rolloutfleet_push_begin", target="draft", revision=1, epoch=3)) == "busy"
    with pytest.raises(EngineRPCError) as err:
        await client.load("draft", sim.spec.draft_path or "", 1)
    assert err.value.code == "busy"


async def test_push_begin_refuses_an_engine_without_the_transfer_config_or_the_draft(
    fleet: SimulatedFleet, spec: EngineSpec
) -> None:
    plain = await fleet.add("127.0.0.3", 0, spec=dataclasses.replace(spec, weight_transfer=None))
    assert code(await rpc(plain, "rolloutfleet_push_begin", target="verifier", revision=1, epoch=1)) == "no_transfer"
    solo = await fleet.add("127.0.0.4", 0, spec=dataclasses.replace(spec, draft_path=None))
    assert code(await rpc(solo, "rolloutfleet_push_begin", target="draft", revision=1, epoch=1)) == "no_draft"
    frozen = await fleet.add("127.0.0.5", 0, spec=dataclasses.replace(spec, draft_policy="frozen"))
    assert code(await rpc(frozen, "rolloutfleet_push_begin", target="draft", revision=1, epoch=1)) == "frozen"


async def test_push_begin_refuses_sleeping_weights(sim: SimulatedEngine, client: EngineClient) -> None:
    await client.pause("keep", clear_cache=False)
    await client.sleep(2)
    assert code(await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=1, epoch=1)) == "order"


async def test_an_incomplete_push_destroys_its_target_until_a_restart(
    sim: SimulatedEngine, client: EngineClient, ckpts: Checkpoints
) -> None:
    names = names_of(ckpts.verifier_b)
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=2, epoch=1))["ok"]
    assert await session(sim, "/start_weight_update", update_info(ckpts.verifier_b, only=names[:1])) == (
        200,
        200,
        200,
    )
    ended = await rpc(sim, "rolloutfleet_push_end")
    assert code(ended) == "incomplete" and names[1] in ended["error"]["message"]
    after = await state(sim)
    assert after["verifier"]["destroyed"] is True and after["verifier"]["revision"] is None
    assert after["resident"] is False
    with pytest.raises(EngineRPCError) as err:
        await client.load("verifier", ckpts.verifier_a, 1)
    assert err.value.code == "destroyed"
    assert code(await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=3, epoch=2)) == "destroyed"
    await client.pause("keep", clear_cache=False)
    await client.wake_up(["weights"])  # takes a failed update off meta; the extension's verdict stays
    assert (await state(sim))["verifier"]["destroyed"] is True
    await sim.restart()  # the operator's repair: a new engine process on the initial weights
    await client.load("verifier", ckpts.verifier_a, 1)


async def test_a_failed_update_fails_the_push_and_the_state_shows_it_first(
    sim: SimulatedEngine, ckpts: Checkpoints
) -> None:
    layer = names_of(ckpts.verifier_b)[-1]
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=2, epoch=1))["ok"]
    assert (await post(sim, "/start_weight_update"))[0] == 200
    wrong = update_info(ckpts.verifier_b, shapes={layer: [64]})
    assert (await post(sim, "/update_weights", {"update_info": wrong}))[0] == 500
    during = await state(sim)
    assert during["session"]["error"] is not None and layer in during["session"]["error"]
    assert during["verifier"]["destroyed"] is True
    ended = await rpc(sim, "rolloutfleet_push_end")
    assert code(ended) == "failed"
    assert (await state(sim))["session"] is None


async def test_a_tensor_sent_twice_fails_the_update(sim: SimulatedEngine, ckpts: Checkpoints) -> None:
    """The extension raises inside load_weights: the digest of what was received would be ambiguous."""
    info = update_info(ckpts.verifier_b)
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=2, epoch=1))["ok"]
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert (await post(sim, "/update_weights", {"update_info": info}))[0] == 200
    status, answer = await post(sim, "/update_weights", {"update_info": info})
    assert status == 500 and "received twice in one session" in answer["error"]["message"]
    assert code(await rpc(sim, "rolloutfleet_push_end")) == "failed"


async def test_push_end_before_vllms_finish_fails_the_session(sim: SimulatedEngine, ckpts: Checkpoints) -> None:
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=2, epoch=1))["ok"]
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert (await post(sim, "/update_weights", {"update_info": update_info(ckpts.verifier_b)}))[0] == 200
    ended = await rpc(sim, "rolloutfleet_push_end")
    assert code(ended) == "failed" and "/finish_weight_update first" in ended["error"]["message"]
    assert (await state(sim))["verifier"]["destroyed"] is True


async def test_abandoning_and_ending_nothing(sim: SimulatedEngine) -> None:
    assert code(await rpc(sim, "rolloutfleet_push_end")) == "no_session"
    assert (await state(sim))["verifier"]["destroyed"] is False  # no session: no target touched
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=1, epoch=1))["ok"]
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert (await post(sim, "/finish_weight_update"))[0] == 200  # the trainer never came: nothing sent
    ended = await rpc(sim, "rolloutfleet_push_end", abandon=True)
    assert code(ended) == "abandoned"
    assert (await state(sim))["verifier"]["destroyed"] is True


async def test_the_draft_never_needs_what_it_shares_with_the_verifier(
    fleet: SimulatedFleet, ckpts: Checkpoints, tmp_path: pathlib.Path
) -> None:
    """EAGLE-like: the draft's embed and lm_head are the verifier's. Sent ones are hashed, not applied."""
    draft = write_checkpoint(tmp_path / "eagle", 3, layers=1, extra=True)
    spec = EngineSpec(
        verifier_path=ckpts.verifier_a,
        draft_path=draft,
        weight_transfer={"backend": "ipc"},
        shared_tensors=("embed_tokens.weight", "lm_head.weight"),
    )
    sim = await fleet.add("127.0.0.6", 0, spec=spec)
    assert (await push(sim, "verifier", ckpts.verifier_b, 2, 1))["ok"]
    own = [n for n in names_of(draft) if "layers" in n]
    assert (await rpc(sim, "rolloutfleet_push_begin", target="draft", revision=2, epoch=2))["ok"]
    assert await session(sim, "/start_draft_weight_update", update_info(draft, only=own)) == (200, 200, 200)
    assert (await rpc(sim, "rolloutfleet_push_end"))["ok"]
    everything = await push(sim, "draft", draft, 2, 3)
    assert everything["skipped"] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert everything["digest"] == digest_directory(draft) and everything["tensors"] == 3


async def test_a_synthetic_model_takes_any_tensor_and_needs_one(fleet: SimulatedFleet, ckpts: Checkpoints) -> None:
    """Unknown parameters (the engine started from a synthetic path): names and shapes are not checked."""
    sim = await fleet.add("127.0.0.7", 0, spec=EngineSpec(weight_transfer={"backend": "ipc"}))
    info = update_info(ckpts.verifier_b, rename={"model.embed_tokens.weight": "anything.at.all"})
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=1, epoch=1))["ok"]
    assert await session(sim, "/start_weight_update", info) == (200, 200, 200)
    assert (await rpc(sim, "rolloutfleet_push_end"))["ok"]
    assert (await rpc(sim, "rolloutfleet_push_begin", target="verifier", revision=2, epoch=2))["ok"]
    assert (await post(sim, "/start_weight_update"))[0] == 200
    assert (await post(sim, "/finish_weight_update"))[0] == 200
    assert code(await rpc(sim, "rolloutfleet_push_end")) == "incomplete"


async def test_the_call_log_orders_a_push(sim: SimulatedEngine, ckpts: Checkpoints) -> None:
    """What the operator's tests read to prove order: every step of a push, with its key and status."""
    assert (await push(sim, "verifier", ckpts.verifier_b, 2, 1))["ok"]
    steps = [(e.get("key") or e["step"], e.get("status")) for e in sim.log.entries if e["step"] != "listen"]
    assert steps == [
        ("rpc_started", None),
        ("rpc_finished", None),
        ("rolloutfleet_push_begin:verifier", 200),
        ("start_weight_update", 200),
        ("update_weights", 200),
        ("finish_weight_update", 200),
        ("rpc_started", None),
        ("rpc_finished", None),
        ("rolloutfleet_push_end", 200),
    ]
    end = sim.log.entries[-1]
    assert end["state"]["claimed_verifier"]["revision"] == 2 and end["state"]["session"] is None
    begin = next(e for e in sim.log.entries if e.get("key") == "rolloutfleet_push_begin:verifier")
    assert begin["state"]["session"]["epoch"] == 1


async def test_a_failed_draft_that_shares_with_the_verifier_destroys_both(
    fleet: SimulatedFleet, ckpts: Checkpoints, tmp_path: pathlib.Path
) -> None:
    """vLLM's draft session moves the draft to meta, shared embed/lm_head included: the verifier loses them."""
    draft = write_checkpoint(tmp_path / "eagle", 3, layers=1, extra=True)
    spec = EngineSpec(
        verifier_path=ckpts.verifier_a,
        draft_path=draft,
        weight_transfer={"backend": "ipc"},
        shared_tensors=("embed_tokens.weight", "lm_head.weight"),
    )
    sim = await fleet.add("127.0.0.8", 0, spec=spec)
    assert (await push(sim, "verifier", ckpts.verifier_b, 2, 1))["ok"]
    assert (await rpc(sim, "rolloutfleet_push_begin", target="draft", revision=2, epoch=2))["ok"]
    wrong = update_info(draft, shapes={"model.layers.0.mlp.up_proj.weight": [64]})
    assert await session(sim, "/start_draft_weight_update", wrong) == (200, 500, 500)
    assert code(await rpc(sim, "rolloutfleet_push_end")) == "failed"
    after = await state(sim)
    assert after["verifier"]["destroyed"] is True and after["draft"]["destroyed"] is True
