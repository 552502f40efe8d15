"""Staged updates in the worker (docs/staging.md) on fake vLLM workers, on CPU.

``rolloutfleet_stage`` reads the next revision into host memory in the background and hashes it; a staged
``rolloutfleet_load`` commits it under the same rules as a load from files; ``rolloutfleet_unstage`` and
the last commit give the memory back. Stages are held in their ``staging`` phase deterministically by a
gate in the readers' pacing point (``staging_area.Throttle.take``), which watches the stop event exactly as
the real bandwidth cap does.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_fakes import WorkerV1, write_eagle, write_verifier

import rolloutfleet_digest as digest
from rolloutfleet_worker import loader, loader_base, options, staging, staging_area

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def ckpt(tmp_path: Path) -> dict[str, Path]:
    return {
        "v1": write_verifier(tmp_path / "verifier-1", seed=1),
        "v2": write_verifier(tmp_path / "verifier-2", seed=2),
        "d1": write_eagle(tmp_path / "draft-1", seed=1),
        "d2": write_eagle(tmp_path / "draft-2", seed=2),
    }


_workers: list[Any] = []


@pytest.fixture(autouse=True)
def no_stage_outlives_its_test() -> Iterator[None]:
    """Every test gives its stages back; no staging thread may leak into the next test."""
    _workers.clear()
    yield
    for w in _workers:
        staging.unstage(w)
    deadline = time.monotonic() + 5
    while any(t.name.startswith("rolloutfleet-stage") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a staging thread outlived its stage"
        time.sleep(0.01)


def worker(draft: str = "eagle") -> WorkerV1:
    w = WorkerV1(draft)
    _workers.append(w)
    return w


class Gate:
    """Holds every chunk read at the pacing point until opened; a stop still ends the wait at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        gate = self.open

        def take(self: staging_area.Throttle, n: int, stop: threading.Event) -> None:
            while not gate.wait(0.005):
                if stop.is_set():
                    raise loader_base.StoppedError

        monkeypatch.setattr(staging_area.Throttle, "take", take)


def stage(w: Any, revision: Any, v: Path | str, d: Path | str | None = None, limit: Any = None) -> dict[str, Any]:
    result: dict[str, Any] = w.rolloutfleet_stage(revision, str(v), None if d is None else str(d), limit)
    return result


def settle(w: Any, timeout: float = 20.0) -> dict[str, Any] | None:
    """The stage once it left ``staging``."""
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] | None = w.rolloutfleet_state()["staged"]
        if st is None or st["phase"] != "staging":
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.005)


def commit(w: Any, target: str, path: Path, revision: int) -> dict[str, Any]:
    result: dict[str, Any] = w.rolloutfleet_load(target, str(path), revision, staged=True)
    return result


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def released(st: staging.Stage) -> bool:
    return all(area.address == 0 for c in st.checkpoints for area in c.areas)


def nbytes(path: Path) -> int:
    return sum(t.nbytes for t in digest.scan_directory(path))


# -- staging ------------------------------------------------------------------------------------------


def test_a_stage_holds_both_checkpoints_with_the_publishers_digests(ckpt: dict[str, Path]) -> None:
    """The operator compares the staged digests with the publisher's before any pod pauses: they must be
    the digest definition exactly (every tensor, the draft's shared ones included), over the staged bytes."""
    w = worker()
    answer = stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert answer["ok"] is True and answer["stage"]["phase"] in ("staging", "staged")
    assert answer["stage"]["bytes_total"] == nbytes(ckpt["v1"]) + nbytes(ckpt["d1"])
    st = settle(w)
    assert st is not None
    assert st == {
        "revision": 1,
        "phase": "staged",
        "verifier": {
            "path": str(ckpt["v1"]),
            "digest": digest.digest_directory(ckpt["v1"]),
            "bytes": nbytes(ckpt["v1"]),
            "tensors": 19,
            "committed": False,
        },
        "draft": {
            "path": str(ckpt["d1"]),
            "digest": digest.digest_directory(ckpt["d1"]),
            "bytes": nbytes(ckpt["d1"]),
            "tensors": 11,
            "committed": False,
        },
        "bytes_total": nbytes(ckpt["v1"]) + nbytes(ckpt["d1"]),
        "bytes_done": nbytes(ckpt["v1"]) + nbytes(ckpt["d1"]),
        "limit_bytes": None,
        "seconds": st["seconds"],
        "error": None,
    }
    assert st["seconds"] > 0


