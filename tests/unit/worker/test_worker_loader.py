"""The streaming loader on CPU, both pipelines: chunking, windows, read-ahead, skip, early stop, errors.

The extension tests drive the loader through the RPCs with default options; these pin each pipeline's own
rules with options chosen to stress them (chunks of a few bytes, a read-ahead of one tensor, windows of
one page). The mapped path runs with a recording pinner in place of cudaHostRegister, which checks what
the driver would: page-aligned, non-overlapping, every range unlocked exactly once.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from worker_fakes import write_verifier

import rolloutfleet_digest as digest
from rolloutfleet_worker import loader, loader_base

pytestmark = pytest.mark.unit


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_verifier(tmp_path / "verifier", seed=3)


def expected(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


class Recorder:
    """A ``load_weights`` that keeps every tensor it is given (a loader that buffers, the worst case)."""

    def __init__(self, stop_after: int | None = None, fail_at: int | None = None) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        self.stop_after, self.fail_at = stop_after, fail_at

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for i, (name, tensor) in enumerate(weights):
            if i == self.fail_at:
                raise ValueError("model refused the tensor")
            self.seen[name] = tensor  # kept, not copied: must never be overwritten later
            if self.stop_after is not None and i + 1 >= self.stop_after:
                return


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rolloutfleet-")]


class RecordingPinner:
    """Stands in for cudaHostRegister: page alignment, no overlap, unlock once; can refuse every n-th."""

    def __init__(self, refuse_every: int = 0) -> None:
        self.live: dict[int, int] = {}
        self.locked_total = self.calls = self.peak = 0
        self.refuse_every = refuse_every
        self.lock = threading.Lock()

    def register(self, address: int, length: int) -> bool:
        with self.lock:
            self.calls += 1
            assert address % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0, "not whole pages"
            for a, n in self.live.items():
                assert address + length <= a or a + n <= address, "overlapping registration"
            if self.refuse_every and self.calls % self.refuse_every == 0:
                return False
            self.live[address] = length
            self.locked_total += length
            self.peak = max(self.peak, sum(self.live.values()))
            return True

    def unregister(self, address: int) -> None:
        with self.lock:
            assert address in self.live, "unlock of a range never locked (or unlocked twice)"
            del self.live[address]


def mapped(pinner: RecordingPinner | None = None, **kw: Any) -> loader.LoadOptions:
    return loader.LoadOptions(mode="mapped", pinner=pinner or RecordingPinner(), **kw)


@pytest.mark.parametrize(
    "options",
    [
        loader.LoadOptions(),
        loader.LoadOptions(read_threads=1, chunk_bytes=7, readahead_bytes=1),
        loader.LoadOptions(read_threads=4, chunk_bytes=100, readahead_bytes=3000, hash_threads=1),
        mapped(),
        mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=1, register_threads=1),
        mapped(RecordingPinner(refuse_every=2), window_bytes=mmap.PAGESIZE, readahead_bytes=3 * mmap.PAGESIZE),
        mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=1, unlock_apart=True),
        mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=1, bounce_share=1.0, chunk_bytes=100, bounce_threads=3),
        mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=2 * mmap.PAGESIZE, bounce_share=0.5, chunk_bytes=999),
    ],
    ids=[
        "read-defaults",
        "read-one-reader-7-byte-chunks-one-tensor-ahead",
        "read-four-readers-100-byte-chunks",
        "mapped-defaults",
        "mapped-one-page-windows-nothing-ahead",
        "mapped-every-other-window-refused",
        "mapped-unlocking-on-its-own-thread",
        "mapped-every-window-read-into-bounce-buffers",
        "mapped-half-the-windows-bounced",
    ],
)
def test_every_tensor_arrives_intact_and_the_digest_matches_the_files(ckpt: Path, options: loader.LoadOptions) -> None:
    model = Recorder()
    outcome = loader.stream_into(model, ckpt, options=options)
    want = expected(ckpt)
    assert set(model.seen) == set(want)
    for name, tensor in want.items():
        assert model.seen[name].dtype == tensor.dtype and torch.equal(model.seen[name], tensor), name
    assert outcome.digest == digest.digest_directory(ckpt)
    assert outcome.tensors == len(want) and outcome.bytes == sum(t.nbytes for t in digest.scan_directory(ckpt))
    assert pipeline_threads() == []
    assert outcome.path == ("mapped" if options.pinner is not None else "read")
    if isinstance(options.pinner, RecordingPinner):
        assert options.pinner.live == {}, "a window was left locked"
        assert (options.pinner.locked_total > 0) == (options.bounce_share < 1)
        assert (outcome.unpinned_bytes > 0) == bool(options.pinner.refuse_every)
        if options.bounce_share == 1:
            assert outcome.bounced_bytes == outcome.bytes
        else:
            assert (0 < outcome.bounced_bytes < outcome.bytes) == (options.bounce_share > 0)


def test_mapped_tensors_are_private_copies(ckpt: Path) -> None:
    """The model may edit what it is given: the mapping (and so the files) must not change."""

    class Editor(Recorder):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in weights:
                tensor.add_(1)  # some vLLM loaders adjust weights in place (e.g. norm offsets)
                self.seen[name] = tensor

    before = digest.digest_directory(ckpt)
    outcome = loader.stream_into(Editor(), ckpt, options=mapped())
    assert outcome.digest == before == digest.digest_directory(ckpt)


def test_mapped_lock_budget_fits_a_tensor_wider_than_the_read_ahead(ckpt: Path) -> None:
    pinner = RecordingPinner()
    opts = mapped(pinner, window_bytes=mmap.PAGESIZE, readahead_bytes=mmap.PAGESIZE)  # less than any big tensor
    outcome = loader.stream_into(Recorder(), ckpt, options=opts)
    assert outcome.digest == digest.digest_directory(ckpt) and pinner.live == {}


@pytest.mark.parametrize("options", [loader.LoadOptions(), mapped()], ids=["read", "mapped"])
def test_skipped_tensors_are_hashed_but_not_fed(ckpt: Path, options: loader.LoadOptions) -> None:
    model = Recorder()
    outcome = loader.stream_into(model, ckpt, skip=lambda n: n.startswith("lm_head"), options=options)
    assert "lm_head.weight" not in model.seen and outcome.skipped == ["lm_head.weight"]
    assert outcome.digest == digest.digest_directory(ckpt)


@pytest.mark.parametrize(
    "options",
    [loader.LoadOptions(chunk_bytes=64, readahead_bytes=1), mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=1)],
    ids=["read", "mapped"],
)
def test_a_loader_that_stops_early_fails_the_load(ckpt: Path, options: loader.LoadOptions) -> None:
    """A ``load_weights`` that returns after 2 of 19 tensors left most parameters holding the old weights.

    Reporting the checkpoint's digest for that model would tell the operator the new revision is resident
    when most of it is not, so the load must fail (and no digest be produced), with every thread stopped.
    """
    model = Recorder(stop_after=2)
    with pytest.raises(loader.IncompleteLoadError, match="2 of 19") as failed:
        loader.stream_into(model, ckpt, options=options)
    assert "digest" not in str(failed.value)
    assert len(model.seen) == 2
    assert pipeline_threads() == []
    if isinstance(options.pinner, RecordingPinner):
        assert options.pinner.live == {}


class Reporting(Recorder):
    """A ``load_weights`` that returns the names it loaded, as vLLM's models do, minus ``ignore``d ones."""

    def __init__(self, ignore: str = "") -> None:
        super().__init__()
        self.ignore = ignore

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:  # type: ignore[override]
        super().load_weights(weights)
        return {n for n in self.seen if not (self.ignore and n.startswith(self.ignore))}


