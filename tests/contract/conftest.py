"""Fixtures of the engine contract suite: one engine to test, simulated by default, real vLLM on demand.

By default every test gets a fresh simulated engine (``rolloutfleet.sim``) on 127.0.0.1 with a draft
(policy ``coUpdate``), sleep mode enabled, a bearer token, and four small safetensors checkpoints written
into a tmp dir. To run the same assertions against a real vLLM (the GPU tier, shared/gpu/README.md):

    ROLLOUTFLEET_CONTRACT_URL=http://127.0.0.1:8000     the engine (our image: extension + auth middleware)
    ROLLOUTFLEET_CONTRACT_TOKEN=...                      the control token it was started with
    ROLLOUTFLEET_CONTRACT_WEIGHTS=/path                   holding verifier-a, verifier-b, draft-a, draft-b:
                                                         safetensors dirs of the served shapes, where the
                                                         draft-X proposes what verifier-X predicts.

    ROLLOUTFLEET_CONTRACT_TRANSFER=ipc|nccl               the engine's --weight-transfer-config backend
                                                         (unset: it was started without the flag)
    ROLLOUTFLEET_CONTRACT_PLAIN_URL=...                  optional: an engine started without the flag
    ROLLOUTFLEET_CONTRACT_SENDER=ipc                     this process shares the engine's GPU and sends CUDA
                                                         IPC handles (the engine: VLLM_ALLOW_INSECURE_SERIALIZATION=1)

The simulated engine is started with ``--weight-transfer-config '{"backend": "ipc"}'`` and sends through
the simulator's transport; a second simulated engine, without the flag, plays the plain one.

The real engine is shared by all tests, so each test leaves it awake and resumed (``restore`` fixture).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import AsyncIterator

import pytest
from contract_support import TOKEN, IpcSender, SimulatedSender, Target, Weights, write_checkpoint

from rolloutfleet.adapters.engine import EngineClient, EnginePool, ResetPolicy, RetryPolicy
from rolloutfleet.sim import EngineSpec, Latencies, SimulatedFleet


def _target_id(release: str) -> str:
    """``sim-vllm0.33``/``sim-vllm0.26``; against a real engine (``ROLLOUTFLEET_CONTRACT_URL``) the one that runs is
    ``real-engine``, so that a GPU run's log does not read as the simulator's."""
    if os.environ.get("ROLLOUTFLEET_CONTRACT_URL"):
        return "real-engine" if release == "0.33" else "real-engine-once"
    return f"sim-vllm{release}"


# The simulator plays both vLLM releases the project meets: 0.33 (the image) and 0.26 (the lent GPU).
@pytest.fixture(params=["0.33", "0.26"], ids=_target_id)
async def target(tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    url = os.environ.get("ROLLOUTFLEET_CONTRACT_URL")
    if url:
        if request.param != "0.33":
            pytest.skip("a real engine is one release: the suite runs against it once")
        root = pathlib.Path(os.environ["ROLLOUTFLEET_CONTRACT_WEIGHTS"])
        weights = Weights(*(str(root / n) for n in ("verifier-a", "verifier-b", "draft-a", "draft-b")), empty=None)
        transfer = os.environ.get("ROLLOUTFLEET_CONTRACT_TRANSFER") or None
        plain = os.environ.get("ROLLOUTFLEET_CONTRACT_PLAIN_URL") or (url if transfer is None else None)
        sender = IpcSender() if os.environ.get("ROLLOUTFLEET_CONTRACT_SENDER") == "ipc" else None
        token = os.environ["ROLLOUTFLEET_CONTRACT_TOKEN"]
        yield Target(url, token, weights, real=True, transfer=transfer, plain_url=plain, sender=sender)
        return
    (tmp_path / "empty").mkdir()
    weights = Weights(
        verifier_a=write_checkpoint(tmp_path / "verifier-a", 1),
        verifier_b=write_checkpoint(tmp_path / "verifier-b", 2),
        draft_a=write_checkpoint(tmp_path / "draft-a", 1, layers=1),
        draft_b=write_checkpoint(tmp_path / "draft-b", 2, layers=1),
        empty=str(tmp_path / "empty"),
    )
    spec = EngineSpec(
        verifier_path=weights.verifier_a,
        draft_path=weights.draft_a,
        draft_policy="coUpdate",
        vllm_version=request.param,
        weight_transfer={"backend": "ipc"},
    )
    # A finite generation speed, as on a GPU: a long request is still running when a test pauses. Staging
    # takes a while too, as reading gigabytes does: a test sees the engine serve while it stages.
    latencies = Latencies(token_s=0.001, stage_s=0.1)
    async with SimulatedFleet(token=TOKEN, spec=spec, latencies=latencies) as fleet:
        engine = await fleet.add("127.0.0.1", 0)
        plain = await fleet.add("127.0.0.2", 0, spec=dataclasses.replace(spec, weight_transfer=None))
        sender = SimulatedSender()
        yield Target(engine.url, TOKEN, weights, real=False, transfer="ipc", plain_url=plain.url, sender=sender)


@pytest.fixture
async def pool(target: Target) -> AsyncIterator[EnginePool]:
    async with EnginePool(
        token=target.token, retry=RetryPolicy(attempts=2, base_delay=0.01), reset=ResetPolicy(attempts=50)
    ) as p:
        yield p


@pytest.fixture
async def engine(target: Target, pool: EnginePool) -> AsyncIterator[EngineClient]:
    """The client of the engine under test; afterwards the engine is left awake and resumed."""
    client = pool.client(target.url)
    yield client
    # Wake only what sleeps, by tag: a tag-less wake after a weights-only wake kills vLLM 0.26's engine
    # (CUDA "invalid argument" in cumem_allocator, measured on the H200).
    if (await client.observe()).mapped is False:
        await client.wake_up(["weights"])
    await client.wake_up(["kv_cache"])
    await client.resume()
