"""Simulated engines for operator integration tests: a pod follower on a background event loop,
tiny real safetensors checkpoints, and call-log analysis (order, barrier, concurrency, mixed pairs)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
from kubernetes import client
from safetensors.numpy import save_file

from rolloutfleet.sim.config import Latencies, WeightsConfig
from rolloutfleet.sim.follower import PodFollower

T = TypeVar("T")


def write_checkpoint(directory: pathlib.Path, seed: int, tensors: int = 3) -> pathlib.Path:
    """A small real checkpoint whose content depends on ``seed``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file(
        {f"layers.{i}.weight": rng.standard_normal((16, 16)).astype(np.float32) for i in range(tensors)},
        str(directory / "model.safetensors"),
    )
    return directory


class FollowerThread:
    """Runs a ``PodFollower`` on its own event loop in a daemon thread."""

    def __init__(self, api: client.ApiClient, namespace: str, fleet: str, latencies: Latencies | None = None) -> None:
        if os.environ.get("ROLLOUTFLEET_TEST_LOOPBACK_PODS") == "0":
            # On kind (or any real cluster) pod IPs are private-range: never listened on or dialled here.
            pytest.skip("simulated engines need loopback pod IPs (the local control plane)")
        self.loop = asyncio.new_event_loop()
        self.follower = PodFollower(
            api,
            namespace,
            fleet,
            weights=WeightsConfig(synthetic_root=None),
            latencies=latencies or Latencies(),
            interval=0.2,
        )
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"follower-{fleet}")
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self.follower.run(), self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def engines(self) -> int:
        async def count() -> int:
            return 0 if self.follower.sim is None else len(self.follower.sim.engines)

        return self.call(count())

    def logs(self) -> dict[str, list[dict[str, Any]]]:
        async def read() -> dict[str, list[dict[str, Any]]]:
            sim = self.follower.sim
            return {} if sim is None else {k: list(e.log.entries) for k, e in sim.engines.items()}

        return self.call(read())

    def stop(self) -> None:
        """Cancel the follower, close every engine's listener, then stop the loop (ports are free after)."""

        async def shutdown() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            if self.follower.sim is not None:
                await self.follower.sim.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def ok_calls(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """State-changing calls that succeeded (status 200), in order."""
    return [e for e in log if e.get("status") == 200]


def step_names(log: list[dict[str, Any]]) -> list[str]:
    return [str(e.get("key") or e["step"]) for e in ok_calls(log)]


def out_of_service_intervals(log: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(pause, resume) time pairs of one engine."""
    out, start = [], None
    for e in ok_calls(log):
        name = str(e.get("key") or e["step"])
        if name.startswith("pause") and start is None:  # "pause:keep"
            start = e["t"]
        elif name.startswith("resume") and start is not None:
            out.append((start, e["t"]))
            start = None
    return out


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda x: (x[0], x[1]))
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


async def _traffic(follower: PodFollower, stop: asyncio.Event, period: float) -> int:
    """Send small completions round-robin to every engine until ``stop``; returns how many were sent."""
    import aiohttp

    sent = 0
    async with aiohttp.ClientSession(trust_env=False) as session:
        while not stop.is_set():
            sim = follower.sim
            engines = list(sim.engines.values()) if sim is not None else []
            for engine in engines:
                body = {"model": "policy", "prompt": [1, 2, 3], "max_tokens": 4, "return_weight_versions": True}
                try:
                    async with session.post(
                        f"{engine.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=2)
                    ) as resp:
                        await resp.read()
                        sent += 1
                except (aiohttp.ClientError, TimeoutError):
                    pass  # paused/aborted/crashed engines refuse or drop: that is the point
            await asyncio.sleep(period)
    return sent


class Traffic:
    """Generation traffic to every engine of a follower, for the 'never a mixed pair' checks."""

    def __init__(self, follower: FollowerThread, period: float = 0.05) -> None:
        self._follower = follower
        self._stop = asyncio.Event()
        self._future = asyncio.run_coroutine_threadsafe(self._start(period), follower.loop)

    async def _start(self, period: float) -> int:
        return await _traffic(self._follower.follower, self._stop, period)

    def stop(self) -> int:
        self._follower.loop.call_soon_threadsafe(self._stop.set)
        return int(self._future.result(timeout=30))


def served(logs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every completion the engines served, with the pair(s) that generated it."""
    out = []
    for log in logs.values():
        for entry in log:
            result = entry.get("result")
            if entry.get("step") == "completions" and entry.get("status") == 200 and isinstance(result, dict):
                out.append(result)
    return out
