"""Can two NCCL ranks share the one lent GPU if each says it is on another host (``NCCL_HOSTID``)?

NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected") only when their host
hashes match; ``NCCL_HOSTID`` overrides the host hash, so two processes that set different values look like
two hosts with one GPU each and talk through NCCL's network transport (sockets on loopback here). This probe
forms such a group with torch.distributed and broadcasts 1 GiB from rank 0; it prints what NCCL chose and the
bandwidth. Run on the device: ``python3 scripts/gpu/nccl_hostid_probe.py`` (no vLLM needed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def child(rank: int, port: int, same_host: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.full((256 * 1024 * 1024,), float(rank + 1), device="cuda")  # 1 GiB of float32
    dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    started = time.monotonic()
    for _ in range(3):
        dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    took = (time.monotonic() - started) / 3
    ok = bool((x == 1.0).all())
    print(f"rank {rank} same_host={same_host}: received={ok} {x.numel() * 4 / took / 1e9:.2f} GB/s", flush=True)
    dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) > 1:
        child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
        return 0
    rc = 0
    for same_host in (True, False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in (0, 1):
            env = {
                **os.environ,
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,NET",
                "NCCL_SOCKET_IFNAME": "lo",
                "NCCL_IB_DISABLE": "1",
                "NCCL_NVLS_ENABLE": "0",
            }
            if not same_host:
                env["NCCL_HOSTID"] = f"rolloutfleet-probe-{rank}"
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(rank), str(port), "1" if same_host else "0"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        for p in procs:
            try:
                out, _ = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            keep = ("received", "Duplicate", "NET/", "Error", "error", "via")
            lines = [line for line in out.splitlines() if "rank" in line.lower() and any(k in line for k in keep)]
            print(f"--- same_host={same_host} rc={p.returncode}")
            print("\n".join(lines[-25:]))
            rc |= p.returncode if not same_host else 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