@pytest.mark.parametrize("options", [loader.LoadOptions(), mapped()], ids=["read", "mapped"])
def test_a_parameter_the_model_did_not_report_loaded_fails_the_load(ckpt: Path, options: loader.LoadOptions) -> None:
    """Every tensor was fed, but the model says it never filled ``lm_head.weight`` (a name it ignored).

    vLLM's ``load_weights`` returns the parameters it loaded, and vLLM itself refuses a start-up load
    that leaves one out; a parameter left out here still holds the previous revision, so claiming the
    new digest for it would be false.
    """
    names = set(expected(ckpt))
    with pytest.raises(loader.IncompleteLoadError, match=r"lm_head\.weight"):
        loader.stream_into(Reporting(ignore="lm_head"), ckpt, options=options, required=names)
    assert pipeline_threads() == []
    outcome = loader.stream_into(Reporting(), ckpt, options=options, required=names)
    assert outcome.digest == digest.digest_directory(ckpt)


def test_a_model_whose_loader_returns_nothing_is_checked_by_the_feed_alone(ckpt: Path) -> None:
    """Some loaders return None instead of the loaded names: then a complete feed is all we can check.

    Refusing them outright would make such engines unable to take any update; the feed check still
    catches a loader that stops early (test above).
    """
    outcome = loader.stream_into(Recorder(), ckpt, required={"model.never.loaded"})
    assert outcome.digest == digest.digest_directory(ckpt) and outcome.tensors == 19


