"""Tiny safetensors checkpoints for the sandbox demo, written without the safetensors package.

Called by ``sandbox.demo``. The operator package must not import safetensors or torch (import-linter),
and the format is simple: an 8-byte little-endian header length, a JSON header of dtype/shape/offsets,
then the raw bytes. The simulated engines read these files and compute the real digest from them.
"""

from __future__ import annotations

import json
import pathlib
import random
import struct


def write_checkpoint(directory: pathlib.Path, seed: int, tensors: int = 4, size: int = 64) -> pathlib.Path:
    """A checkpoint of ``tensors`` float32 vectors of ``size`` values derived from ``seed``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)  # noqa: S311 - demo weights, not secrets
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for index in range(tensors):
        blob = struct.pack(f"<{size}f", *(rng.uniform(-1, 1) for _ in range(size)))
        header[f"layers.{index}.weight"] = {
            "dtype": "F32",
            "shape": [size],
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return directory
