"""RolloutFleetExtension on fake vLLM workers: order, in-place loads, shared tensors, policies, residency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from worker_fakes import GraphWrapper, TinyLlama, WorkerV1, WorkerV2, write_eagle, write_verifier

import rolloutfleet_digest as digest
from rolloutfleet import cli
from rolloutfleet_worker import extension, models

pytestmark = pytest.mark.unit


@pytest.fixture
def ckpt(tmp_path: Path) -> dict[str, Path]:
    return {
        "v1": write_verifier(tmp_path / "verifier-1", seed=1),
        "v2": write_verifier(tmp_path / "verifier-2", seed=2),
        "d1": write_eagle(tmp_path / "draft-1", seed=1),
        "d2": write_eagle(tmp_path / "draft-2", seed=2),
    }


def ptrs(module: torch.nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in module.named_parameters()}


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def load(worker: Any, target: str, path: Path, revision: int) -> dict[str, Any]:
    result: dict[str, Any] = worker.rolloutfleet_load(target, str(path), revision)
    return result


def test_verifier_then_draft_in_place(ckpt: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    w = WorkerV1()
    before = ptrs(w.verifier) | {"d." + k: v for k, v in ptrs(w.draft).items()}  # type: ignore[arg-type]
    res = load(w, "verifier", ckpt["v1"], 1)
    assert res["ok"] is True, res
    assert res["target"] == "verifier" and res["revision"] == 1 and res["path"] == str(ckpt["v1"])
    assert res["skipped"] == [] and res["tensors"] == 19 and res["bytes"] > 0 and res["seconds"] >= 0
    # stacked q/k/v landed in the right slices
    qkv = w.verifier.model.layers[0].self_attn.qkv_proj.weight
    from safetensors.torch import load_file

    raw = load_file(str(ckpt["v1"] / "model-00001-of-00002.safetensors")) | load_file(
        str(ckpt["v1"] / "model-00002-of-00002.safetensors")
    )
    assert torch.equal(qkv[16:32], raw["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(w.verifier.lm_head.weight, raw["lm_head.weight"])

    shared_before = snapshot(w.verifier)
    res = load(w, "draft", ckpt["d1"], 1)
    assert res["ok"] is True, res
    assert res["skipped"] == ["embed_tokens.weight", "lm_head.weight"]
    # the draft's copies of the shared tensors did not overwrite the verifier's
    for n, t in snapshot(w.verifier).items():
        assert torch.equal(t, shared_before[n]), n
    assert w.draft is not None
    assert w.draft.model.fc.weight.abs().sum() > 0
    after = ptrs(w.verifier) | {"d." + k: v for k, v in ptrs(w.draft).items()}
    assert after == before  # nothing rebound: CUDA graphs keep valid pointers

    # both digests equal what `rolloutfleet digest` prints for the same files
    for target, path in (("verifier", ckpt["v1"]), ("draft", ckpt["d1"])):
        assert cli.main(["digest", str(path)]) == 0
        printed = capsys.readouterr().out.strip()
        state = w.rolloutfleet_state()
        assert state["ok"] is True
        assert state[target]["digest"] == printed  # type: ignore[literal-required]
    state = w.rolloutfleet_state()
    assert state["ok"] is True
    assert state["resident"] is True and state["rank"] == 0 and state["draft_method"] == "eagle"
    assert state["verifier"] == {
        "revision": 1,
        "digest": state["verifier"]["digest"],
        "path": str(ckpt["v1"]),
        "verified": True,
        "destroyed": False,
    }
    assert state["draft"] is not None and state["draft"]["revision"] == 1 and state["draft"]["policy"] == "coUpdate"
    assert state["shared_tensors"] == ["lm_head.weight", "model.embed_tokens.weight"]


def test_draft_before_verifier_is_refused(ckpt: dict[str, Path]) -> None:
    w = WorkerV1()
    untouched = snapshot(w.draft)  # type: ignore[arg-type]
    res = load(w, "draft", ckpt["d1"], 1)
    assert res == {"ok": False, "error": {"code": "order", "message": res["error"]["message"]}}
    assert "verifier at revision 1" in res["error"]["message"]
    assert all(torch.equal(t, untouched[n]) for n, t in snapshot(w.draft).items())  # type: ignore[arg-type]
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    assert load(w, "draft", ckpt["d2"], 2)["error"]["code"] == "order"  # verifier holds 1, not 2
    assert load(w, "draft", ckpt["d1"], 1)["ok"]


def test_frozen_draft_refused_and_restorable(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTFLEET_DRAFT_POLICY", "frozen")
    w = WorkerV1()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    res = load(w, "draft", ckpt["d1"], 1)
    assert res["ok"] is False and res["error"]["code"] == "frozen"
    monkeypatch.setenv("ROLLOUTFLEET_DRAFT_PATH", str(ckpt["d1"]))
    wrong = w.rolloutfleet_restore_draft(str(ckpt["d2"]))
    assert wrong["ok"] is False and wrong["error"]["code"] == "invalid_path"
    res = dict(w.rolloutfleet_restore_draft(str(ckpt["d1"])))
    assert res["ok"] is True and res["target"] == "draft" and res["revision"] is None
    assert res["digest"] == digest.digest_directory(ckpt["d1"])
    state = w.rolloutfleet_state()
    assert state["ok"] and state["draft"] is not None
    assert state["draft"]["policy"] == "frozen" and state["draft"]["digest"] == res["digest"]
    assert state["draft"]["revision"] is None and state["draft"]["verified"] is True


def test_restore_refused_for_co_updated_draft(ckpt: dict[str, Path]) -> None:
    res = WorkerV1().rolloutfleet_restore_draft(str(ckpt["d1"]))
    assert res["ok"] is False and res["error"]["code"] == "invalid_target"


def test_v2_speculator_and_draft_model_method(ckpt: dict[str, Path], tmp_path: Path) -> None:
    w2 = WorkerV2()
    assert load(w2, "verifier", ckpt["v1"], 3)["ok"]
    res = load(w2, "draft", ckpt["d1"], 3)
    assert res["ok"] and res["skipped"] == ["embed_tokens.weight", "lm_head.weight"]
    assert w2.rolloutfleet_state()["draft_method"] == "eagle3"  # type: ignore[typeddict-item]
    # an independent draft_model draft shares nothing and loads every tensor
    w1 = WorkerV1(draft="draft_model")
    small = write_verifier(tmp_path / "small", seed=5)
    assert load(w1, "verifier", ckpt["v1"], 1)["ok"]
    from safetensors.torch import load_file, save_file

    one_layer = {k: v for k, v in load_file(str(small / "model-00001-of-00002.safetensors")).items() if ".1." not in k}
    one_layer |= {k: v for k, v in load_file(str(small / "model-00002-of-00002.safetensors")).items() if ".1." not in k}
    (tmp_path / "small1").mkdir()
    save_file(one_layer, str(tmp_path / "small1" / "model.safetensors"))
    res = load(w1, "draft", tmp_path / "small1", 1)
    assert res["ok"], res
    assert res["skipped"] == [] and w1.rolloutfleet_state()["shared_tensors"] == []  # type: ignore[typeddict-item]


def test_no_draft_and_pipeline_rank_without_draft(ckpt: dict[str, Path]) -> None:
    w = WorkerV1(draft="none")
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    assert load(w, "draft", ckpt["d1"], 1)["error"]["code"] == "no_draft"
    state = w.rolloutfleet_state()
    assert state["ok"] and state["draft"] is None and state["draft_method"] is None and state["resident"]


@pytest.mark.parametrize(
    ("target", "path", "revision", "code"),
    [
        ("lm", "/abs", 1, "invalid_target"),
        ("verifier", "relative/dir", 1, "invalid_path"),
        ("verifier", "/tmp/../etc", 1, "invalid_path"),
        ("verifier", "/nonexistent/rolloutfleet", 1, "invalid_path"),
        ("verifier", "/tmp", "7", "invalid_revision"),
        ("verifier", "/tmp", True, "invalid_revision"),
        ("verifier", 42, 1, "invalid_path"),
    ],
)
def test_bad_arguments_are_refused_not_raised(target: str, path: Any, revision: Any, code: str) -> None:
    w = WorkerV1()
    res = w.rolloutfleet_load(target, path, revision)
    assert res["ok"] is False and res["error"]["code"] == code


def test_weight_roots(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUTFLEET_WEIGHT_ROOTS", str(tmp_path / "elsewhere"))
    res = load(WorkerV1(), "verifier", ckpt["v1"], 1)
    assert res["ok"] is False and res["error"]["code"] == "invalid_path" and "allowed" in res["error"]["message"]
    monkeypatch.setenv("ROLLOUTFLEET_WEIGHT_ROOTS", str(tmp_path))
    assert load(WorkerV1(), "verifier", ckpt["v1"], 1)["ok"]


def test_the_directory_checked_is_the_directory_read(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A link swapped between the roots check and the read must not redirect the load outside the roots.

    The path is resolved once and the load reads the resolved directory; the result still names the path
    the operator asked for, which is what it compares with its goal.
    """
    roots = tmp_path / "roots"
    inside = write_verifier(roots / "step-1", seed=1)
    outside = ckpt["v2"]
    link = roots / "current"
    link.symlink_to(inside)
    monkeypatch.setenv("ROLLOUTFLEET_WEIGHT_ROOTS", str(roots))
    scan = digest.scan_directory

    def swap_then_scan(path: Path | str) -> list[digest.TensorInfo]:
        link.unlink()
        link.symlink_to(outside)  # the race: after the check, before the files are opened
        return scan(path)

    monkeypatch.setattr(digest, "scan_directory", swap_then_scan)
    res = load(WorkerV1(), "verifier", link, 1)
    monkeypatch.undo()
    assert res["ok"] is True, res
    assert res["digest"] == digest.digest_directory(inside) and res["path"] == str(link)


