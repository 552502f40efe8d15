"""Shared pytest configuration: every test under tests/unit is a `unit` test unless marked otherwise, and
tests marked `both_loops` run once on asyncio's event loop and once on uvloop's (the operator's)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Callable, Mapping

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts and parts[0] == "unit" and not any(m.name == "unit" for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """`both_loops`: the code the operator runs on uvloop (handlers/event_loop.py), tested on it too, and on
    asyncio's loop, which ``ROLLOUTFLEET_EVENT_LOOP=asyncio`` selects. uvloop is a dev dependency through the
    operator's own: its absence here is a broken environment, not a reason to skip."""
    if item.get_closest_marker("both_loops") is None:
        return {"asyncio": asyncio.new_event_loop}  # pytest-asyncio's own default (a mapping is required)
    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
