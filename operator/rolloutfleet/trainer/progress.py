"""Progress reports of a publish: the report type, the digest byte counter and the terminal line.

Called by ``rolloutfleet.trainer.publish`` (digest progress, created/exists) and ``rolloutfleet.trainer.wait``
(rollout progress). ``TtyProgress`` rewrites one stderr line; a caller's callable gets the same reports.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO


@dataclasses.dataclass(frozen=True)
class PublishProgress:
    """One progress report: ``stage`` is ``digest`` (bytes), ``created``/``exists`` or ``rollout`` (pods)."""

    stage: str
    done: int
    total: int
    message: str


ProgressFn = Callable[[PublishProgress], None]


class DigestProgress:
    """Sums the byte progress of the verifier and draft digests running in parallel."""

    def __init__(self, report: ProgressFn | None) -> None:
        self.report, self.lock = report, threading.Lock()
        self.parts: dict[str, tuple[int, int]] = {}

    def part(self, target: str) -> Callable[[int, int], None]:
        def update(done: int, total: int) -> None:
            if self.report is None:
                return
            with self.lock:
                self.parts[target] = (done, total)
                done_all = sum(d for d, _ in self.parts.values())
                total_all = sum(t for _, t in self.parts.values())
            self.report(PublishProgress("digest", done_all, total_all, f"digest {', '.join(sorted(self.parts))}"))

        return update


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class TtyProgress:
    """Rewrites one stderr line: digest bytes, then the rollout's pods; a newline when the text kind changes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.last, self.stage, self.start = stream, 0.0, "", time.monotonic()

    def __call__(self, p: PublishProgress) -> None:
        now = time.monotonic()
        if p.stage == "digest":
            if now - self.last < 0.1 and p.done < p.total:
                return
            rate = p.done / max(now - self.start, 1e-9)
            pct = 100.0 * p.done / p.total if p.total else 100.0
            text = f"{p.message}: {size(p.done)}/{size(p.total)} ({pct:.0f}%) {size(rate)}/s"
        else:
            text = p.message
        if self.stage and self.stage != p.stage:
            self.stream.write("\n")
        self.stage, self.last = p.stage, now
        self.stream.write(f"\r\x1b[2K{text}")
        self.stream.flush()

    def close(self) -> None:
        if self.stage:
            self.stream.write("\n")
            self.stream.flush()
            self.stage = ""


def reporter(progress: ProgressFn | bool | None) -> ProgressFn | None:
    """None: a progress line on a terminal's stderr, nothing otherwise; False: nothing; a callable: it."""
    if progress is None:
        return TtyProgress(sys.stderr) if sys.stderr.isatty() else None
    if progress is True:
        return TtyProgress(sys.stderr)
    if progress is False:
        return None
    return progress
