"""``EngineClient.preflight`` against the simulated engine: the extension's ``rolloutfleet_preflight``.

A pre-flight reads safetensors headers and sizes only and changes nothing; it answers with the load's
error codes (worker_image/README.md, "RPCs"). The simulated engine here starts from small real checkpoints
(not synthetic paths), so it knows its models' parameter counts and can answer ``incomplete``.
"""

from __future__ import annotations

import json
import pathlib
import struct
import time
from typing import Any
from unittest import mock

import numpy as np
import pytest
from engine_support import TOKEN
from safetensors.numpy import save_file

from rolloutfleet.adapters.engine import EngineClient, EnginePool
from rolloutfleet.adapters.engine_wire import EngineHTTPError, EngineInconsistent, EngineRPCError
from rolloutfleet.api import engine as api
from rolloutfleet.sim import EngineSpec, FaultKind, FaultRule, SimulatedEngine, SimulatedFleet

HIDDEN = 32
# Not about time (its faults are HTTP errors and split ranks, no hang): the client's own deadlines. A pre-flight
# reads checkpoint files, and on a loaded CI box (2026-12-05) one outlasted the fault tests' 0.25 s and failed
# test_preflight_changes_nothing with an EngineTimeout (tests/unit/engine/conftest.py, SHORT).
ROOMY_DEADLINES = True


def tensors_of(layers: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((64, HIDDEN), dtype=np.float32)}
    for i in range(layers):
        out[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32)
    return out


