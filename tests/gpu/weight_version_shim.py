"""Test-only stand-in for vLLM's weight-version routes where the engine lacks them (vLLM 0.26).

vLLM 0.26.0, the newest release on the lent H200's torch, has no ``POST /update_weight_version``, no
``GET /weight_info`` and no ``return_weight_versions`` (they arrived later; the image's 0.33 has them).
The operator's ``EngineClient.observe()`` reads ``/weight_info``, so on 0.26 every observe raises
``EngineHTTPError(404)`` and the per-pod transaction cannot run at all. That gap is reported to the
integrator; this module does NOT hide it from the plain contract run. It lets the GPU tier exercise
everything else of the real transaction on 0.26: when (and only when) the engine answers 404 on those two
routes, the version is kept here, per engine URL, exactly as the engine would keep it.

Used two ways: as a pytest plugin (``-p weight_version_shim``: the contract suite's second run) and by
``tests/gpu`` fixtures through ``install()``. ``FALLBACKS`` counts how often the stand-in answered.
"""

from __future__ import annotations

from typing import Any

from rolloutfleet.adapters import engine as engine_mod
from rolloutfleet.adapters.engine_wire import EngineHTTPError

_VERSIONS: dict[str, str | None] = {}
FALLBACKS: dict[str, int] = {"weight_info": 0, "update_weight_version": 0}
_installed = False


def install() -> None:
    """Patch ``EngineClient`` so a 404 on the weight-version routes falls back to a per-URL record."""
    global _installed
    if _installed:
        return
    original_info = engine_mod.EngineClient.weight_info
    original_update = engine_mod.EngineClient.update_weight_version

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

    engine_mod.EngineClient.weight_info = weight_info  # type: ignore[method-assign]
    engine_mod.EngineClient.update_weight_version = update_weight_version  # type: ignore[method-assign]
    _installed = True


def pytest_configure(config: Any) -> None:
    """As a plugin (``-p weight_version_shim``): install before any test runs."""
    install()
