"""BLAKE3 on a device (blake3_device + the Triton kernels) against the blake3 package, bit for bit.

The plain-Python compression runs here directly; the Triton kernels run in Triton's CPU interpreter in a
child process (``TRITON_INTERPRET=1`` must be set before triton is imported, and must not leak into other
tests). On a GPU the loader re-checks the compiled kernels with ``self_test`` before trusting them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import pytest

from rolloutfleet_worker import blake3_device

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3000, 4096, 5 * 1024 + 17, 9 * 1024])
def test_plain_python_blake3_matches_the_package(size: int) -> None:
    data = os.urandom(size)
    assert blake3_device.hash_bytes(data) == blake3.blake3(data).digest()


def test_a_one_chunk_input_is_refused_on_the_device() -> None:
    import torch

    with pytest.raises(ValueError, match="more than one chunk"):
        blake3_device.hash_on_device(torch.zeros(1024, dtype=torch.uint8))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_the_package_in_the_interpreter(tmp_path: Path) -> None:
    """Chunks, odd levels, a partial tail chunk, and whole mapped-path loads hashed on the 'device'."""
    script = textwrap.dedent(
        """
        import os, sys
        import blake3, torch
        from safetensors.torch import save_file
        import rolloutfleet_digest as digest
        from rolloutfleet_worker import blake3_device, loader
        sys.path.insert(0, sys.argv[2])
        from test_worker_loader import Recorder, RecordingPinner

        for size in (2048, 3 * 1024, 5 * 1024 + 17, 65 * 1024 + 100, 130 * 1024):
            data = os.urandom(size)
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            full = size // 1024 * 1024
            got = blake3_device.digest_of(blake3_device.hash_on_device(tensor, data[full:] if size % 1024 else None))
            assert got == blake3.blake3(data).digest(), size

        ckpt = sys.argv[1]
        g = torch.Generator().manual_seed(7)
        save_file(
            {
                "big": torch.randn(40, 64, generator=g).to(torch.bfloat16),       # 5,120 bytes: 5 chunks
                "odd": torch.randn(1, 1537, generator=g).to(torch.bfloat16),      # 3,074 bytes: a tail
                "small": torch.randn(8, generator=g).to(torch.bfloat16),          # hashed on the host
            },
            os.path.join(ckpt, "model.safetensors"),
        )
        for share in (0.0, 1.0):  # windows locked in place, then every window read into bounce buffers
            opts = loader.LoadOptions(
                mode="mapped", pinner=RecordingPinner(), gpu_hash=True, gpu_hash_min_bytes=2048,
                bounce_share=share, window_bytes=4096, chunk_bytes=1000,
            )
            model = Recorder()
            out = loader.stream_into(model, ckpt, options=opts)
            assert out.digest == digest.digest_directory(ckpt), (share, out.digest, digest.digest_directory(ckpt))
            assert out.device_hashed_bytes == 5120 + 3074, out.device_hashed_bytes
            assert (out.bounced_bytes == out.bytes) == (share == 1.0), out.bounced_bytes
        print("ok")
        """
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "digest"), str(REPO / "operator")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