def write(directory: pathlib.Path, tensors: dict[str, np.ndarray]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def write_raw(directory: pathlib.Path, header: dict[str, Any], data: bytes, *, length: int | None = None) -> str:
    """A safetensors file written by hand (for headers the library refuses to write)."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw) if length is None else length) + raw + data
    (directory / "model.safetensors").write_bytes(blob)
    return str(directory)


@pytest.fixture
def ckpt(tmp_path: pathlib.Path) -> dict[str, str]:
    return {
        "v1": write(tmp_path / "v1", tensors_of(2, 1)),
        "v2": write(tmp_path / "v2", tensors_of(2, 2)),
        "d1": write(tmp_path / "d1", tensors_of(1, 3)),
        "d2": write(tmp_path / "d2", tensors_of(1, 4)),
        "root": str(tmp_path),
    }


@pytest.fixture
def spec(ckpt: dict[str, str]) -> EngineSpec:
    return EngineSpec(verifier_path=ckpt["v1"], draft_path=ckpt["d1"])


async def test_a_good_checkpoint_reports_its_tensors_and_bytes(client: EngineClient, ckpt: dict[str, str]) -> None:
    expected = tensors_of(2, 2)
    result = await client.preflight(api.Target.VERIFIER, ckpt["v2"])
    assert result == api.PreflightResult(
        target=api.Target.VERIFIER,
        path=ckpt["v2"],
        tensors=len(expected),
        bytes=sum(t.nbytes for t in expected.values()),
    )
    draft = await client.preflight("draft", ckpt["d2"])
    assert (
        draft.target is api.Target.DRAFT
        and draft.tensors == 2
        and draft.bytes == sum(t.nbytes for t in tensors_of(1, 4).values())
    )


async def test_bad_paths_and_targets_fail_with_the_extensions_codes(
    client: EngineClient, ckpt: dict[str, str], tmp_path: pathlib.Path
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    cases = [
        ("verifier", str(tmp_path / "missing"), "invalid_path"),
        ("verifier", "relative/path", "invalid_path"),
        ("verifier", ckpt["v1"] + "/../v2", "invalid_path"),
        ("verifier", ckpt["v1"] + "\n", "invalid_path"),
        ("verifier", "", "invalid_path"),
        ("verifier", str(tmp_path / "a-file"), "invalid_path"),
        ("embedding", ckpt["v1"], "invalid_target"),
        ("verifier", str(tmp_path / "empty"), "io"),
    ]
    for target, path, code in cases:
        with pytest.raises(EngineRPCError) as err:
            await client.preflight(target, path)
        assert err.value.code == code, (target, path, err.value)
        assert err.value.step == f"rolloutfleet_preflight:{target}"


async def test_corrupt_checkpoints_fail_with_io(client: EngineClient, tmp_path: pathlib.Path) -> None:
    f32 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    dirs = {
        "truncated header": write_raw(tmp_path / "t1", {"w": f32}, b"\0" * 16, length=10**6),
        "header not JSON": write_raw(tmp_path / "t2", {}, b""),
        "tensor beyond the file": write_raw(tmp_path / "t3", {"w": f32}, b"\0" * 8),
        "bytes do not match the shape": write_raw(
            tmp_path / "t4", {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16
        ),
        "unloadable dtype": write_raw(
            tmp_path / "t5", {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2
        ),
    }
    (tmp_path / "t2" / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")  # overwritten: not JSON
    dup = tmp_path / "dup"
    write(dup, {"w": np.zeros(4, np.float32)})
    save_file({"w": np.zeros(4, np.float32)}, str(dup / "other.safetensors"))
    dirs["a name in two files"] = str(dup)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"\1\2")
    dirs["no header at all"] = str(tmp_path / "tiny")
    for why, path in dirs.items():
        with pytest.raises(EngineRPCError) as err:
            await client.preflight("verifier", path)
        assert err.value.code == "io", (why, err.value)


async def test_a_checkpoint_too_small_for_the_model_is_incomplete(client: EngineClient, ckpt: dict[str, str]) -> None:
    with pytest.raises(EngineRPCError) as err:
        await client.preflight("verifier", ckpt["d1"])  # one layer where the verifier has two
    assert err.value.code == "incomplete"
    # Larger than the model is not refused: which parameter a name fills is only known to load_weights.
    assert (await client.preflight("draft", ckpt["v1"])).tensors == 3


@pytest.mark.parametrize("target", ["verifier", "draft"])
async def test_synthetic_paths_report_the_configured_size(
    client: EngineClient, sim: SimulatedEngine, target: str
) -> None:
    result = await client.preflight(target, f"/synthetic/{target}/7")
    size = sim.weights.verifier_bytes if target == "verifier" else sim.weights.draft_bytes
    assert (result.tensors, result.bytes) == (sim.weights.tensors, size)


async def test_a_draft_target_without_a_draft_model_is_no_draft(
    fleet: SimulatedFleet, client: EngineClient, ckpt: dict[str, str]
) -> None:
    lone = await fleet.add("127.0.0.1", 0, spec=EngineSpec(verifier_path=ckpt["v1"], draft_path=None))
    async with EnginePool(token=TOKEN) as pool:
        plain = pool.client(lone.url)
        with pytest.raises(EngineRPCError) as err:
            await plain.preflight("draft", ckpt["d2"])
        assert err.value.code == "no_draft"
        with pytest.raises(EngineRPCError) as err:
            await plain.preflight("draft", ckpt["root"] + "/missing")
        assert err.value.code == "invalid_path"  # the path is checked before the model, as the extension does
        assert (await plain.preflight("verifier", ckpt["v2"])).tensors == 3


async def test_shared_tensors_are_left_out_of_the_draft_element_count(
    fleet: SimulatedFleet, ckpt: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """An EAGLE-style draft whose embedding is the verifier's: a checkpoint without it still fills it."""
    spec = EngineSpec(verifier_path=ckpt["v1"], draft_path=ckpt["d1"], shared_tensors=("embed_tokens.weight",))
    eagle = await fleet.add("127.0.0.1", 0, spec=spec)
    layers_only = {k: v for k, v in tensors_of(1, 5).items() if "embed" not in k}
    path = write(tmp_path / "draft-no-embed", layers_only)
    async with EnginePool(token=TOKEN) as pool:
        result = await pool.client(eagle.url).preflight("draft", path)
    assert result.tensors == 1


async def test_preflight_changes_nothing(client: EngineClient, sim: SimulatedEngine, ckpt: dict[str, str]) -> None:
    await client.load("verifier", ckpt["v2"], 2)
    await client.load("draft", ckpt["d2"], 2)
    await client.pause("keep")
    before_state, before_summary = await client.observe(), sim.core.summary()
    seq = len(sim.log.entries)
    await client.preflight("verifier", ckpt["v1"])
    await client.preflight("draft", ckpt["d1"])
    with pytest.raises(EngineRPCError):
        await client.preflight("verifier", ckpt["d1"])
    with pytest.raises(EngineRPCError):
        await client.preflight("verifier", ckpt["root"] + "/missing")
    assert await client.observe() == before_state
    assert sim.core.summary() == before_summary
    assert sim.log.since(seq) == []  # no rpc_started/rpc_finished, no call entry: nothing happened
    # Also while asleep (level 2): it reads files, not the model's memory.
    await client.sleep(2)
    asleep = sim.core.summary()
    assert (await client.preflight("verifier", ckpt["v1"])).tensors == 3
    assert sim.core.summary() == asleep


async def test_preflight_reads_headers_only(client: EngineClient, tmp_path: pathlib.Path) -> None:
    """A 16 GiB sparse tensor is checked in well under a second: its bytes are never read."""
    n = 4 << 30
    header = {"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}
    path = write_raw(tmp_path / "huge", header, b"")
    with (tmp_path / "huge" / "model.safetensors").open("r+b") as f:
        f.truncate(8 + len(json.dumps(header).encode()) + 4 * n)
    started = time.monotonic()
    result = await client.preflight("verifier", path)
    assert result.bytes == 4 * n and result.tensors == 1
    assert time.monotonic() - started < 2.0


async def test_preflight_is_sent_while_a_loads_outcome_is_unknown(
    client: EngineClient, pool: EnginePool, ckpt: dict[str, str]
) -> None:
    """It loads nothing, so the guard against a second load does not hold it back."""
    pool.loads.mark(client.base_url)
    assert (await client.preflight("verifier", ckpt["v2"])).tensors == 3


async def test_faults_are_keyed_by_target_and_a_503_is_retried(
    client: EngineClient, sim: SimulatedEngine, ckpt: dict[str, str]
) -> None:
    sim.add_fault(FaultRule(step="rolloutfleet_preflight:draft", kind=FaultKind.HTTP_ERROR, status=503, body={}))
    assert (await client.preflight("verifier", ckpt["v2"])).tensors == 3  # another key: not faulted
    assert (await client.preflight("draft", ckpt["d2"])).tensors == 2  # idempotent: retried after the 503
    fired = [e for e in sim.log.entries if "fault" in e]
    assert len(fired) == 1 and fired[0]["step"] == "rolloutfleet_preflight"
    assert fired[0]["key"] == "rolloutfleet_preflight:draft"
    assert fired[0]["args"]["kwargs"] == {"target": "draft", "path": ckpt["d2"]}
    sim.add_fault(FaultRule(step="rolloutfleet_preflight", kind=FaultKind.HTTP_ERROR, status=500, body={"e": 1}))
    with pytest.raises(EngineHTTPError) as err:
        await client.preflight("verifier", ckpt["v2"])
    assert err.value.status == 500


async def test_ranks_must_agree(fleet: SimulatedFleet, ckpt: dict[str, str]) -> None:
    tp = await fleet.add("127.0.0.1", 0, spec=EngineSpec(verifier_path=ckpt["v1"], draft_path=ckpt["d1"], tp_size=2))
    async with EnginePool(token=TOKEN) as pool:
        client = pool.client(tp.url)
        assert (await client.preflight("verifier", ckpt["v2"])).tensors == 3  # two ranks, one answer
        tp.add_fault(FaultRule(step="rolloutfleet_preflight:verifier", kind=FaultKind.SPLIT_RANKS))
        with pytest.raises(EngineInconsistent):
            await client.preflight("verifier", ckpt["v2"])


@pytest.mark.parametrize("sequences", [True, False], ids=["one-request", "an-image-without-sequences"])
async def test_both_pre_flights_answer_apart_whether_sent_together_or_not(
    client: EngineClient, sim: SimulatedEngine, ckpt: dict[str, str], sequences: bool
) -> None:
    """``preflights`` sends both targets in one request where it can (a refusal of one never hides the other's
    answer) and falls back to a request each on an image without ``/rolloutfleet/sequence`` (404)."""
    if not sequences:
        sim.add_fault(FaultRule(step="sequence", kind=FaultKind.HTTP_ERROR, status=404, body={"detail": "Not Found"}))
    answers = await client.preflights(
        [(api.Target.VERIFIER, ckpt["root"] + "/missing"), (api.Target.DRAFT, ckpt["d2"])]
    )
    assert isinstance(answers[0], EngineRPCError) and answers[0].code == "invalid_path"
    assert answers[1] == await client.preflight(api.Target.DRAFT, ckpt["d2"])


@pytest.mark.parametrize(
    ("refusal", "requests"),
    [
        (None, ["sequence:rolloutfleet_preflight:verifier+rolloutfleet_preflight:draft+observe"]),
        # An image from before an observation could be a call: its sequence refuses it before running anything.
        (
            400,
            [
                "sequence:rolloutfleet_preflight:verifier+rolloutfleet_preflight:draft+observe",
                "sequence:rolloutfleet_preflight:verifier+rolloutfleet_preflight:draft",
                "observe",
            ],
        ),
        # An image without sequences: a pre-flight each, and the read apart.
        (
            404,
            [
                "sequence:rolloutfleet_preflight:verifier+rolloutfleet_preflight:draft+observe",
                "rolloutfleet_preflight",
                "rolloutfleet_preflight",
                "observe",
            ],
        ),
    ],
    ids=["one-request", "an-image-refusing-the-read-in-a-sequence", "an-image-without-sequences"],
)
async def test_the_pre_flights_and_the_first_read_go_in_one_request_where_the_image_allows(
    client: EngineClient, sim: SimulatedEngine, ckpt: dict[str, str], refusal: int | None, requests: list[str]
) -> None:
    """Issue 18: before a revision's first pause every engine was checked and then read, two requests each.
    Where the image takes the observation among a sequence's calls both go in one; elsewhere they go apart as
    before, with the same answers, and an image that refused is remembered (its next pre-flight sends the
    read apart straight away)."""
    checks = [(api.Target.VERIFIER, ckpt["root"] + "/missing"), (api.Target.DRAFT, ckpt["d2"])]
    expected = (await client.preflights(checks), await client.observe())
    if refusal is not None:
        body = {"detail": "Not Found"} if refusal == 404 else {"error": {"message": "cannot be part of a sequence"}}
        # The older image refuses only the sequences that carry the read (the fault: the first one here).
        count = 1 if refusal == 400 else None
        sim.add_fault(FaultRule(step="sequence", kind=FaultKind.HTTP_ERROR, status=refusal, body=body, count=count))
    sent: list[str] = []
    original = EngineClient._sent

    async def counted(self: EngineClient, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(kwargs.get("step")))
        return await original(self, *args, **kwargs)

    with mock.patch.object(EngineClient, "_sent", counted):
        for attempt in range(2):
            sent.clear()
            results, state = await client.preflights_then_observe(checks)
            assert isinstance(results[0], EngineRPCError) and results[0].code == "invalid_path"
            assert results[1] == expected[0][1] and state == expected[1]
            if refusal is not None and attempt:  # remembered: the read goes apart without asking again
                assert sent == requests[1:], sent
            else:
                assert sent == requests, sent
