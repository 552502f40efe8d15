"""The operator's start-up handler (``handlers.wiring.configure``): it leaves nothing running when it fails, and it
sets no kopf setting by a deprecated name.

kopf runs a start-up handler that raised again. What ``configure`` starts that outlives it (the collector clock in
``gc.callbacks``, the event loop's lag watch) is started last, after everything that can fail (the metrics port,
the cluster credentials): started before, each failed attempt left one more of them running, never removed, beside
the attempt that succeeded (a second clock timing every collection, a second watch sampling twice a second).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import pathlib
import warnings

import kopf
import pytest

from rolloutfleet.handlers import wiring

pytestmark = pytest.mark.unit


async def test_a_start_up_that_fails_starts_neither_the_collector_clock_nor_the_lag_watch(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))  # no credentials: the client refuses
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv(wiring.METRICS_PORT_ENV, raising=False)
    memo = kopf.Memo()
    callbacks, tasks = list(gc.callbacks), asyncio.all_tasks()
    with pytest.raises(Exception, match=r"(?i)config"):
        await wiring.configure(settings=kopf.OperatorSettings(), memo=memo, logger=logging.getLogger(__name__))
    assert gc.callbacks == callbacks
    assert asyncio.all_tasks() == tasks
    assert not hasattr(memo, "lag_watch") and not hasattr(memo, "gc_clock")


async def test_the_kopf_settings_use_no_deprecated_name(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf 1.45 kept ``settings.batching`` only as a deprecated alias of ``settings.queueing`` (a warning in every
    operator's start-up log); a kopf that drops the alias would fail the start-up instead. The settings are set
    before the credentials are loaded, so the failing start-up above goes through all of them."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv(wiring.METRICS_PORT_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match=r"(?i)config"):
            await wiring.configure(
                settings=kopf.OperatorSettings(), memo=kopf.Memo(), logger=logging.getLogger(__name__)
            )
    # (kopf warns from its own module: its settings' deprecated names carry no stack level)
    kopf_dir = str(pathlib.Path(kopf.__file__).parent)
    from_kopf = [w for w in caught if issubclass(w.category, DeprecationWarning) and w.filename.startswith(kopf_dir)]
    assert not from_kopf, [str(w.message) for w in from_kopf]
