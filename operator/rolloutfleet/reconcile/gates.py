"""The engine pods' readiness gate: a pod receives traffic only while it serves the fleet's verified pair.

Called by ``reconcile.rollout_pass`` (before a pause, after a resume, at the end of every pass; AllAtOnce:
beside the pauses and the resumes) and by ``reconcile.revision`` for fleets still on their initial weights.
Owns two switches per pod, always moved together (``open_for``/``close_for``; an AllAtOnce pass writes the
gate beside the engine call that moves the admission):

- the condition ``rolloutfleet.io/weights-ready`` (``resources.children`` puts the gate in the pod
  template): the kubelet marks a pod Ready only when its containers are ready *and* this is True;
- the engine process's admission (worker_image/README.md): the readiness probe asks the engine, which
  answers ready only once the operator admitted *this process*. A container that restarts on the initial
  checkpoint starts un-admitted, so it is not Ready even while the gate (set for its predecessor) is True.

So a pod that restarted, is paused mid-update, or holds anything unverified is not behind the Service.
``planning.pod_readiness`` reads the same rule back from a pod, for the rollout budget and the status.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from rolloutfleet.adapters import engine_wire
from rolloutfleet.adapters.engine import EngineClient
from rolloutfleet.adapters.kube import KubeError
from rolloutfleet.api.engine import EngineState
from rolloutfleet.planning import pod_readiness, transaction
from rolloutfleet.planning.transaction import Goal
from rolloutfleet.reconcile.context import OperatorContext
from rolloutfleet.resources import labels

Manifest = dict[str, Any]
CONDITION = labels.WEIGHTS_READY_CONDITION
log = logging.getLogger(__name__)


gate_value = pod_readiness.gate_value


def serves(state: EngineState, goals: list[Goal]) -> bool:
    """The engine is in service and holds one of ``goals``' pairs, verified and stamped."""
    return state.serving and any(transaction.at_goal(goal, state) for goal in goals)


def serves_initial(state: EngineState, goal: Goal | None) -> bool:
    """A fleet on its initial weights: the engine serves what it started with and has loaded nothing since
    (the initial checkpoint has no digest to check: it is what ``vllm serve`` was given)."""
    if not state.serving or state.verifier.revision not in (None, transaction.INITIAL_REVISION):
        return False
    return goal is None or transaction.engine_mismatch(goal, state) is None


async def set_gate(ctx: OperatorContext, pod: Manifest, value: bool, reason: str, message: str) -> bool:
    """Set the gate on ``pod`` when it differs from what the pod shows; True when written.

    A pod deleted or replaced meanwhile is skipped: its replacement starts with the gate unset (not Ready).
    """
    if gate_value(pod) == value:
        return False
    meta = pod["metadata"]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": CONDITION,
        "status": "True" if value else "False",
        "reason": reason,
        "message": message[:256],
        "lastTransitionTime": now,
    }
    try:
        await ctx.kube.patch_pod_condition(meta["namespace"], meta["name"], condition, uid=meta.get("uid"))
    except KubeError as exc:
        # 404: deleted; 409/422: replaced by a pod of the same name (another uid), which starts with the
        # gate unset: it is not the pod this decision was made for.
        if exc.status in (404, 409, 422):
            return False
        raise
    conditions = [c for c in (pod.setdefault("status", {}).get("conditions") or []) if c.get("type") != CONDITION]
    pod["status"]["conditions"] = [*conditions, condition]
    return True


async def open_for(
    ctx: OperatorContext, pod: Manifest, client: EngineClient, state: EngineState, reason: str, message: str
) -> EngineState:
    """Route traffic to the pod: its gate True, and its engine process admitted (the readiness probe).

    Returns the state with what the engine now says of its admission. An engine error is logged and left
    to the next sync (the pod simply stays out of the Service meanwhile: fail-closed).
    """
    await set_gate(ctx, pod, True, reason, message)
    if state.admitted is False:
        try:
            await client.admit(state.verifier.revision, instance=state.instance)
        except engine_wire.EngineHTTPError as exc:
            if exc.status != 409:
                log.warning("pod %s: not admitted: %s", pod["metadata"]["name"], exc)
                return state
            # Another process than the one observed answers there now (it restarted): it stays out.
            log.warning(
                "pod %s: not admitted: the engine process changed since it was observed", pod["metadata"]["name"]
            )
            return state
        except engine_wire.EngineError as exc:
            log.warning("pod %s: not admitted: %s", pod["metadata"]["name"], exc)
            return state
        return state.evolve(admitted=True)
    return state


async def close_for(
    ctx: OperatorContext,
    pod: Manifest,
    client: EngineClient,
    state: EngineState,
    reason: str,
    message: str,
    *,
    withdraw: bool = True,
) -> EngineState:
    """Take the pod out of the Service: its engine withdrawn (the readiness probe fails) and its gate False.

    A withdrawal that fails is logged: the gate alone already keeps the pod out of the Service.
    ``withdraw=False``: the gate only, for a pod about to pause (the pause withdraws it in the same request:
    ``reconcile.executor``).
    """
    if withdraw and state.admitted is not False and state.reachable:
        try:
            await client.withdraw()
            state = state.evolve(admitted=False if state.admitted is not None else None)
        except engine_wire.EngineError as exc:
            log.warning("pod %s: not withdrawn: %s", pod["metadata"]["name"], exc)
    await set_gate(ctx, pod, False, reason, message)
    return state
