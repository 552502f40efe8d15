"""What the worker reads from its environment: the draft policy, the loader's and the staging area's options.

Imported by ``rolloutfleet_worker.extension`` (loads), ``rolloutfleet_worker.records`` (the warm-up),
``rolloutfleet_worker.push`` (whether received tensors may be hashed on the GPU) and
``rolloutfleet_worker.staging`` (how fast a stage may read while the engine serves). worker_image/README.md
lists every variable; a malformed value means the default, never a crash. The loader is imported lazily,
so this module imports without torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rolloutfleet_worker import paths
from rolloutfleet_worker.payloads import DraftPolicy

POLICY_ENV = "ROLLOUTFLEET_DRAFT_POLICY"
DRAFT_PATH_ENV = "ROLLOUTFLEET_DRAFT_PATH"
ROOTS_ENV = paths.ROOTS_ENV
THREADS_ENV = "ROLLOUTFLEET_HASH_THREADS"
READ_THREADS_ENV = "ROLLOUTFLEET_LOAD_READ_THREADS"
READAHEAD_ENV = "ROLLOUTFLEET_LOAD_READAHEAD_BYTES"
MODE_ENV = "ROLLOUTFLEET_LOAD_MODE"
GPU_HASH_ENV = "ROLLOUTFLEET_LOAD_GPU_HASH"
UNLOCK_APART_ENV = "ROLLOUTFLEET_LOAD_UNLOCK_APART"
BOUNCE_SHARE_ENV = "ROLLOUTFLEET_LOAD_BOUNCE_SHARE"
BOUNCE_THREADS_ENV = "ROLLOUTFLEET_LOAD_BOUNCE_THREADS"
STAGE_THREADS_ENV = "ROLLOUTFLEET_STAGE_THREADS"
STAGE_GBPS_ENV = "ROLLOUTFLEET_STAGE_GBPS"
STAGE_PIN_CHUNK_ENV = "ROLLOUTFLEET_STAGE_PIN_CHUNK_BYTES"

# Staging runs while the engine serves: a few reader threads leave the host's cores to the engine's
# scheduler and tokenizers (the loader's defaults take most of the cores, inside a pause).
DEFAULT_STAGE_THREADS = 4


def draft_policy() -> DraftPolicy:
    """The draft policy from the environment; an unknown value counts as frozen (never overwrite)."""
    value = os.environ.get(POLICY_ENV, "coUpdate")
    return "coUpdate" if value == "coUpdate" else "frozen"


def _positive_env(name: str) -> int | None:
    """A positive integer from the environment; unset or malformed means the loader's default."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def load_options(pin: bool, world_size: int = 1, sample: Path | None = None, *, probe: bool = True) -> Any:
    """The loader's options from ROLLOUTFLEET_LOAD_* / ROLLOUTFLEET_HASH_THREADS (worker_image/README.md).

    The mapped path (GPU staging; windows read into pinned bounce buffers, or page-locked in place) for a
    single-rank engine on a GPU whose platform locks a read-only mapping of ``sample`` (a file of the
    checkpoint being loaded; probed once per process), unless ``ROLLOUTFLEET_LOAD_MODE=read``; otherwise
    the read path. Defaults are the fastest measured on the H200 (bench/results/gpu_update.md): every
    window bounced, the hash on the GPU, unlocking on its own thread. ``probe=False`` skips the
    page-locking probe (no pinner): the warm-up must not decide it on a file that is not the checkpoint's.
    """
    from rolloutfleet_worker import loader, loader_cuda

    defaults = loader.LoadOptions()
    mode = os.environ.get(MODE_ENV, "auto").strip() or "auto"
    if mode not in ("auto", "mapped", "read"):
        mode = "auto"
    pinner = loader_cuda.cuda_pinner(sample) if probe and pin and world_size == 1 and mode != "read" else None
    return loader.LoadOptions(
        pin=pin,
        mode=mode,  # type: ignore[arg-type]
        read_threads=_positive_env(READ_THREADS_ENV) or defaults.read_threads,
        hash_threads=_positive_env(THREADS_ENV),
        readahead_bytes=_positive_env(READAHEAD_ENV) or defaults.readahead_bytes,
        pinner=pinner,
        gpu_hash=flag_env(GPU_HASH_ENV, True),
        unlock_apart=flag_env(UNLOCK_APART_ENV, True),
        bounce_share=_share_env(BOUNCE_SHARE_ENV, 1.0),
        bounce_threads=_positive_env(BOUNCE_THREADS_ENV) or defaults.bounce_threads,
        roots=paths.weight_roots(),
    )


def stage_threads() -> int:
    """Reader threads of a stage, and the most threads its host hash may use (``ROLLOUTFLEET_STAGE_THREADS``)."""
    return _positive_env(STAGE_THREADS_ENV) or DEFAULT_STAGE_THREADS


# Measured on the H200 inside vLLM 0.26 (bench/results/gpu/bench-staged-sweep-2026-12-01.json): staging a
# 3.76 GB pair uncapped on 4 threads cut a steady load's throughput to 0.53x idle and doubled its p50 latency;
# capped at 2 GB/s the load kept its idle throughput and p99 (1.07x, 0.96 s vs 1.00 s) and the stage took 2 s.
DEFAULT_STAGE_GBPS = 2.0


def stage_gbps() -> float:
    """The stage's read bandwidth cap in GB/s (10^9 B/s; ``ROLLOUTFLEET_STAGE_GBPS``, default
    ``DEFAULT_STAGE_GBPS``); ``0``: uncapped (staging as fast as the disks and cores go, serving slows down)."""
    raw = os.environ.get(STAGE_GBPS_ENV, "").strip()
    if not raw:
        return DEFAULT_STAGE_GBPS
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_STAGE_GBPS
    if value == 0:
        return 0.0
    return value if 0 < value < float("inf") else DEFAULT_STAGE_GBPS  # nan, negative, inf: the default


def stage_pin_chunk_bytes() -> int | None:
    """Bytes per ``cudaHostRegister`` call when a stage page-locks a filled area
    (``ROLLOUTFLEET_STAGE_PIN_CHUNK_BYTES``); None: the whole area in one call."""
    return _positive_env(STAGE_PIN_CHUNK_ENV)


def flag_env(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return default


def _share_env(name: str, default: float) -> float:
    """A share in [0, 1] from the environment; unset or malformed means ``default``."""
    try:
        value = float(os.environ.get(name, "").strip())
    except ValueError:
        return default
    return value if 0.0 <= value <= 1.0 else default
