"""The extension's side of pushed weight-transfer sessions (docs/push.md), on fake vLLM 0.26 workers.

``PushWorker`` (worker_fakes) behaves as vLLM's Worker does around a session: start moves the target's
parameters to the meta device, ``update_weights`` hands the trainer's list to ``engine.model.load_weights``,
a failed update ends the session and leaves the parameters on meta, finish puts them back. The operator's
order is followed: ``rolloutfleet_push_begin`` → start → updates → finish → ``rolloutfleet_push_end``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file
from worker_fakes import PushWorker, WorkerV1, write_eagle, write_verifier

import rolloutfleet_digest as digest
from rolloutfleet.adapters import engine_wire
from rolloutfleet.api.engine import GroupMembership, Target
from rolloutfleet_worker import models, transfer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
UNKNOWN = {"revision": None, "digest": None, "path": None, "verified": False, "destroyed": False}
DESTROYED = UNKNOWN | {"destroyed": True}


@pytest.fixture
def ckpt(tmp_path: Path) -> dict[str, Path]:
    return {
        "v1": write_verifier(tmp_path / "verifier-1", seed=1),
        "v2": write_verifier(tmp_path / "verifier-2", seed=2),
        "d1": write_eagle(tmp_path / "draft-1", seed=1),
        "d2": write_eagle(tmp_path / "draft-2", seed=2),
    }


def tensors_of(path: Path) -> list[tuple[str, torch.Tensor]]:
    """What a trainer holding the checkpoint's tensors sends, in its own (here: file) order."""
    out: list[tuple[str, torch.Tensor]] = []
    for f in sorted(path.glob("*.safetensors")):
        out.extend(load_file(str(f)).items())
    return out


def unwrapped(w: PushWorker) -> bool:
    """No wrapper of a session is left on any object (the models' and the engine's own methods answer)."""
    objects: list[Any] = [w.verifier, w.draft, w.weight_transfer_engine]
    return not any(o is not None and {"load_weights", "update_weights"} & set(vars(o)) for o in objects)


def session(w: PushWorker, target: str, revision: int, epoch: int, *batches: list[Any]) -> dict[str, Any]:
    """The operator's sequence around one session fed with ``batches`` (one ``/update_weights`` each)."""
    begun = w.rolloutfleet_push_begin(target, revision, epoch)
    assert begun == {"ok": True, "target": target, "revision": revision, "epoch": epoch}, begun
    w.start_weight_update(draft=target == "draft")
    for batch in batches:
        w.update_weights({"weights": batch})
    w.finish_weight_update()
    result: dict[str, Any] = dict(w.rolloutfleet_push_end())
    assert unwrapped(w)
    return result


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_a_good_session_gives_the_checkpoint_digest_and_the_path_loads_weights(ckpt: dict[str, Path]) -> None:
    """The digest of what was received equals ``rolloutfleet digest`` of a checkpoint with the same tensors,
    and the weights equal a path load of that checkpoint: a push and a path load are interchangeable."""
    w = PushWorker()
    ptrs = {n: p.data_ptr() for n, p in w.verifier.named_parameters()}
    sent = tensors_of(ckpt["v1"])
    res = session(w, "verifier", 7, 3, sent[:5], sent[5:])  # two /update_weights calls
    assert res == {
        "ok": True,
        "target": "verifier",
        "revision": 7,
        "epoch": 3,
        "path": None,
        "digest": digest.digest_directory(ckpt["v1"]),
        "bytes": sum(t.numel() * t.element_size() for _, t in sent),
        "seconds": res["seconds"],
        "tensors": 19,
        "skipped": [],
    }
    assert {n: p.data_ptr() for n, p in w.verifier.named_parameters()} == ptrs  # in place: graphs stay valid
    reference = WorkerV1()
    assert reference.rolloutfleet_load("verifier", str(ckpt["v1"]), 7)["ok"]
    got, want = params(w.verifier), params(reference.verifier)
    assert all(torch.equal(got[n], want[n]) for n in want)

    # The EAGLE draft: its copies of the verifier's embed_tokens/lm_head are hashed (they were received)
    # but never applied, so the verifier keeps its own, exactly as a path load skips them.
    verifier_before = params(w.verifier)
    res = session(w, "draft", 7, 4, tensors_of(ckpt["d1"]))
    assert res["ok"] is True and res["digest"] == digest.digest_directory(ckpt["d1"]), res
    assert res["skipped"] == ["embed_tokens.weight", "lm_head.weight"] and res["tensors"] == 11
    assert all(torch.equal(t, verifier_before[n]) for n, t in params(w.verifier).items())
    assert reference.rolloutfleet_load("draft", str(ckpt["d1"]), 7)["ok"]
    assert w.draft is not None and reference.draft is not None
    got, want = params(w.draft), params(reference.draft)
    assert all(torch.equal(got[n], want[n]) for n in want)

    state = w.rolloutfleet_state()
    assert state["ok"] is True and state["session"] is None and state["resident"] is True
    assert state["verifier"] == {
        "revision": 7,
        "digest": digest.digest_directory(ckpt["v1"]),
        "path": None,
        "verified": True,
        "destroyed": False,
    }
    assert state["draft"] is not None and state["draft"]["revision"] == 7 and state["draft"]["verified"] is True
    assert state["draft"]["digest"] == digest.digest_directory(ckpt["d1"]) and state["draft"]["destroyed"] is False