def test_areas_and_chunks_do_not_change_the_bytes(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Areas of a few tensors and 7-byte chunks read by one thread: the layout is an implementation
    detail, the staged bytes and digests must not depend on it."""
    monkeypatch.setattr(staging_area, "AREA_BYTES", 1500)
    monkeypatch.setattr(staging_area, "CHUNK", 7)
    monkeypatch.setenv(options.STAGE_THREADS_ENV, "1")
    w = worker()
    stage(w, 1, ckpt["v1"])
    st = settle(w)
    assert (
        st is not None and st["phase"] == "staged" and st["verifier"]["digest"] == digest.digest_directory(ckpt["v1"])
    )
    held = staging.held(w)
    assert held is not None and held.threads == 1
    areas = held.verifier.areas
    assert len(areas) > 2  # split per file and per 1,500 bytes
    for info in held.verifier.infos:  # no tensor spans two areas (one registration per copy)
        index, offset = held.verifier.places[info.name]
        assert offset + info.nbytes <= areas[index].length
    assert commit(w, "verifier", ckpt["v1"], 1)["ok"]


def test_staging_answers_at_once_and_a_restage_is_idempotent(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine runs RPCs between scheduler steps, so the stage must return while its readers work; and
    the operator re-sends the same stage after a restart, which must neither restart nor duplicate it."""
    gate = Gate(monkeypatch)
    w = worker()
    first = stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert first["ok"] and first["stage"]["phase"] == "staging" and first["stage"]["bytes_done"] == 0
    held = staging.held(w)
    again = stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert again["ok"] and again["stage"]["phase"] == "staging" and staging.held(w) is held
    assert commit(w, "verifier", ckpt["v1"], 1)["error"]["code"] == "not_staged"  # not finished yet
    gate.open.set()
    st = settle(w)
    assert st is not None and st["phase"] == "staged"
    again = stage(w, 1, ckpt["v1"], ckpt["d1"], limit=1)  # the held stage answers, whatever the limit
    assert again["ok"] and again["stage"] == st and staging.held(w) is held


def test_another_revision_stops_and_releases_the_old_stage(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two revisions must never sit in host memory at once: a new stage stops the old readers and gives
    their memory back before it allocates."""
    gate = Gate(monkeypatch)
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    old = staging.held(w)
    assert old is not None
    deadline = time.monotonic() + 5
    while not old.verifier.areas:  # the old stage has allocated (and waits at the gate)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    started = time.monotonic()
    answer = stage(w, 2, ckpt["v2"], ckpt["d2"])
    assert time.monotonic() - started < 2  # stopped within a chunk, not after the whole revision
    assert answer["ok"] and answer["stage"]["revision"] == 2
    assert old.thread is not None and not old.thread.is_alive() and released(old)
    gate.open.set()
    st = settle(w)
    assert (
        st is not None and st["phase"] == "staged" and st["verifier"]["digest"] == digest.digest_directory(ckpt["v2"])
    )
    assert commit(w, "verifier", ckpt["v1"], 1)["error"]["code"] == "not_staged"


def test_over_budget_allocates_nothing_and_loads_read_the_files(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget the checkpoints do not fit is known from the headers alone: nothing is allocated, and the
    operator falls back to loads from files (a staged load must say not_staged, not half-commit)."""
    total = nbytes(ckpt["v1"]) + nbytes(ckpt["d1"])

    def no_memory(*_a: Any, **_k: Any) -> Any:
        pytest.fail("allocated host memory over budget")

    with monkeypatch.context() as m:
        m.setattr(staging_area, "HostArea", no_memory)
        w = worker()
        answer = stage(w, 1, ckpt["v1"], ckpt["d1"], limit=total - 1)
        assert answer["ok"] is True
        st = answer["stage"]
        assert st["phase"] == "over_budget" and st["bytes_total"] == total and st["bytes_done"] == 0
        assert st["limit_bytes"] == total - 1 and st["error"] is None and st["verifier"]["digest"] is None
        held = staging.held(w)
        assert held is not None and held.thread is None
        res = commit(w, "verifier", ckpt["v1"], 1)
        assert res["ok"] is False and res["error"]["code"] == "not_staged" and "over_budget" in res["error"]["message"]
        loaded = w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)
        assert loaded["ok"] is True and loaded["staged"] is False
    answer = stage(w, 1, ckpt["v1"], ckpt["d1"], limit=total)  # a budget of exactly the bytes fits
    assert answer["ok"] and answer["stage"]["phase"] in ("staging", "staged")
    st2 = settle(w)
    assert st2 is not None and st2["phase"] == "staged"


def test_argument_errors_answer_at_once_and_change_nothing(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """Bad arguments are the caller's mistake, known without reading a byte: refused with the load's
    codes, and a stage already held stays as it was."""
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    held = staging.held(w)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases: list[tuple[tuple[Any, Any, Any], str]] = [
        ((1, tmp_path / "missing", None), "invalid_path"),
        ((1, empty, None), "invalid_path"),
        ((1, "relative/path", None), "invalid_path"),
        ((1, ckpt["v1"], tmp_path / "missing"), "invalid_path"),
        ((-1, ckpt["v1"], None), "invalid_revision"),
        ((True, ckpt["v1"], None), "invalid_revision"),
        (("1", ckpt["v1"], None), "invalid_revision"),
    ]
    for (revision, v, d), code in cases:
        res = stage(w, revision, v, d)
        assert res["ok"] is False and res["error"]["code"] == code, (revision, v, d, res)
    assert stage(w, 1, ckpt["v1"], limit=-5)["ok"] is False
    assert staging.held(w) is held
    res = stage(worker(draft="none"), 1, ckpt["v1"], ckpt["d1"])
    assert res["ok"] is False and res["error"]["code"] == "no_draft"


def test_a_path_outside_the_roots_is_refused(
    ckpt: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging reads files as a load does, so it is held to the same allowed roots."""
    monkeypatch.setenv("ROLLOUTFLEET_WEIGHT_ROOTS", str(tmp_path / "elsewhere"))
    res = stage(worker(), 1, ckpt["v1"])
    assert res["ok"] is False and res["error"]["code"] == "invalid_path"


def test_a_corrupt_header_fails_the_stage(ckpt: dict[str, Path]) -> None:
    """A header is read synchronously: a corrupt one is the checkpoint's fault (io), reported as the
    stage's phase so the operator sees it where it looks for the stage, with nothing allocated."""
    shard = ckpt["v2"] / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    w = worker()
    res = stage(w, 2, ckpt["v2"])
    assert res["ok"] is True and res["stage"]["phase"] == "failed"
    assert res["stage"]["error"]["code"] == "io" and "truncated" in res["stage"]["error"]["message"]
    assert commit(w, "verifier", ckpt["v2"], 2)["error"]["code"] == "not_staged"


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_file_damaged_after_the_header_scan_fails_the_stage(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Reading is where a vanished or shortened file shows: the stage fails with io and gives its memory
    back at once (a failed stage must hold nothing), and no commit can use it."""
    real_open = loader_base.open_file

    def damaged_then_open(file: Path, roots: tuple[str, ...]) -> int:
        if file.name.startswith("model-00002"):
            if damage == "removed":
                file.unlink()
            else:
                with file.open("r+b") as f:
                    f.truncate(file.stat().st_size - 50)
        return real_open(file, roots)

    monkeypatch.setattr(staging_area, "open_file", damaged_then_open)
    monkeypatch.setenv(options.STAGE_THREADS_ENV, "1")
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    st = settle(w)
    assert st is not None and st["phase"] == "failed" and st["error"]["code"] == "io", st
    assert ("unreadable" if damage == "removed" else "truncated") in st["error"]["message"]
    assert st["verifier"]["digest"] is None
    held = staging.held(w)
    assert held is not None and released(held)
    assert commit(w, "verifier", ckpt["v1"], 1)["error"]["code"] == "not_staged"


# -- committing ---------------------------------------------------------------------------------------


def test_a_commit_loads_what_a_file_load_loads(ckpt: dict[str, Path]) -> None:
    """The commit replaces the file load inside the pause: the model must end up with the same parameters,
    the same digest and the same shared-tensor skips, and the result must say it came from the stage."""
    by_file, by_stage = worker(), worker()
    assert by_file.rolloutfleet_load("verifier", str(ckpt["v2"]), 2)["ok"]
    file_draft = dict(by_file.rolloutfleet_load("draft", str(ckpt["d2"]), 2))
    stage(by_stage, 2, ckpt["v2"], ckpt["d2"])
    assert settle(by_stage) is not None
    v = commit(by_stage, "verifier", ckpt["v2"], 2)
    d = commit(by_stage, "draft", ckpt["d2"], 2)
    assert v["ok"] and d["ok"], (v, d)
    assert v["staged"] is True and d["staged"] is True and file_draft["staged"] is False
    assert v["digest"] == digest.digest_directory(ckpt["v2"]) and d["digest"] == file_draft["digest"]
    assert d["skipped"] == file_draft["skipped"] == ["embed_tokens.weight", "lm_head.weight"]
    assert d["tensors"] == file_draft["tensors"] and v["tensors"] == 19
    assert same(snapshot(by_stage.verifier), snapshot(by_file.verifier))
    assert by_stage.draft is not None and by_file.draft is not None
    assert same(snapshot(by_stage.draft), snapshot(by_file.draft))
    a, b = by_file.rolloutfleet_state(), by_stage.rolloutfleet_state()
    assert a["ok"] and b["ok"]
    assert a["verifier"] == b["verifier"] and a["draft"] == b["draft"] and b["resident"] is True


def test_a_commit_of_another_path_or_revision_is_not_staged(ckpt: dict[str, Path]) -> None:
    """A commit must be of exactly what was staged; anything else is refused before the target is touched,
    so the model and its verified claim stay as they were."""
    w = worker()
    assert w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]
    before, claim = snapshot(w.verifier), w.rolloutfleet_state()["verifier"]  # type: ignore[typeddict-item]
    assert commit(w, "verifier", ckpt["v2"], 2)["error"]["code"] == "not_staged"  # nothing staged
    stage(w, 2, ckpt["v2"])
    assert settle(w) is not None
    for target, path, revision in (("verifier", ckpt["v1"], 2), ("verifier", ckpt["v2"], 3), ("draft", ckpt["d2"], 2)):
        res = commit(w, target, path, revision)
        assert res["ok"] is False and res["error"]["code"] == "not_staged", res
    assert same(snapshot(w.verifier), before)
    assert w.rolloutfleet_state()["verifier"] == claim  # type: ignore[typeddict-item]
    res = commit(w, "lm", ckpt["v2"], 2)
    assert res["error"]["code"] == "invalid_target"


def test_a_staged_byte_changed_in_memory_fails_the_commit_closed(ckpt: dict[str, Path]) -> None:
    """The commit re-hashes what it hands the model: bytes that changed in host memory since they were
    hashed must not be reported as the staged revision. The target stays unknown (its parameters hold
    the changed bytes) and the stage, no longer trustworthy, is dropped."""
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert settle(w) is not None
    view = staging.staged_bytes(w, "verifier", "lm_head.weight")
    view[3] ^= 0xFF
    res = commit(w, "verifier", ckpt["v1"], 1)
    assert res["ok"] is False and res["error"]["code"] == "staged_mismatch", res
    state = w.rolloutfleet_state()
    assert state["ok"]
    assert state["verifier"]["revision"] is None and state["verifier"]["verified"] is False
    assert state["verifier"]["digest"] is None
    st = state["staged"]
    assert st is not None and st["phase"] == "failed" and st["error"] is not None
    assert st["error"]["code"] == "staged_mismatch"
    held = staging.held(w)
    assert held is not None and released(held)
    assert commit(w, "verifier", ckpt["v1"], 1)["error"]["code"] == "not_staged"
    assert w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]  # the files still load


def test_the_draft_is_not_committed_before_the_verifier(ckpt: dict[str, Path]) -> None:
    """A commit obeys every load's order: a new draft beside an old verifier would draft for the wrong
    model. The refusal leaves the stage for the right order."""
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert settle(w) is not None
    untouched = snapshot(w.draft)  # type: ignore[arg-type]
    res = commit(w, "draft", ckpt["d1"], 1)
    assert res["ok"] is False and res["error"]["code"] == "order"
    assert same(snapshot(w.draft), untouched)  # type: ignore[arg-type]
    assert commit(w, "verifier", ckpt["v1"], 1)["ok"]
    assert commit(w, "draft", ckpt["d1"], 1)["ok"]


def test_a_frozen_draft_is_never_committed(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged path does not bypass the draft policy."""
    monkeypatch.setenv("ROLLOUTFLEET_DRAFT_POLICY", "frozen")
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert settle(w) is not None
    assert commit(w, "verifier", ckpt["v1"], 1)["ok"]
    assert commit(w, "draft", ckpt["d1"], 1)["error"]["code"] == "frozen"


def test_the_stage_is_released_after_its_last_commit(ckpt: dict[str, Path]) -> None:
    """A second copy of the model in host memory between revisions costs memory and buys nothing: after
    the last target is committed the stage goes (and not before: the draft still needs its bytes)."""
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert settle(w) is not None
    held = staging.held(w)
    assert held is not None
    assert commit(w, "verifier", ckpt["v1"], 1)["ok"]
    st: Any = w.rolloutfleet_state()["staged"]  # type: ignore[typeddict-item]
    assert st is not None and st["verifier"]["committed"] is True and st["draft"]["committed"] is False
    assert not released(held)
    assert commit(w, "draft", ckpt["d1"], 1)["ok"]
    assert w.rolloutfleet_state()["staged"] is None  # type: ignore[typeddict-item]
    assert released(held) and staging.held(w) is None
    only = worker(draft="none")  # a stage without a draft ends with its verifier
    stage(only, 1, ckpt["v1"])
    assert settle(only) is not None
    assert commit(only, "verifier", ckpt["v1"], 1)["ok"]
    assert only.rolloutfleet_state()["staged"] is None  # type: ignore[typeddict-item]


def test_unstage_releases_the_area(ckpt: dict[str, Path]) -> None:
    """The operator unstages when staging is turned off or the goal moved on: all memory comes back."""
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    assert settle(w) is not None
    held = staging.held(w)
    assert held is not None
    res = w.rolloutfleet_unstage()
    assert res["ok"] is True and res["released_bytes"] >= nbytes(ckpt["v1"]) + nbytes(ckpt["d1"])
    assert released(held) and w.rolloutfleet_state()["staged"] is None  # type: ignore[typeddict-item]
    assert w.rolloutfleet_unstage() == {"ok": True, "released_bytes": 0}
    assert commit(w, "verifier", ckpt["v1"], 1)["error"]["code"] == "not_staged"


def test_unstage_stops_capped_readers_promptly(ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With a bandwidth cap a stage can take minutes; turning staging off must not wait for it (the
    real pacing waits on the stop event)."""
    monkeypatch.setenv(options.STAGE_GBPS_ENV, "1e-9")  # one byte a second: the second chunk never comes
    monkeypatch.setenv(options.STAGE_THREADS_ENV, "2")
    w = worker()
    stage(w, 1, ckpt["v1"], ckpt["d1"])
    time.sleep(0.05)
    st = w.rolloutfleet_state()["staged"]  # type: ignore[typeddict-item]
    assert st is not None and st["phase"] == "staging" and st["bytes_done"] < st["bytes_total"]
    started = time.monotonic()
    res = w.rolloutfleet_unstage()
    assert res["ok"] and time.monotonic() - started < 2


def test_the_stage_keeps_its_bytes_across_a_level2_sleep(ckpt: dict[str, Path]) -> None:
    """The point of staging in sleep mode: the GPU weights are discarded by the sleep, the host copy is
    not, so the commit after the wake restores the next revision without touching the files."""
    w, reference = worker(), worker()
    assert w.rolloutfleet_load("verifier", str(ckpt["v1"]), 1)["ok"]
    assert w.rolloutfleet_load("draft", str(ckpt["d1"]), 1)["ok"]
    stage(w, 2, ckpt["v2"], ckpt["d2"])
    assert settle(w) is not None
    with torch.no_grad():  # what sleep(level=2) + wake_up(tags=weights) leaves behind
        for p in list(w.verifier.parameters()) + list(w.draft.parameters()):  # type: ignore[union-attr]
            p.zero_()
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is False and state["staged"] is not None
    assert commit(w, "verifier", ckpt["v2"], 2)["ok"]
    assert commit(w, "draft", ckpt["d2"], 2)["ok"]
    state = w.rolloutfleet_state()
    assert state["ok"] and state["resident"] is True and state["staged"] is None
    assert state["verifier"]["digest"] == digest.digest_directory(ckpt["v2"])
    assert reference.rolloutfleet_load("verifier", str(ckpt["v2"]), 2)["ok"]
    assert reference.rolloutfleet_load("draft", str(ckpt["d2"]), 2)["ok"]
    assert same(snapshot(w.verifier), snapshot(reference.verifier))
    assert same(snapshot(w.draft), snapshot(reference.draft))  # type: ignore[arg-type]


def test_the_model_gets_private_copies_of_the_staged_bytes(ckpt: dict[str, Path]) -> None:
    """A loader may keep or edit what it is given; the staging area must not change under it, since a
    later commit (after another sleep) copies the same bytes again."""
    w = worker(draft="none")
    stage(w, 1, ckpt["v1"])
    assert settle(w) is not None
    checkpoint = staging.committable(w, "verifier", str(ckpt["v1"]), 1)
    assert isinstance(checkpoint, staging.Checkpoint)

    class Vandal:
        def load_weights(self, weights: Any) -> None:
            for _name, tensor in weights:
                tensor.zero_()

    outcome = loader.commit_into(Vandal(), checkpoint)
    assert outcome.digest == digest.digest_directory(ckpt["v1"]) and outcome.path == "staged"
    again = loader.commit_into(Vandal(), checkpoint)
    assert again.digest == outcome.digest


# -- the environment ---------------------------------------------------------------------------------


def test_stage_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging shares the host with a serving engine: a few readers and a 2 GB/s cap by default (measured on
    the H200: uncapped staging halved a steady load's throughput, 2 GB/s left it at its idle speed), ``0``
    uncaps on purpose, and a malformed value means the default, never a crash."""
    assert options.stage_threads() == 4 and options.stage_gbps() == options.DEFAULT_STAGE_GBPS == 2.0
    monkeypatch.setenv(options.STAGE_THREADS_ENV, "16")
    monkeypatch.setenv(options.STAGE_GBPS_ENV, "2.5")
    assert options.stage_threads() == 16 and options.stage_gbps() == 2.5
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(options.STAGE_THREADS_ENV, bad)
        assert options.stage_threads() == 4
    for bad in ("-1", "fast", "nan", "inf"):
        monkeypatch.setenv(options.STAGE_GBPS_ENV, bad)
        assert options.stage_gbps() == options.DEFAULT_STAGE_GBPS
    monkeypatch.setenv(options.STAGE_GBPS_ENV, "0")
    assert options.stage_gbps() == 0.0


def test_the_pace_holds_the_cap() -> None:
    """Chunks wait for their slot, so a capped stage reads at most at the cap (plus one chunk)."""
    throttle = staging_area.Throttle(gbps=20e-6)  # 20,000 bytes a second
    stop = threading.Event()
    started = time.monotonic()
    for _ in range(5):
        throttle.take(1000, stop)
    assert 0.18 <= time.monotonic() - started < 2  # 4 waits of 50 ms after the first chunk
    stop.set()
    with pytest.raises(loader_base.StoppedError):  # a stop ends the wait for a slot at once
        throttle.take(10**9, stop)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_commit_hashes_large_tensors_on_the_device(tmp_path: Path) -> None:
    """With the device hash on (here the Triton kernels in the CPU interpreter), large tensors are hashed
    where they landed and the digest is still the files' digest."""
    script = textwrap.dedent(
        """
        import os, sys, time, types
        import torch
        from safetensors.torch import save_file
        import rolloutfleet_digest as digest
        from rolloutfleet_worker import loader, staging

        ckpt = sys.argv[1]
        g = torch.Generator().manual_seed(7)
        save_file(
            {
                "big": torch.randn(40, 64, generator=g).to(torch.bfloat16),       # 5,120 bytes: 5 chunks
                "odd": torch.randn(1, 1537, generator=g).to(torch.bfloat16),      # 3,074 bytes: a tail
                "small": torch.randn(8, generator=g).to(torch.bfloat16),          # hashed on the host
            },
            os.path.join(ckpt, "model.safetensors"),
        )
        w = types.SimpleNamespace()
        assert staging.stage(w, 1, ckpt)["ok"]
        while staging.report(w)["phase"] == "staging":
            time.sleep(0.01)
        checkpoint = staging.committable(w, "verifier", ckpt, 1)
        seen = {}

        class Model:
            def load_weights(self, weights):
                for name, tensor in weights:
                    seen[name] = tensor.clone()

        opts = loader.LoadOptions(gpu_hash=True, gpu_hash_min_bytes=2048)
        out = loader.commit_into(Model(), checkpoint, options=opts)
        assert out.digest == digest.digest_directory(ckpt), out.digest
        assert out.device_hashed_bytes == 5120 + 3074, out.device_hashed_bytes
        assert sorted(seen) == ["big", "odd", "small"]
        staging.unstage(w)
        print("ok")
        """
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "digest"), str(REPO / "operator")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


# -- tuning: per-stage threads, cap and registration chunks ----------------------------------------------


class FakePinner:
    """Records every registration and unregistration; refuses the ``refuse``-th registration (1-based)."""

    def __init__(self, refuse: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.refuse = refuse
        self.calls = 0

    def register(self, address: int, length: int) -> bool:
        self.calls += 1
        if self.calls == self.refuse:
            return False
        self.registered.append((address, length))
        return True

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_an_area_registers_in_chunks_and_releases_every_chunk() -> None:
    """Chunked page-locking: one driver call per chunk (whole pages, the last one shorter), and the release
    unregisters every chunk; without a chunk the whole area is one call, as before."""
    page = staging_area.mmap.PAGESIZE
    area = staging_area.HostArea(10 * page - 7)
    pinner = FakePinner()
    assert area.pin(pinner, chunk=3 * page - 100) and area.pinned  # rounded up to 3 pages
    assert pinner.registered == [
        (area.address, 3 * page),
        (area.address + 3 * page, 3 * page),
        (area.address + 6 * page, 3 * page),
        (area.address + 9 * page, page),
    ]
    starts = [a for a, _ in pinner.registered]
    assert area.release() == 10 * page - 7
    assert pinner.unregistered == starts and not area.pinned and area.release() == 0

    whole, pinner = staging_area.HostArea(5 * page), FakePinner()
    assert whole.pin(pinner)
    assert pinner.registered == [(whole.address, 5 * page)]
    whole.release()
    assert pinner.unregistered == [pinner.registered[0][0]]


def test_a_refused_chunk_unregisters_the_chunks_before_it() -> None:
    page = staging_area.mmap.PAGESIZE
    area, pinner = staging_area.HostArea(8 * page), FakePinner(refuse=3)
    assert area.pin(pinner, chunk=2 * page) is False and not area.pinned
    assert pinner.unregistered == [area.address, area.address + 2 * page]
    area.release()
    assert len(pinner.unregistered) == 2  # nothing unregistered twice


def test_a_stop_between_chunks_leaves_the_registered_ones_to_the_release() -> None:
    page = staging_area.mmap.PAGESIZE
    area, pinner, stop = staging_area.HostArea(4 * page), FakePinner(), threading.Event()

    def register(address: int, length: int) -> bool:
        stop.set()  # the stage is stopped while its first chunk registers
        return FakePinner.register(pinner, address, length)

    pinner.register = register  # type: ignore[method-assign]
    start = area.address
    with pytest.raises(loader_base.StoppedError):
        area.pin(pinner, chunk=page, stop=stop)
    assert pinner.registered == [(start, page)] and area.pinned
    area.release()
    assert pinner.unregistered == [start]


def test_a_stage_pins_in_chunks_and_its_release_unregisters_them_all(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pin_chunk_bytes`` (the stage kwarg, else ``ROLLOUTFLEET_STAGE_PIN_CHUNK_BYTES``) splits each
    filled area's registration; every chunk is unregistered when the stage goes, and the bytes stay right."""
    pinner = FakePinner()
    monkeypatch.setattr(staging_area.Stage, "_pinner", lambda self: pinner)
    page = staging_area.mmap.PAGESIZE
    w = worker()
    res = w.rolloutfleet_stage(1, str(ckpt["v1"]), str(ckpt["d1"]), None, threads=2, gbps=0, pin_chunk_bytes=page)
    assert res["ok"] is True
    st = settle(w)
    assert (
        st is not None and st["phase"] == "staged" and st["verifier"]["digest"] == digest.digest_directory(ckpt["v1"])
    )
    held = staging.held(w)
    assert held is not None and held.threads == 2 and held.gbps == 0.0 and held.pin_chunk_bytes == page
    areas = [a for c in held.checkpoints for a in c.areas]
    assert held.pinned_bytes == sum(a.length for a in areas)
    assert len(pinner.registered) == sum(a.size // page for a in areas) > len(areas)
    assert all(length == page for _, length in pinner.registered)
    staging.unstage(w)
    assert sorted(pinner.unregistered) == sorted(a for a, _ in pinner.registered)

    monkeypatch.setenv(options.STAGE_PIN_CHUNK_ENV, str(2 * page))
    assert options.stage_pin_chunk_bytes() == 2 * page
    assert stage(w, 2, ckpt["v2"])["ok"] and settle(w) is not None
    held = staging.held(w)
    assert held is not None and held.pin_chunk_bytes == 2 * page
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(options.STAGE_PIN_CHUNK_ENV, bad)
        assert options.stage_pin_chunk_bytes() is None  # the whole area in one call


def test_tuning_kwargs_override_the_environment_and_bad_ones_are_refused(
    ckpt: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``threads`` (1..64), ``gbps`` (>= 0, finite) and ``pin_chunk_bytes`` (> 0) override the environment
    for one stage; a malformed one answers ``internal`` with what was wrong and keeps the held stage."""
    monkeypatch.setenv(options.STAGE_THREADS_ENV, "8")
    monkeypatch.setenv(options.STAGE_GBPS_ENV, "3")
    w = worker()
    assert stage(w, 1, ckpt["v1"])["ok"]
    held = staging.held(w)
    assert held is not None and held.threads == 8 and held.gbps == 3.0 and held.pin_chunk_bytes is None
    bad: list[dict[str, Any]] = [
        {"threads": 0},
        {"threads": 65},
        {"threads": True},
        {"threads": "4"},
        {"threads": 2.0},
        {"gbps": -1},
        {"gbps": "fast"},
        {"gbps": float("inf")},
        {"gbps": float("nan")},
        {"gbps": False},
        {"pin_chunk_bytes": 0},
        {"pin_chunk_bytes": -4096},
        {"pin_chunk_bytes": 1.5},
    ]
    for kwargs in bad:
        res = w.rolloutfleet_stage(2, str(ckpt["v2"]), **kwargs)
        assert res["ok"] is False and res["error"]["code"] == "internal", (kwargs, res)
        assert next(iter(kwargs)) in res["error"]["message"]
        assert staging.held(w) is held
    assert w.rolloutfleet_stage(2, str(ckpt["v2"]), threads=1, gbps=0.0)["ok"]
    held = staging.held(w)
    assert held is not None and held.threads == 1 and held.gbps == 0.0
    assert settle(w) is not None
    assert w.rolloutfleet_stage(3, str(ckpt["v1"]), threads=64, gbps=2)["ok"]
    held = staging.held(w)
    assert held is not None and held.threads == 64 and held.gbps == 2.0
