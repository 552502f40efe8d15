"""Shared pytest configuration: make every test under tests/unit a `unit` test unless marked otherwise."""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts and parts[0] == "unit" and not any(m.name == "unit" for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)
