"""kopf's diff base (what it compares to see a spec change), built without copying what it throws away.

Used by ``handlers.wiring`` (``settings.persistence.diffbase_storage``). kopf builds the "essence" of an
object at every watch event of a resource with change handlers: it deep-copies the whole body, then deletes
``status`` and ``metadata`` and picks the labels and annotations back from the body. Our fleets' and
revisions' statuses carry a row per pod, and their metadata the field managers of every status write; each
progress write the operator makes comes back as such an event. At 1,024 pods copying the status was 3.9 % of
the operator's CPU; with the status left out, copying the metadata (``managedFields`` most of it) still took
most of each build: 619 µs against 44 without it, for ~1,000 managed-field nodes (issue 18,
bench/results/rollout_overhead.md). The essence never holds either (we register no handler on a status or
metadata field), so the body is handed over with its metadata cut to what kopf reads of it: the labels and
annotations it keeps, and the owner references its annotation keys may depend on. The same essence, with
nothing copied only to be deleted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import kopf

# What kopf's ``build`` reads of the metadata: the labels and annotations it keeps in the essence, and the
# owner references ``mark_key`` looks at to name its annotation.
METADATA_READ = ("labels", "annotations", "ownerReferences")


class SpecDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """``kopf.AnnotationsDiffBaseStorage`` whose ``build`` copies neither the status nor the metadata kopf drops."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        if extra_fields:  # a status or metadata field asked for: kopf's own way
            return super().build(body=body, extra_fields=extra_fields)
        meta = body.get("metadata") or {}
        kept: dict[str, Any] = {key: value for key, value in body.items() if key not in ("status", "metadata")}
        kept["metadata"] = {key: meta[key] for key in METADATA_READ if key in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, kept)), extra_fields=extra_fields)
