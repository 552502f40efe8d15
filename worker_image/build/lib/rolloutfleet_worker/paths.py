"""Which checkpoint directories and files the worker may read: ROLLOUTFLEET_WEIGHT_ROOTS and path hygiene.

Called by ``rolloutfleet_worker.extension`` (before a load or a pre-flight: resolve the directory once and
check it) and by ``rolloutfleet_worker.loader_base`` (each file opened must lie under the same roots). Owns
the rule itself; no torch, no vLLM, so the extension imports it at module level.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Final

ROOTS_ENV: Final = "ROLLOUTFLEET_WEIGHT_ROOTS"


class PathRefusedError(Exception):
    """A checkpoint path the worker will not load from; the message says why."""


def weight_roots() -> tuple[str, ...]:
    """The resolved allowed roots from ROLLOUTFLEET_WEIGHT_ROOTS; empty (anything goes) when unset.

    The operator always sets it (worker_image/README.md); the unrestricted default is for engines
    started by hand.
    """
    return tuple(os.path.realpath(r) for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r)


def under_roots(real: str, roots: tuple[str, ...]) -> bool:
    """Whether resolved path ``real`` is one of the resolved ``roots`` or inside one."""
    for root in roots:
        try:
            if os.path.commonpath([real, root]) == root:
                return True
        except ValueError:  # a relative path against an absolute root: never inside
            continue
    return False


def resolve(path: object) -> str:
    """The resolved directory to load ``path`` from; PathRefusedError when it may not be loaded.

    Symlinks are resolved once, here, and the load reads from the result, so the directory checked
    against the roots is the one read (the loader checks each file it opens as well).
    """
    if not isinstance(path, str) or not path:
        raise PathRefusedError("path must be a non-empty string")
    if any(unicodedata.category(c) == "Cc" for c in path):
        # NUL truncates C paths and line breaks forge log lines: no checkpoint is named like that.
        raise PathRefusedError(f"path must not contain control characters: {path!r}")
    if not Path(path).is_absolute():
        raise PathRefusedError(f"path must be absolute: {path!r}")
    if ".." in path.split("/"):
        raise PathRefusedError(f"path must not contain '..': {path!r}")
    real = os.path.realpath(path)
    roots = weight_roots()
    if roots and not under_roots(real, roots):
        raise PathRefusedError(f"path {path!r} is outside the allowed weight roots {list(roots)}")
    if not Path(real).is_dir():
        raise PathRefusedError(f"no such directory: {path!r}")
    return real


def first_file(real: str) -> Path | None:
    """The resolved first ``*.safetensors`` file of directory ``real`` when it lies under the roots.

    For the page-locking probe, which maps a page of it before the load checks anything else.
    """
    first = next(iter(sorted(Path(real).glob("*.safetensors"))), None)
    if first is None:
        return None
    resolved = os.path.realpath(first)
    roots = weight_roots()
    if roots and not under_roots(resolved, roots):
        return None  # the load refuses such a file itself, with a message naming it
    return Path(resolved)