def test_the_operator_reads_the_results_and_the_state() -> None:
    """The wire contract, checked by the operator's own parsers (``engine_wire``), not by a copy of it."""
    w = PushWorker(draft="draft_model")
    assert w.rolloutfleet_push_begin("verifier", 5, 9)["ok"]
    w.start_weight_update()
    w.update_weights({"weights": [("model.norm.weight", torch.ones(16, dtype=torch.bfloat16))]})
    states = engine_wire.states_from_wire([w.rolloutfleet_state()], url="http://engine")
    engine = engine_wire.state_from_wire(paused=True, sleeping=True, weight_version=None, states=states)
    assert engine.session is not None and engine.session.target == Target.VERIFIER
    got = engine.session
    assert (got.revision, got.epoch, got.tensors, got.bytes) == (5, 9, 1, 32)
    assert engine.session.error is None and not engine.destroyed and engine.verifier.revision is None
    w.finish_weight_update()
    with pytest.raises(engine_wire.EngineRPCError) as err:
        engine_wire.load_result_from_wire([w.rolloutfleet_push_end()], url="http://engine", step="push_end")
    assert err.value.code == "incomplete" and "12 of 13 parameters" in str(err.value)
    states = engine_wire.states_from_wire([w.rolloutfleet_state()], url="http://engine")
    engine = engine_wire.state_from_wire(paused=True, sleeping=True, weight_version=None, states=states)
    assert engine.session is None and engine.verifier.destroyed and engine.destroyed

    good = PushWorker(draft="draft_model")
    res = session(good, "verifier", 5, 9, [(n, t) for n, t in sorted(full_verifier().items())])
    parsed = engine_wire.load_result_from_wire([res], url="http://engine", step="push_end")
    assert parsed.path is None and parsed.revision == 5 and parsed.digest == res["digest"] and parsed.tensors == 19


