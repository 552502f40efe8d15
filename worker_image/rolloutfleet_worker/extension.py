"""``RolloutFleetExtension``: the RPCs the operator calls on every vLLM worker.

vLLM appends this class to its Worker's bases (``--worker-extension-cls
rolloutfleet_worker.extension.RolloutFleetExtension``); the operator reaches the methods through
``POST /collective_rpc`` and gets one result per worker. This module owns the per-worker record of what
was loaded (``self._rolloutfleet_state``), the order and policy rules (verifier before draft, frozen
drafts never overwritten, shared tensors never written by the draft) and the wire payloads. Loading is
``rolloutfleet_worker.loader``; finding the modules is ``rolloutfleet_worker.models``; which paths may be
read is ``rolloutfleet_worker.paths``.

Rules vLLM imposes: only ADD attributes (a clash with a Worker attribute is an assertion error), so every
public name starts with ``rolloutfleet_`` and helpers are module functions; import torch/vLLM lazily so
this module imports without them; never raise across the RPC boundary (an exception becomes an opaque
HTTP 500), so every method returns ``{"ok": False, "error": {...}}`` instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from rolloutfleet_worker import digest, paths

ErrorCode = Literal[
    "invalid_target",
    "invalid_path",
    "invalid_revision",
    "io",
    "order",
    "frozen",
    "no_draft",
    "load_failed",
    "incomplete",
    "internal",
]
Target = Literal["verifier", "draft"]
DraftPolicy = Literal["coUpdate", "frozen"]

POLICY_ENV = "ROLLOUTFLEET_DRAFT_POLICY"
DRAFT_PATH_ENV = "ROLLOUTFLEET_DRAFT_PATH"
ROOTS_ENV = paths.ROOTS_ENV
THREADS_ENV = "ROLLOUTFLEET_HASH_THREADS"
# A child of vLLM's logger, so the lines land in the engine's log with its format and level.
log = logging.getLogger("vllm.rolloutfleet")
READ_THREADS_ENV = "ROLLOUTFLEET_LOAD_READ_THREADS"
READAHEAD_ENV = "ROLLOUTFLEET_LOAD_READAHEAD_BYTES"
MODE_ENV = "ROLLOUTFLEET_LOAD_MODE"
GPU_HASH_ENV = "ROLLOUTFLEET_LOAD_GPU_HASH"
UNLOCK_APART_ENV = "ROLLOUTFLEET_LOAD_UNLOCK_APART"
BOUNCE_SHARE_ENV = "ROLLOUTFLEET_LOAD_BOUNCE_SHARE"
BOUNCE_THREADS_ENV = "ROLLOUTFLEET_LOAD_BOUNCE_THREADS"


class ErrorBody(TypedDict):
    code: ErrorCode
    message: str


class Failure(TypedDict):
    ok: Literal[False]
    error: ErrorBody


class LoadResult(TypedDict):
    ok: Literal[True]
    target: Target
    revision: int | None
    path: str
    digest: str
    bytes: int
    seconds: float
    tensors: int
    skipped: list[str]


class PreflightResult(TypedDict):
    ok: Literal[True]
    target: Target
    path: str
    tensors: int  # in the checkpoint, shared ones included
    bytes: int  # what a load would read and hash


class VerifierState(TypedDict):
    revision: int | None
    digest: str | None
    path: str | None
    verified: bool


class DraftState(VerifierState):
    policy: DraftPolicy


class StateResult(TypedDict):
    ok: Literal[True]
    resident: bool
    mapped: bool  # weights' memory is mapped (False while asleep): waking mapped weights is not harmless
    verifier: VerifierState
    draft: DraftState | None
    draft_method: str | None
    shared_tensors: list[str]
    rank: int


@dataclass
class _Slot:
    """What this worker knows about one target's weights."""

    revision: int | None = None
    digest: str | None = None
    path: str | None = None
    verified: bool = False
    fingerprint: list[float] | None = None  # None: nothing recorded, residency unknown
    lost: bool = False  # sticky: contents changed under us (level-2 sleep) until the next good load

    def unknown(self) -> None:
        """Fail closed: contents unknown until a load succeeds."""
        self.revision, self.digest, self.path, self.verified = None, None, None, False
        self.fingerprint = None

    def report(self, mapped: bool) -> VerifierState:
        if not mapped or self.lost:
            return VerifierState(revision=None, digest=None, path=None, verified=False)
        return VerifierState(revision=self.revision, digest=self.digest, path=self.path, verified=self.verified)


