"""Benchmark (bench/results/first_run.md): two binaries of k8s.io/kubernetes built with empty Go caches,
one ``go build`` per binary (what ``rolloutfleet.sandbox.binaries`` does) vs one invocation for both.

    .venv/bin/python bench/go_build_sharing.py separate   # then: together

Each mode uses its own empty caches under /tmp/gobench-MODE (delete it to run a mode again cold).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "separate"
ROOT = pathlib.Path(f"/tmp/gobench-{MODE}")
os.environ.update(ROLLOUTFLEET_CACHE=str(ROOT / "cache"), GOCACHE=str(ROOT / "gocache"), GOMODCACHE=str(ROOT / "gomod"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "operator"))

from rolloutfleet.sandbox import binaries  # noqa: E402 - after the cache locations are set

NAMES = ("kube-scheduler", "kube-controller-manager")


def main() -> None:
    started = time.monotonic()
    if MODE == "separate":
        for name in NAMES:
            mark = time.monotonic()
            binaries.build(name, force=True)
            print(name, round(time.monotonic() - mark, 1), flush=True)
    else:
        tools = [binaries.TOOLS[n] for n in NAMES]
        ROOT.mkdir(parents=True, exist_ok=True)
        log, out = ROOT / "together.log", ROOT / "bin"
        out.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            work = pathlib.Path(tmp)
            (work / "go.mod").write_text(binaries._wrapper_gomod(tools[0], work, log))
            binaries.run_go(["get", "-tool", *[f"{t.package}@{t.version}" for t in tools]], work, log)
            flags = " ".join(("-s", "-w", *tools[0].ldflags))
            binaries.run_go(
                ["build", "-trimpath", "-o", f"{out}/", "-ldflags", flags, *[t.package for t in tools]], work, log
            )
        print(sorted(p.name for p in out.iterdir()))
    print(MODE, "total", round(time.monotonic() - started, 1), flush=True)


if __name__ == "__main__":
    main()
