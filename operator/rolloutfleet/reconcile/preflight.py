"""Pre-flight: before any pod leaves service for a revision, the engines check its checkpoints.

Called by ``reconcile.rollout_pass`` once per revision, before its first step (``check_then_read``: each
engine's pre-flight and then its first read of the pass, in one request where the image takes an observation
among a sequence's calls). Each engine is asked
(``rolloutfleet_preflight``, headers and sizes only, no tensor bytes) whether its load of the verifier and
draft could succeed: every file there, readable under the fleet's allowed roots, enough elements for the
model. A checkpoint that is missing, unreadable or too small for the model is found while every pod still
serves, and the revision fails with zero pods touched (before, the demo's missing checkpoint took the whole
AllAtOnce fleet out of service for 6.7 s: sleep, fail, reload the previous revision).

Only answers about the checkpoint count: an engine that cannot be reached, or an older image without the
RPC, is left to the transaction itself (which verifies everything again anyway).
"""

from __future__ import annotations

import dataclasses
import logging

from rolloutfleet.adapters import engine_wire
from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.api.engine import EngineState, PreflightResult, Target
from rolloutfleet.planning.transaction import Goal

log = logging.getLogger(__name__)
# The extension's answers that say the checkpoint cannot be loaded (worker_image/README.md).
CHECKPOINT_CODES = frozenset({"invalid_path", "io", "incomplete", "no_draft", "invalid_target"})


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One engine's reason why a target's checkpoint cannot be loaded."""

    pod: str
    target: Target
    code: str
    message: str


def targets(goal: Goal) -> list[tuple[Target, str]]:
    """The checkpoints of ``goal`` an engine can check: (target, path); pushed targets have none (the
    trainer's digest and the session verify them)."""
    out: list[tuple[Target, str]] = [(Target.VERIFIER, goal.verifier_path)] if goal.verifier_path else []
    if goal.draft_path is not None:
        out.append((Target.DRAFT, goal.draft_path))
    return out


async def check_pod(pod: str, client: EngineClient, checks: list[tuple[Target, str]], deadline: float) -> list[Refusal]:
    """One engine's refusals of ``checks`` (``targets``); both in one request where it can."""
    if not checks:
        return []
    return _refusals(pod, checks, await client.preflights(checks, deadline=deadline))


def _refusals(
    pod: str, checks: list[tuple[Target, str]], answers: list[PreflightResult | engine_wire.EngineError]
) -> list[Refusal]:
    """The refusals among one engine's pre-flight answers; anything not conclusive is logged, not refused."""
    refusals = []
    for (target, _), answer in zip(checks, answers, strict=True):
        if isinstance(answer, engine_wire.EngineRPCError):
            if answer.code in CHECKPOINT_CODES:
                refusals.append(Refusal(pod, target, answer.code, answer.message))
            else:
                log.info("pod %s: pre-flight of the %s not conclusive: %s", pod, target, answer)
        elif isinstance(answer, engine_wire.EngineError):  # unreachable, an older image (no such RPC), a 500
            log.info("pod %s: no pre-flight of the %s: %s", pod, target, answer)
    return refusals


async def check_then_read(
    pod: str, client: EngineClient, checks: list[tuple[Target, str]], deadline: float
) -> tuple[list[Refusal], EngineState]:
    """``check_pod``, then what the engine holds (its first read of the pass), in one request where it can
    (``EngineClient.preflights_then_observe``)."""
    if not checks:
        return [], await client.observe()
    answers, state = await client.preflights_then_observe(checks, deadline=deadline)
    return _refusals(pod, checks, answers), state


def summary(refusals: list[Refusal], total: int) -> str:
    """One line: each distinct refusal once, with how many engines gave it."""
    seen: dict[tuple[Target, str, str], list[str]] = {}
    for r in refusals:
        seen.setdefault((r.target, r.code, r.message), []).append(r.pod)
    parts = [
        f"{target.value} checkpoint refused by {len(pods)}/{total} engines ({code}): {message}"
        for (target, code, message), pods in seen.items()
    ]
    return "; ".join(parts)[:1024]
