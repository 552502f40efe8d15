"""The digest of sent tensors is the project's one digest: equal to ``rolloutfleet digest`` of a safetensors
checkpoint holding the same tensors (docs/digest.md), for raw records, CPU tensors and (on a GPU) CUDA tensors
hashed where they live. That equality is what lets the operator verify a pushed target like a path load."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file as save_numpy

from rolloutfleet import cli
from rolloutfleet.digest import digest_directory
from rolloutfleet.trainer import tensors as torch_tensors
from rolloutfleet.trainer.digest import RawTensor, TensorSource, digest_tensors
from rolloutfleet.trainer.errors import InvalidTensors

REPO = pathlib.Path(__file__).resolve().parents[3]


def _numpy_checkpoint(directory: pathlib.Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.mlp.weight": rng.standard_normal((8, 8)).astype(np.float16),
        "model.layers.0.bias": rng.integers(-5, 5, (8,)).astype(np.int64),
        "lm_head.mask": rng.integers(0, 2, (3, 5)).astype(bool),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.uint8),
    }
    directory.mkdir(parents=True)
    save_numpy(arrays, str(directory / "model.safetensors"))
    return arrays


_NUMPY_TO_ST = {"float32": "F32", "float16": "F16", "int64": "I64", "bool": "BOOL", "float64": "F64", "uint8": "U8"}


def test_raw_records_equal_the_checkpoint_digest(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = _numpy_checkpoint(tmp_path / "ckpt")
    records = [(n, _NUMPY_TO_ST[str(a.dtype)], a.shape, a.tobytes()) for n, a in arrays.items()]
    expected = digest_directory(tmp_path / "ckpt")
    assert digest_tensors(records) == expected
    # What the `rolloutfleet digest` command prints, too.
    assert cli.main(["digest", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.strip() == expected
    # The send order does not matter (the definition combines in name order); torch's dtype spelling works.
    torch_names = {"F32": "float32", "F16": "float16", "I64": "int64", "BOOL": "bool", "F64": "float64", "U8": "uint8"}
    pairs = [(n, RawTensor(torch_names[d], s, b)) for n, d, s, b in reversed(records)]
    assert digest_tensors(pairs) == expected
    # Any change to a name, a dtype, a shape or a byte changes it.
    assert digest_tensors([("renamed" if n == "scalar" else n, d, s, b) for n, d, s, b in records]) != expected
    flipped = [(n, d, s, bytes([b[0] ^ 1]) + b[1:] if n == "scalar" else b) for n, d, s, b in records]
    assert digest_tensors(flipped) != expected
    reshaped = [(n, d, (8, 16) if n == "model.embed_tokens.weight" else s, b) for n, d, s, b in records]
    assert digest_tensors(reshaped) != expected


def test_providers_mapping_pairs_generator_callable(tmp_path: pathlib.Path) -> None:
    arrays = _numpy_checkpoint(tmp_path / "ckpt")
    raw = {n: RawTensor(_NUMPY_TO_ST[str(a.dtype)], a.shape, a.tobytes()) for n, a in arrays.items()}
    expected = digest_directory(tmp_path / "ckpt")
    assert digest_tensors(raw) == expected
    assert digest_tensors(list(raw.items())) == expected
    assert digest_tensors(lambda: iter(raw.items())) == expected
    # A one-shot iterator is read once and kept: the push client reads a source again for every session.
    source = TensorSource((item for item in raw.items()), "verifier")
    assert digest_tensors(source) == expected
    assert [n for n, _ in source.items()] == list(raw)


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ([], "no tensors"),
        ([("a", "F32", (1,), b"\0" * 4), ("a", "F32", (1,), b"\0" * 4)], "'a' appears twice"),
        ([("a", "F32", (2,), b"\0" * 4)], r"F32\[2\] needs 8 bytes, got 4"),
        ([("a", "Q4", (1,), b"\0")], "unknown dtype 'Q4'"),
        ([("", "F32", (1,), b"\0" * 4)], "non-empty string"),
        ([("a", [1, 2])], "expected a torch tensor or a RawTensor"),
        ([("a",)], r"expected \(name, tensor\)"),
        ("/weights/step-1", "expected tensors, got str"),
        (42, "expected tensors, got int"),
    ],
)
def test_bad_tensors_are_named(provider: Any, message: str) -> None:
    with pytest.raises(InvalidTensors, match=message):
        digest_tensors(TensorSource(provider, "verifier"))


def test_dtype_tables_match_the_worker_loader() -> None:
    torch = pytest.importorskip("torch")
    from rolloutfleet_worker.loader_base import torch_dtype

    for st, name in torch_tensors.TORCH_DTYPES.items():
        if getattr(torch, name, None) is None:
            continue  # a dtype this torch lacks
        assert str(torch_dtype(st, pathlib.Path("x"))) == f"torch.{name}"
        assert torch_tensors.dtype_pair(st) == torch_tensors.dtype_pair(name) == (st, name)


def _torch_tensors(torch: Any, device: str = "cpu") -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, generator=g)
    out = {
        "model.embed_tokens.weight": base.to(torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(96, 32, generator=g).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.randn(48, generator=g),
        "model.layers.0.mlp.down_proj.weight": base.t(),  # not contiguous
        "ids": torch.randint(0, 1000, (7, 3), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(2.25, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
        "conj": torch.randn(3, 2, dtype=torch.complex64, generator=g).conj(),  # a lazily conjugated view
        "fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
    }
    return {k: v.to(device) for k, v in out.items()}


def _save_torch(tensors: dict[str, Any], directory: pathlib.Path) -> str:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    stored = {k: v.detach().resolve_conj().contiguous().cpu() for k, v in tensors.items()}
    save_file(stored, str(directory / "m.safetensors"))
    return digest_directory(directory)


def test_torch_cpu_tensors_equal_the_checkpoint_digest(tmp_path: pathlib.Path) -> None:
    torch = pytest.importorskip("torch")
    tensors = _torch_tensors(torch)
    expected = _save_torch(tensors, tmp_path / "ckpt")
    assert digest_tensors(tensors) == expected
    assert digest_tensors(list(reversed(tensors.items())), gpu=False) == expected
    progress: list[tuple[int, int]] = []
    digest_tensors(tensors, progress=lambda done, total: progress.append((done, total)))
    assert progress[-1][0] == progress[-1][1] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_torch_tensors_that_have_no_bytes_are_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidTensors, match="meta device"):
        digest_tensors({"w": torch.empty(2, device="meta")})
    with pytest.raises(InvalidTensors, match="make it dense"):
        digest_tensors({"w": torch.eye(3).to_sparse()})


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs torch with a CUDA device")


@needs_cuda
def test_cuda_tensors_hashed_on_the_gpu_equal_the_checkpoint_digest(tmp_path: pathlib.Path) -> None:
    import torch

    tensors = _torch_tensors(torch, "cuda")
    big = torch.randn(3 * 1024 * 1024 + 17, device="cuda")  # many chunks and a short tail
    tensors["big"] = big
    tensors["sliced"] = big[1:4097]  # a view at an offset the int32 reader cannot take as is
    tensors["one_chunk"] = torch.arange(256, dtype=torch.float32, device="cuda")  # exactly 1 KiB
    tensors["chunk_and_a_bit"] = torch.arange(257, dtype=torch.float32, device="cuda")
    expected = _save_torch(tensors, tmp_path / "ckpt")
    assert torch_tensors.gpu_hash_works(torch.cuda.current_device()), "the Triton BLAKE3 self-test failed"
    assert digest_tensors(tensors) == expected
    assert digest_tensors(tensors, gpu=False) == expected


@needs_cuda
def test_ipc_update_info_rebuilds_the_same_tensors_in_another_process(tmp_path: pathlib.Path) -> None:
    """What vLLM's IPC engine (0.26 and 0.33, ``receive_weights``) does with our body: unpickle, take its
    GPU's arguments, set the device index, ``rebuild_cuda_tensor``, load. The rebuilt tensors must digest to
    what we pinned."""
    import json

    import torch

    from rolloutfleet.trainer.senders import IpcSender

    tensors = {k: v for k, v in _torch_tensors(torch, "cuda").items() if k not in ("conj", "empty")}
    prepared = IpcSender().prepare(list(tensors.items()), "verifier")
    info = json.loads(prepared.body)["update_info"]
    assert info["names"] == list(tensors)
    assert info["dtype_names"][:2] == ["bfloat16", "float16"]
    assert info["shapes"][0] == [64, 48]
    (tmp_path / "body.json").write_bytes(prepared.body)
    child = r"""
import base64, json, os, pickle, sys
import torch
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
info = json.load(open(sys.argv[1]))["update_info"]
device = torch.cuda.current_device()
uuid = str(torch.cuda.get_device_properties(device).uuid)
rebuilt = []
from torch.multiprocessing.reductions import rebuild_cuda_tensor
for name, handle in zip(info["names"], pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))):
    args = list(handle[uuid])
    args[6] = device  # as vLLM does: the receiver's device index
    rebuilt.append((name, rebuild_cuda_tensor(*args)))
from rolloutfleet.trainer.digest import digest_tensors
print(digest_tensors(rebuilt))
"""
    path = os.pathsep.join(
        [str(REPO / "operator"), str(REPO / "worker_image"), str(REPO / "digest"), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "body.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == digest_tensors(tensors)
    IpcSender().release(prepared)  # the handles were valid while it was alive
    assert prepared.keepalive == []
