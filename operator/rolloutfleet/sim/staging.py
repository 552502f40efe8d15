"""Staged updates of one simulated engine (docs/staging.md): the staging area, its RPCs and its commits.

Owned by ``rolloutfleet.sim.engine.EngineCore`` (one ``Staging`` per engine process, so a restarted engine
has no stage, like the extension whose stage lives in the process). The core routes ``rolloutfleet_stage``
and ``rolloutfleet_unstage`` here through its one-at-a-time RPC path, reports ``Staging.report()`` as
``rolloutfleet_state().staged``, and asks ``commit_target``/``committed`` around a staged load
(``rolloutfleet_load(..., staged=True)``). No HTTP here, and no import of the core (it imports this).

What it plays, as the contract describes the worker extension:

- ``rolloutfleet_stage`` answers at once: arguments are checked with the load's codes (``invalid_revision``,
  ``invalid_path`` also for a directory without ``*.safetensors`` files, ``no_draft``), the headers are read
  (the project's header scanner, ``weights.scan_headers``), and the stage's ``bytes_total`` is every tensor
  byte of both checkpoints. A corrupt header answers phase ``failed`` (``io``); more than ``limit_bytes``
  answers ``over_budget`` with nothing held. Otherwise a background task (an asyncio task that holds no
  RPC lock, so serving and other RPCs go on, as the extension's reader threads do) reads and hashes the
  real files with the digest a load computes (``weights.resolve``), so a staged digest equals
  ``rolloutfleet digest`` of the directory; it takes ``Latencies.stage_s`` + bytes /
  ``stage_bytes_per_s`` of simulated time, then the real reading time. A file that vanished or changed
  meanwhile ends it ``failed`` (``io``), and so does the ``fail_stage`` fault.
- The same ``(revision, verifier_path, draft_path)`` as a stage held (``staging`` or ``staged``) answers
  that stage unchanged; anything else replaces it (its reader stops, its memory is released).
- ``rolloutfleet_unstage`` stops the reader and releases the area: ``released_bytes`` is what was held,
  0 for a failed or over-budget stage, which holds nothing (here the whole area from the stage's start;
  the extension counts the areas allocated so far, each rounded up to its alignment, so at least the
  tensor bytes once staged).
- A staged load is refused with ``not_staged`` unless the stage is ``staged`` for its revision and path;
  once the last target of the stage is committed (the draft, or the verifier of a stage without draft)
  the area is released. A commit whose bytes do not hash to the staged digest (the ``corrupt_load``
  fault) fails the stage with ``staged_mismatch`` and releases it. A level-2 sleep does not touch the
  area (host memory, not the GPU's). Digests are reported once the whole stage is ``staged``.
- Argument errors (checked in the extension's order: revision, limit, the verifier's path, the draft
  model, the draft's path, each after the idempotence check) leave the held stage alone.

Synthetic paths (``WeightsConfig.synthetic_root``) are never read: their size and tensor count are the
configured ones, their digest the synthetic one, as for a load. What it cannot model: per-rank shards (every
tensor-parallel rank reports the same stage) and the reader threads' bandwidth cap.

Every stage start, end, commit and release goes to the engine's call log with its monotonic timestamp
(``stage_started``, ``stage_finished``, ``stage_committed``, ``stage_mismatch``, ``stage_released``), so a
test can tell that every stage finished before the first pod paused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rolloutfleet.sim import weights
from rolloutfleet.sim.config import EngineSpec, Latencies, WeightsConfig

STAGING, STAGED, FAILED, OVER_BUDGET = "staging", "staged", "failed", "over_budget"
HOLDING = (STAGING, STAGED)  # phases whose area holds (or is filling) pinned host memory


class Log(Protocol):
    """The engine's call log (``rolloutfleet.sim.engine.EngineLog``)."""

    def add(self, step: str, **fields: Any) -> dict[str, Any]: ...


@dataclasses.dataclass
class StagedCheckpoint:
    """One checkpoint of a stage: what its headers said, and its digest once every byte is hashed."""

    path: str
    bytes: int  # tensor bytes, from the headers
    tensors: int
    synthetic: bool
    digest: str | None = None
    committed: bool = False

    def report(self, staged: bool) -> dict[str, Any]:
        """``staged``: the whole stage is; a digest counts only then (as the extension reports it)."""
        return {
            "path": self.path,
            "digest": self.digest if staged else None,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "committed": self.committed,
        }

    def checkpoint(self) -> weights.Checkpoint:
        """What a commit copies into the model: the staged bytes (``staged`` only, so the digest is set)."""
        assert self.digest is not None
        return weights.Checkpoint(self.path, self.digest, self.bytes, self.tensors, self.synthetic)


