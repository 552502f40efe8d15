"""The per-worker record of what is loaded, and the reads that keep it honest.

Imported by ``rolloutfleet_worker.extension`` (loads, the state report) and ``rolloutfleet_worker.push``
(weight-transfer sessions). Owns ``Record`` (one ``Slot`` per target, the open session, the shared
parameters seen at its begin), where it lives on the worker, the fingerprint check that notices a level-2
sleep, and the rules every writer obeys first: nothing loads while a session is open (``busy``) or into a
target a failed session destroyed (``destroyed``). Parameters on the meta device (inside a session, or
left by a failed one) are never read: only their metadata. torch and vLLM are imported inside functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rolloutfleet_worker import options
from rolloutfleet_worker.payloads import Failure, GroupState, VerifierState, fail

if TYPE_CHECKING:
    from rolloutfleet_worker.transfer import Session

# A child of vLLM's logger, so the lines land in the engine's log with its format and level.
log = logging.getLogger("vllm.rolloutfleet")


@dataclass
class Slot:
    """What this worker knows about one target's weights."""

    revision: int | None = None
    digest: str | None = None
    path: str | None = None
    verified: bool = False
    fingerprint: list[float] | None = None  # None: nothing recorded, residency unknown
    lost: bool = False  # sticky: contents changed under us (level-2 sleep) until the next good load
    # Sticky until the process ends: a weight-transfer session failed into this target, and vLLM leaves a
    # failed target's parameters on the meta device. Nothing may load into it or read it; the operator
    # restarts the pod.
    destroyed: bool = False

    def unknown(self) -> None:
        """Fail closed: contents unknown until a load succeeds."""
        self.revision, self.digest, self.path, self.verified = None, None, None, False
        self.fingerprint = None

    def report(self, mapped: bool) -> VerifierState:
        if not mapped or self.lost or self.destroyed:
            return VerifierState(revision=None, digest=None, path=None, verified=False, destroyed=self.destroyed)
        return VerifierState(
            revision=self.revision, digest=self.digest, path=self.path, verified=self.verified, destroyed=False
        )


@dataclass
class Record:
    """Everything this worker knows about its weights (kept on the worker as ``_rolloutfleet_state``)."""

    verifier: Slot = field(default_factory=Slot)
    draft: Slot = field(default_factory=Slot)
    baseline_taken: bool = False
    session: Session | None = None  # the open weight-transfer session (``push``)
    group: GroupState | None = None  # the NCCL transfer group this process joined (``push.record_group``)
    # The draft's parameters shared with the verifier, as found at the last session's begin: while a session
    # is open or a target destroyed, parameters may sit on the meta device, where sharing cannot be seen.
    shared: list[str] | None = None

    def slot(self, target: str) -> Slot:
        return self.draft if target == "draft" else self.verifier

    @property
    def unsettled(self) -> bool:
        """Parameters may be on the meta device: read none (a session is open, or one destroyed a target)."""
        return self.session is not None or self.verifier.destroyed or self.draft.destroyed


_warmed: list[bool] = []


