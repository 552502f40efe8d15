"""The weight loader in-process on the GPU, stage by stage, without vLLM (part of bench/gpu_update.py).

Called by ``bench/gpu_update.py`` before it starts vLLM: it loads the same verifier checkpoint into a
stand-in CUDA module whose ``load_weights`` copies each tensor into a same-shaped parameter (what vLLM's
default weight loader does for an unsharded tensor), and times

- each stage alone: reading the files into pinned buffers (``preadv`` on N threads), blake3 over pinned
  memory (per 16 MiB chunk, as the loader feeds it), and the device copies (the ceiling, measured by the
  caller);
- host memory bandwidth: reading while the GPU copies another buffer in, and a plain memcpy;
- both pipelines (``loader.stream_into``): the mapped path (GPU staging from bounce buffers or from the
  page cache locked in place, hashed on the GPU; what a single-GPU engine runs) and the read path (files
  copied into pinned buffers, hashed on the host; tensor parallel, or no read-only registration), each
  with the worker's default options (``extension.load_options``), with a model that discards the tensors
  (host side only), and over a sweep of their knobs; BLAKE3 on the GPU alone.

Every run's digest is checked against the publisher's. GB/s are 10^9 bytes per second. Alone (no vLLM
needed, only torch with CUDA, blake3 and safetensors), it writes a checkpoint of the bench's shape first:

    python3 bench/loader_stages.py --out DIR     # DIR/loader_stages.json and .md
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


def _read_only(path: str, threads: int, repeats: int, chunk: int = 16 * MiB, dma: bool = False) -> dict[str, Any]:
    """Files → pinned buffers with the loader's own chunk reader, nothing else.

    ``dma``: meanwhile a side stream copies another pinned buffer to the GPU over and over (what the
    device copies of a load do to host memory); both rates are reported, to see whether host memory
    bandwidth bounds a pipeline that reads and copies at once.
    """
    import os

    import torch

    import rolloutfleet_digest as digest
    from rolloutfleet_worker import loader_base

    infos = digest.scan_directory(path)
    total = sum(t.nbytes for t in infos)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    base = buffer.data_ptr()
    fds = {t.file: os.open(t.file, os.O_RDONLY) for t in infos}
    jobs = []
    pos = 0
    for t in infos:
        for start in range(0, t.nbytes, chunk):
            length = min(chunk, t.nbytes - start)
            jobs.append((fds[t.file], t.file, base + pos + start, t.offset + start, length))
        pos += t.nbytes
    seconds = []
    copier = _BackgroundCopies() if dma else None
    try:
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeats):
                if copier is not None:
                    copier.start()
                t0 = time.perf_counter()
                for fut in [pool.submit(loader_base.read_into, *job) for job in jobs]:
                    fut.result()
                seconds.append(time.perf_counter() - t0)
                if copier is not None:
                    copier.stop()
    finally:
        for fd in fds.values():
            os.close(fd)
    out = {"threads": threads, "chunk_MiB": chunk // MiB, **_best_and_median(seconds, total)}
    if copier is not None:
        out["dma_GBps"] = copier.rates
    return out


class _BackgroundCopies:
    """Host→device copies of one pinned 1 GiB buffer in a loop on a thread of its own, until stopped."""

    def __init__(self) -> None:
        import threading

        import torch

        self.src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        self.rates: list[float] = []
        self.halt = threading.Event()
        self.thread: Any = None

    def start(self) -> None:
        import threading

        self.halt.clear()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()

    def _run(self) -> None:
        import torch

        torch.cuda.set_device(self.dst.device)
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        copied, t0 = 0, time.perf_counter()
        with torch.cuda.stream(stream):
            while not self.halt.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                stream.synchronize()
                copied += self.src.numel()
        self.rates.append(copied / (time.perf_counter() - t0) / GB)


def _memcpy(nbytes: int, repeats: int) -> dict[str, Any]:
    """Host memory → host memory with every core (torch's parallel copy): the host's copy bandwidth."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return {"threads": torch.get_num_threads(), **_best_and_median(seconds, nbytes)}


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


def _lock_while_copying(path: str) -> dict[str, Any]:
    """Does page-locking wait for the device? Lock one window with the GPU idle, then behind a long copy."""
    import mmap
    import os
    import warnings

    import torch

    import rolloutfleet_digest as digest
    from rolloutfleet_worker import loader_base, loader_cuda

    pinner = loader_cuda.cuda_pinner()
    if pinner is None:
        return {"error": "no pinner"}
    file = digest.scan_directory(path)[0].file
    fd = os.open(file, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        address = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    window = min(loader_base.WINDOW_BYTES, len(mm) // mmap.PAGESIZE * mmap.PAGESIZE)
    big = 4 << 30
    src = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(big, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"window_bytes": window}
    for label, busy in (("idle", False), ("behind_a_copy", True), ("idle_again", False)):
        torch.cuda.synchronize()
        if busy:
            t_copy = time.perf_counter()
            dst.copy_(src, non_blocking=True)  # ~75 ms of DMA queued
        t0 = time.perf_counter()
        ok = pinner.register(address, window)
        lock_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if ok:
            pinner.unregister(address)
        unlock_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        entry = {"locked": ok, "lock_s": lock_s, "unlock_s": unlock_s}
        if busy:
            entry["copy_s"] = time.perf_counter() - t_copy
        out[label] = entry
    del src, dst
    return out


def _gpu_hash_only(nbytes: int, repeats: int) -> dict[str, Any]:
    """blake3_device over bytes already on the GPU (after its self-test against the blake3 package)."""
    import torch

    from rolloutfleet_worker import blake3_device

    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    if not blake3_device.self_test(device):
        return {"error": "self-test failed: the device kernels disagree with the blake3 package"}
    self_test_s = time.perf_counter() - t0  # the first one includes compiling the kernels
    size = min(nbytes, 470 << 20) // 1024 * 1024
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        blake3_device.digest_of(blake3_device.hash_on_device(data))
        seconds.append(time.perf_counter() - t0)
    return {"bytes": size, "self_test_s": self_test_s, **_best_and_median(seconds, size)}


class _StandIn:
    """Parameters of the checkpoint's shapes on the GPU; ``load_weights`` copies into them in place."""

    def __init__(self, path: str) -> None:
        import torch

        import rolloutfleet_digest as digest
        from rolloutfleet_worker import loader

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

    seconds, nbytes, split = [], 0, []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outcome = loader.stream_into(model, path, options=make_options())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        nbytes = outcome.bytes
        split.append([outcome.model_seconds, outcome.waiting_seconds, outcome.finish_seconds])
        if outcome.digest != expected:
            raise AssertionError(f"loader digest {outcome.digest} != publisher's {expected}")
    # split: per load, [load_weights' own time, its waits for tensors, after it returned] in seconds
    return {"first_s": seconds[0], "split_s": split, **_best_and_median(seconds[1:] or seconds, nbytes)}


def measure(path: str, expected_digest: str, repeats: int = 4) -> dict[str, Any]:
    """All of the above for checkpoint ``path``; the stand-in module is freed before returning."""
    import dataclasses

    import torch

    import rolloutfleet_digest as digest
    from rolloutfleet_worker import extension, loader_cuda

    nbytes = sum(t.nbytes for t in digest.scan_directory(path))
    worker = extension.load_options(pin=True)  # exactly what a single-GPU worker uses by default
    pinner = loader_cuda.cuda_pinner()
    mapped = dataclasses.replace(worker, mode="mapped", pinner=pinner)
    read = dataclasses.replace(worker, mode="read", pinner=None)
    out: dict[str, Any] = {
        "bytes": nbytes,
        "default_read_threads": worker.read_threads,
        "mapped_available": pinner is not None,
        "default_path": "mapped" if worker.pinner is not None else "read",
    }
    out["read_only"] = [_read_only(path, n, repeats) for n in (2, 6, 12, 16)]
    out["read_only"].append(_read_only(path, 12, repeats, chunk=64 * MiB))
    out["read_while_copying"] = [_read_only(path, n, repeats, dma=True) for n in (6, 12)]
    out["memcpy"] = _memcpy(nbytes, repeats)
    out["hash_only"] = _hash_only(nbytes, repeats)
    if pinner is not None:
        out["lock_while_copying"] = _lock_while_copying(path)
    stand_in = _StandIn(path)
    out["read_default"] = _pipeline(path, stand_in, lambda: read, expected_digest, repeats)
    out["read_discard"] = _pipeline(path, _Discard(), lambda: read, expected_digest, repeats)
    sweep = []
    if pinner is not None:
        out["mapped_default"] = _pipeline(path, stand_in, lambda: mapped, expected_digest, repeats)
        out["mapped_discard"] = _pipeline(path, _Discard(), lambda: mapped, expected_digest, repeats)
        for lock_threads in (1, 2):
            for readahead in (2048 * MiB, 8192 * MiB):
                opts = dataclasses.replace(
                    mapped, bounce_share=0.0, register_threads=lock_threads, readahead_bytes=readahead
                )
                r = _pipeline(path, stand_in, lambda o=opts: o, expected_digest, 3)  # type: ignore[misc]
                sweep.append({"path": "mapped", "lock_threads": lock_threads, "readahead_MiB": readahead // MiB, **r})
        # Locking in place with unlocking on its own thread, hashed on the host or on the GPU (with the
        # hash on the GPU the host only locks: 17-19.5 GB/s whatever the lock pool's width or the window
        # size on 2026-11-30, so locking itself is the bound there).
        experiments = [(True, False, 2, 256, 0.0, 6, 16, 2048), (True, True, 2, 256, 0.0, 6, 16, 2048)]
        # Bounce buffers: windows read on host cores into pinned memory instead of locked in place.
        experiments += [(True, True, 2, 256, 1.0, n, 16, 2048) for n in (10, 12, 14, 16)]
        experiments += [(True, True, 2, 256, 1.0, 12, 64, 2048), (True, True, 2, 256, 1.0, 12, 16, 4096)]
        experiments += [(True, True, 2, 512, 1.0, 12, 32, 4096), (True, False, 2, 256, 1.0, 12, 16, 2048)]
        for apart, on_gpu, lock_threads, window_mib, share, readers, chunk_mib, ahead_mib in experiments:
            opts = dataclasses.replace(
                mapped,
                unlock_apart=apart,
                gpu_hash=on_gpu,
                register_threads=lock_threads,
                window_bytes=window_mib * MiB,
                bounce_share=share,
                bounce_threads=readers,
                chunk_bytes=chunk_mib * MiB,
                readahead_bytes=ahead_mib * MiB,
            )
            r = _pipeline(path, stand_in, lambda o=opts: o, expected_digest, 3)  # type: ignore[misc]
            knobs = {
                "unlock_apart": apart,
                "gpu_hash": on_gpu,
                "lock_threads": lock_threads,
                "window_MiB": window_mib,
                "bounce_share": share,
                "read_threads": readers,
                "chunk_MiB": chunk_mib,
                "readahead_MiB": ahead_mib,
            }
            sweep.append({"path": "mapped", **knobs, **r})
        try:
            out["gpu_hash_only"] = _gpu_hash_only(nbytes, repeats)
        except Exception as exc:  # a report: say what failed
            out["gpu_hash_only"] = {"error": f"{type(exc).__name__}: {exc}"}
    for read_threads, hash_threads in ((6, None), (6, 10), (8, 8), (12, None)):
        opts = dataclasses.replace(read, read_threads=read_threads, hash_threads=hash_threads)
        r = _pipeline(path, stand_in, lambda o=opts: o, expected_digest, 3)  # type: ignore[misc]
        sweep.append({"path": "read", "read_threads": read_threads, "hash_threads": hash_threads, **r})
    out["sweep"] = sweep
    del stand_in
    torch.cuda.empty_cache()
    return out


def report_lines(stages: dict[str, Any], ceiling_gbps: float) -> list[str]:
    """The loader section of gpu_update.md."""

    def row(label: str, r: dict[str, Any], bold: bool = False) -> str:
        b = "**" if bold else ""
        return (
            f"| {b}{label}{b} | {b}{r['GBps_best']:.1f}{b} | {r['GBps_median']:.1f} | "
            f"{b}{r['GBps_median'] / ceiling_gbps:.2f}x{b} |"
        )

    h = stages["hash_only"]
    default = stages["default_path"]
    lines = [
        "## The loader in-process, stage by stage (no vLLM; stand-in CUDA module, same verifier bytes)",
        "",
        f"Worker default here: the {default} path (mapped path "
        f"{'available' if stages['mapped_available'] else 'NOT available'}); read path with "
        f"{stages['default_read_threads']} reader threads; 2 GiB read-ahead; blake3 on all cores. "
        "Best and median of the repeats after the first (the first warms the pinned/GPU caches).",
        "",
        "| stage | GB/s best | GB/s median | median vs ceiling |",
        "|---|---|---|---|",
    ]
    for r in stages["read_only"]:
        lines.append(row(f"read files → pinned buffers, {r['threads']} threads, {r.get('chunk_MiB', 16)} MiB reads", r))
    for r in stages.get("read_while_copying", []):
        dma = ", ".join(f"{x:.1f}" for x in r["dma_GBps"])
        lines.append(row(f"the same, {r['threads']} threads, while the GPU copies in (DMA GB/s: {dma})", r))
    if "memcpy" in stages:
        lines.append(
            row(f"host memcpy, {stages['memcpy']['threads']} threads (host memory bandwidth)", stages["memcpy"])
        )
    lines += [
        row("blake3 over memory, 16 MiB updates", h["chunked"]),
        row("blake3 over memory, one update", h["one_update"]),
        row("read path, model discards: host side only", stages["read_discard"]),
        row("read path: read + hash + device copy", stages["read_default"], bold=default == "read"),
    ]
    if "mapped_default" in stages:
        lines += [
            row("mapped path, model discards: lock + hash + copy to GPU staging", stages["mapped_discard"]),
            row(
                "mapped path: lock + hash + copy to staging + device copy",
                stages["mapped_default"],
                bold=default == "mapped",
            ),
        ]
    gh = stages.get("gpu_hash_only") or {}
    if gh:
        label = (
            f"blake3 on the GPU (blake3_device, {gh.get('bytes', 0) >> 20} MiB tensor; "
            f"self-test incl. compile {gh.get('self_test_s', 0):.1f} s)"
        )
        lines.append(row(label, gh) if "GBps_best" in gh else f"| {label} | {gh.get('error')} | | |")
    lw = stages.get("lock_while_copying") or {}
    if "idle" in lw:
        lines += [
            "",
            f"Locking one {lw['window_bytes'] >> 20} MiB window of the mapping (cudaHostRegister, read-only): "
            f"{lw['idle']['lock_s'] * 1e3:.1f} ms with the GPU idle, {lw['behind_a_copy']['lock_s'] * 1e3:.1f} ms "
            f"right after queueing a {lw['behind_a_copy']['copy_s'] * 1e3:.0f} ms host→device copy "
            f"(unlock {lw['idle']['unlock_s'] * 1e3:.1f} / {lw['behind_a_copy']['unlock_s'] * 1e3:.1f} ms).",
        ]
    lines += [
        "",
        f"First load of the process (cold caches): read path "
        f"{stages['bytes'] / stages['read_default']['first_s'] / GB:.1f} GB/s"
        + (
            f", mapped path {stages['bytes'] / stages['mapped_default']['first_s'] / GB:.1f} GB/s (after the read path "
            "warmed the GPU allocator)."
            if "mapped_default" in stages
            else "."
        ),
        "",
        "Sweep (median of 2 after a first run):",
        "",
        "| path | knobs | GB/s |",
        "|---|---|---|",
    ]
    for r in stages["sweep"]:
        if r["path"] == "mapped" and "gpu_hash" in r:
            knobs = (
                f"unlock apart {r['unlock_apart']}, hash on the GPU {r['gpu_hash']}, "
                f"{r['lock_threads']} lock threads, {r['window_MiB']} MiB windows, "
                f"{r['bounce_share']:.0%} bounced on {r['read_threads']} readers, {r['chunk_MiB']} MiB reads, "
                f"{r['readahead_MiB']} MiB ahead (first load {r['first_s']:.2f} s)"
            )
        elif r["path"] == "mapped":
            knobs = f"page-locked in place, {r['lock_threads']} lock threads, {r['readahead_MiB']} MiB ahead"
        else:
            knobs = f"{r['read_threads']} readers, {r['hash_threads'] or 'all'} hash threads"
        lines.append(f"| {r['path']} | {knobs} | {r['GBps_median']:.1f} |")
    lines.append("")
    return lines


def main() -> int:
    import argparse
    import json
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root / "worker_image"), str(root / "digest")]
    import torch
    from safetensors.torch import save_file

    import rolloutfleet_digest as digest

    parser = argparse.ArgumentParser(description="the loader alone, stage by stage, on the GPU")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/rf-loader"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    h, i, kv = 8192, 28672, 1024  # the verifier of bench/gpu_update.py: 2 layers, 3.49 GB of bf16
    shapes = {"model.embed_tokens.weight": (2048, h), "lm_head.weight": (2048, h), "model.norm.weight": (h,)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    names = sorted(shapes)
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        tensors = {n: torch.randn(shapes[n], dtype=torch.bfloat16, device="cuda").cpu() for n in part}
        save_file(tensors, str(args.work / f"model-0000{k + 1}-of-00002.safetensors"))
    expected = digest.digest_directory(args.work)
    stages = measure(str(args.work), expected)
    ceiling = torch.empty(stages["bytes"], dtype=torch.uint8, pin_memory=True)
    device = torch.empty(stages["bytes"], dtype=torch.uint8, device="cuda")
    seconds = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        device.copy_(ceiling, non_blocking=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    stages["ceiling_GBps"] = stages["bytes"] / min(seconds) / GB
    (args.out / "loader_stages.json").write_text(json.dumps(stages, indent=1))
    text = "\n".join(report_lines(stages, stages["ceiling_GBps"]))
    (args.out / "loader_stages.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
