"""``reconcile.status_writes.write_revision``: only the fields that differ from what is stored are patched.

The pass writes a 1,024-pod revision's progress every second; what is stored is what it wrote last, kept in
wire form beside the status (``Revision.written_wire``) instead of serialised again for each comparison. The
risk of that shortcut is comparing against something that is not stored: each write here must patch exactly
what changed since the last, and a status replaced from elsewhere (read back) is compared as it is.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from kube_fakes import FakeCall, FakeKube

from rolloutfleet.adapters.kube import Kube
from rolloutfleet.api import common
from rolloutfleet.api.revision import Phase, WeightRevisionStatus
from rolloutfleet.metrics import Metrics
from rolloutfleet.planning import revisions
from rolloutfleet.reconcile.context import OperatorContext
from rolloutfleet.reconcile.status_writes import write_revision

pytestmark = pytest.mark.unit


async def test_each_write_patches_what_changed_since_the_last_and_a_replaced_status_is_compared_as_it_is() -> None:
    kube = FakeKube()
    body: dict[str, Any] = {
        "apiVersion": common.API_VERSION,
        "kind": "WeightRevision",
        "metadata": {"name": "step-1", "namespace": "ns"},
        "spec": {},
    }
    await kube.create(body)
    ctx = OperatorContext(kube=cast(Kube, kube), metrics=Metrics())
    rev = revisions.Revision("step-1", "", None, WeightRevisionStatus(), (), body)
    patches: list[dict[str, Any]] = []

    async def record(call: FakeCall) -> None:
        if call.verb == "patch_status":
            patches.append(call.body["status"])

    kube.before_call = record
    progressing = WeightRevisionStatus(phase=Phase.PROGRESSING, pods_total=4, pods_updated=1, updated="1/4")
    assert await write_revision(ctx, rev, progressing)
    assert await write_revision(ctx, rev, progressing) is False  # nothing changed since: no request
    assert await write_revision(ctx, rev, progressing.model_copy(update={"pods_updated": 2, "updated": "2/4"}))
    assert patches[1] == {"podsUpdated": 2, "updated": "2/4"}  # against the last write, not the first
    # The status replaced from elsewhere (the object read back, another writer's count in it): compared as it is,
    # so the count is put right (compared with the last write instead, nothing would be patched).
    rev.status = WeightRevisionStatus.model_validate({**rev.status.to_wire(), "podsUpdated": 3, "updated": "3/4"})
    assert await write_revision(ctx, rev, progressing.model_copy(update={"pods_updated": 2, "updated": "2/4"}))
    assert patches[2] == {"podsUpdated": 2, "updated": "2/4"}