def _warm_up_once(worker: Any) -> None:
    """Start the loader's warm-up (GPU hash self-test, bounce buffers) once per worker process.

    Called when the extension's state is first made (the operator reads the state long before it asks
    for a load), so the first load neither compiles kernels nor allocates pinned memory.
    """
    if _warmed:
        return
    _warmed.append(True)
    from rolloutfleet_worker import loader_cuda, models

    verifier, _draft, _shared_names = models_of(worker)
    if verifier is None or not models.on_cuda(verifier) or models.world_size() != 1:
        return  # the read path runs there: nothing to warm
    opts = options.load_options(pin=True, probe=False)
    if opts.mode == "read":
        return
    sizes = []
    if opts.bounce_share > 0:
        sizes = [opts.window_bytes] * (opts.readahead_bytes // opts.window_bytes + 2)
    import torch

    loader_cuda.warm_up(torch.cuda.current_device(), opts.gpu_hash, sizes)


def record_of(worker: Any) -> Record:
    """The worker's record, made (and the loader's warm-up started) on first use."""
    state = getattr(worker, "_rolloutfleet_state", None)
    if not isinstance(state, Record):
        state = Record()
        worker._rolloutfleet_state = state
        try:
            _warm_up_once(worker)
        except Exception as exc:  # an optimisation only: never fail a request for it
            log.warning("rolloutfleet: loader warm-up not started: %s: %s", type(exc).__name__, exc)
    return state


def models_of(worker: Any, state: Record | None = None) -> tuple[Any | None, Any | None, list[str]]:
    """The verifier, the draft (None without one) and the draft's parameters shared with the verifier.

    Sharing is seen by storage, which parameters on the meta device do not have: while ``state`` is
    unsettled the list recorded at the last session's begin stands in.
    """
    from rolloutfleet_worker import models

    verifier = models.verifier_model(worker)
    draft = models.draft_model(worker)
    if state is not None and state.unsettled and state.shared is not None:
        return verifier, draft, list(state.shared)
    shared = models.shared_parameters(draft, verifier) if draft is not None else []
    return verifier, draft, shared


def observe(slot: Slot, model: Any | None, exclude: list[str], *, read: bool = True) -> bool:
    """Compare ``slot``'s recorded fingerprint with the model now; mark it lost on a mismatch.

    Returns whether the weights are mapped (False while the engine sleeps: then nothing is read).
    ``read=False`` (a session is open) and a destroyed slot read no parameter values at all: they may be
    on the meta device.
    """
    from rolloutfleet_worker import models

    if model is None or slot.destroyed:
        return True
    if not models.weights_mapped(model):
        return False
    if not read:
        return True
    if slot.fingerprint is not None and not slot.lost and models.fingerprint(model, exclude) != slot.fingerprint:
        slot.lost = True
        slot.verified = False
    return True


def take_baseline(state: Record, verifier: Any | None, draft: Any | None, shared: list[str]) -> None:
    """Fingerprint the weights vLLM loaded at start-up, so a sleep before our first load is noticed."""
    from rolloutfleet_worker import models

    if state.baseline_taken or state.unsettled:
        return
    for slot, model, exclude in ((state.verifier, verifier, []), (state.draft, draft, shared)):
        if model is not None and slot.fingerprint is None and models.weights_mapped(model):
            slot.fingerprint = models.fingerprint(model, exclude)
    state.baseline_taken = True


def vllm_session_open(worker: Any) -> bool:
    """vLLM's own weight-update flag (``Worker._weight_update_active``, 0.26 and 0.33): its session is open,
    so the target's parameters are on the meta device. False where the attribute does not exist."""
    return getattr(worker, "_weight_update_active", False) is True


def refused(worker: Any, state: Record, target: str, verifier: Any | None, draft: Any | None) -> Failure | None:
    """Why nothing may load into ``target`` now: a session is open, or one destroyed the target."""
    if state.session is not None:
        s = state.session
        return fail("busy", f"a {s.target} weight-transfer session (epoch {s.epoch}) is open: end it first")
    settle(state, verifier, draft, vllm_open=vllm_session_open(worker))
    if state.slot(target).destroyed:
        return fail("destroyed", f"a failed weight-transfer session destroyed the {target}: restart the engine")
    return None


def settle(state: Record, verifier: Any | None, draft: Any | None, *, vllm_open: bool = False) -> None:
    """Mark destroyed any target with parameters on the meta device, once this process has had a session
    of ours, or while vLLM has one the extension did not open (``vllm_open``).

    Outside our sessions only a failed one leaves parameters there, and not only its own target's: an
    EAGLE-style draft holds the verifier's embedding and head, which a draft session moves to meta too.
    Such a target has no data at all; reading it would fail, loading into it would write nowhere. A vLLM
    session nobody bracketed changes the target unverified: the same verdict. Metadata only.
    """
    from rolloutfleet_worker import models

    if state.session is not None or (state.shared is None and not vllm_open):
        return
    for name, slot, model in (("verifier", state.verifier, verifier), ("draft", state.draft, draft)):
        if model is None or slot.destroyed:
            continue
        meta = models.on_meta(model)
        if meta:
            slot.unknown()
            slot.destroyed = True
            log.warning("rolloutfleet: %s destroyed: %d parameters left on the meta device", name, len(meta))
