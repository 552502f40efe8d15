"""Shared pieces of the CRD models: the wire base model, conditions, object references.

Imported by ``fleet``, ``revision``, ``conditions`` and ``crdgen``. Owns the wire conventions: camelCase
aliases, field-path-friendly validation errors, and the Kubernetes condition shape.
"""

from __future__ import annotations

import datetime
import enum
from typing import Annotated

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_camel

JsonDict = dict[str, pydantic.JsonValue]

GROUP = "rolloutfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Absolute, no empty segment, no control character (NUL..US, DEL: they end up in logs, events and the
# engine's command line), bounded (CEL cost estimation needs bounds on strings).
ABSOLUTE_PATH_PATTERN = r"^/([^/\x00-\x1f\x7f]+/?)*$"
PATH_MAX_LENGTH = 4096
# No `..` and no `.` segment: a path names one directory in one spelling, so prefix rules (allowed roots,
# refused mount paths) cannot be walked around with `/weights/../etc` or `/./proc`.
NO_DOTDOT_RULE: JsonDict = {
    "rule": "!self.matches('(^|/)[.][.](/|$)')",
    "message": "must not contain a '..' segment",
}
NO_DOT_RULE: JsonDict = {
    "rule": "!self.matches('(^|/)[.](/|$)')",
    "message": "must not contain a '.' segment",
}
PATH_RULES: list[pydantic.JsonValue] = [NO_DOTDOT_RULE, NO_DOT_RULE]
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

AbsolutePath = Annotated[
    str,
    Field(
        pattern=ABSOLUTE_PATH_PATTERN,
        max_length=PATH_MAX_LENGTH,
        json_schema_extra={"x-kubernetes-validations": PATH_RULES},
    ),
]


class WireModel(pydantic.BaseModel):
    """Base of every CRD model: camelCase on the wire, snake_case in Python, unknown fields refused.

    The API server prunes unknown fields before the operator sees an object, so ``extra="forbid"`` only
    bites on local validation (examples, ``kubectl apply --dry-run`` of files, tests): typos surface early.
    """

    model_config = pydantic.ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=False,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, object]:
        """The camelCase JSON-compatible dict, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ConditionStatus(enum.StrEnum):
    """``status`` of a condition, per Kubernetes API conventions."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(WireModel):
    """One observation of an aspect of the object's state (Kubernetes API conventions)."""

    type: str = Field(description="Type of condition in CamelCase, e.g. Available.", max_length=316)
    status: ConditionStatus = Field(description="Status of the condition: True, False or Unknown.")
    reason: str = Field(
        description="Machine-readable CamelCase reason for the last transition.",
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(default="", description="Human-readable details of the last transition.", max_length=32768)
    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation this condition was computed from."
    )
    last_transition_time: datetime.datetime = Field(
        description="When the condition last changed status (not when it was last evaluated)."
    )


CONDITIONS_LIST_EXTRA: JsonDict = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}
# The statuses' per-pod lists, one entry per pod of the fleet, written whole by the operator alone (merge
# patches replace lists anyway). Atomic, not a map keyed by pod: the API server tracks every key of a map in
# managedFields, on every write of the object, whatever the write changes. At 1,024 pods one write of a
# RolloutFleet's targetRevision took 388 ms and 664 ms of the API server's CPU as a map, 146 ms and 223 ms
# atomic, the object 306 KB against 144 KB (bench/results/fleet_status_write_cost.md; issue 18).
PER_POD_LIST_EXTRA: JsonDict = {"x-kubernetes-list-type": "atomic"}
# A status lists at most this many pods (``status.pods`` of both kinds): the API server stores an object whole,
# etcd refuses one over 1.5 MiB by default, and a fleet may have 100,000 pods. Beyond it a status lists the pods
# that stand out (planning.fleet_status, planning.revision_status).
MAX_POD_ENTRIES = 256


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[fd00::1]:8000``): what a URL and a published push session
    need. A pod's ``status.podIP`` is an IPv6 address on an IPv6 cluster and on a dual-stack one that lists IPv6
    first; written bare, its colons run into the port's."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class LocalObjectReference(WireModel):
    """A reference to an object by name in the same namespace."""

    name: str = Field(description="Name of the referenced object.", min_length=1, max_length=253, pattern=NAME_PATTERN)
