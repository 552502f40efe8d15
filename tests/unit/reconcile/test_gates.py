"""``reconcile.gates``: a decision about one pod (and one engine process) never lands on another.

Found by the soak (bench/results/soak.md, checks b and c): the operator decided to open the gate of
``policy-29`` from its engine's verified weights; the pod was deleted and recreated under the same name
and IP meanwhile, and the gate patch (by name) and the admit (by address) reached the replacement, which
served its initial weights to clients.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
from kube_fakes import FakeKube

from rolloutfleet.adapters.kube import Kube
from rolloutfleet.api.engine import EngineState, TargetState
from rolloutfleet.metrics import Metrics
from rolloutfleet.reconcile import gates
from rolloutfleet.reconcile.context import OperatorContext

pytestmark = pytest.mark.unit
NS = "rl"


class Engine:
    """The two admission calls the gate makes, answered like the worker middleware: a named process."""

    def __init__(self, instance: str) -> None:
        self.instance, self.admits = instance, []  # type: list[Any]

    async def admit(self, revision: int | None, *, instance: str | None = None) -> None:
        from rolloutfleet.adapters.engine_wire import EngineHTTPError

        self.admits.append((revision, instance))
        if instance is not None and instance != self.instance:
            raise EngineHTTPError(409, {"error": {"type": "Conflict"}}, url="http://engine", step="admit")

    async def withdraw(self) -> None:
        pass


def _setup() -> tuple[FakeKube, OperatorContext]:
    kube = FakeKube()
    return kube, OperatorContext(kube=cast(Kube, kube), metrics=Metrics())


def _verified(instance: str) -> EngineState:
    return EngineState(
        reachable=True, verifier=TargetState(revision=3, digest="blake3:" + "a" * 64), admitted=False, instance=instance
    )


async def test_the_gate_of_a_replaced_pod_is_not_opened() -> None:
    kube, ctx = _setup()
    looked_at = copy.deepcopy(kube.add_pod(NS, "policy-29", "127.1.0.29", readiness_gates=(gates.CONDITION,)))
    kube.objects.pop(("v1", "Pod", NS, "policy-29"))  # deleted, and recreated under the same name
    kube.add_pod(NS, "policy-29", "127.1.0.29", readiness_gates=(gates.CONDITION,))

    assert await gates.set_gate(ctx, looked_at, True, "Serving", "serves revision 3, verified") is False
    replacement = kube.objects[("v1", "Pod", NS, "policy-29")]
    assert all(c.get("type") != gates.CONDITION for c in replacement["status"].get("conditions") or [])


async def test_an_admit_reaches_only_the_engine_process_that_was_observed() -> None:
    kube, ctx = _setup()
    pod = kube.add_pod(NS, "policy-29", "127.1.0.29", readiness_gates=(gates.CONDITION,))
    restarted = Engine(instance="b" * 16)  # the process now at the address; the weights were read from "a..."

    state = await gates.open_for(ctx, pod, cast(Any, restarted), _verified("a" * 16), "Serving", "verified")
    assert restarted.admits == [(3, "a" * 16)]
    assert state.admitted is False  # refused: the pod stays out of the Service

    same = Engine(instance="a" * 16)
    state = await gates.open_for(ctx, pod, cast(Any, same), _verified("a" * 16), "Serving", "verified")
    assert state.admitted is True