def full_verifier() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {n: tuple(p.shape) for n, p in WorkerV1().verifier.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if "qkv_proj" in name:
            for part in ("q_proj", "k_proj", "v_proj"):
                out[name.replace("qkv_proj", part)] = torch.randn(shape[0] // 3, *shape[1:], generator=g).bfloat16()
        elif "gate_up_proj" in name:
            for part in ("gate_proj", "up_proj"):
                out[name.replace("gate_up_proj", part)] = torch.randn(shape[0] // 2, *shape[1:], generator=g).bfloat16()
        else:
            out[name] = torch.randn(*shape, generator=g).bfloat16()
    return out


def test_state_reports_the_open_session_without_reading_parameters(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between vLLM's start and finish the target's parameters are on the meta device: the state report
    must describe the session from what the extension counted, never from the parameters."""
    w = PushWorker()
    assert w.rolloutfleet_state()["resident"] is True  # type: ignore[typeddict-item]
    assert w.rolloutfleet_push_begin("verifier", 2, 11)["ok"]
    w.start_weight_update()
    assert all(p.device.type == "meta" for p in w.verifier.parameters())
    assert "load_weights" in vars(w.verifier)
    assert "load_weights" not in vars(w.model_runner.model)  # never the CUDA-graph wrapper
    monkeypatch.setattr(models, "fingerprint", lambda *a: pytest.fail("read parameters during a session"))
    state = w.rolloutfleet_state()
    assert state["ok"] is True, state
    assert state["session"] == {
        "target": "verifier",
        "revision": 2,
        "epoch": 11,
        "age_s": state["session"]["age_s"],  # type: ignore[index]
        "tensors": 0,
        "bytes": 0,
        "error": None,
    }
    assert state["verifier"] == UNKNOWN and state["resident"] is False
    sent = tensors_of(ckpt["v2"])
    w.update_weights({"weights": sent[:4]})
    state = w.rolloutfleet_state()
    assert state["ok"] and state["session"] is not None and state["session"]["tensors"] == 4
    assert state["session"]["bytes"] == sum(t.numel() * 2 for _, t in sent[:4])
    w.update_weights({"weights": sent[4:]})
    w.finish_weight_update()
    monkeypatch.undo()
    assert w.rolloutfleet_push_end()["ok"] is True
    state = w.rolloutfleet_state()
    assert state["ok"] and state["session"] is None and state["verifier"]["revision"] == 2 and state["resident"]


def test_one_session_at_a_time_and_nothing_else_loads_meanwhile(ckpt: dict[str, Path]) -> None:
    w = PushWorker()
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    for res in (
        w.rolloutfleet_push_begin("verifier", 1, 2),
        w.rolloutfleet_push_begin("draft", 1, 2),
        w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1),
        w.rolloutfleet_load("draft", str(ckpt["d1"]), 1),
    ):
        assert res["ok"] is False and res["error"]["code"] == "busy", res
        assert "epoch 1" in res["error"]["message"]
    w.start_weight_update()
    w.update_weights({"weights": tensors_of(ckpt["v1"])})
    w.finish_weight_update()
    assert w.rolloutfleet_push_end()["ok"]
    assert w.rolloutfleet_load("verifier", str(ckpt["v2"]), 2)["ok"]  # free again
    w.start_weight_update()  # a vLLM session nobody bracketed: what it receives is never verified
    res = w.rolloutfleet_push_begin("verifier", 3, 2)
    assert res["ok"] is False and res["error"]["code"] == "busy" and "vLLM" in res["error"]["message"]
    assert w.rolloutfleet_state()["verifier"] == DESTROYED  # type: ignore[typeddict-item]  # on meta, unverified


def test_a_draft_session_needs_the_verifier_at_its_revision(ckpt: dict[str, Path]) -> None:
    w = PushWorker()
    res = w.rolloutfleet_push_begin("draft", 1, 1)
    assert res["ok"] is False and res["error"]["code"] == "order" and "revision 1" in res["error"]["message"]
    assert w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]
    res = w.rolloutfleet_push_begin("draft", 2, 1)
    assert res["ok"] is False and res["error"]["code"] == "order" and "holds 1" in res["error"]["message"]
    assert session(w, "verifier", 2, 2, tensors_of(ckpt["v2"]))["ok"]
    assert session(w, "draft", 2, 3, tensors_of(ckpt["d2"]))["ok"]
    assert unwrapped(w)


def test_refusals_leave_everything_as_it_was(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused begin opens nothing, wraps nothing and leaves the slot's claim alone."""
    w = PushWorker(draft="none")
    assert w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]
    cases: list[tuple[tuple[Any, Any, Any], str]] = [
        (("draft", 1, 1), "no_draft"),
        (("lm", 1, 1), "invalid_target"),
        (("verifier", -1, 1), "invalid_revision"),
        (("verifier", True, 1), "invalid_revision"),
        (("verifier", 1, "3"), "invalid_epoch"),
    ]
    for args, code in cases:
        res = w.rolloutfleet_push_begin(*args)
        assert res["ok"] is False and res["error"]["code"] == code, (args, res)
    w.weight_transfer_engine = None  # vLLM started without --weight-transfer-config
    res = w.rolloutfleet_push_begin("verifier", 2, 1)
    assert res["ok"] is False and res["error"]["code"] == "no_transfer"
    state = w.rolloutfleet_state()
    assert state["ok"] and state["session"] is None and state["verifier"]["revision"] == 1
    assert state["verifier"]["verified"] is True and unwrapped(w)

    monkeypatch.setenv("ROLLOUTFLEET_DRAFT_POLICY", "frozen")
    frozen = PushWorker()
    assert frozen.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]
    res = frozen.rolloutfleet_push_begin("draft", 1, 1)
    assert res["ok"] is False and res["error"]["code"] == "frozen"


def test_a_load_weights_that_ignores_names_leaves_the_target_destroyed(ckpt: dict[str, Path]) -> None:
    """Every tensor arrived and was hashed (the digest would even match the trainer's), yet no parameter
    was filled: vLLM's ``load_weights`` says which it loaded, and a parameter it did not name fails."""
    w = PushWorker()
    w.verifier.lenient = True  # skips names it has no parameter for, as many vLLM loaders do
    renamed = [(n.replace("model.", "transformer.", 1), t) for n, t in tensors_of(ckpt["v1"])]
    res = session(w, "verifier", 1, 1, renamed)
    assert res["ok"] is False and res["error"]["code"] == "incomplete", res
    assert "12 of 13 parameters" in res["error"]["message"]
    assert "model.layers.0.mlp.down_proj.weight" in res["error"]["message"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["verifier"] == DESTROYED and state["resident"] is False
    refused = w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)
    assert refused["ok"] is False and refused["error"]["code"] == "destroyed"
    assert "restart" in refused["error"]["message"]
    refused = w.rolloutfleet_push_begin("verifier", 2, 2)
    assert refused["ok"] is False and refused["error"]["code"] == "destroyed"
    assert w.rolloutfleet_push_begin("draft", 1, 2)["error"]["code"] == "order"  # type: ignore[typeddict-item]
    assert w.rolloutfleet_state()["verifier"] == DESTROYED  # type: ignore[typeddict-item]  # sticky


def test_a_partial_send_is_incomplete(ckpt: dict[str, Path]) -> None:
    """The trainer sent a layer short: vLLM's finish keeps the old values in what got nothing, so the
    target would serve a mix of two revisions. The check is by parameter (and by elements for stacked ones)."""
    w = PushWorker()
    sent = [(n, t) for n, t in tensors_of(ckpt["v1"]) if ".1.mlp" not in n]
    res = session(w, "verifier", 1, 1, sent)
    assert res["ok"] is False and res["error"]["code"] == "incomplete"
    assert "did not load 2 of 13 parameters" in res["error"]["message"]
    # q_proj of layer 0 alone still names qkv_proj as loaded: the element count catches the missing k and v.
    w = PushWorker()
    kv = ("model.layers.0.self_attn.k_", "model.layers.0.self_attn.v_")
    sent = [(n, t) for n, t in tensors_of(ckpt["v1"]) if not n.startswith(kv)]
    res = session(w, "verifier", 1, 1, sent)
    assert res["ok"] is False and res["error"]["code"] == "incomplete" and "elements" in res["error"]["message"]
    w = PushWorker()
    res = session(w, "verifier", 1, 1)  # nothing at all
    assert res["ok"] is False and res["error"]["code"] == "incomplete" and "no tensor" in res["error"]["message"]
    assert w.rolloutfleet_state()["verifier"] == DESTROYED  # type: ignore[typeddict-item]


def one_layer(path: Path, tmp: Path) -> Path:
    """A one-layer Llama checkpoint (the draft_model draft's shape) from the two-layer verifier ``path``."""
    tmp.mkdir()
    save_file({n: t for n, t in tensors_of(path) if ".1." not in n}, str(tmp / "model.safetensors"))
    return tmp


def test_an_update_that_raises_fails_the_session_and_destroys_the_target(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """A wrong-shape tensor: vLLM answers the trainer 500, ends its side and leaves the target on meta.
    The state says so at once (so the operator need not wait for a deadline), and the end fails."""
    w = PushWorker(draft="draft_model")
    assert w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]
    assert session(w, "verifier", 2, 1, tensors_of(ckpt["v2"]))["ok"]
    assert w.rolloutfleet_push_begin("draft", 2, 2)["ok"]
    w.start_draft_weight_update()
    sent = tensors_of(one_layer(ckpt["v2"], tmp_path / "small-2"))
    bad = [(n, t.t().contiguous() if "down_proj" in n else t) for n, t in sent]
    with pytest.raises(RuntimeError):
        w.update_weights({"weights": bad})
    assert w.draft is not None and any(p.device.type == "meta" for p in w.draft.parameters())
    state = w.rolloutfleet_state()
    assert state["ok"] and state["session"] is not None and state["session"]["error"] is not None
    assert "RuntimeError" in state["session"]["error"]
    res = w.rolloutfleet_push_end()  # no finish: vLLM's side is gone already
    assert res["ok"] is False and res["error"]["code"] == "failed" and "RuntimeError" in res["error"]["message"]
    assert unwrapped(w)
    state = w.rolloutfleet_state()
    assert state["ok"] and state["draft"] is not None and state["draft"]["destroyed"] is True
    assert state["draft"]["revision"] is None and state["draft"]["verified"] is False
    assert state["verifier"]["revision"] == 2 and state["verifier"]["verified"] is True  # shares nothing: fine
    assert state["resident"] is False
    refused = w.rolloutfleet_load("draft", str(ckpt["d2"]), 2)
    assert refused["ok"] is False and refused["error"]["code"] == "destroyed"


def test_a_failed_eagle_draft_session_destroys_the_verifier_it_shares_with(ckpt: dict[str, Path]) -> None:
    """An EAGLE-style draft holds the verifier's embed_tokens and lm_head: vLLM's draft session moves them
    to meta with the rest of the draft, and a failed update leaves them there. The verifier has no
    embedding then, so it is destroyed too (and its state report must not touch those parameters)."""
    w = PushWorker()
    assert session(w, "verifier", 2, 1, tensors_of(ckpt["v2"]))["ok"]
    assert w.rolloutfleet_push_begin("draft", 2, 2)["ok"]
    w.start_draft_weight_update()
    bad = [(n, t.t().contiguous() if n == "fc.weight" else t) for n, t in tensors_of(ckpt["d2"])]
    with pytest.raises(RuntimeError):
        w.update_weights({"weights": bad})
    assert w.verifier.lm_head.weight.device.type == "meta"
    res = w.rolloutfleet_push_end()
    assert res["ok"] is False and res["error"]["code"] == "failed"
    state = w.rolloutfleet_state()
    assert state["ok"] is True, state
    assert state["verifier"] == DESTROYED and state["draft"] is not None and state["draft"]["destroyed"] is True
    assert state["shared_tensors"] == ["lm_head.weight", "model.embed_tokens.weight"]  # as found at begin
    refused = w.rolloutfleet_load("verifier", str(ckpt["v2"]), 3)
    assert refused["ok"] is False and refused["error"]["code"] == "destroyed"


def test_a_failure_outside_load_weights_fails_the_session_too() -> None:
    """A malformed update (or a missing IPC handle, a broken collective) raises in vLLM before any tensor
    reaches ``load_weights``; the engine-level wrapper still records it."""
    w = PushWorker()
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    w.start_weight_update()
    with pytest.raises(KeyError):
        w.update_weights({"names": ["x"]})
    state = w.rolloutfleet_state()
    assert state["ok"] and state["session"] is not None and "KeyError" in str(state["session"]["error"])
    res = w.rolloutfleet_push_end()
    assert res["ok"] is False and res["error"]["code"] == "failed" and unwrapped(w)


def test_tensors_received_twice_fail_the_session(ckpt: dict[str, Path]) -> None:
    """Two tensors under one name leave the digest undefined (which one did the model keep?)."""
    w = PushWorker()
    sent = tensors_of(ckpt["v1"])
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    w.start_weight_update()
    w.update_weights({"weights": sent})
    with pytest.raises(transfer.ReceiveError, match="received twice"):
        w.update_weights({"weights": sent[:1]})
    res = w.rolloutfleet_push_end()
    assert res["ok"] is False and res["error"]["code"] == "failed" and "received twice" in res["error"]["message"]


def test_abandoned_unfinished_and_absent_sessions(ckpt: dict[str, Path]) -> None:
    w = PushWorker()
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    w.start_weight_update()
    w.finish_weight_update()  # the operator ends vLLM's side, then abandons (the trainer never sent)
    res = w.rolloutfleet_push_end(abandon=True)
    assert res["ok"] is False and res["error"]["code"] == "abandoned" and "0 tensors" in res["error"]["message"]
    assert w.rolloutfleet_state()["verifier"] == DESTROYED and unwrapped(w)  # type: ignore[typeddict-item]
    res = w.rolloutfleet_push_end()
    assert res["ok"] is False and res["error"]["code"] == "no_session"

    w = PushWorker()  # everything arrived, but vLLM's side was never finished (its reload not committed)
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    w.start_weight_update()
    w.update_weights({"weights": tensors_of(ckpt["v1"])})
    res = w.rolloutfleet_push_end()
    assert res["ok"] is False and res["error"]["code"] == "failed" and "finish_weight_update" in res["error"]["message"]
    assert unwrapped(w) and w.rolloutfleet_state()["verifier"] == DESTROYED  # type: ignore[typeddict-item]

    w = PushWorker()  # a vLLM without that flag: the parameters still on meta tell the same
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    w.start_weight_update()
    w.update_weights({"weights": tensors_of(ckpt["v1"])})
    w._weight_update_active = False
    res = w.rolloutfleet_push_end()
    assert res["ok"] is False and res["error"]["code"] == "failed" and "meta device" in res["error"]["message"]


def test_the_wrapper_restores_what_the_model_held_before(ckpt: dict[str, Path]) -> None:
    """A model that already held an instance ``load_weights`` (another wrapper) gets it back at the end, and
    the session's wrapper sat in front of it in between."""
    w = PushWorker()
    calls: list[int] = []
    real = w.verifier.load_weights

    def counting(weights: Any) -> set[str]:
        calls.append(1)
        return real(weights)

    w.verifier.load_weights = counting  # type: ignore[method-assign]
    assert w.rolloutfleet_push_begin("verifier", 1, 1)["ok"]
    assert vars(w.verifier)["load_weights"] is not counting
    w.start_weight_update()
    w.update_weights({"weights": tensors_of(ckpt["v1"])})
    w.finish_weight_update()
    assert w.rolloutfleet_push_end()["ok"] is True
    assert calls == [1] and vars(w.verifier)["load_weights"] is counting


class Recorder(torch.nn.Module):
    """Takes anything: reports every name as loaded (a model without parameters to check)."""

    def load_weights(self, weights: Any) -> set[str]:
        return {name for name, _ in weights}


def test_non_contiguous_and_odd_tensors_hash_as_their_row_major_bytes(tmp_path: Path) -> None:
    """A transposed view, a view at an odd offset into a buffer (packed NCCL), a scalar, an empty tensor and
    several dtypes: each is hashed as the bytes a safetensors file of it holds, so the session's digest is
    the file's."""
    g = torch.Generator().manual_seed(1)
    buffer = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    tensors = {
        "transposed": torch.randn(64, 48, generator=g).t(),
        "odd_view": buffer[3:4003].view(torch.int8).reshape(40, 100),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "bool": torch.rand(33, generator=g) > 0.5,
        "int64": torch.arange(17),
        "f8": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
    }
    hashes, on_device = transfer.hash_received(list(tensors.values()), lambda _d: False)
    assert on_device == 0
    for (name, t), h in zip(tensors.items(), hashes, strict=True):
        assert h == blake3.blake3(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).digest(), name
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "m.safetensors"))
    model = Recorder()
    s = transfer.Session(target="verifier", revision=1, epoch=1, model=model, required=[], need_elements=None)
    s.install(None)
    model.load_weights(list(tensors.items())[:3])
    model.load_weights(list(tensors.items())[3:])
    s.uninstall()
    assert "load_weights" not in vars(model)
    assert s.verdict(abandon=False, vllm_open=False) is None
    assert s.builder.hexdigest() == digest.digest_directory(tmp_path) and s.tensors == len(tensors)


