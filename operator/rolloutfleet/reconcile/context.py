"""What every reconcile needs from the process: the Kubernetes adapter, metrics and settings.

Built once by the handlers at operator start-up and kept in kopf's memo; passed explicitly to reconcilers
(no globals), so tests and benchmarks can build their own.
"""

from __future__ import annotations

import dataclasses

from rolloutfleet.adapters.kube import Kube
from rolloutfleet.metrics import Metrics


@dataclasses.dataclass
class OperatorContext:
    """Process-wide collaborators of the reconcilers."""

    kube: Kube
    metrics: Metrics
    operator_namespace: str | None = None