@pytest.mark.parametrize(
    "options",
    [loader.LoadOptions(chunk_bytes=50, readahead_bytes=1), mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=1)],
    ids=["read", "mapped"],
)
def test_a_failing_load_weights_stops_every_thread(ckpt: Path, options: loader.LoadOptions) -> None:
    with pytest.raises(loader.LoadWeightsError, match="model refused"):
        loader.stream_into(Recorder(fail_at=3), ckpt, options=options)
    assert pipeline_threads() == []
    if isinstance(options.pinner, RecordingPinner):
        assert options.pinner.live == {}


@pytest.mark.parametrize("options", [loader.LoadOptions(chunk_bytes=64), mapped()], ids=["read", "mapped"])
def test_a_file_truncated_after_the_scan_is_an_io_error(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, options: loader.LoadOptions
) -> None:
    scan = digest.scan_directory

    def scan_then_truncate(path: Path | str) -> list[digest.TensorInfo]:
        infos = scan(path)
        last = max(infos, key=lambda t: (t.file, t.offset))
        with last.file.open("r+b") as f:
            f.truncate(last.offset + last.nbytes // 2)
        return infos

    monkeypatch.setattr(loader.digest, "scan_directory", scan_then_truncate)
    with pytest.raises(digest.CheckpointError, match="truncated while reading"):
        loader.stream_into(Recorder(), ckpt, options=options)
    assert pipeline_threads() == []


def test_read_ahead_stays_within_its_budget(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = [t.nbytes for t in digest.scan_directory(ckpt)]
    limit = max(sizes) + 1  # room for the largest tensor, never for two of the big ones at once
    peaks: list[int] = []
    acquire = loader_base.Budget.acquire

    def watched(self: loader_base.Budget, n: int, stop: threading.Event) -> None:
        acquire(self, n, stop)
        peaks.append(self.used)

    monkeypatch.setattr(loader_base.Budget, "acquire", watched)

    class Slow(Recorder):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            def slowly(it: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
                for item in it:
                    threading.Event().wait(0.002)  # let the readers run ahead as far as they may
                    yield item

            super().load_weights(slowly(weights))

    loader.stream_into(Slow(), ckpt, options=loader.LoadOptions(readahead_bytes=limit, chunk_bytes=32))
    assert len(peaks) == len(sizes)
    assert max(peaks) <= limit


def test_default_read_threads_are_bounded() -> None:
    assert 2 <= loader.default_read_threads() <= 8


def test_environment_configures_the_extension_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutfleet_worker import extension

    monkeypatch.setenv(extension.READ_THREADS_ENV, "3")
    monkeypatch.setenv(extension.READAHEAD_ENV, "1048576")
    monkeypatch.setenv(extension.THREADS_ENV, "nonsense")
    monkeypatch.setenv(extension.MODE_ENV, "mapped")
    monkeypatch.setenv(extension.GPU_HASH_ENV, "0")
    monkeypatch.setenv(extension.BOUNCE_SHARE_ENV, "0.25")
    monkeypatch.setenv(extension.BOUNCE_THREADS_ENV, "5")
    opts: Any = extension.load_options(pin=False)
    assert (opts.read_threads, opts.readahead_bytes, opts.hash_threads, opts.pin) == (3, 1048576, None, False)
    assert (opts.gpu_hash, opts.unlock_apart, opts.bounce_share, opts.bounce_threads) == (False, True, 0.25, 5)
    # No GPU: nothing to page-lock for, so the read path runs whatever the mode says.
    assert opts.mode == "mapped" and opts.pinner is None


def test_the_extension_defaults_are_the_fastest_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutfleet_worker import extension

    for name in (extension.GPU_HASH_ENV, extension.UNLOCK_APART_ENV, extension.BOUNCE_SHARE_ENV):
        monkeypatch.delenv(name, raising=False)
    opts: Any = extension.load_options(pin=False)
    assert (opts.gpu_hash, opts.unlock_apart, opts.bounce_share) == (True, True, 1.0)
    monkeypatch.setenv(extension.BOUNCE_SHARE_ENV, "1.5")  # out of range: the default, not a crash
    assert extension.load_options(pin=False).bounce_share == 1.0


def test_a_load_does_not_wait_for_the_gpu_hash_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the background self-test compiles the kernels, loads hash on the host; after it, on the GPU."""
    from rolloutfleet_worker import blake3_device, loader_cuda

    release, entered = threading.Event(), threading.Event()

    def slow_self_test(device: Any) -> bool:
        entered.set()
        assert release.wait(10)
        return True

    monkeypatch.setattr(blake3_device, "self_test", slow_self_test)
    copies = object.__new__(loader_cuda.CudaCopies)
    copies.device = 97  # no such device: the fake self-test never touches it
    warm = threading.Thread(target=loader_cuda.check_device_hash, args=(97,))
    warm.start()
    try:
        assert entered.wait(10)
        assert loader_cuda.device_hash_works(copies) is False
    finally:
        release.set()
        warm.join()
    assert loader_cuda.device_hash_works(copies) is True
    monkeypatch.setattr(blake3_device, "self_test", lambda device: pytest.fail("ran twice"))
    assert loader_cuda.check_device_hash(97) is True
    loader_cuda._hash_checked.pop(97)


def test_mapped_copies_never_span_two_registrations(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA driver refuses (invalid argument) a copy whose source crosses from one locked range into another."""
    from rolloutfleet_worker import loader_cuda

    pinner = RecordingPinner()
    pieces: list[int] = []

    class Checking(loader_cuda.HostCopies):
        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            lo, hi = src.data_ptr(), src.data_ptr() + src.numel()
            with pinner.lock:
                inside = [a for a, n in pinner.live.items() if a <= lo and hi <= a + n]
                touching = [a for a, n in pinner.live.items() if lo < a + n and a < hi]
            assert len(touching) <= 1 and inside == touching, "copy spans two registrations"
            pieces.append(src.numel())
            super().copy(dst, src)

    monkeypatch.setattr(loader_cuda, "HostCopies", Checking)
    opts = mapped(pinner, window_bytes=mmap.PAGESIZE, readahead_bytes=1)
    outcome = loader.stream_into(Recorder(), ckpt, options=opts)
    assert outcome.digest == digest.digest_directory(ckpt)
    assert len(pieces) > outcome.tensors  # one-page windows split the larger tensors


def test_auto_maps_when_a_pinner_works_and_read_mode_never_does(ckpt: Path) -> None:
    pinner = RecordingPinner()
    outcome = loader.stream_into(Recorder(), ckpt, options=loader.LoadOptions(mode="auto", pinner=pinner))
    assert outcome.path == "mapped" and pinner.calls > 0
    pinner = RecordingPinner()
    outcome = loader.stream_into(Recorder(), ckpt, options=loader.LoadOptions(mode="read", pinner=pinner))
    assert outcome.path == "read" and pinner.calls == 0


def test_mapped_tensors_without_gpu_room_are_handed_over_as_host_copies(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging that finds no GPU memory, even after the model drained what was staged, falls back to host."""
    from rolloutfleet_worker import loader_cuda

    big = max(t.nbytes for t in digest.scan_directory(ckpt))
    refused: list[int] = []

    class Full(loader_cuda.HostCopies):
        def empty(self, n: int) -> torch.Tensor:
            if n == big:
                refused.append(n)
                raise torch.cuda.OutOfMemoryError("no room for staging")
            return super().empty(n)

    monkeypatch.setattr(loader_cuda, "HostCopies", Full)
    model = Recorder()
    outcome = loader.stream_into(model, ckpt, options=mapped(readahead_bytes=1))
    want = expected(ckpt)
    assert all(torch.equal(model.seen[n], want[n]) for n in want)
    assert outcome.digest == digest.digest_directory(ckpt) and outcome.path == "mapped"
    big_tensors = sum(1 for t in digest.scan_directory(ckpt) if t.nbytes == big)
    assert len(refused) == 2 * big_tensors  # each tried, then tried again once the model drained


def test_files_that_cannot_be_mapped_are_read_instead(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutfleet_worker import loader_mapped

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise OSError(19, "No such device")  # what mmap says on a mount without mmap support

    want = digest.digest_directory(ckpt)
    monkeypatch.setattr(loader_mapped.mmap, "mmap", refuse)  # the mmap module itself, for this test only
    pinner = RecordingPinner()
    outcome = loader.stream_into(Recorder(), ckpt, options=mapped(pinner))
    assert outcome.path == "read" and pinner.calls == 0
    assert outcome.digest == want


def test_the_pinning_probe_maps_a_file_of_the_checkpoint(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe asks the storage the weights come from (a network filesystem may refuse what /tmp allows)."""
    from rolloutfleet_worker import loader_cuda

    calls: list[int] = []

    class FakePinner:
        def register(self, address: int, length: int) -> bool:
            calls.append(length)
            return len(calls) == 1  # accept the probe's page

        def unregister(self, address: int) -> None:
            calls.append(-1)

    monkeypatch.setattr(loader_cuda, "_probed", {})
    monkeypatch.setattr(loader_cuda.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader_cuda, "CudaPinner", FakePinner)
    opened: list[str] = []
    real_mmap = loader_cuda.mmap.mmap

    def spy(fileno: int, length: int, **kwargs: Any) -> Any:
        opened.append(os.readlink(f"/proc/self/fd/{fileno}"))
        return real_mmap(fileno, length, **kwargs)

    monkeypatch.setattr(loader_cuda.mmap, "mmap", spy)
    sample = sorted(ckpt.glob("*.safetensors"))[0]
    assert isinstance(loader_cuda.cuda_pinner(sample), FakePinner)
    assert opened == [str(sample)] and calls == [mmap.PAGESIZE, -1]


@pytest.mark.parametrize("options", [loader.LoadOptions(), mapped()], ids=["read", "mapped"])
def test_the_outcome_says_where_the_time_went(ckpt: Path, options: loader.LoadOptions) -> None:
    """load_weights' own time, its waits for tensors, and the finish add up to the load's seconds."""
    import time

    class Slow:
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _ in weights:
                time.sleep(0.02)

    outcome = loader.stream_into(Slow(), ckpt, options=options)
    assert outcome.model_seconds >= 0.02 * outcome.tensors
    assert outcome.waiting_seconds >= 0 and outcome.finish_seconds >= 0
    parts = outcome.model_seconds + outcome.waiting_seconds + outcome.finish_seconds
    assert parts <= outcome.seconds + 1e-3 and outcome.seconds - parts < 0.5  # the rest: scan and start


def test_a_failed_bounce_read_fails_the_load_and_stages_no_partly_read_tensor(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutfleet_worker import loader_mapped

    real = loader_mapped.read_into
    failed: list[tuple[Path, int, int]] = []

    def flaky(fd: int, file: Path, address: int, offset: int, length: int) -> None:
        if not failed and offset > 0:  # a later piece of some window: the disk answers EIO
            failed.append((file, offset, length))
            raise digest.CheckpointError(file, "unreadable: Input/output error")
        real(fd, file, address, offset, length)

    staged: list[digest.TensorInfo] = []
    real_stage = loader_mapped.MappedPipeline._stage

    def stage(self: Any, t: Any) -> Any:
        staged.append(t.info)
        return real_stage(self, t)

    monkeypatch.setattr(loader_mapped, "read_into", flaky)
    monkeypatch.setattr(loader_mapped.MappedPipeline, "_stage", stage)
    model = Recorder()
    opts = mapped(window_bytes=mmap.PAGESIZE, readahead_bytes=1, bounce_share=1.0, chunk_bytes=256, bounce_threads=1)
    with pytest.raises(digest.CheckpointError, match="Input/output error"):
        loader.stream_into(model, ckpt, options=opts)
    file, offset, _length = failed[0]
    lo = offset // mmap.PAGESIZE * mmap.PAGESIZE  # the one-page window the failed piece belongs to
    for info in staged:  # nothing from that window reached GPU staging, let alone the model
        assert info.file != file or not (info.offset < lo + mmap.PAGESIZE and lo < info.offset + info.nbytes), info
    want = expected(ckpt)
    assert all(torch.equal(tensor, want[name]) for name, tensor in model.seen.items())
    assert pipeline_threads() == []


def test_the_warm_up_options_do_not_probe_page_locking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is cached per process: it must run on a file of the checkpoint, not on the warm-up's."""
    from rolloutfleet_worker import extension, loader_cuda

    monkeypatch.setattr(loader_cuda, "cuda_pinner", lambda sample=None: pytest.fail("probed"))
    opts: Any = extension.load_options(pin=True, probe=False)
    assert opts.pinner is None and opts.bounce_share == 1.0


@pytest.mark.parametrize(
    "options", [loader.LoadOptions(), mapped(), mapped(bounce_share=1.0)], ids=["read", "mapped", "bounced"]
)
def test_a_shard_swapped_outside_after_the_check_is_refused_when_opened(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: loader.LoadOptions
) -> None:
    """The roots are enforced on what each pipeline actually opened, not only on the names checked before.

    Here the per-file check is skipped (as if a link were swapped right after it): the open must refuse.
    """
    import dataclasses

    roots = tmp_path / "roots"
    inside = roots / "step"
    inside.mkdir(parents=True)
    for f in sorted(ckpt.glob("*.safetensors")):
        (inside / f.name).symlink_to(f)  # every shard links out of the roots
    monkeypatch.setattr(loader_base, "confine", lambda infos, roots: infos)
    opts = dataclasses.replace(options, roots=(os.path.realpath(roots),))
    with pytest.raises(loader_base.OutsideRootsError, match="outside the allowed weight roots"):
        loader.stream_into(Recorder(), inside, options=opts)
    assert pipeline_threads() == []
    assert loader.stream_into(Recorder(), inside, options=options).digest == digest.digest_directory(ckpt)


def test_no_header_outside_the_roots_is_read(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard linked out of the roots is refused before its header is opened: not even its first bytes
    (or a parse error quoting them) may come from outside."""
    roots = tmp_path / "roots"
    inside = roots / "step"
    inside.mkdir(parents=True)
    for f in sorted(ckpt.glob("*.safetensors")):
        (inside / f.name).symlink_to(f)
    monkeypatch.setattr(digest, "read_header", lambda file: pytest.fail(f"read the header of {file}"))
    opts = loader.LoadOptions(roots=(os.path.realpath(roots),))
    with pytest.raises(loader_base.OutsideRootsError):
        loader.stream_into(Recorder(), inside, options=opts)
