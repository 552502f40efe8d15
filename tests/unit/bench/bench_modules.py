"""Loads a bench script (``bench/*.py``, not a package) as a module, for the bench's unit tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


def load(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``name`` (registered, so dataclasses and pickling find it)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
