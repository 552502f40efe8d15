"""Fixtures of the GPU tier (marker ``gpu``): tiny revisions, one real vLLM for the session, a recorder.

Runs only on a machine with CUDA and vLLM (the lent H200, see docs/gpu.md); anywhere else every test is
skipped at set-up. The session starts vLLM once (verifier-a + draft-a, DESIGN.md §4 flags) and captures
the outputs of the fresh server before any test touches it; each test leaves the engine awake and
resumed. Measurements go to ``$ROLLOUTFLEET_GPU_RESULTS/gpu-suite.json`` (default: the session tmp dir)
and the server log to ``vllm-suite.log`` beside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import gpu_support
import pytest

from rolloutfleet.adapters.engine import EngineClient, EnginePool, ResetPolicy, RetryPolicy
from rolloutfleet_digest import digest_directory


def _gpu_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable"
    if importlib.util.find_spec("torch") is None:
        return "torch is not importable"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = pathlib.Path(os.environ.get("ROLLOUTFLEET_GPU_RESULTS") or tmp_path_factory.mktemp("gpu-results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def record(results_dir: pathlib.Path) -> Iterator[dict[str, Any]]:
    """A dict the tests fill with measurements; written as gpu-suite.json at the end of the session."""
    data: dict[str, Any] = {}
    yield data
    (results_dir / "gpu-suite.json").write_text(json.dumps(data, indent=1, default=str))


@pytest.fixture(scope="session")
def revisions(tmp_path_factory: pytest.TempPathFactory) -> gpu_support.Revisions:
    missing = _gpu_missing()
    if missing:
        pytest.skip(missing)
    return gpu_support.make_tiny_revisions(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="session")
def digests(revisions: gpu_support.Revisions) -> dict[str, str]:
    """The publisher's digests of the four revision directories (``rolloutfleet digest``, no GPU)."""
    paths = (revisions.verifier_a, revisions.verifier_b, revisions.draft_a, revisions.draft_b)
    return {p: digest_directory(p) for p in paths}


@pytest.fixture(scope="session")
def server(
    revisions: gpu_support.Revisions,
    results_dir: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
    record: dict[str, Any],
) -> Iterator[gpu_support.Server]:
    srv = gpu_support.start_server(
        revisions.verifier_a,
        revisions.draft_a,
        tmp_path_factory.mktemp("vllm"),
        results_dir / "vllm-suite.log",
        gpu_memory_utilization=0.2,
    )
    try:
        import vllm

        record["vllm_version"] = vllm.__version__
        record["server_start_s"] = round(srv.started_s, 1)
        # The fresh server's outputs (weights loaded by vLLM itself), before any test changes anything.
        record["fresh_outputs_a"] = gpu_support.generate_sync(srv.url, gpu_support.prompts())
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def pool(server: gpu_support.Server) -> AsyncIterator[EnginePool]:
    async with EnginePool(
        token=server.token, retry=RetryPolicy(attempts=2, base_delay=0.05), reset=ResetPolicy(attempts=50)
    ) as p:
        yield p


@pytest.fixture
async def engine(server: gpu_support.Server, pool: EnginePool) -> AsyncIterator[EngineClient]:
    """The operator's client for the session's engine; afterwards the engine is awake and resumed."""
    client = pool.client(server.url)
    yield client
    await client.wake_up()
    await client.resume()
