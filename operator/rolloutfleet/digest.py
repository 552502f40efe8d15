"""``rolloutfleet digest PATH [--json]``: the weights digest of a checkpoint directory, from its files.

Called by ``rolloutfleet.cli`` (dispatch) for trainers, CI and publishers that need the value an engine
will report after loading the same directory, on any machine and without a GPU. The definition lives in
``rolloutfleet_digest`` (pure Python + blake3; its own distribution, digest/, shipped by both images); this
module only parses arguments, shows progress on a terminal and formats the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TextIO

import rolloutfleet_digest as wdigest

# The one definition of the digest, re-exported for the operator side (publish, simulator, tests).
digest_directory = wdigest.digest_directory
DIGEST_PATTERN = wdigest.DIGEST_PATTERN
CheckpointError = wdigest.CheckpointError

_MIN_PROGRESS_BYTES = 256 << 20  # small checkpoints finish before a progress line would help


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``digest`` subcommand's arguments."""
    parser.add_argument("path", metavar="PATH", help="checkpoint directory holding *.safetensors files")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the bare digest")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="hashing threads (default: all cores)",
    )


class _Progress:
    """Rewrites one stderr line with bytes hashed and throughput, at most ten times a second."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.start, self.last, self.shown = stream, time.monotonic(), 0.0, False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if total < _MIN_PROGRESS_BYTES or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9) / 1e9
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\rdigest: {done / 1e9:.1f}/{total / 1e9:.1f} GB ({pct:.0f}%) {rate:.1f} GB/s ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def run(args: argparse.Namespace) -> int:
    """Print the digest (or a JSON report); exit 1 with a message naming the bad path on error."""
    progress = _Progress(sys.stderr) if sys.stderr.isatty() else None
    try:
        report = wdigest.digest_report(args.path, threads=args.threads, progress=progress)
    except wdigest.CheckpointError as exc:
        print(f"rolloutfleet digest: {exc}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(report["digest"])
    return 0