@dataclass
class _State:
    verifier: _Slot = field(default_factory=_Slot)
    draft: _Slot = field(default_factory=_Slot)
    baseline_taken: bool = False


def _fail(code: ErrorCode, message: str) -> Failure:
    return Failure(ok=False, error=ErrorBody(code=code, message=message))


def draft_policy() -> DraftPolicy:
    """The draft policy from the environment; an unknown value counts as frozen (never overwrite)."""
    value = os.environ.get(POLICY_ENV, "coUpdate")
    return "coUpdate" if value == "coUpdate" else "frozen"


def _positive_env(name: str) -> int | None:
    """A positive integer from the environment; unset or malformed means the loader's default."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def load_options(pin: bool, world_size: int = 1, sample: Path | None = None, *, probe: bool = True) -> Any:
    """The loader's options from ROLLOUTFLEET_LOAD_* / ROLLOUTFLEET_HASH_THREADS (worker_image/README.md).

    The mapped path (GPU staging; windows read into pinned bounce buffers, or page-locked in place) for a
    single-rank engine on a GPU whose platform locks a read-only mapping of ``sample`` (a file of the
    checkpoint being loaded; probed once per process), unless ``ROLLOUTFLEET_LOAD_MODE=read``; otherwise
    the read path. Defaults are the fastest measured on the H200 (bench/results/gpu_update.md): every
    window bounced, the hash on the GPU, unlocking on its own thread. ``probe=False`` skips the
    page-locking probe (no pinner): the warm-up must not decide it on a file that is not the checkpoint's.
    """
    from rolloutfleet_worker import loader, loader_cuda

    defaults = loader.LoadOptions()
    mode = os.environ.get(MODE_ENV, "auto").strip() or "auto"
    if mode not in ("auto", "mapped", "read"):
        mode = "auto"
    pinner = loader_cuda.cuda_pinner(sample) if probe and pin and world_size == 1 and mode != "read" else None
    return loader.LoadOptions(
        pin=pin,
        mode=mode,  # type: ignore[arg-type]
        read_threads=_positive_env(READ_THREADS_ENV) or defaults.read_threads,
        hash_threads=_positive_env(THREADS_ENV),
        readahead_bytes=_positive_env(READAHEAD_ENV) or defaults.readahead_bytes,
        pinner=pinner,
        gpu_hash=_flag_env(GPU_HASH_ENV, True),
        unlock_apart=_flag_env(UNLOCK_APART_ENV, True),
        bounce_share=_share_env(BOUNCE_SHARE_ENV, 1.0),
        bounce_threads=_positive_env(BOUNCE_THREADS_ENV) or defaults.bounce_threads,
        roots=paths.weight_roots(),
    )


def _flag_env(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return default


def _share_env(name: str, default: float) -> float:
    """A share in [0, 1] from the environment; unset or malformed means ``default``."""
    try:
        value = float(os.environ.get(name, "").strip())
    except ValueError:
        return default
    return value if 0.0 <= value <= 1.0 else default


_warmed: list[bool] = []


def _warm_up_once(worker: Any) -> None:
    """Start the loader's warm-up (GPU hash self-test, bounce buffers) once per worker process.

    Called when the extension's state is first made (the operator reads the state long before it asks
    for a load), so the first load neither compiles kernels nor allocates pinned memory.
    """
    if _warmed:
        return
    _warmed.append(True)
    from rolloutfleet_worker import loader_cuda, models

    verifier, _draft, _shared_names = _shared(worker)
    if verifier is None or not models.on_cuda(verifier) or models.world_size() != 1:
        return  # the read path runs there: nothing to warm
    options = load_options(pin=True, probe=False)
    if options.mode == "read":
        return
    sizes = []
    if options.bounce_share > 0:
        sizes = [options.window_bytes] * (options.readahead_bytes // options.window_bytes + 2)
    import torch

    loader_cuda.warm_up(torch.cuda.current_device(), options.gpu_hash, sizes)


def check_path(path: object) -> str | None:
    """Why ``path`` may not be loaded, or None when it may (``paths.resolve`` without the result)."""
    try:
        paths.resolve(path)
    except paths.PathRefusedError as exc:
        return str(exc)
    return None


def _state(worker: Any) -> _State:
    state = getattr(worker, "_rolloutfleet_state", None)
    if not isinstance(state, _State):
        state = _State()
        worker._rolloutfleet_state = state
        try:
            _warm_up_once(worker)
        except Exception as exc:  # an optimisation only: never fail a request for it
            log.warning("rolloutfleet: loader warm-up not started: %s: %s", type(exc).__name__, exc)
    return state


def _shared(worker: Any) -> tuple[Any | None, Any | None, list[str]]:
    from rolloutfleet_worker import models

    verifier = models.verifier_model(worker)
    draft = models.draft_model(worker)
    shared = models.shared_parameters(draft, verifier) if draft is not None else []
    return verifier, draft, shared


def _observe(slot: _Slot, model: Any | None, exclude: list[str]) -> bool:
    """Compare ``slot``'s recorded fingerprint with the model now; mark it lost on a mismatch.

    Returns whether the weights are mapped (False while the engine sleeps: then nothing is read).
    """
    from rolloutfleet_worker import models

    if model is None:
        return True
    if not models.weights_mapped(model):
        return False
    if slot.fingerprint is not None and not slot.lost and models.fingerprint(model, exclude) != slot.fingerprint:
        slot.lost = True
        slot.verified = False
    return True


def _take_baseline(state: _State, verifier: Any | None, draft: Any | None, shared: list[str]) -> None:
    """Fingerprint the weights vLLM loaded at start-up, so a sleep before our first load is noticed."""
    from rolloutfleet_worker import models

    if state.baseline_taken:
        return
    for slot, model, exclude in ((state.verifier, verifier, []), (state.draft, draft, shared)):
        if model is not None and slot.fingerprint is None and models.weights_mapped(model):
            slot.fingerprint = models.fingerprint(model, exclude)
    state.baseline_taken = True


def _load(worker: Any, target: object, path: object, revision: int | None, restore: bool) -> LoadResult | Failure:
    from rolloutfleet_worker import loader, loader_base, models

    if target not in ("verifier", "draft"):
        return _fail("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
    if revision is not None and (not isinstance(revision, int) or isinstance(revision, bool) or revision < 0):
        return _fail("invalid_revision", f"revision must be a non-negative integer, got {revision!r}")
    try:
        real = paths.resolve(path)
    except paths.PathRefusedError as exc:
        return _fail("invalid_path", str(exc))
    assert isinstance(path, str)
    state = _state(worker)
    try:
        verifier, draft, shared = _shared(worker)
    except models.LookupFailedError as exc:
        return _fail("internal", str(exc))
    _take_baseline(state, verifier, draft, shared)
    if target == "verifier":
        model, slot, exclude = verifier, state.verifier, []
        if model is None:
            return _fail("load_failed", "the worker has no verifier model")
    else:
        model, slot, exclude = draft, state.draft, shared
        if model is None:
            return _fail("no_draft", "this engine (or this pipeline rank) has no draft model")
        policy = draft_policy()
        if restore and policy != "frozen":
            return _fail("invalid_target", "restore_draft is only for a frozen draft; use rolloutfleet_load")
        if not restore and policy == "frozen":
            return _fail("frozen", "the draft policy is frozen: its weights are never overwritten")
        if not restore:
            _observe(state.verifier, verifier, [])
            v = state.verifier
            if v.lost or not v.verified or v.revision != revision:
                held = None if v.lost or not v.verified else v.revision
                return _fail("order", f"load the verifier at revision {revision} first (it holds {held})")
    if not models.weights_mapped(model):
        return _fail("order", f"the {target} weights are not mapped (asleep): wake_up(tags=weights) first")
    slot.unknown()  # fail closed from here on: a crash mid-load must not leave an old claim behind
    slot.lost = False
    skip = (lambda name: models.matches_shared(name, shared)) if target == "draft" and shared else None
    # vLLM checks the loaded names only for unquantized models (quantization methods may create
    # parameters no checkpoint carries); for a quantized one the complete feed is what is checked.
    quantized = models.quantization(worker, target) is not None
    try:
        outcome = loader.stream_into(
            model,
            real,
            skip=skip or (lambda _name: False),
            options=load_options(
                pin=models.on_cuda(model),
                world_size=models.world_size(),
                sample=paths.first_file(real),
            ),
            required=None if quantized else models.required_parameters(model, exclude),
        )
    except loader_base.OutsideRootsError as exc:
        return _fail("invalid_path", str(exc))
    except digest.CheckpointError as exc:
        return _fail("io", str(exc))
    except loader.LoadWeightsError as exc:
        return _fail("load_failed", str(exc))
    except loader.IncompleteLoadError as exc:
        return _fail("incomplete", str(exc))
    except Exception as exc:
        return _fail("load_failed", f"{type(exc).__name__}: {exc}")
    log.info(
        "rolloutfleet: loaded %s revision %s from %s: %.2f GB in %.3f s (%.1f GB/s, %s path%s%s%s; "
        "load_weights %.3f s, waiting for tensors %.3f s, finishing %.3f s)",
        target,
        revision,
        path,
        outcome.bytes / 1e9,
        outcome.seconds,
        outcome.bytes / 1e9 / max(outcome.seconds, 1e-9),
        outcome.path,
        f", {outcome.unpinned_bytes / 1e9:.2f} GB not page-locked" if outcome.unpinned_bytes else "",
        f", {outcome.device_hashed_bytes / 1e9:.2f} GB hashed on the GPU" if outcome.device_hashed_bytes else "",
        f", {outcome.bounced_bytes / 1e9:.2f} GB through bounce buffers" if outcome.bounced_bytes else "",
        outcome.model_seconds,
        outcome.waiting_seconds,
        outcome.finish_seconds,
    )
    slot.revision, slot.digest, slot.path, slot.verified = revision, outcome.digest, path, True
    slot.fingerprint = models.fingerprint(model, exclude)
    return LoadResult(
        ok=True,
        target="draft" if target == "draft" else "verifier",
        revision=revision,
        path=path,
        digest=outcome.digest,
        bytes=outcome.bytes,
        seconds=outcome.seconds,
        tensors=outcome.tensors,
        skipped=outcome.skipped,
    )


def _preflight(worker: Any, target: object, path: object) -> PreflightResult | Failure:
    """Whether a load of ``target`` from ``path`` can succeed, judged from headers and sizes alone.

    Checks: the target and path as a load checks them; the target model exists (and for a draft, which
    of its tensors the verifier owns); every ``*.safetensors`` file directly in the directory resolves and
    opens under the allowed roots and is readable; every header parses, every tensor lies inside its file
    with as many bytes as its dtype and shape say, no name appears twice, and every dtype is one torch can
    load; and, for an unquantized engine, the tensors a load would feed hold at least as many elements as
    the target's parameters on this rank (shared and vocabulary-padding ones left out).

    Cannot check, because vLLM's per-model ``load_weights`` decides it: which parameter each checkpoint
    name fills (q/k/v are stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, prefixes are
    renamed, tensor-parallel ranks take slices), so neither a name nor a shape is compared one to one, and
    a checkpoint with enough elements under names the model ignores still passes (the load itself then
    fails with ``incomplete``); nor anything about the values. For a quantized engine the element count is
    not compared either (quantization methods create parameters no checkpoint carries). Reads no tensor
    bytes and touches no parameter, so it is safe while the engine serves or sleeps.
    """
    from rolloutfleet_worker import loader_base, models

    if target not in ("verifier", "draft"):
        return _fail("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
    try:
        real = paths.resolve(path)
    except paths.PathRefusedError as exc:
        return _fail("invalid_path", str(exc))
    assert isinstance(path, str)
    try:
        verifier, draft, shared = _shared(worker)
    except models.LookupFailedError as exc:
        return _fail("internal", str(exc))
    model, exclude = (verifier, []) if target == "verifier" else (draft, shared)
    if model is None:
        if target == "verifier":
            return _fail("load_failed", "the worker has no verifier model")
        return _fail("no_draft", "this engine (or this pipeline rank) has no draft model")
    roots = paths.weight_roots()
    try:
        if roots:
            loader_base.check_files(real, roots)
        infos = digest.scan_directory(real)
        if roots:
            infos = loader_base.confine(infos, roots)
        for file in dict.fromkeys(info.file for info in infos):
            os.close(loader_base.open_file(file, roots))
        for info in infos:
            loader_base.torch_dtype(info.dtype, info.file)
    except loader_base.OutsideRootsError as exc:
        return _fail("invalid_path", str(exc))
    except digest.CheckpointError as exc:
        return _fail("io", str(exc))
    fed = [info for info in infos if not (exclude and models.matches_shared(info.name, exclude))]
    if models.quantization(worker, target) is None:
        have = sum(_elements(info.shape) for info in fed)
        need = models.parameter_elements(model, exclude)
        if have < need:
            return _fail(
                "incomplete",
                f"the checkpoint's {len(fed)} tensors hold {have} elements; the {target}'s parameters on this "
                f"rank need {need}: it cannot fill the model",
            )
    return PreflightResult(
        ok=True,
        target="draft" if target == "draft" else "verifier",
        path=path,
        tensors=len(infos),
        bytes=sum(info.nbytes for info in infos),
    )


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _report(worker: Any) -> StateResult:
    from rolloutfleet_worker import models

    state = _state(worker)
    verifier, draft, shared = _shared(worker)
    _take_baseline(state, verifier, draft, shared)
    v_mapped = _observe(state.verifier, verifier, [])
    d_mapped = _observe(state.draft, draft, shared)
    resident = v_mapped and d_mapped and not state.verifier.lost and (draft is None or not state.draft.lost)
    draft_report: DraftState | None = None
    if draft is not None:
        d = state.draft.report(d_mapped)
        draft_report = DraftState(
            revision=d["revision"],
            digest=d["digest"],
            path=d["path"],
            verified=d["verified"],
            policy=draft_policy(),
        )
    return StateResult(
        ok=True,
        resident=resident,
        mapped=v_mapped and d_mapped,
        verifier=state.verifier.report(v_mapped),
        draft=draft_report,
        draft_method=models.draft_method(worker),
        shared_tensors=shared,
        rank=models.rank(),
    )


class RolloutFleetExtension:
    """Mixin for vLLM's Worker. Every method returns a dict and never raises."""

    def rolloutfleet_load(self, target: str, path: str, revision: int) -> LoadResult | Failure:
        """Load ``target`` ("verifier" | "draft") in place from checkpoint directory ``path``."""
        try:
            if revision is None:
                return _fail("invalid_revision", "revision is required")
            return _load(self, target, path, revision, restore=False)
        except Exception as exc:  # the RPC boundary: report, never raise
            return _fail("load_failed", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_restore_draft(self, path: str) -> LoadResult | Failure:
        """Reload a frozen draft from ``path`` (after a level-2 sleep); revision stays None."""
        try:
            pinned = os.environ.get(DRAFT_PATH_ENV)
            if pinned and isinstance(path, str) and os.path.normpath(path) != os.path.normpath(pinned):
                return _fail("invalid_path", f"the frozen draft comes from {pinned!r}, not {path!r}")
            return _load(self, "draft", path, None, restore=True)
        except Exception as exc:
            return _fail("load_failed", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_preflight(self, target: str, path: str) -> PreflightResult | Failure:
        """Check, from headers and sizes only, that ``target`` could load from ``path`` (``_preflight``)."""
        try:
            return _preflight(self, target, path)
        except Exception as exc:
            return _fail("internal", f"{type(exc).__name__}: {exc}")

    def rolloutfleet_state(self) -> StateResult | Failure:
        """What this worker holds: revisions, digests, residency, draft method, shared tensors, rank."""
        try:
            return _report(self)
        except Exception as exc:
            return _fail("internal", f"{type(exc).__name__}: {exc}")
