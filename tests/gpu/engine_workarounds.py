"""Test-only workarounds for two gaps of vLLM 0.26 that would otherwise stop the GPU tier.

1. Weight versions.
vLLM 0.26.0, the newest release on the lent H200's torch, has no ``POST /update_weight_version``, no
``GET /weight_info`` and no ``return_weight_versions`` (they arrived later; the image's 0.33 has them).
The operator's ``EngineClient.observe()`` reads ``/weight_info``, so on 0.26 every observe raises
``EngineHTTPError(404)`` and the per-pod transaction cannot run at all. That gap is reported to the
integrator; this module does NOT hide it from the plain contract run. It lets the GPU tier exercise
everything else of the real transaction on 0.26: when (and only when) the engine answers 404 on those two
routes, the version is kept here, per engine URL, exactly as the engine would keep it.

2. ``wake_up()`` without tags after a partial wake. After sleep(2) + wake_up(tags=weights), vLLM 0.26's
executor passes ``tags=None`` to the workers, whose CuMemAllocator maps every handle again, including
the weights already mapped: ``CUDA Error: invalid argument at cumem_allocator.cpp:169``, HTTP 500, and
the engine core is dead from then on (measured on the H200; the simulator accepts it). The operator's
executor always wakes by tag; the contract suite's fixture does not, so here a tag-less wake becomes
``weights`` then ``kv_cache`` (each a no-op where already awake), which is what the fixture means.

Used two ways: as a pytest plugin (``-p engine_workarounds``: the contract suite's run) and by
``tests/gpu`` fixtures and the benchmark through ``install()``. ``FALLBACKS`` counts how often each
workaround acted.
"""

from __future__ import annotations

from typing import Any

from rolloutfleet.adapters import engine as engine_mod
from rolloutfleet.adapters.engine_wire import EngineHTTPError

_VERSIONS: dict[str, str | None] = {}
FALLBACKS: dict[str, int] = {"weight_info": 0, "update_weight_version": 0, "wake_up_without_tags": 0}
_installed = False


def install() -> None:
    """Patch ``EngineClient``: weight-version routes fall back on 404; a tag-less wake wakes tag by tag."""
    global _installed
    if _installed:
        return
    original_info = engine_mod.EngineClient.weight_info
    original_update = engine_mod.EngineClient.update_weight_version
    original_wake = engine_mod.EngineClient.wake_up

    async def weight_info(self: engine_mod.EngineClient) -> str | None:
        try:
            return await original_info(self)
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
            FALLBACKS["weight_info"] += 1
            return _VERSIONS.get(self.base_url)

    async def update_weight_version(self: engine_mod.EngineClient, version: str) -> None:
        try:
            await original_update(self, version)
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
            FALLBACKS["update_weight_version"] += 1
            _VERSIONS[self.base_url] = version

    async def wake_up(self: engine_mod.EngineClient, tags: Any = None) -> None:
        if tags:
            await original_wake(self, tags)
            return
        FALLBACKS["wake_up_without_tags"] += 1
        await original_wake(self, ["weights"])
        await original_wake(self, ["kv_cache"])

    engine_mod.EngineClient.wake_up = wake_up  # type: ignore[method-assign]
    engine_mod.EngineClient.weight_info = weight_info  # type: ignore[method-assign]
    engine_mod.EngineClient.update_weight_version = update_weight_version  # type: ignore[method-assign]
    _installed = True


def pytest_configure(config: Any) -> None:
    """As a plugin (``-p engine_workarounds``): install before any test runs."""
    install()
