"""The digest definition, byte for byte, and the ``rolloutfleet digest`` command built on it."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import save_file

import rolloutfleet_digest as digest
from rolloutfleet import cli

pytestmark = pytest.mark.unit


def _write_raw(path: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _hand_made(dirpath: Path) -> tuple[bytes, bytes]:
    """Two tensors written byte by byte; names chosen so UTF-8 order differs from file order."""
    a = struct.pack("<4e", 1.0, -2.0, 0.5, 3.0)  # F16 [2, 2]
    b = bytes([1, 2, 3])  # U8 [3]
    header = {
        "zeta": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]},
        "Alpha": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]},
        "__metadata__": {"format": "pt"},
    }
    _write_raw(dirpath / "one.safetensors", header, a + b)
    return a, b


# Computed once from the spec and pinned: a change here means every published digest changes.
GOLDEN = "blake3:234e577e6d7d4fae229ed2456534669ba1e0590f12b4e9c88a1d734c3d6fbdcd"


def test_exact_bytes_of_the_definition(tmp_path: Path) -> None:
    a, b = _hand_made(tmp_path)
    expected = blake3.blake3(b"rolloutfleet-digest-v1\n")
    # "Alpha" < "zeta" in UTF-8 byte order (uppercase first)
    expected.update(b"Alpha\0U8\0" + b"3\0" + blake3.blake3(b).digest())
    expected.update(b"zeta\0F16\0" + b"2,2\0" + blake3.blake3(a).digest())
    value = digest.digest_directory(tmp_path)
    assert value == "blake3:" + expected.hexdigest()
    assert re.match(digest.DIGEST_PATTERN, value)
    assert digest.is_digest(value) and not digest.is_digest("sha256:" + "0" * 64)


def test_golden_value_is_pinned(tmp_path: Path) -> None:
    _hand_made(tmp_path)
    assert digest.digest_directory(tmp_path) == GOLDEN


def test_scalar_and_empty_tensors(tmp_path: Path) -> None:
    header = {
        "s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        "e": {"dtype": "BF16", "shape": [0, 5], "data_offsets": [4, 4]},
    }
    data = struct.pack("<f", 7.0)
    _write_raw(tmp_path / "x.safetensors", header, data)
    expected = blake3.blake3(b"rolloutfleet-digest-v1\n")
    expected.update(b"e\0BF16\0" + b"0,5\0" + blake3.blake3(b"").digest())
    expected.update(b"s\0F32\0" + b"\0" + blake3.blake3(data).digest())
    assert digest.digest_directory(tmp_path) == "blake3:" + expected.hexdigest()


def test_split_across_files_equals_one_file(tmp_path: Path) -> None:
    t = {f"w{i}": torch.arange(i * 10, i * 10 + 6, dtype=torch.float32).reshape(2, 3) for i in range(4)}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    save_file(t, str(one / "model.safetensors"))
    save_file({k: t[k] for k in ("w0", "w3")}, str(two / "a.safetensors"))
    save_file({k: t[k] for k in ("w1", "w2")}, str(two / "b.safetensors"))
    assert digest.digest_directory(one) == digest.digest_directory(two)
    assert digest.digest_directory(one, threads=1) == digest.digest_directory(one, threads=4)


def test_streaming_builder_matches_directory(tmp_path: Path) -> None:
    _hand_made(tmp_path)
    builder = digest.DigestBuilder()
    for info in reversed(digest.scan_directory(tmp_path)):  # any order in, sorted order out
        with (tmp_path / "one.safetensors").open("rb") as f:
            f.seek(info.offset)
            data = f.read(info.nbytes)
        hasher = digest.TensorHasher(info)
        for i in range(0, len(data), 3):  # arbitrary chunking
            hasher.update(data[i : i + 3])
        builder.add(info, hasher.finish())
    assert builder.hexdigest() == digest.digest_directory(tmp_path)


def test_non_recursive_and_ignores_other_files(tmp_path: Path) -> None:
    _hand_made(tmp_path)
    before = digest.digest_directory(tmp_path)
    (tmp_path / "sub").mkdir()
    _write_raw(tmp_path / "sub" / "x.safetensors", {"q": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x")
    (tmp_path / "config.json").write_text("{}")
    assert digest.digest_directory(tmp_path) == before


def test_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(digest.CheckpointError, match=re.escape("no *.safetensors")):
        digest.digest_directory(tmp_path)
    with pytest.raises(digest.CheckpointError, match="not a directory"):
        digest.digest_directory(tmp_path / "missing")
    _hand_made(tmp_path)
    _write_raw(tmp_path / "two.safetensors", {"zeta": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"z")
    with pytest.raises(digest.CheckpointError, match=r"zeta.*also present in one\.safetensors"):
        digest.digest_directory(tmp_path)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "truncated"),
        (b"\x05\x00\x00\x00", "truncated"),
        (struct.pack("<Q", 1 << 40) + b"{}", "corrupt or truncated header"),
        (struct.pack("<Q", 4) + b"{{{{", "corrupt header"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_corrupt_headers(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(digest.CheckpointError, match=why) as err:
        digest.digest_directory(tmp_path)
    assert err.value.path.endswith("bad.safetensors")


def test_truncated_data_and_wrong_sizes(tmp_path: Path) -> None:
    _write_raw(tmp_path / "t.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 10)
    with pytest.raises(digest.CheckpointError, match=r"t\.safetensors: truncated"):
        digest.digest_directory(tmp_path)
    _write_raw(tmp_path / "t.safetensors", {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(digest.CheckpointError, match="has 16 bytes"):
        digest.digest_directory(tmp_path)


def test_cli_prints_the_same_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _hand_made(tmp_path)
    assert cli.main(["digest", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == digest.digest_directory(tmp_path)
    assert cli.main(["digest", str(tmp_path), "--json", "--threads", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["digest"] == GOLDEN and report["tensors"] == 2 and report["bytes"] == 11 and report["files"] == 1


def test_cli_error_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["digest", str(tmp_path)]) == 1
    assert str(tmp_path) in capsys.readouterr().err
