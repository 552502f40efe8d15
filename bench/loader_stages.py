"""The weight loader in-process on the GPU, stage by stage, without vLLM (part of bench/gpu_update.py).

Called by ``bench/gpu_update.py`` before it starts vLLM: it loads the same verifier checkpoint into a
stand-in CUDA module whose ``load_weights`` copies each tensor into a same-shaped parameter (what vLLM's
default weight loader does for an unsharded tensor), and times

- each stage alone: reading the files into pinned buffers (``preadv`` on N threads), blake3 over pinned
  memory (per 16 MiB chunk, as the loader feeds it), and the device copies (the ceiling, measured by the
  caller);
- the whole pipeline (``loader.stream_into``) with the default options, with a model that discards the
  tensors (read + hash only), and over a small sweep of reader threads and read-ahead.

Every run's digest is checked against the publisher's. GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

GB = 1e9
MiB = 1 << 20


def _best_and_median(seconds: list[float], nbytes: int) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "GBps_best": nbytes / min(seconds) / GB,
        "GBps_median": nbytes / statistics.median(seconds) / GB,
    }


def _read_only(path: str, threads: int, repeats: int) -> dict[str, Any]:
    """Files → pinned buffers with the loader's own chunk reader, nothing else."""
    import os

    import torch

    from rolloutfleet_worker import digest, loader

    infos = digest.scan_directory(path)
    total = sum(t.nbytes for t in infos)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    base = buffer.data_ptr()
    fds = {t.file: os.open(t.file, os.O_RDONLY) for t in infos}
    jobs = []
    pos = 0
    for t in infos:
        for start in range(0, t.nbytes, loader.CHUNK_BYTES):
            length = min(loader.CHUNK_BYTES, t.nbytes - start)
            jobs.append((fds[t.file], t.file, base + pos + start, t.offset + start, length))
        pos += t.nbytes
    seconds = []
    try:
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeats):
                t0 = time.perf_counter()
                for fut in [pool.submit(loader._fill, *job) for job in jobs]:
                    fut.result()
                seconds.append(time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"threads": threads, **_best_and_median(seconds, total)}


def _hash_only(nbytes: int, repeats: int) -> dict[str, Any]:
    """blake3 (all cores) over pinned memory, 16 MiB per update as the loader does, and in one update."""
    import blake3
    import torch

    from rolloutfleet_worker import loader

    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buffer.random_(0, 256)
    view = memoryview(buffer.numpy())
    chunked, whole = [], []
    for _ in range(repeats):
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        t0 = time.perf_counter()
        for start in range(0, nbytes, loader.CHUNK_BYTES):
            h.update(view[start : start + loader.CHUNK_BYTES])
        h.digest()
        chunked.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()
        whole.append(time.perf_counter() - t0)
    return {"chunked": _best_and_median(chunked, nbytes), "one_update": _best_and_median(whole, nbytes)}


class _StandIn:
    """Parameters of the checkpoint's shapes on the GPU; ``load_weights`` copies into them in place."""

    def __init__(self, path: str) -> None:
        import torch

        from rolloutfleet_worker import digest, loader

        self.params = {
            t.name: torch.empty(t.shape, dtype=loader.torch_dtype(t.dtype, t.file), device="cuda")
            for t in digest.scan_directory(path)
        }

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)


