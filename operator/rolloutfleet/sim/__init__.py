"""Simulated vLLM engines (GPU-free) that speak the engine contract of DESIGN.md §4.

Used by the contract suite (``tests/contract``), the engine-client tests, the WeightRevision integration
tests, the sandbox demo (``rolloutfleet sim serve``) and the benchmarks. Nothing here touches a GPU,
torch or vLLM; every engine is *simulated* and says so in its names.

- ``fleet.SimulatedFleet``: many engines in one process, each on its own loopback ``IP:port``, plus the
  admin API (faults, call logs, crash/restart).
- ``server.SimulatedEngine``: one engine's HTTP surface (vLLM routes + our auth middleware + faults).
- ``engine.EngineCore``: its state machine (pause/sleep/wake/load/complete/metrics) and call log.
- ``transfer``: vLLM's weight-transfer sessions and our extension's push RPCs, over a SIMULATED transport
  (the tensors' bytes inline: no CUDA IPC, no NCCL); ``transfer_http``: vLLM's session routes.
- ``staging``: staged updates (docs/staging.md): a background stage of the next revision's checkpoints,
  and its commit by a staged load.
- ``config``: ``EngineSpec``, ``Latencies``, ``FaultRule``, ``WeightsConfig`` (synthetic weights).
- ``commands``: ``rolloutfleet sim serve``.
"""

from rolloutfleet.sim.config import EngineSpec, FaultKind, FaultRule, Latencies, WeightsConfig
from rolloutfleet.sim.fleet import SimulatedFleet
from rolloutfleet.sim.server import SimulatedEngine

__all__ = ["EngineSpec", "FaultKind", "FaultRule", "Latencies", "SimulatedEngine", "SimulatedFleet", "WeightsConfig"]