@dataclasses.dataclass
class Stage:
    """The staging area's one stage (``StageState`` of worker_image/rolloutfleet_worker/payloads.py)."""

    revision: int
    verifier: StagedCheckpoint
    draft: StagedCheckpoint | None
    limit_bytes: int | None
    phase: str
    duration: float  # simulated seconds the readers take
    started: float = dataclasses.field(default_factory=time.monotonic)
    seconds: float | None = None  # final once staged or failed
    failed_at: int = 0  # bytes_done when it failed
    error: dict[str, str] | None = None
    task: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[int, str, str | None]:
        return self.revision, self.verifier.path, None if self.draft is None else self.draft.path

    @property
    def bytes_total(self) -> int:
        return self.verifier.bytes + (0 if self.draft is None else self.draft.bytes)

    def targets(self) -> list[tuple[str, StagedCheckpoint]]:
        return [("verifier", self.verifier)] + ([] if self.draft is None else [("draft", self.draft)])

    def bytes_done(self) -> int:
        if self.phase == STAGED:
            return self.bytes_total
        if self.phase == FAILED:
            return self.failed_at
        if self.phase == OVER_BUDGET:
            return 0
        # Staging: the readers' progress in simulated time (the real hashing of small files is instant).
        if self.duration <= 0:
            return 0
        return min(self.bytes_total, int(self.bytes_total * (time.monotonic() - self.started) / self.duration))

    def held_bytes(self) -> int:
        return self.bytes_total if self.phase in HOLDING else 0

    def report(self) -> dict[str, Any]:
        seconds = self.seconds if self.seconds is not None else time.monotonic() - self.started
        return {
            "revision": self.revision,
            "phase": self.phase,
            "verifier": self.verifier.report(self.phase == STAGED),
            "draft": None if self.draft is None else self.draft.report(self.phase == STAGED),
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done(),
            "limit_bytes": self.limit_bytes,
            "seconds": round(seconds, 6),
            "error": self.error,
        }