class _Discard:
    """A ``load_weights`` that takes every tensor and copies nothing: the pipeline's host side alone."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        for _ in weights:
            pass


def _pipeline(path: str, model: Any, make_options: Callable[[], Any], expected: str, repeats: int) -> dict[str, Any]:
    import torch

    from rolloutfleet_worker import loader

    seconds, nbytes = [], 0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outcome = loader.stream_into(model, path, options=make_options())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        nbytes = outcome.bytes
        if outcome.digest != expected:
            raise AssertionError(f"loader digest {outcome.digest} != publisher's {expected}")
    return {"first_s": seconds[0], **_best_and_median(seconds[1:] or seconds, nbytes)}


def measure(path: str, expected_digest: str, repeats: int = 4) -> dict[str, Any]:
    """All of the above for checkpoint ``path``; the stand-in module is freed before returning."""
    import torch

    from rolloutfleet_worker import digest, loader

    nbytes = sum(t.nbytes for t in digest.scan_directory(path))
    out: dict[str, Any] = {"bytes": nbytes, "default_read_threads": loader.default_read_threads()}
    out["read_only"] = [_read_only(path, n, repeats) for n in (1, 2, 4, 8, 12)]
    out["hash_only"] = _hash_only(nbytes, repeats)
    pin = loader.LoadOptions(pin=True)
    stand_in = _StandIn(path)
    out["pipeline_default"] = _pipeline(path, stand_in, lambda: pin, expected_digest, repeats)
    out["pipeline_discard"] = _pipeline(path, _Discard(), lambda: pin, expected_digest, repeats)
    sweep = []
    for threads in (2, 4, 8, 12):
        for readahead in (512 * MiB, 2048 * MiB, 8192 * MiB):
            opts = loader.LoadOptions(pin=True, read_threads=threads, readahead_bytes=readahead)
            result = _pipeline(path, stand_in, lambda o=opts: o, expected_digest, 3)  # type: ignore[misc]
            sweep.append({"read_threads": threads, "readahead_MiB": readahead // MiB, **result})
    out["sweep"] = sweep
    del stand_in
    torch.cuda.empty_cache()
    return out


def report_lines(stages: dict[str, Any], ceiling_gbps: float) -> list[str]:
    """The loader section of gpu_update.md."""
    d = stages["pipeline_default"]
    lines = [
        "## The loader in-process, stage by stage (no vLLM; stand-in CUDA module, same verifier bytes)",
        "",
        f"Default options: {stages['default_read_threads']} reader threads, 2 GiB read-ahead, 16 MiB chunks, "
        "blake3 on all cores, pinned buffers. Best of the repeats after the first (first = cold pinned cache).",
        "",
        "| stage | GB/s best | GB/s median | vs ceiling |",
        "|---|---|---|---|",
    ]
    for r in stages["read_only"]:
        lines.append(
            f"| read files → pinned, {r['threads']} threads | {r['GBps_best']:.1f} | {r['GBps_median']:.1f} | "
            f"{r['GBps_best'] / ceiling_gbps:.2f}x |"
        )
    h = stages["hash_only"]
    lines += [
        f"| blake3 over pinned memory, 16 MiB updates | {h['chunked']['GBps_best']:.1f} | "
        f"{h['chunked']['GBps_median']:.1f} | {h['chunked']['GBps_best'] / ceiling_gbps:.2f}x |",
        f"| blake3 over pinned memory, one update | {h['one_update']['GBps_best']:.1f} | "
        f"{h['one_update']['GBps_median']:.1f} | |",
        f"| pipeline, model discards (read + hash) | {stages['pipeline_discard']['GBps_best']:.1f} | "
        f"{stages['pipeline_discard']['GBps_median']:.1f} | "
        f"{stages['pipeline_discard']['GBps_best'] / ceiling_gbps:.2f}x |",
        f"| **pipeline, defaults (read + hash + device copy)** | **{d['GBps_best']:.1f}** | {d['GBps_median']:.1f} | "
        f"**{d['GBps_median'] / ceiling_gbps:.2f}x** |",
        "",
        f"First load of the process (cold pinned cache): {stages['bytes'] / d['first_s'] / GB:.1f} GB/s.",
        "",
        "Sweep (median of 2 after a first run, GB/s):",
        "",
        "| reader threads | 512 MiB ahead | 2 GiB ahead | 8 GiB ahead |",
        "|---|---|---|---|",
    ]
    by_threads: dict[int, list[str]] = {}
    for r in stages["sweep"]:
        by_threads.setdefault(r["read_threads"], []).append(f"{r['GBps_median']:.1f}")
    for threads, cells in by_threads.items():
        lines.append(f"| {threads} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines
