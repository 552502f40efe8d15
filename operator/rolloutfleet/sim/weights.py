"""What a simulated load reads: the real digest of a safetensors directory, or a synthetic one.

Called by ``rolloutfleet.sim.engine`` for ``rolloutfleet_load``/``rolloutfleet_restore_draft``. The real
digest is computed by the one digest implementation of the project (``rolloutfleet.digest``, which
re-exports ``rolloutfleet_digest.digest_directory``) so a simulated engine reports exactly what
the GPU extension and ``rolloutfleet digest`` compute. Paths under the configured synthetic root are
never read: their digest is BLAKE3 of the path, their size is configured (see ``WeightsConfig``).

Validation mirrors the extension's error codes: ``invalid_path`` for relative paths, ``..`` components
and missing directories; ``io`` for a directory without ``*.safetensors`` files or a digest failure.
``scan_headers`` (the project's header scanner, with the worker's dtype rule) and ``matches_shared`` (the
worker's shared-tensor rule) serve the engine's pre-flight and the weight-transfer sessions
(``rolloutfleet.sim.transfer``), which take the simulated model's parameters from a checkpoint's headers.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from collections.abc import Callable
from typing import Any

import blake3

from rolloutfleet.sim.config import WeightsConfig


class LoadError(Exception):
    """A load that the extension would refuse or fail, with its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    path: str
    digest: str
    bytes: int
    tensors: int
    synthetic: bool


def synthetic_digest(path: str) -> str:
    return "blake3:" + blake3.blake3(path.encode()).hexdigest()


def digest_function() -> Callable[[str], str]:
    """The project's digest (``rolloutfleet.digest.digest_directory``), looked up when first needed.

    Looked up by name at run time so the simulator imports (and serves synthetic weights) before the
    digest module exists; ``rolloutfleet.digest`` is the only module allowed to reach into the worker
    package, so that is the name asked for first.
    """
    for module_name in ("rolloutfleet.digest", "rolloutfleet_digest"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, "digest_directory", None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    raise LoadError("io", "no digest implementation: rolloutfleet.digest.digest_directory is missing")


def _synthetic(path: str, config: WeightsConfig) -> bool:
    root = config.synthetic_root
    return bool(root) and (path == root or path.startswith(str(root).rstrip("/") + "/"))


def check_path(path: str, config: WeightsConfig) -> None:
    """The extension's ``check_path``: absolute, no ``..``, an existing directory (before any write)."""
    if not path or not path.startswith("/"):
        raise LoadError("invalid_path", f"path must be absolute: {path!r}")
    if ".." in path.split("/"):
        raise LoadError("invalid_path", f"path must not contain '..': {path!r}")
    if not _synthetic(path, config) and not pathlib.Path(path).is_dir():
        raise LoadError("invalid_path", f"no such directory: {path!r}")


def resolve(path: str, *, target: str, config: WeightsConfig) -> Checkpoint:
    """Validate ``path`` like the extension and describe what loading it would read."""
    check_path(path, config)
    if _synthetic(path, config):
        size = config.verifier_bytes if target == "verifier" else config.draft_bytes
        return Checkpoint(path, synthetic_digest(path), size, config.tensors, synthetic=True)
    directory = pathlib.Path(path)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LoadError("io", f"no *.safetensors files in {path}")
    try:
        digest = digest_function()(path)
        size = sum(f.stat().st_size for f in files)
    except LoadError:
        raise
    except Exception as exc:  # a corrupt header, an unreadable file: the extension reports "io"
        raise LoadError("io", f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    return Checkpoint(path, digest, size, _count_tensors(files), synthetic=False)


def _count_tensors(files: list[pathlib.Path]) -> int:
    import json
    import struct

    count = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            count += sum(1 for k in header if k != "__metadata__")
        except (OSError, ValueError, struct.error):
            continue
    return count


@dataclasses.dataclass
class Slot:
    """One model's weights in a simulated engine: what the extension claims and what memory holds.

    The claim (``revision``/``digest``/``path``/``verified``) follows ``rolloutfleet_worker.extension``:
    nothing is claimed for the weights ``vllm serve`` loaded at start-up, a load clears the claim first
    (fail closed), a level-2 sleep marks the slot ``lost`` until the next good load, and nothing is
    reported while the weights are unmapped (asleep). ``content`` is the truth the extension cannot see
    directly: ``(kind, path, revision)`` with kind ``initial``/``loaded``/``pushed``/``corrupt``/``partial``,
    or None when memory reads zero (after a level-2 sleep). Tokens and spec-decode acceptance derive from it.
    A pushed content's ``path`` is ``"push:" + digest`` of the bytes received (``rolloutfleet.sim.transfer``).

    Weight-transfer sessions add three flags (docs/push.md, ``rolloutfleet.sim.transfer``): ``on_meta`` —
    vLLM's layerwise reload holds the parameters on the ``meta`` device (from a session's start to its
    finish): no forward pass, no level-2 sleep; ``broken`` — a failed update left them there, until
    ``wake_up(tags=weights)`` (measured) or a restart; and ``destroyed`` — the extension's verdict on a
    failed, incomplete or abandoned push session, sticky until the engine restarts (as
    ``rolloutfleet_worker.extension``). A broken or destroyed target reports ``destroyed: true`` and no
    claim, and refuses loads.
    """

    content: tuple[str, str, int | None] | None
    revision: int | None = None
    digest: str | None = None
    path: str | None = None
    verified: bool = False
    lost: bool = False
    destroyed: bool = False
    broken: bool = False
    on_meta: bool = False

    @property
    def unusable(self) -> bool:
        """Reported ``destroyed``: the extension gave it up, or a failed update left it on ``meta``."""
        return self.destroyed or self.broken

    def report(self, mapped: bool) -> dict[str, object]:
        if not mapped or self.lost or self.unusable:
            return {"revision": None, "digest": None, "path": None, "verified": False, "destroyed": self.unusable}
        claim = {"revision": self.revision, "digest": self.digest, "path": self.path, "verified": self.verified}
        return {**claim, "destroyed": False}

    def unclaim(self) -> None:
        """Fail closed: nothing is claimed until a load or a session verifies the contents again."""
        self.revision, self.digest, self.path, self.verified = None, None, None, False

    def discard(self) -> None:
        """Level-2 sleep: memory is freed; after wake it reads zero and the claim is void."""
        self.content, self.lost, self.verified = None, True, False

    def begin_load(self, path: str, revision: int | None) -> None:
        self.revision, self.digest, self.path, self.verified, self.lost = None, None, None, False, False
        self.content = ("partial", path, revision)

    def finish_load(self, ckpt: Checkpoint, revision: int | None, digest: str) -> None:
        kind = "loaded" if digest == ckpt.digest else "corrupt"
        self.content = (kind, ckpt.path, revision)
        self.revision, self.digest, self.path, self.verified = revision, digest, ckpt.path, True

    @property
    def content_revision(self) -> int | None:
        return None if self.content is None else self.content[2]

    @property
    def good(self) -> bool:
        """Memory holds a whole checkpoint as published (not zeros, not half-written, not corrupt)."""
        return self.content is not None and self.content[0] in ("initial", "loaded", "pushed")


def same_checkpoint_generation(verifier: Slot, draft: Slot) -> bool:
    """A co-updated pair matches when both hold good content of the same revision (or both initial).

    Loaded and pushed content of one revision match (sources may be mixed, docs/push.md); a pushed content
    knows its revision only from ``rolloutfleet_push_begin`` (None for a bare vLLM session).
    """
    if not (verifier.good and draft.good):
        return False
    assert verifier.content is not None and draft.content is not None

    def generation(content: tuple[str, str, int | None]) -> tuple[str, int | None]:
        return ("initial", None) if content[0] == "initial" else ("revision", content[2])

    return generation(verifier.content) == generation(draft.content)


# What ``rolloutfleet_worker.loader_base.torch_dtype`` maps to a torch dtype: anything else fails with ``io``.
LOADABLE_DTYPES = frozenset(
    {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64", "C64"}
    | {"F8_E4M3", "F8_E5M2", "F8_E8M0"}
)


def _header_scanner() -> Callable[[str], list[Any]]:
    """The project's safetensors header scanner (``scan_directory``), looked up by name like the digest
    (``digest_function``): ``rolloutfleet.digest`` first, the one module that may reach the worker."""
    for module_name in ("rolloutfleet.digest", "rolloutfleet_digest"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, "scan_directory", None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    raise LoadError("io", "no header scanner: rolloutfleet_digest.scan_directory is missing")


def scan_headers(path: str) -> list[Any]:
    """Every tensor's header entry in ``path`` (``TensorInfo``), dtypes checked; ``io`` for what the worker
    would refuse (a missing or unreadable file, a corrupt or truncated header, a name twice, a dtype)."""
    scan = _header_scanner()
    try:
        infos = scan(path)
    except Exception as exc:  # CheckpointError: the extension answers "io" with its message
        raise LoadError("io", str(exc)) from exc
    for info in infos:
        if info.dtype not in LOADABLE_DTYPES:
            raise LoadError("io", f"{info.file}: dtype {info.dtype!r} not supported by this torch")
    return infos


def matches_shared(tensor_name: str, shared: tuple[str, ...]) -> bool:
    """``rolloutfleet_worker.models.matches_shared``: whether a checkpoint tensor lands in a shared parameter
    (names compared with ``model.`` prefixes stripped; a dotted suffix of two components or more matches)."""

    def strip(name: str) -> str:
        while name.startswith("model."):
            name = name[len("model.") :]
        return name

    a = strip(tensor_name)
    for s in shared:
        b = strip(s)
        if a == b:
            return True
        shorter, longer = (a, b) if len(a) < len(b) else (b, a)
        if shorter.count(".") >= 1 and longer.endswith("." + shorter):
            return True
    return False
