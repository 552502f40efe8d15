"""kopf's diff base (what it compares to see a spec change), built without copying the status first.

Used by ``handlers.wiring`` (``settings.persistence.diffbase_storage``). kopf builds the "essence" of an
object at every watch event of a resource with change handlers: it deep-copies the whole body, then deletes
``status``. Our fleets' and revisions' statuses carry a row per pod, and each progress write the operator
makes comes back as such an event: at 1,024 pods that copy was 3.9 % of the operator's CPU (issue 18,
bench/results/rollout_overhead.md). The essence never holds the status (we register no handler on a status
field), so the body is handed over without it: the same essence, with nothing copied only to be deleted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import kopf


class SpecDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """``kopf.AnnotationsDiffBaseStorage`` whose ``build`` never copies ``status``."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        if extra_fields or "status" not in body:  # a status field asked for: kopf's own way
            return super().build(body=body, extra_fields=extra_fields)
        without = kopf.Body(cast(kopf.RawBody, {key: value for key, value in body.items() if key != "status"}))
        return super().build(body=without, extra_fields=extra_fields)