def test_a_dtype_without_a_safetensors_name_fails_the_session() -> None:
    model = Recorder()
    s = transfer.Session(target="verifier", revision=1, epoch=1, model=model, required=[], need_elements=None)
    s.install(None)
    with pytest.raises(transfer.ReceiveError, match="no safetensors name"):
        model.load_weights([("x", torch.zeros(2, dtype=torch.complex128))])
    s.uninstall()
    verdict = s.verdict(abandon=False, vllm_open=False)
    assert verdict is not None and verdict[0] == "failed" and "complex128" in verdict[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_device_hash_path_matches_the_host_in_the_interpreter() -> None:
    """Tensors of more than one chunk go to the device hash (Triton's CPU interpreter here), their tails
    and the small ones to the host, in batches: every hash equals the blake3 package's."""
    script = textwrap.dedent(
        """
        import blake3, torch
        from rolloutfleet_worker import transfer
        g = torch.Generator().manual_seed(5)
        raw = torch.randint(0, 256, (20000,), dtype=torch.uint8, generator=g)
        tensors = [
            raw[:2048],                                  # exactly two chunks
            raw[100:100 + 3074].view(torch.bfloat16),    # odd offset (copied to align) and a tail
            raw[:5 * 1024 + 17],                         # a tail of 17 bytes
            raw[:1024],                                  # one chunk: host
            raw[:10],                                    # tiny: host
            raw[:8192].view(torch.float32).reshape(64, 32).t(),  # not contiguous
        ]
        transfer.HOST_BATCH_BYTES = 1500                     # several host batches
        hashes, on_device = transfer.hash_received(tensors, lambda _d: True)
        for t, h in zip(tensors, hashes):
            assert h == blake3.blake3(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).digest()
        assert on_device == 2048 + 3074 + 5 * 1024 + 17 + 8192, on_device
        print("ok")
        """
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "digest"), str(REPO / "operator")]),
    }
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_the_device_hash_is_used_only_after_its_self_test_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors arrive inside vLLM's ``/update_weights``: a first self-test (a ~30 s compile) must not land
    there. Until a verdict exists the host hashes, and the self-test is started on a thread of its own."""
    from rolloutfleet_worker import loader_cuda

    started: list[int] = []
    monkeypatch.setattr(loader_cuda, "_hash_checked", {0: True, 1: False})
    monkeypatch.setattr(loader_cuda, "_hash_running", set())
    monkeypatch.setattr(torch.cuda, "set_device", lambda _d: None)
    monkeypatch.setattr(loader_cuda, "check_device_hash", started.append)
    assert loader_cuda.device_hash_ready(0) is True
    assert loader_cuda.device_hash_ready(1) is False
    assert loader_cuda.device_hash_ready(2) is False  # unknown: started in the background, host meanwhile
    assert loader_cuda.device_hash_ready(2) is False  # running: not started twice
    for _ in range(200):
        if started:
            break
        threading.Event().wait(0.01)
    assert started == [2]


def test_a_quantized_target_is_checked_by_what_arrived_only(ckpt: dict[str, Path]) -> None:
    """As for path loads: a quantization method may create parameters no trainer sends (derived scales), so
    the parameter names are not required there; a session with nothing received still fails."""
    from types import SimpleNamespace

    w = PushWorker()
    w.model_config = SimpleNamespace(quantization="fp8")  # type: ignore[attr-defined]
    partial = [(n, t) for n, t in tensors_of(ckpt["v1"]) if n != "lm_head.weight"]
    assert session(w, "verifier", 1, 1, partial)["ok"] is True
    w = PushWorker()
    w.model_config = SimpleNamespace(quantization="fp8")  # type: ignore[attr-defined]
    res = session(w, "verifier", 1, 1)
    assert res["ok"] is False and res["error"]["code"] == "incomplete"


def test_the_engine_spells_dtypes_as_the_trainer_and_the_files_do() -> None:
    """The trainer's digest (``rolloutfleet.trainer.tensors``) and the engine's must name every dtype alike,
    or a pushed revision could never verify; both are the inverse of the loader's safetensors table."""
    from rolloutfleet.trainer import tensors as trainer_tensors
    from rolloutfleet_worker import loader_base

    engine = {str(dt).removeprefix("torch."): st for dt, st in transfer.SAFETENSORS_NAMES.items()}
    assert engine == trainer_tensors.SAFETENSORS_DTYPES
    assert {st: name for name, st in engine.items()} == loader_base.TORCH_DTYPE_NAMES


def test_the_group_joined_is_recorded_reported_and_read_by_the_operator() -> None:
    """NCCL: the operator records the group once vLLM's init returned; the state reports it (the operator's
    own parser reads it back) and a new process reports none, which is how a lost member is seen."""
    w = PushWorker(draft="draft_model")
    assert w.rolloutfleet_state()["group"] is None
    assert w.rolloutfleet_push_group(4, 3, 7) == {"ok": True, "epoch": 4}
    states = engine_wire.states_from_wire([w.rolloutfleet_state()], url="http://engine")
    engine = engine_wire.state_from_wire(paused=True, sleeping=True, weight_version=None, states=states)
    assert engine.group == GroupMembership(epoch=4, rank_offset=3, world_size=7)
    for bad in ((4, 0, 7), (4, 7, 7), (-1, 1, 2), (True, 1, 2)):
        refused = w.rolloutfleet_push_group(*bad)
        assert refused["ok"] is False and refused["error"]["code"] == "invalid_group", bad
    assert w.rolloutfleet_state()["group"] == {"epoch": 4, "rank_offset": 3, "world_size": 7}  # unchanged
    assert PushWorker(draft="draft_model").rolloutfleet_state()["group"] is None
