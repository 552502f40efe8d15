"""The part of an engine pod the reconcilers read, as a small plain dict.

Called by ``handlers.wiring`` to fill the operator's pod index (one entry per engine pod, fed by a watch)
and so, indirectly, by ``reconcile.fleet`` and ``reconcile.revision``, which read pods only through
``OperatorContext.fleet_pods``. Keeping a slim copy keeps the index small at thousands of pods and makes
the fields the operator depends on explicit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rolloutfleet.resources.labels import FLEET_LABEL

Manifest = dict[str, Any]
ENGINE_POD_LABELS = {"app.kubernetes.io/name": "rolloutfleet-engine"}  # the index's watch selector


def fleet_of(pod: Mapping[str, Any]) -> str | None:
    """The fleet an engine pod belongs to (its ``rolloutfleet.io/fleet`` label), if any."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(FLEET_LABEL)
    return str(value) if value else None


def slim(pod: Mapping[str, Any]) -> Manifest:
    """Name, namespace, labels, deletion mark; IP, phase, conditions and container waiting reasons."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "labels": dict(meta.get("labels") or {}),
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "status": {
            "podIP": status.get("podIP"),
            "phase": status.get("phase"),
            "conditions": [
                {"type": c.get("type"), "status": c.get("status")} for c in status.get("conditions") or []
            ],
            "containerStatuses": [
                {"state": {"waiting": {"reason": ((cs.get("state") or {}).get("waiting") or {}).get("reason")}}}
                for cs in status.get("containerStatuses") or []
            ],
        },
    }
