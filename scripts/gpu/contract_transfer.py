"""The transfer contract (tests/contract/test_transfer_contract.py) against real vLLM 0.26 with the IPC backend.

Starts, one after the other (two vLLM starts at once upset each other's memory profiling), the GPU tier's
tiny pair (tests/gpu/gpu_support.py: verifier = draft, revisions A and B) on a server with
``--weight-transfer-config '{"backend":"ipc"}'`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (push_proof's
``start_server``) and on a plain server without the flag (same token), then runs the unchanged test file
with ``ROLLOUTFLEET_CONTRACT_TRANSFER=ipc``, ``ROLLOUTFLEET_CONTRACT_SENDER=ipc`` (pytest shares the
engine's GPU and sends CUDA IPC handles) and ``ROLLOUTFLEET_CONTRACT_PLAIN_URL``. Writes
``$OUT/contract-transfer.log`` (pytest -rA, then the extension's lines of the engine log) and the engine logs.

    python3 scripts/gpu/contract_transfer.py --out DIR   # on the device, vLLM importable (run-device-suite.sh)
"""

# A device-only rig like push_proof.py: fixed paths under /tmp, loopback, a subprocess.
# ruff: noqa: S108

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(REPO / "operator"),
    str(REPO / "worker_image"),
    str(REPO / "tests" / "gpu"),
    str(REPO / "scripts" / "gpu"),
]

import gpu_support  # noqa: E402
import push_proof  # noqa: E402

TEST = "tests/contract/test_transfer_contract.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT") or "/tmp/ct-out"))
    parser.add_argument("--no-plain", action="store_true", help="skip the plain server (its case then skips)")
    parser.add_argument("--test", default=TEST, help="pytest node ids to run (default: the whole file)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="contract-transfer-"))
    revs = gpu_support.make_tiny_revisions(work / "weights")
    log = args.out / "contract-transfer.log"
    servers = []
    try:
        t0 = time.monotonic()
        ipc = push_proof.start_server(work / "ipc", args.out / "vllm-contract-ipc.log", revs.verifier_a, revs.draft_a)
        servers.append(ipc)
        started = [f"ipc server {ipc.url}: {time.monotonic() - t0:.0f} s"]
        plain = None
        if not args.no_plain:
            t0 = time.monotonic()
            plain = gpu_support.start_server(
                revs.verifier_a,
                revs.draft_a,
                work / "plain",
                args.out / "vllm-contract-plain.log",
                gpu_memory_utilization=0.2,
                token=push_proof.TOKEN,
            )
            servers.append(plain)
            started.append(f"plain server {plain.url}: {time.monotonic() - t0:.0f} s")
        env = {
            **os.environ,
            "ROLLOUTFLEET_CONTRACT_URL": ipc.url,
            "ROLLOUTFLEET_CONTRACT_TOKEN": push_proof.TOKEN,
            "ROLLOUTFLEET_CONTRACT_WEIGHTS": str(revs.root),
            "ROLLOUTFLEET_CONTRACT_TRANSFER": "ipc",
            "ROLLOUTFLEET_CONTRACT_SENDER": "ipc",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        }
        if plain is not None:
            env["ROLLOUTFLEET_CONTRACT_PLAIN_URL"] = plain.url
        cmd = [sys.executable, "-m", "pytest", *args.test.split(), "-m", "contract", "-rA", "-p", "no:cacheprovider"]
        cmd += ["--timeout", "90"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)
        took = time.monotonic() - t0
        engine_lines = [
            line
            for line in (args.out / "vllm-contract-ipc.log").read_text(errors="replace").splitlines()
            if "rolloutfleet:" in line or "Error" in line or "error" in line
        ]
        env_shown = {k: v for k, v in env.items() if k.startswith(("ROLLOUTFLEET_CONTRACT", "VLLM_ALLOW"))}
        log.write_text(
            "\n".join(
                [
                    f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} scripts/gpu/contract_transfer.py",
                    *started,
                    f"env: {env_shown}",
                    f"$ {' '.join(cmd)}",
                    f"(rc={proc.returncode}, {took:.0f} s)",
                    proc.stdout,
                    proc.stderr,
                    "# the IPC engine's log: extension lines and errors",
                    *engine_lines[-150:],
                    "",
                ]
            )
        )
        print(proc.stdout[-6000:], flush=True)
        return proc.returncode
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    raise SystemExit(main())
