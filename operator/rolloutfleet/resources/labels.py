"""Deterministic names and labels of a fleet's children.

Imported by the builders here, by reconcile (to find children) and by handlers (to index pods).
Names are derived from the fleet's name only, so a restarted operator finds what it made.
"""

from __future__ import annotations

FLEET_LABEL = "rolloutfleet.io/fleet"
SPEC_HASH_ANNOTATION = "rolloutfleet.io/spec-hash"
FIELD_MANAGER = "rolloutfleet-operator"
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "rolloutfleet-operator"}
TOKEN_KEY = "token"  # noqa: S105 - the Secret key name
TOKEN_MOUNT_DIR = "/var/run/rolloutfleet/token"  # noqa: S105 - a mount path
SHM_MOUNT = "/dev/shm"  # noqa: S108 - the container's shared-memory mount


def selector_labels(fleet: str) -> dict[str, str]:
    """Labels that select a fleet's engine pods (stable: a StatefulSet selector is immutable)."""
    return {"app.kubernetes.io/name": "rolloutfleet-engine", "app.kubernetes.io/instance": fleet, FLEET_LABEL: fleet}


def common_labels(fleet: str) -> dict[str, str]:
    """Labels on every child object."""
    return {
        **selector_labels(fleet),
        "app.kubernetes.io/managed-by": "rolloutfleet",
        "app.kubernetes.io/part-of": fleet,
    }


def selector_string(fleet: str) -> str:
    """The selector in ``key=value,...`` form (status.selector for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(fleet).items()))


def statefulset_name(fleet: str) -> str:
    """The engines' StatefulSet; pods are ``<fleet>-0 .. <fleet>-N``."""
    return fleet


def headless_service_name(fleet: str) -> str:
    """The headless Service giving each pod a stable DNS name."""
    return f"{fleet}-engines"


def service_name(fleet: str) -> str:
    """The Service for generation traffic."""
    return fleet


def network_policy_name(fleet: str) -> str:
    """The NetworkPolicy guarding the engine port."""
    return f"{fleet}-engine-access"


def pdb_name(fleet: str) -> str:
    """The PodDisruptionBudget of the engines."""
    return fleet


def token_secret_name(fleet: str) -> str:
    """The Secret holding the engines' control token."""
    return f"{fleet}-control-token"


# The pod readiness gate the operator sets from the engine's state (reconcile.gates).
WEIGHTS_READY_CONDITION = "rolloutfleet.io/weights-ready"

# Put on a WeightRevision once it reached a final phase: the revision loop lists only revisions without it,
# so a namespace holding thousands of finished revisions costs it nothing per pass.
SETTLED_LABEL = "rolloutfleet.io/settled"
UNSETTLED_SELECTOR = f"{SETTLED_LABEL}!=true"
