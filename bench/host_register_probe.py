"""Probe: can the loader skip the host copy by page-locking the checkpoint's page cache in place?

Run on the lent GPU (needs torch with CUDA and blake3; no vLLM). The loader's read stage costs ~0.18
core-seconds per GB and blake3 ~0.34, so a loader that copies files into pinned buffers and hashes them
cannot pass ~31 GB/s on 16 cores, below 0.8 x the 55 GB/s link. This measures the alternative: mmap the
file, ``cudaHostRegister`` the mapping (read-only), copy to the device straight from the page cache while
blake3 hashes the same mapping. It also sweeps the current loader's reader/hasher thread split.

    python3 bench/host_register_probe.py --out DIR     # writes DIR/register_probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import sys
import threading
import time
import warnings
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "worker_image"), str(REPO / "digest"), str(REPO / "bench")]

GB = 1e9
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


def write_file(path: pathlib.Path, pieces: list[int]) -> None:
    import torch

    with path.open("wb") as f:
        for n in pieces:
            f.write(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda").cpu().numpy().tobytes())
    with path.open("rb") as f:  # into the page cache
        while f.read(1 << 26):
            pass


def main() -> int:
    import blake3
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    big, mid = 8192 * 28672 * 2, 8192 * 8192 * 2
    pieces = [big] * 6 + [mid] * 4 + [8192 * 1024 * 2] * 4
    total = sum(pieces)
    work = pathlib.Path("/tmp/rf-probe")
    work.mkdir(exist_ok=True)
    path = work / "blob.bin"
    write_file(path, pieces)
    out["bytes"] = total
    cudart = torch.cuda.cudart()
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host = torch.frombuffer(mm, dtype=torch.uint8)
    ptr = host.data_ptr()
    offsets = []
    pos = 0
    for n in pieces:
        offsets.append((pos, n))
        pos += n

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out["pageable_mmap_copy_GBps"] = total / timed(lambda: dev.copy_(host)) / GB
    results: dict[str, Any] = {}
    for flags in (REGISTER_READ_ONLY, 0):
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, total, flags)
        reg_s = time.perf_counter() - t0
        entry: dict[str, Any] = {"error": str(err), "code": int(err), "register_s": reg_s}
        if int(err) == 0:
            entry["register_GBps"] = total / reg_s / GB
            copies = [timed(lambda: dev.copy_(host)) for _ in range(3)]
            entry["copy_GBps"] = total / min(copies) / GB
            t0 = time.perf_counter()
            entry["unregister_error"] = str(cudart.cudaHostUnregister(ptr))
            entry["unregister_s"] = time.perf_counter() - t0
        results[f"flags={flags}"] = entry
        print(json.dumps({f"flags={flags}": entry}), flush=True)
        if int(err) == 0:
            break
    out["register_whole"] = results
    ok_flags = next((int(k.split("=")[1]) for k, v in results.items() if v["code"] == 0), None)
    if ok_flags is not None and "copy_GBps" in results[f"flags={ok_flags}"]:
        # Per tensor: register, copy, (hash on another thread), unregister; a pipelined load.
        def registered_load(hash_threads: int | None) -> dict[str, Any]:
            hashes: list[bytes] = []
            hash_s = [0.0]
            view = memoryview(mm)

            def hasher() -> None:
                t0 = time.perf_counter()
                for o, n in offsets:
                    hashes.append(
                        blake3.blake3(view[o : o + n], max_threads=hash_threads or blake3.blake3.AUTO).digest()
                    )
                hash_s[0] = time.perf_counter() - t0

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            th = threading.Thread(target=hasher)
            th.start()
            reg = 0.0
            for o, n in offsets:
                r0 = time.perf_counter()
                assert int(cudart.cudaHostRegister(ptr + o, n, ok_flags)) == 0
                reg += time.perf_counter() - r0
                dev[o : o + n].copy_(host[o : o + n])
                cudart.cudaHostUnregister(ptr + o)
            torch.cuda.synchronize()
            copy_done = time.perf_counter() - t0
            th.join()
            view.release()
            wall = time.perf_counter() - t0
            return {
                "hash_threads": hash_threads,
                "wall_GBps": total / wall / GB,
                "copy_path_GBps": total / copy_done / GB,
                "hash_GBps": total / hash_s[0] / GB,
                "register_s_total": reg,
            }

        out["registered_pipeline"] = [registered_load(h) for h in (None, None, 12, 8)]
        for r in out["registered_pipeline"]:
            print(json.dumps(r), flush=True)
    os.close(fd)  # the mapping stays until exit: the tensor over it still exports its buffer
    # The current loader, reader/hasher split, into a stand-in CUDA module (same bytes as a checkpoint).
    import loader_stages
    from safetensors.torch import save_file

    import rolloutfleet_digest as digest
    from rolloutfleet_worker import loader

    ckpt = work / "ckpt"
    ckpt.mkdir(exist_ok=True)
    tensors = {
        f"t{i:02d}": torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda").cpu() for i, n in enumerate(pieces)
    }
    save_file(tensors, str(ckpt / "model.safetensors"))
    del tensors
    expected = digest.digest_directory(ckpt)
    model = loader_stages._StandIn(str(ckpt))
    split = []
    for read_threads, hash_threads in ((8, None), (8, 8), (6, 10), (10, 6), (12, 4), (4, 12), (12, 12), (16, 16)):
        opts = loader.LoadOptions(pin=True, read_threads=read_threads, hash_threads=hash_threads)
        r = loader_stages._pipeline(str(ckpt), model, lambda o=opts: o, expected, 3)  # type: ignore[misc]
        split.append({"read_threads": read_threads, "hash_threads": hash_threads, "GBps_median": r["GBps_median"]})
        print(json.dumps(split[-1]), flush=True)
    out["loader_split"] = split
    (args.out / "register_probe.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
