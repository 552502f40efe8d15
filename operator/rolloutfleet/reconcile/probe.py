"""The parity probe: processed logprobs of the canaries against the trainer's reference.

Called by ``reconcile.rollout_pass`` once every canary serves the revision. Owns the probe's requests
(each with the fleet's ``verifySeconds`` deadline) and the verdict per canary. Two outcomes differ on
purpose: a logprob mismatch is a property of the weights (no retry: the revision rolls back), while an
engine that did not answer the probe is a failed attempt like any failed step (retried within
``maxRetries``), so one dropped connection does not roll a good revision back.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence

from rolloutfleet.adapters import engine_wire
from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.api.revision import ParityProbe, ParityProbeResult
from rolloutfleet.planning import verification


@dataclasses.dataclass(frozen=True)
class CanaryVerdict:
    """One canary's probe: the largest difference seen, and why it failed (None: it passed)."""

    pod: str
    worst: float
    why: str | None
    engine_error: bool  # the engine did not answer usably (retried), as opposed to a mismatch


async def run(
    probe: ParityProbe, canaries: Sequence[str], clients: Mapping[str, EngineClient], deadline: float
) -> tuple[ParityProbeResult, list[CanaryVerdict]]:
    """Probe every canary concurrently; the summary for the status and the per-canary verdicts."""
    expected = list(probe.expected_logprobs)

    async def one(pod: str) -> CanaryVerdict:
        try:
            seen = await clients[pod].greedy_logprobs(probe.prompt_token_ids, len(expected), deadline=deadline)
        except engine_wire.EngineError as exc:
            return CanaryVerdict(pod, float("inf"), f"{type(exc).__name__}: {exc}", engine_error=True)
        worst, why = verification.probe_verdict(expected, seen, probe.tolerance)
        return CanaryVerdict(pod, worst, why, engine_error=False)

    verdicts = await asyncio.gather(*(one(p) for p in canaries))
    worst = max((v.worst for v in verdicts), default=0.0)
    failures = [v for v in verdicts if v.why is not None]
    message = "; ".join(f"{v.pod}: {v.why}" for v in failures) or f"{len(canaries)} canaries match"
    result = ParityProbeResult(
        passed=not failures,
        max_abs_diff=None if worst == float("inf") else round(worst, 6),
        tolerance=probe.tolerance,
        pods=list(canaries),
        message=message[:1024],
    )
    return result, list(verdicts)
