"""The fleet's pods as a revision pass sees them (``PodView``), each pod object read once.

Called by ``reconcile.revision`` at the start of every pass (the fleet's ``FleetMemory`` keeps one
``PodViewMemo``); ``reconcile.rollout_pass`` reads the view. A fleet at rest is passed over every idle period
(5 s by default), and each pass asked every pod again whether it is live, whether its engine is up, whether
the Service routes to it and which engine process it runs, then sorted them: at 1,024 pods most of what a
fleet at rest cost the operator (bench/results/rollout_overhead.md, "A fleet at rest reads each pod object
once"; issue 18). The pod watch replaces a pod's object on every change, and the one change made to a listed
object in place (the gate the operator writes replaces the pod's conditions list: ``reconcile.gates``) is told
by that list's identity, as ``planning.fleet_status.PodFactsMemo`` does: an object read before reads the same
again, and a list of the same objects in the same order as the last one is the same view.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rolloutfleet.planning import pod_readiness

Manifest = dict[str, Any]
# What ``PodViewMemo.signature`` gives for each live pod: its name, engine process (uid and restart counts),
# IP, not routed, engine not up.
Signature = tuple[tuple[object, ...], ...]


@dataclasses.dataclass(frozen=True)
class PodView:
    """The fleet's pods as Kubernetes shows them at the start of a pass."""

    order: list[str]  # pods whose engine is up (containers ready), by ordinal: the pods the pass moves
    bodies: dict[str, Manifest]  # every live pod with an IP, by name
    not_routed: frozenset[str]  # pods the Service does not route to (they cost no availability to move)
    starting: frozenset[str]  # pods whose engine is not up yet: unavailable, not moved, not failed


def ordinal(name: str) -> tuple[int, str]:
    """A StatefulSet pod's ordinal (``policy-12`` → 12), pods without one last, for the passes' order."""
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


@dataclasses.dataclass(slots=True, eq=False)
class _PodRead:
    """What a pass reads of one pod object; ``pod`` and ``conditions`` are what it was read from."""

    pod: Manifest
    conditions: object
    name: str
    live: bool  # Running, with an IP, not being deleted
    up: bool  # live, and its engine answers (``pod_readiness.engine_up``)
    routed: bool  # live, and behind the Service (``pod_readiness.routed``)
    incarnation: str  # live: which engine process it runs (``pod_readiness.incarnation``); else ""
    ip: str | None


def _read(pod: Manifest) -> _PodRead:
    meta = pod["metadata"]
    status = pod.get("status") or {}
    ip = status.get("podIP")
    live = bool(ip) and not meta.get("deletionTimestamp") and status.get("phase") == "Running"
    return _PodRead(
        pod=pod,
        conditions=status.get("conditions"),
        name=meta["name"],
        live=live,
        up=live and pod_readiness.engine_up(pod),
        routed=live and pod_readiness.routed(pod),
        incarnation=pod_readiness.incarnation(pod) if live else "",
        ip=ip,
    )


@dataclasses.dataclass
class _Built:
    reads: list[_PodRead]  # the reads the view was built from, in the listed order
    view: PodView
    signature: Signature | None = None  # made on first use


class PodViewMemo:
    """Each pod's reads, made again only from a pod object (or conditions list) not read before; the view, made
    again only from a list that differs from the last one. Forgets pods no longer listed."""

    def __init__(self) -> None:
        self._reads: dict[str, _PodRead] = {}
        self._built: _Built | None = None

    def __len__(self) -> int:
        return len(self._reads)

    def _of(self, pod: Manifest) -> _PodRead:
        name = pod["metadata"]["name"]
        known = self._reads.get(name)
        if known is not None and known.pod is pod and known.conditions is (pod.get("status") or {}).get("conditions"):
            return known
        read = self._reads[name] = _read(pod)
        return read

    def view(self, pods: list[Manifest]) -> PodView:
        """The view of ``pods``. Each call returns its own ``order`` list and ``bodies`` dict (a pass may change
        them), over the same pod objects."""
        reads = [self._of(p) for p in pods]
        built = self._built
        if (
            built is None
            or len(built.reads) != len(reads)
            or any(a is not b for a, b in zip(built.reads, reads, strict=True))
        ):
            built = self._built = _Built(reads, _view(reads))
            listed = {r.name for r in reads}
            if self._reads.keys() - listed:  # pods gone (or renamed): not kept for ever
                self._reads = {name: read for name, read in self._reads.items() if name in listed}
        view = built.view
        return PodView(
            order=list(view.order), bodies=dict(view.bodies), not_routed=view.not_routed, starting=view.starting
        )

    def signature(self) -> Signature:
        """What Kubernetes shows of the last view's pods that an engine's restart or replacement changes (see
        ``reconcile.revision``'s rest mark): sorted by name, equal for equal views."""
        built = self._built
        if built is None:
            return ()
        if built.signature is None:
            live = {r.name: r for r in built.reads if r.live}  # (the last of a name, as the view's bodies)
            built.signature = tuple(
                sorted((r.name, r.incarnation, r.ip, not r.routed, not r.up) for r in live.values())
            )
        return built.signature


def _view(reads: list[_PodRead]) -> PodView:
    live = {r.name: r for r in reads if r.live}
    up = [name for name, r in live.items() if r.up]
    return PodView(
        order=sorted(up, key=ordinal),
        bodies={name: r.pod for name, r in live.items()},
        not_routed=frozenset(name for name, r in live.items() if not r.routed),
        starting=frozenset(name for name, r in live.items() if not r.up),
    )