class Staging:
    """The staging area of one simulated engine process (see the module docstring)."""

    def __init__(
        self,
        spec: EngineSpec,
        cfg: WeightsConfig,
        latencies: Latencies,
        log: Log,
        notify: Callable[[], Awaitable[None]],
    ) -> None:
        self.spec, self.cfg, self.lat, self.log = spec, cfg, latencies, log
        self._notify = notify
        self.stage: Stage | None = None

    # --- views ---------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any] | None:
        """``rolloutfleet_state().staged``: None when nothing is staged (never, released, or unstaged)."""
        return None if self.stage is None else self.stage.report()

    def summary(self) -> dict[str, Any]:
        """For the call log's state snapshots."""
        s = self.stage
        return {"stage": None if s is None else {"revision": s.revision, "phase": s.phase}}

    # --- RPCs ----------------------------------------------------------------------------------------

    async def stage_rpc(self, kw: dict[str, Any], *, fail: bool) -> dict[str, Any]:
        """``rolloutfleet_stage``: the stage's state at once; ``weights.LoadError`` for an argument error
        (the stage held before, if any, is kept: a malformed request must not cost a good stage)."""
        revision, verifier_path = kw.get("revision"), kw.get("verifier_path")
        draft_path, limit = kw.get("draft_path"), kw.get("limit_bytes")
        if not isinstance(revision, int) or isinstance(revision, bool) or revision < 0:
            raise weights.LoadError("invalid_revision", f"revision must be a non-negative integer, got {revision!r}")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            # No code of the contract fits a malformed limit (the operator never sends one): what the
            # extension answers for an unexpected exception.
            raise weights.LoadError("internal", f"limit_bytes must be a non-negative integer or null, got {limit!r}")
        held = self.stage
        if held is not None and held.phase in HOLDING and held.key == (revision, verifier_path, draft_path):
            # Idempotent (the operator re-sends it after a restart), before any path is looked at again.
            return {"ok": True, "stage": held.report()}
        # The checks of the extension's ``staging.stage``, in its order: the verifier's path, then the draft
        # model, then the draft's path.
        await self._check_path(verifier_path)
        assert isinstance(verifier_path, str)
        if draft_path is not None:
            if self.spec.draft_path is None:
                raise weights.LoadError("no_draft", "this engine (or this pipeline rank) has no draft model")
            await self._check_path(draft_path)
            assert isinstance(draft_path, str)
        stage = await self._new_stage(revision, verifier_path, draft_path, limit)
        self.release("replaced")
        self.stage = stage
        self.log.add(
            "stage_started",
            revision=revision,
            verifier=verifier_path,
            draft=draft_path,
            bytes_total=stage.bytes_total,
            limit_bytes=limit,
            phase=stage.phase,
        )
        if stage.phase == STAGING:
            stage.task = asyncio.ensure_future(self._fill(stage, fail=fail))
            stage.task.add_done_callback(_retrieve)
        else:  # failed at the headers, or over budget: decided at once, nothing is read
            self._log_finished(stage)
        await self._notify()
        return {"ok": True, "stage": stage.report()}

    def unstage(self) -> dict[str, Any]:
        """``rolloutfleet_unstage``: stop the reader, release the area."""
        released = 0 if self.stage is None else self.stage.held_bytes()
        self.release("unstaged")
        return {"ok": True, "released_bytes": released}

    # --- commits (staged loads) ----------------------------------------------------------------------

    def commit_target(self, target: str, path: str, revision: object) -> StagedCheckpoint:
        """The staged checkpoint a staged load of ``target`` from ``path`` at ``revision`` commits, or
        ``not_staged``: the stage must be ``staged``, of that revision, with that path for that target
        (paths compared normalized, as the extension does)."""
        stage = self.stage
        if stage is None:
            raise weights.LoadError("not_staged", "nothing is staged: stage the revision first, or load from files")
        if stage.phase != STAGED:
            raise weights.LoadError("not_staged", f"the stage of revision {stage.revision} is {stage.phase}")
        if stage.revision != revision:
            raise weights.LoadError("not_staged", f"the stage holds revision {stage.revision}, not {revision!r}")
        held = stage.verifier if target == "verifier" else stage.draft
        if held is None or os.path.normpath(held.path) != os.path.normpath(path):
            staged_path = None if held is None else held.path
            raise weights.LoadError("not_staged", f"the stage's {target} is {staged_path!r}, not {path!r}")
        return held

    def committed(self, target: str, digest: str) -> None:
        """A staged load of ``target`` went through: mark it, and release the area after the last target."""
        stage = self.stage
        if stage is None:
            return
        held = stage.verifier if target == "verifier" else stage.draft
        if held is not None:
            held.committed = True
        self.log.add("stage_committed", revision=stage.revision, target=target, digest=digest)
        if target == "draft" or stage.draft is None:
            # A second copy of the model in pinned memory buys nothing once the model holds it.
            self.release("committed")

    def mismatched(self, target: str, message: str) -> None:
        """A staged load's bytes did not hash to the staged digest on the GPU (``staged_mismatch``): the
        staged bytes cannot be trusted again, so the stage fails (that code) and its memory goes; a
        re-stage of the revision starts afresh."""
        stage = self.stage
        self.log.add("stage_mismatch", revision=None if stage is None else stage.revision, target=target)
        if stage is not None:
            stage.failed_at = stage.bytes_done()
            stage.phase, stage.error = FAILED, {"code": "staged_mismatch", "message": message}
            self.log.add(
                "stage_released",
                revision=stage.revision,
                phase=FAILED,
                reason="staged_mismatch",
                bytes=stage.bytes_total,
            )

    # --- lifecycle -----------------------------------------------------------------------------------

    def release(self, reason: str) -> None:
        """Drop the stage (its reader stops, its memory is freed), logged with what it held."""
        stage, self.stage = self.stage, None
        if stage is None:
            return
        if stage.task is not None and not stage.task.done():
            stage.task.cancel()
        self.log.add(
            "stage_released", revision=stage.revision, phase=stage.phase, reason=reason, bytes=stage.held_bytes()
        )

    def stop(self) -> None:
        """The engine process ends: its reader ends with it (the stage is gone with the process)."""
        if self.stage is not None and self.stage.task is not None:
            self.stage.task.cancel()

    # --- internals -----------------------------------------------------------------------------------

    def _synthetic(self, path: str) -> bool:
        root = self.cfg.synthetic_root
        return bool(root) and (path == root or path.startswith(str(root).rstrip("/") + "/"))

    async def _check_path(self, path: object) -> None:
        """A stage's path as a load checks it (``invalid_path``), and also ``invalid_path`` for a directory
        without checkpoint files (a load answers ``io``: the contract checks a stage's paths up front)."""
        if not isinstance(path, str) or not path:
            raise weights.LoadError("invalid_path", "path must be a non-empty string")
        weights.check_path(path, self.cfg)
        if self._synthetic(path):
            return
        files = await asyncio.to_thread(lambda: sorted(pathlib.Path(path).glob("*.safetensors")))
        if not files:
            raise weights.LoadError("invalid_path", f"no *.safetensors files in {path}")

    async def _new_stage(self, revision: int, verifier_path: str, draft_path: str | None, limit: int | None) -> Stage:
        """The stage as its headers decide it: staging, failed (a corrupt header) or over budget."""
        described: dict[str, StagedCheckpoint] = {}
        error: dict[str, str] | None = None
        for target, path in (("verifier", verifier_path), ("draft", draft_path)):
            if path is None:
                continue
            if error is not None:  # the headers are read in order; after a corrupt one, no more
                described[target] = StagedCheckpoint(path, 0, 0, synthetic=False)
                continue
            try:
                described[target] = await self._describe(path, target)
            except weights.LoadError as exc:
                described[target] = StagedCheckpoint(path, 0, 0, synthetic=False)
                error = {"code": "io", "message": exc.message}
        total = sum(c.bytes for c in described.values())
        if error is not None:
            phase = FAILED
        elif limit is not None and total > limit:
            phase = OVER_BUDGET
        else:
            phase = STAGING
        rate = self.lat.stage_bytes_per_s
        duration = self.lat.stage_s + (total / rate if rate > 0 else 0.0)
        stage = Stage(revision, described["verifier"], described.get("draft"), limit, phase, duration, error=error)
        if phase != STAGING:
            stage.seconds = 0.0
        return stage

    async def _describe(self, path: str, target: str) -> StagedCheckpoint:
        if self._synthetic(path):
            size = self.cfg.verifier_bytes if target == "verifier" else self.cfg.draft_bytes
            return StagedCheckpoint(path, size, self.cfg.tensors, synthetic=True)
        infos = await asyncio.to_thread(weights.scan_headers, path)
        return StagedCheckpoint(path, sum(i.nbytes for i in infos), len(infos), synthetic=False)

    async def _fill(self, stage: Stage, *, fail: bool) -> None:
        """The readers: hash every byte of both checkpoints (real files), in the stage's simulated time."""
        try:
            if fail:
                await asyncio.sleep(stage.duration / 2)
                raise weights.LoadError("io", f"{stage.verifier.path}: short read (simulated fault)")
            # The bytes are read at the end of the simulated time, so a file that vanishes while the stage
            # is ``staging`` fails it, as it would fail the extension's readers.
            await asyncio.sleep(stage.duration)
            await asyncio.gather(*(self._read(stage, target, held) for target, held in stage.targets()))
        except Exception as exc:
            # A read that failed is ``io``; anything else is what the extension answers for an unexpected
            # exception (``internal``), never a stage left ``staging`` for ever.
            code, message = ("io", exc.message) if isinstance(exc, weights.LoadError) else ("internal", repr(exc))
            # The fault fails the reading half way by definition, not by how late this loop ran it (a busy
            # loop woke it past the end once, and the stage then read as fully done yet failed).
            stage.failed_at = stage.bytes_total // 2 if fail else stage.bytes_done()
            stage.phase, stage.error = FAILED, {"code": code, "message": message}
            for _, held in stage.targets():
                held.digest = None  # nothing is held: no digest to compare with
        else:
            stage.phase = STAGED
        stage.seconds = time.monotonic() - stage.started
        self._log_finished(stage)
        await self._notify()

    async def _read(self, stage: Stage, target: str, held: StagedCheckpoint) -> None:
        if held.synthetic:
            held.digest = weights.synthetic_digest(held.path)
            return
        try:  # the digest a load computes (the project's one implementation), over the real files
            ckpt = await asyncio.to_thread(weights.resolve, held.path, target=target, config=self.cfg)
        except weights.LoadError as exc:  # the directory or a file vanished since the headers were read
            raise weights.LoadError("io", exc.message) from exc
        if ckpt.tensors != held.tensors:
            raise weights.LoadError("io", f"{held.path} changed while it was staged ({ckpt.tensors} tensors now)")
        held.digest = ckpt.digest

    def _log_finished(self, stage: Stage) -> None:
        self.log.add(
            "stage_finished",
            revision=stage.revision,
            phase=stage.phase,
            seconds=stage.seconds,
            digests={t: h.digest for t, h in stage.targets()},
            error=stage.error,
        )


def _retrieve(task: asyncio.Task[None]) -> None:
    """A reader nobody awaits: its end is retrieved so asyncio reports no "never retrieved" error (``_fill``
    turns every failure into a failed stage, so there is nothing to lose)."""
    if not task.cancelled():
        task.exception()
