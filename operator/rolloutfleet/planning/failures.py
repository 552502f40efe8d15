"""Pure summaries of per-pod failures, so a failure on many pods reads once and the status stays bounded.

Called by ``reconcile.rollout_pass`` when a revision gives up. A fleet of thousands of pods failing the same
way (a missing checkpoint) must not print the same long message per pod, three times over, nor grow the
revision's status toward the API server's object size limit: identical failures are grouped (step, reason,
message with pod names taken out), each group said once with its count, one example and which pods.
"""

from __future__ import annotations

import collections
import re

from rolloutfleet.api.revision import PodFailure

MAX_LISTED_PODS = 5  # pod names named per group in a message
MAX_GROUPS = 3  # groups spelled out in a message; the rest are counted
MAX_FAILURE_ENTRIES = 32  # per-pod entries kept in status.failures (the summary covers every pod)
MAX_EXAMPLE_CHARS = 300


def _shape(failure: PodFailure) -> tuple[str, str, str]:
    # Messages differ per pod only by the pod's own name or address; group on what is left.
    message = re.sub(rf"(?<![\w.-]){re.escape(failure.name)}(?![\w.-])", "<pod>", failure.message)
    message = re.sub(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b", "<addr>", message)
    return failure.step, failure.reason, message


def groups(failures: list[PodFailure]) -> list[tuple[tuple[str, str, str], list[PodFailure]]]:
    """Failures grouped by (step, reason, message shape), largest group first (ties: first seen)."""
    grouped: dict[tuple[str, str, str], list[PodFailure]] = collections.OrderedDict()
    for failure in failures:
        grouped.setdefault(_shape(failure), []).append(failure)
    return sorted(grouped.items(), key=lambda item: -len(item[1]))


def summarize(failures: list[PodFailure], *, total: int) -> str:
    """One line: each kind of failure once, with how many pods, an example and which pods."""
    if not failures:
        return "no pod reported a failure"
    parts = []
    grouped = groups(failures)
    for (step, reason, _shape_message), members in grouped[:MAX_GROUPS]:
        names = ", ".join(f.name for f in members[:MAX_LISTED_PODS])
        more = f" and {len(members) - MAX_LISTED_PODS} more" if len(members) > MAX_LISTED_PODS else ""
        example = members[0].message
        if len(example) > MAX_EXAMPLE_CHARS:
            example = example[: MAX_EXAMPLE_CHARS - 1] + "…"
        parts.append(f"{len(members)}/{total} pods failed at {step} ({reason}) on {names}{more}; e.g. {example}")
    rest = sum(len(m) for _, m in grouped[MAX_GROUPS:])
    if rest:
        parts.append(f"{rest} more pods failed in {len(grouped) - MAX_GROUPS} other ways")
    return " | ".join(parts)


def bounded(failures: list[PodFailure]) -> list[PodFailure]:
    """The per-pod entries kept in the status: a few of every group, at most ``MAX_FAILURE_ENTRIES``, and one
    per pod (``status.failures`` is a list-map keyed by name: the API server refuses a pod named twice)."""
    kept: dict[str, PodFailure] = {}
    grouped = groups(failures)
    per_group = max(1, MAX_FAILURE_ENTRIES // max(1, len(grouped)))
    for _, members in grouped:
        for member in members[:per_group]:
            kept.setdefault(member.name, member)
    return list(kept.values())[:MAX_FAILURE_ENTRIES]