def test_a_shard_linked_outside_the_roots_is_refused(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """The directory is inside the roots but one shard links out: what is opened must be inside too.

    Shards linked elsewhere inside the roots (a Hugging Face snapshot's ``blobs/``) stay allowed.
    """
    roots = tmp_path / "roots"
    (roots / "blobs").mkdir(parents=True)
    leaky, snapshot = roots / "leaky", roots / "snapshot"
    leaky.mkdir()
    snapshot.mkdir()
    for f in sorted(ckpt["v1"].glob("*.safetensors")):
        blob = roots / "blobs" / f.name
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(blob)
        (leaky / f.name).symlink_to(f if f.name.startswith("model-00002") else blob)
    mp = pytest.MonkeyPatch()
    mp.setenv("ROLLOUTFLEET_WEIGHT_ROOTS", str(roots))
    try:
        w = WorkerV1()
        res = load(w, "verifier", leaky, 1)
        assert res["ok"] is False and res["error"]["code"] == "invalid_path", res
        assert "outside the allowed weight roots" in res["error"]["message"]
        assert w.rolloutfleet_state()["verifier"] == UNKNOWN  # type: ignore[typeddict-item]
        res = load(w, "verifier", snapshot, 1)
        assert res["ok"] is True and res["digest"] == digest.digest_directory(ckpt["v1"])
    finally:
        mp.undo()


def test_control_characters_in_paths_are_refused(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """No checkpoint is named with a newline or NUL; such a name only serves to forge log lines."""
    odd = tmp_path / "step\n1"
    odd.symlink_to(ckpt["v1"])
    res = load(WorkerV1(), "verifier", odd, 1)
    assert res["ok"] is False and res["error"]["code"] == "invalid_path" and "control" in res["error"]["message"]


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "empty_dir"])
def test_bad_files_fail_closed(ckpt: dict[str, Path], damage: str, tmp_path: Path) -> None:
    w = WorkerV1()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    bad = ckpt["v2"] / "model-00002-of-00002.safetensors"
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:-100])
    elif damage == "corrupt":
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    else:
        ckpt["v2"] = tmp_path / "empty"
        ckpt["v2"].mkdir()
    res = load(w, "verifier", ckpt["v2"], 2)
    assert res["ok"] is False and res["error"]["code"] == "io"
    assert (str(bad) if damage != "empty_dir" else str(ckpt["v2"])) in res["error"]["message"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["verifier"] == UNKNOWN
    assert load(w, "draft", ckpt["d1"], 1)["error"]["code"] == "order"  # unknown verifier blocks the draft


def test_load_weights_failure_is_reported(ckpt: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "odd").mkdir()
    save_file({"model.not_a_param.weight": torch.zeros(2)}, str(tmp_path / "odd" / "m.safetensors"))
    w = WorkerV1()
    res = load(w, "verifier", tmp_path / "odd", 5)
    assert res["ok"] is False and res["error"]["code"] == "load_failed"
    assert "not_a_param" in res["error"]["message"]
    assert w.rolloutfleet_state()["verifier"]["verified"] is False  # type: ignore[typeddict-item]


UNKNOWN = {"revision": None, "digest": None, "path": None, "verified": False, "destroyed": False}


def test_a_load_weights_that_stops_early_leaves_the_slot_unknown(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only 3 of 19 tensors reached the model: most parameters still hold revision 1.

    Claiming revision 2 (verified, with the publisher's digest) would let the operator resume a pod that
    serves a mix of two revisions; the slot must read unknown so it never resumes on it.
    """
    w = WorkerV1()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    real = w.verifier.load_weights

    def three(weights: Any) -> set[str]:
        return real(item for _, item in zip(range(3), weights, strict=False))

    monkeypatch.setattr(w.verifier, "load_weights", three)
    res = load(w, "verifier", ckpt["v2"], 2)
    assert res["ok"] is False and res["error"]["code"] == "incomplete", res
    assert "3 of 19" in res["error"]["message"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["verifier"] == UNKNOWN


def test_names_the_model_ignores_fail_the_load(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint saved under other names (``transformer.`` for ``model.``) that the model skips silently.

    Every tensor was fed and hashed, so the digest equals the publisher's, yet no parameter changed:
    vLLM's ``load_weights`` reports which parameters it filled, and any left out must fail the load.
    """
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in ckpt["v2"].glob("*.safetensors"):
        tensors = {k.replace("model.", "transformer.", 1): v for k, v in load_file(str(f)).items()}
        save_file(tensors, str(renamed / f.name))
    w = WorkerV1()
    w.verifier.lenient = True
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    res = load(w, "verifier", renamed, 2)
    assert res["ok"] is False and res["error"]["code"] == "incomplete", res
    assert "12 of 13 parameters" in res["error"]["message"]  # lm_head kept its name: loaded
    assert "model.layers.0.mlp.down_proj.weight" in res["error"]["message"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["verifier"] == UNKNOWN


def test_a_draft_need_not_load_what_it_shares_with_the_verifier(ckpt: dict[str, Path]) -> None:
    """The EAGLE draft's embed_tokens/lm_head are the verifier's: skipped by design, so not required."""
    w = WorkerV1()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    res = load(w, "draft", ckpt["d1"], 1)
    assert res["ok"] is True and res["skipped"] == ["embed_tokens.weight", "lm_head.weight"]


def test_quantized_engines_check_the_feed_only(
    ckpt: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM checks the loaded names only for unquantized models (quantization methods create parameters
    no checkpoint carries, e.g. derived scales); a stricter check here would refuse every update there."""
    from types import SimpleNamespace

    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    for f in ckpt["v2"].glob("*.safetensors"):
        save_file({k: v for k, v in load_file(str(f)).items() if k != "lm_head.weight"}, str(partial / f.name))
    w = WorkerV1()
    res = load(w, "verifier", partial, 2)
    assert res["ok"] is False and res["error"]["code"] == "incomplete" and "lm_head.weight" in res["error"]["message"]
    w.model_config = SimpleNamespace(quantization="fp8")  # type: ignore[attr-defined]
    assert load(w, "verifier", partial, 2)["ok"]


def test_level2_sleep_is_noticed(ckpt: dict[str, Path]) -> None:
    w = WorkerV1()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    assert load(w, "draft", ckpt["d1"], 1)["ok"]
    assert w.rolloutfleet_state()["resident"] is True  # type: ignore[typeddict-item]
    with torch.no_grad():  # what sleep(level=2) + wake_up(tags=weights) leaves behind
        for p in list(w.verifier.parameters()) + list(w.draft.parameters()):  # type: ignore[union-attr]
            p.zero_()
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is False
    assert state["verifier"]["revision"] is None and state["verifier"]["digest"] is None
    assert state["draft"] is not None and state["draft"]["revision"] is None
    assert w.rolloutfleet_state()["resident"] is False  # type: ignore[typeddict-item]  # sticky
    assert load(w, "verifier", ckpt["v2"], 2)["ok"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is False and state["verifier"]["revision"] == 2  # draft still lost
    assert load(w, "draft", ckpt["d2"], 2)["ok"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is True and state["draft"] is not None and state["draft"]["revision"] == 2


def test_sleep_before_first_load_is_noticed() -> None:
    w = WorkerV1()
    with torch.no_grad():
        for p in w.verifier.parameters():
            p.normal_()
    assert w.rolloutfleet_state()["resident"] is True  # type: ignore[typeddict-item]  # baseline taken
    with torch.no_grad():
        for p in w.verifier.parameters():
            p.zero_()
    assert w.rolloutfleet_state()["resident"] is False  # type: ignore[typeddict-item]


def test_a_draft_lookup_that_raises_fails_the_state_report() -> None:
    """An accessor that raises means this vLLM's layout is not what we know, not "no draft here".

    Reporting ``draft: None`` would tell the operator the engine has no draft, so it would skip the draft
    load and resume a pod whose draft still holds the previous revision.
    """
    w = WorkerV2()

    def broken() -> Any:
        raise RuntimeError("drafter not initialised")

    w.get_draft_model = broken  # type: ignore[method-assign]
    state = w.rolloutfleet_state()
    assert state["ok"] is False and state["error"]["code"] == "internal", state
    assert "drafter not initialised" in state["error"]["message"]
    res = load(w, "verifier", Path("/nonexistent"), 1)
    assert res["ok"] is False


def test_a_configured_method_without_a_draft_model_is_an_error(ckpt: dict[str, Path]) -> None:
    """``--speculative-config`` says eagle, yet no draft module is found: the lookup is broken.

    Saying "no draft" would let a rollout skip the draft and pair a new verifier with an old draft.
    """
    w = WorkerV1()
    w.model_runner.drafter = None
    state = w.rolloutfleet_state()
    assert state["ok"] is False and state["error"]["code"] == "internal", state
    assert "'eagle'" in state["error"]["message"]
    res = load(w, "verifier", ckpt["v1"], 1)
    assert res["ok"] is False and res["error"]["code"] == "internal"


def test_methods_without_a_draft_model_and_ranks_without_the_drafter_report_no_draft(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """n-gram/suffix speculation has no draft module, and vLLM builds the drafter on the last pipeline
    rank only: there "no draft" is the truth, and the configured method is still reported."""
    from types import SimpleNamespace

    w = WorkerV1(draft="none")
    w.speculative_config = SimpleNamespace(method="ngram")
    state = w.rolloutfleet_state()
    assert state["ok"] and state["draft"] is None and state["draft_method"] == "ngram"
    w = WorkerV1()
    w.model_runner.drafter = None
    monkeypatch.setattr(models, "last_pipeline_rank", lambda: False)
    state = w.rolloutfleet_state()
    assert state["ok"] and state["draft"] is None and state["draft_method"] == "eagle"


def test_draft_method_is_reported_as_configured() -> None:
    """The operator compares ``draft_method`` with the fleet spec; an enum-valued method is its value,
    and a method that is no name at all is an error rather than a silent None."""
    import enum
    from types import SimpleNamespace

    class Method(enum.Enum):
        EAGLE3 = "eagle3"

    w = WorkerV2()
    w.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method=Method.EAGLE3))
    assert w.rolloutfleet_state()["draft_method"] == "eagle3"  # type: ignore[typeddict-item]
    w.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method=3))
    state = w.rolloutfleet_state()
    assert state["ok"] is False and state["error"]["code"] == "internal"


def test_unwrap_is_bounded_and_skips_forwarders() -> None:
    model = TinyLlama()
    assert models.unwrap(model) is model  # a real model has .model too: not peeled
    assert models.unwrap(GraphWrapper(GraphWrapper(model))) is model

    class Loop:
        def __init__(self) -> None:
            self.runnable = self

    class Chain:
        def __init__(self, depth: int) -> None:
            self.module = Chain(depth - 1) if depth else None

    assert models.unwrap(Loop()) is None
    assert models.unwrap(Chain(50)) is None
    assert models.unwrap(None) is None


def test_state_never_raises() -> None:
    class Broken(extension.RolloutFleetExtension):
        @property
        def model_runner(self) -> Any:
            raise RuntimeError("boom")

    res = Broken().rolloutfleet_state()
    assert res["ok"] is True or res["error"]["code"] == "internal"
    res2 = Broken().rolloutfleet_load("verifier", "/tmp", 1)
    assert res2["ok"] is False


def test_asleep_weights_are_not_read(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    w = WorkerV1()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    monkeypatch.setattr(models, "weights_mapped", lambda model, names=None: False)
    monkeypatch.setattr(models, "fingerprint", lambda *a: pytest.fail("read unmapped memory"))
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is False and state["verifier"]["revision"] is None
    res = load(w, "verifier", ckpt["v1"], 1)
    assert res["ok"] is False and res["error"]["code"] == "order" and "wake_up" in res["error"]["message"]
    monkeypatch.undo()  # level-1 wake: same contents back, not a loss
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is True and state["verifier"]["revision"] == 1


def test_pointer_mapped_reads_the_driver_answer() -> None:
    import ctypes

    class Driver:
        def __init__(self, rc: int, value: int) -> None:
            self.rc, self.value = rc, value

        def cuPointerGetAttribute(self, out: Any, attr: Any, ptr: Any) -> int:
            assert attr.value == 13  # CU_POINTER_ATTRIBUTE_MAPPED
            ctypes.cast(out, ctypes.POINTER(ctypes.c_ubyte))[0] = self.value
            return self.rc

    assert models._pointer_mapped(Driver(0, 1), 0x1000) is True
    assert models._pointer_mapped(Driver(0, 0), 0x1000) is False
    assert models._pointer_mapped(Driver(1, 0), 0x1000) is False  # CUDA_ERROR_INVALID_VALUE: unmapped
    assert models.weights_mapped(TinyLlama()) is True  # CPU parameters: nothing to check


def test_preflight_checks_a_good_checkpoint_without_reading_tensors(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator pre-flights every pod before it pauses one: that must cost headers, not bytes."""
    from rolloutfleet_worker import loader_base

    w = WorkerV1()
    before = snapshot(w.verifier)
    monkeypatch.setattr(digest, "hash_tensor", lambda *a, **k: pytest.fail("hashed tensor bytes"))
    monkeypatch.setattr(loader_base, "read_into", lambda *a: pytest.fail("read tensor bytes"))
    monkeypatch.setattr(w.verifier, "load_weights", lambda weights: pytest.fail("fed the model"))
    res = w.rolloutfleet_preflight("verifier", str(ckpt["v1"]))
    report = digest.scan_directory(ckpt["v1"])
    assert res == {
        "ok": True,
        "target": "verifier",
        "path": str(ckpt["v1"]),
        "tensors": 19,
        "bytes": sum(t.nbytes for t in report),
    }
    assert all(torch.equal(t, before[n]) for n, t in snapshot(w.verifier).items())
    monkeypatch.undo()
    assert load(w, "verifier", ckpt["v1"], 1)["ok"]
    res = w.rolloutfleet_preflight("draft", str(ckpt["d1"]))  # shared tensors neither needed nor counted
    assert res["ok"] is True and res["tensors"] == 11


def test_preflight_refuses_a_checkpoint_too_small_for_the_model(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """A one-layer checkpoint for a two-layer model cannot fill it, whatever its names map to."""
    from safetensors.torch import load_file, save_file

    small = tmp_path / "one-layer"
    small.mkdir()
    for f in ckpt["v1"].glob("*.safetensors"):
        save_file({k: v for k, v in load_file(str(f)).items() if ".1." not in k}, str(small / f.name))
    res = WorkerV1().rolloutfleet_preflight("verifier", str(small))
    assert res["ok"] is False and res["error"]["code"] == "incomplete" and "elements" in res["error"]["message"]


def test_preflight_reports_what_a_load_would(
    ckpt: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = ckpt["v2"] / "model-00002-of-00002.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])
    w = WorkerV1(draft="none")
    assert w.rolloutfleet_preflight("verifier", str(ckpt["v2"]))["error"]["code"] == "io"  # type: ignore[typeddict-item]
    assert w.rolloutfleet_preflight("draft", str(ckpt["d1"]))["error"]["code"] == "no_draft"  # type: ignore[typeddict-item]
    assert w.rolloutfleet_preflight("lm", str(ckpt["v1"]))["error"]["code"] == "invalid_target"  # type: ignore[typeddict-item]
    monkeypatch.setenv("ROLLOUTFLEET_WEIGHT_ROOTS", str(tmp_path / "elsewhere"))
    assert w.rolloutfleet_preflight("verifier", str(ckpt["v1"]))["error"]["code"] == "invalid_path"  # type: ignore[typeddict-item]
