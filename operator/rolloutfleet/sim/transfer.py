"""Weight-transfer sessions of one simulated engine: vLLM's session routes and our extension's push RPCs.

Owned by ``rolloutfleet.sim.engine.EngineCore`` (one ``Transfer`` per engine process); its vLLM side is
driven by ``rolloutfleet.sim.transfer_http`` (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/start_draft_weight_update``, ``/update_weights``, ``/finish_weight_update``), its extension side by the
``rolloutfleet_push_begin`` / ``rolloutfleet_push_end`` RPCs (docs/push.md "Engine side"). No HTTP here.

vLLM's side, as vLLM 0.26/0.33's ``gpu_worker.py`` behaves (DESIGN.md §4b): only with
``EngineSpec.weight_transfer`` (``--weight-transfer-config``), else every call fails "Weight transfer not
configured". One session at a time; a second start, or an update/finish without a session, fails and an
open session stays usable. A start puts the target's parameters on the ``meta`` device (layerwise reload):
no forward pass and no level-2 sleep until the finish, which commits what was received (a layer that got
nothing gets its old tensors back). A failed update ends the session and leaves the target on ``meta``
(``Slot.broken``, reported ``destroyed``): later updates into it fail too (measured: "a second draft
session also fails"), until ``wake_up(tags=weights)`` (``repair``; measured) or a restart.

The SIMULATED transport: the simulator cannot open CUDA IPC handles nor join a NCCL group, so the sender
puts the bytes in the request, beside vLLM's own fields::

    {"update_info": {"names": [...], "dtype_names": ["bfloat16", ...], "shapes": [[...], ...],
                     "simulated_payload_b64": ["<base64 of the tensor's raw bytes>", ...]}}

``dtype_names`` are torch's spellings (``getattr(torch, name)`` in vLLM), mapped to safetensors' (``BF16``)
for the digest. ``ipc_handles``/``ipc_handles_pickled`` fail ("the simulator cannot open CUDA IPC
handles"). vLLM's packing options are accepted and ignored; any other key fails as vLLM's dataclass does.
A malformed payload fails with a message; a tensor the model has no parameter for, or of another shape,
fails with an EMPTY message (measured on vLLM 0.26). Every failure of an update destroys its target, and
a draft that shares tensors with the verifier (EAGLE's embed_tokens, lm_head) takes the verifier along.

The simulated model's parameters (names, safetensors dtypes, shapes) are the tensors of the checkpoint the
engine started from (``EngineSpec.verifier_path`` / ``draft_path``, read from the headers): a real model's
parameters are fixed by its architecture, whatever was loaded since. A draft also takes the tensors it
shares with the verifier (``EngineSpec.shared_tensors``) and never needs them. A dtype other than the
parameter's is accepted (vLLM's copy converts it) and hashed as sent. When that checkpoint is synthetic or
unreadable the parameters are unknown: any name and shape is taken, and a session is complete once it
received one tensor.

NCCL groups: ``init_weight_transfer_engine`` checks vLLM's keys and joins at once (the simulator opens no
rendezvous socket and receives no broadcast; the sender still puts the bytes in each request); a peer that
never comes is the ``hang`` fault on it. ``rolloutfleet_push_group`` records the group joined, reported as
``group`` by ``rolloutfleet_state`` and lost with the process, as ``rolloutfleet_worker.push`` does.

The extension's side (``rolloutfleet_push_begin``/``_end``, as ``rolloutfleet_worker.push`` and its
payloads) hashes every tensor its target receives with the project's one digest
(``rolloutfleet_digest`` through ``rolloutfleet.digest``: BLAKE3 per tensor of its raw bytes,
combined in name order with name, dtype and shape), so a good session's digest equals ``rolloutfleet
digest`` of a checkpoint holding the same tensors. A tensor received twice in one push session fails its
update (the extension raises inside ``load_weights``). A draft's tensors shared with the verifier are
hashed and counted, never applied (``skipped``). ``push_end`` judges in the extension's order: abandoned,
an update failed, vLLM's side still open (``failed``), nothing or not every parameter received
(``incomplete``); any of these leaves the target ``destroyed`` until the engine restarts.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import pathlib
import time
from typing import Any, Protocol

import blake3

from rolloutfleet import digest as project_digest
from rolloutfleet.sim import weights
from rolloutfleet.sim.config import EngineSpec

# The worker's digest module, reached through its one importer in the operator (``rolloutfleet.digest``).
wdigest: Any = project_digest.wdigest  # type: ignore[attr-defined]

# torch attribute names (vLLM does ``getattr(torch, dtype_name)``) → safetensors dtype strings.
TORCH_DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "short": "I16",
    "uint16": "U16",
    "int32": "I32",
    "int": "I32",
    "uint32": "U32",
    "int64": "I64",
    "long": "I64",
    "uint64": "U64",
    "float16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float": "F32",
    "float64": "F64",
    "double": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
UPDATE_KEYS = frozenset({"names", "dtype_names", "shapes", "simulated_payload_b64"})
IGNORED_KEYS = frozenset({"packed", "packed_buffer_size_bytes", "packed_num_buffers", "tensor_sizes"})
IPC_KEYS = frozenset({"ipc_handles", "ipc_handles_pickled"})
NCCL_INIT_FIELDS = frozenset({"master_address", "master_port", "rank_offset", "world_size"})
NCCL_INIT_033 = frozenset({"nccl_unique_id_b64", "packed", "packed_buffer_size_bytes", "packed_num_buffers"})

NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."


class VllmError(Exception):
    """A worker exception: vLLM answers 500 with ``message`` (``transfer_http`` wraps it as vLLM does)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UpdateFailedError(VllmError):
    """An update that raised: the session ended and its target is destroyed. ``reason`` is what happened;
    the client sees ``message``: vLLM answers ``str(exception)``, which is torch's message for a wrong shape
    (measured on the H200 on 2026-12-01: "start (0) + length (512) exceeds dimension size (256).") and
    empty for an exception without one (an earlier measurement)."""

    def __init__(self, reason: str, *, shown: bool) -> None:
        super().__init__(reason if shown else "")
        self.reason = reason


class PushError(Exception):
    """An extension RPC's refusal: ``{"ok": false, "error": {"code", "message"}}``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclasses.dataclass(frozen=True, slots=True)
class Parameter:
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    dtype: str
    shape: tuple[int, ...]
    hash: bytes  # BLAKE3 of the raw bytes (``h_t`` of docs/digest.md)
    nbytes: int


@dataclasses.dataclass
class VllmSession:
    """vLLM's open session: ``_weight_update_active`` and the target its engine points at."""

    target: str
    saved_content: tuple[str, str, int | None] | None  # what a layer that receives nothing gets back
    was_broken: bool  # a failed update left the target on ``meta`` before this start: nothing loads
    received: dict[str, Received] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PushSession:
    """The extension's session (``rolloutfleet_push_begin`` .. ``_end``)."""

    target: str
    revision: int
    epoch: int
    started: float
    received: dict[str, Received] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None

    def report(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "revision": self.revision,
            "epoch": self.epoch,
            "age_s": round(time.monotonic() - self.started, 3),
            "tensors": len(self.received),
            "bytes": sum(r.nbytes for r in self.received.values()),
            "error": self.error,
        }


class Host(Protocol):
    """What a ``Transfer`` needs of its engine (``EngineCore``)."""

    spec: EngineSpec
    verifier: weights.Slot
    draft: weights.Slot | None
    weights_awake: bool
    weight_version: str | None

    def parameters(self, target: str) -> dict[str, Parameter] | None: ...


def parameter_set(path: str | None, synthetic: bool) -> dict[str, Parameter] | None:
    """The parameters of a model started from checkpoint ``path`` (None: unknown, see the module doc)."""
    if path is None or synthetic:
        return None
    try:
        infos = weights.scan_headers(path)
    except weights.LoadError:
        return None
    return {i.name: Parameter(i.dtype, tuple(i.shape)) for i in infos}


def combined_digest(received: dict[str, Received]) -> str:
    """The project's digest of exactly these tensors (what ``rolloutfleet digest`` gives for a checkpoint)."""
    builder = wdigest.DigestBuilder()
    for name, r in received.items():
        builder.add(wdigest.TensorInfo(name, r.dtype, r.shape, pathlib.Path("<pushed>"), 0, r.nbytes), r.hash)
    return str(builder.hexdigest())


class Transfer:
    """The weight-transfer state of one engine process: vLLM's session and the extension's."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.initialized = False
        self.group: dict[str, int] | None = None  # the extension's record of the NCCL group joined
        self.vllm: VllmSession | None = None
        self.push: PushSession | None = None

    # --- views -------------------------------------------------------------------------------------

    @property
    def backend(self) -> str | None:
        config = self.host.spec.weight_transfer
        return None if config is None else str(config.get("backend", "nccl"))

    def slot(self, target: str) -> weights.Slot | None:
        return self.host.verifier if target == "verifier" else self.host.draft

    def slots(self) -> list[weights.Slot]:
        return [s for s in (self.host.verifier, self.host.draft) if s is not None]

    @property
    def forward_blocked(self) -> bool:
        """Some parameters are on the ``meta`` device: a forward pass (and a level-2 sleep) would raise."""
        return any(s.on_meta for s in self.slots())

    def summary(self) -> dict[str, Any]:
        return {
            "vllm_session": None if self.vllm is None else self.vllm.target,
            "session": None if self.push is None else self.push.report(),
        }

    def reached(self, target: str) -> list[weights.Slot]:
        """The models a session into ``target`` moves to ``meta``: a draft that shares tensors with the
        verifier (EAGLE's embed_tokens, lm_head) takes those of the verifier along, so a failure there
        destroys the verifier too (as ``rolloutfleet_worker.push`` finds)."""
        slot = self.slot(target)
        assert slot is not None
        shares = target == "draft" and bool(self.host.spec.shared_tensors)
        return [slot, self.host.verifier] if shares else [slot]

    def required(self, target: str) -> set[str] | None:
        """The parameters a session must fill (None: unknown): all but those shared with the verifier."""
        params = self.host.parameters(target)
        if params is None:
            return None
        shared = self.host.spec.shared_tensors if target == "draft" else ()
        return {n for n in params if not (shared and weights.matches_shared(n, shared))}

    # --- vLLM's routes -----------------------------------------------------------------------------

    def _configured(self) -> None:
        if self.backend is None:
            raise VllmError(NOT_CONFIGURED)

    def init(self, init_info: dict[str, Any]) -> None:
        """``init_weight_transfer_engine``: IPC takes ``{}``; NCCL its rendezvous (joined at once: simulated)."""
        self._configured()
        keys = set(init_info)
        if self.backend == "ipc":
            if keys:
                raise VllmError(f"Invalid init_info for IPCWeightTransferEngine: unexpected keys {sorted(keys)}")
        else:
            allowed = NCCL_INIT_FIELDS | (NCCL_INIT_033 if self.host.spec.vllm_version != "0.26" else frozenset())
            needed = NCCL_INIT_FIELDS
            if "nccl_unique_id_b64" in keys:
                needed = needed - {"master_address", "master_port"}
            if keys - allowed or needed - keys:
                raise VllmError(
                    f"Invalid init_info for NCCLWeightTransferEngine: missing {sorted(needed - keys)}, "
                    f"unexpected {sorted(keys - allowed)}"
                )
        self.initialized = True

    def start(self, target: str) -> None:
        """``start_weight_update`` / ``start_draft_weight_update``, with vLLM's checks in vLLM's order."""
        self._configured()
        if self.vllm is not None:
            raise VllmError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        slot = self.slot(target)
        if slot is None:
            raise VllmError("Draft model weight update requested, but no draft model is configured.")
        self.vllm = VllmSession(target, saved_content=slot.content, was_broken=slot.broken)
        slot.on_meta = True  # initialize_layerwise_reload: every layer on meta until loaded or finished

    def update(self, update_info: object) -> int:
        """``update_weights``: decode, check against the model, record; returns the bytes received."""
        self._configured()
        session = self.vllm
        if session is None:
            raise VllmError("start_weight_update must be called before update_weights.")
        if isinstance(update_info, list) and update_info and self.host.spec.vllm_version != "0.26":
            update_info = update_info[0]  # 0.33: one update_info per worker rank; every simulated rank is alike
        try:
            tensors = self._decode(update_info)
            if self.backend == "nccl" and not self.initialized:
                message = "NCCL weight transfer not initialized. Call init_transfer_engine() first."
                raise UpdateFailedError(message, shown=True)
            self._load(session, tensors)
        except UpdateFailedError as exc:
            self.fail_update(exc)
            raise
        return sum(r.nbytes for _, r in tensors)

    def fail_update(self, exc: UpdateFailedError) -> None:
        """The update raised: vLLM ends the session and the target stays on ``meta`` (destroyed)."""
        session, self.vllm = self.vllm, None
        if session is None:
            return
        for slot in self.reached(session.target):
            slot.on_meta, slot.broken = True, True
            slot.unclaim()
            slot.content = ("partial", "push:failed", None)
        if self.push is not None and self.push.target == session.target and self.push.error is None:
            self.push.error = exc.reason or "load_weights raised"

    def _decode(self, info: object) -> list[tuple[str, Received]]:
        """The simulated transport: every tensor's name, dtype, shape and hash, or ``UpdateFailedError``."""
        if not isinstance(info, dict):
            raise UpdateFailedError(f"Invalid update_info: expected an object, got {type(info).__name__}", shown=True)
        if IPC_KEYS & set(info):
            raise UpdateFailedError("the simulator cannot open CUDA IPC handles", shown=True)
        unexpected = set(info) - UPDATE_KEYS - IGNORED_KEYS
        missing = UPDATE_KEYS - set(info)
        if unexpected or missing:
            raise UpdateFailedError(
                f"Invalid update_info: missing {sorted(missing)}, unexpected {sorted(unexpected)}", shown=True
            )
        names, dtypes, shapes, payloads = (info[k] for k in ("names", "dtype_names", "shapes", "simulated_payload_b64"))
        lists = (names, dtypes, shapes, payloads)
        if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:
            raise UpdateFailedError("names, dtype_names, shapes and payloads must be lists of one length", shown=True)
        out: list[tuple[str, Received]] = []
        for name, dtype_name, shape, payload in zip(names, dtypes, shapes, payloads, strict=True):
            dtype = TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None:
                raise UpdateFailedError(f"module 'torch' has no attribute {dtype_name!r}", shown=True)
            ok = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            if not isinstance(name, str) or not ok or any(d < 0 for d in shape):
                raise UpdateFailedError(f"bad name or shape: {name!r} {shape!r}", shown=True)
            try:
                raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else None
            except (binascii.Error, ValueError):
                raw = None
            size = wdigest.DTYPE_SIZES[dtype] * math.prod(shape)
            if raw is None or len(raw) != size:
                got = "no base64" if raw is None else f"{len(raw)} bytes"
                raise UpdateFailedError(f"{name}: the payload holds {got}, {dtype}{shape} needs {size}", shown=True)
            out.append((name, Received(dtype, tuple(shape), blake3.blake3(raw).digest(), len(raw))))
        return out

    def _load(self, session: VllmSession, tensors: list[tuple[str, Received]]) -> None:
        """The target's ``load_weights``: names and shapes as the model's parameters (a failed update if not)."""
        target = session.target
        push = self.push if self.push is not None and self.push.target == target else None
        if session.was_broken:
            raise UpdateFailedError(f"the {target}'s parameters are on the meta device (a failed update)", shown=True)
        params = self.host.parameters(target)
        shared = self.host.spec.shared_tensors if target == "draft" else ()
        if push is not None:
            names = [name for name, _ in tensors]
            twice = sorted({n for n in names if names.count(n) > 1 or n in push.received})
            if twice:  # the extension raises inside load_weights: the update fails
                raise UpdateFailedError(f"received twice in one session: {', '.join(twice[:5])}", shown=True)
        for name, r in tensors:
            if params is not None:
                param = params.get(name)
                if param is None and not (shared and weights.matches_shared(name, shared)):
                    raise UpdateFailedError(f"the {target} has no parameter {name!r}", shown=True)
                if param is not None and param.shape != r.shape:
                    reason = f"{name}: shape {list(r.shape)} into a parameter of {list(param.shape)}"
                    raise UpdateFailedError(reason, shown=True)
            session.received[name] = r
            if push is not None:
                push.received[name] = r
                if shared and weights.matches_shared(name, shared):
                    push.skipped.append(name)

    def finish(self, weight_version: str | None) -> None:
        """``finish_weight_update``: commit what was received; a layer that got nothing keeps its tensors."""
        self._configured()
        session, self.vllm = self.vllm, None
        if session is None:
            raise VllmError("finish_weight_update called without a matching start_weight_update.")
        slot = self.slot(session.target)
        assert slot is not None
        if session.was_broken:
            return  # finalize puts back the saved "kernel tensors": still on meta
        slot.on_meta = False
        push = self.push if self.push is not None and self.push.target == session.target else None
        revision = None if push is None else push.revision
        if session.received:
            required = self.required(session.target)
            complete = set(session.received) >= required if required is not None else True
            kind = "pushed" if complete else "partial"
            slot.content = (kind, "push:" + combined_digest(session.received), revision)
            if push is None:
                slot.lost, slot.verified = True, False  # changed under the extension: its fingerprint differs
        else:
            slot.content = session.saved_content
        if weight_version is not None and self.host.spec.vllm_version != "0.26":
            self.host.weight_version = weight_version  # 0.33: finish_weight_update(weight_version)

    # --- the extension's RPCs ----------------------------------------------------------------------

    def push_group(self, kw: dict[str, Any]) -> dict[str, Any]:
        """``rolloutfleet_push_group``: remember the NCCL group joined, as ``rolloutfleet_worker.push``."""
        values = [kw.get(k) for k in ("epoch", "rank_offset", "world_size")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise PushError("invalid_group", f"epoch, rank_offset, world_size must be integers >= 0: {values}")
        epoch, offset, world = (int(v) for v in values)  # type: ignore[arg-type]
        if offset < 1 or world <= offset:
            raise PushError("invalid_group", f"rank_offset {offset} is not a rank of a group of {world}")
        self.group = {"epoch": epoch, "rank_offset": offset, "world_size": world}
        return {"ok": True, "epoch": epoch}

    def push_begin(self, kw: dict[str, Any]) -> dict[str, Any]:
        target, revision, epoch = kw.get("target"), kw.get("revision"), kw.get("epoch")
        if target not in ("verifier", "draft"):
            raise PushError("invalid_target", f"target must be 'verifier' or 'draft', got {target!r}")
        for field, value in (("revision", revision), ("epoch", epoch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PushError(f"invalid_{field}", f"{field} must be a non-negative integer, got {value!r}")
        assert isinstance(revision, int) and isinstance(epoch, int)
        if self.backend is None:
            raise PushError("no_transfer", "vLLM runs without --weight-transfer-config: no session can open")
        slot = self.slot(target)
        if slot is None:
            raise PushError("no_draft", "this engine (or this pipeline rank) has no draft model")
        if self.push is not None:
            raise PushError("busy", f"a {self.push.target} session (epoch {self.push.epoch}) is open")
        if self.vllm is not None:
            raise PushError("busy", f"vLLM has a {self.vllm.target} weight update open")
        if slot.unusable:
            raise PushError("destroyed", f"a failed weight-transfer session destroyed the {target}: restart")
        if target == "draft":
            if self.host.spec.draft_policy == "frozen":
                raise PushError("frozen", "the draft policy is frozen: its weights are never overwritten")
            v = self.host.verifier
            if v.lost or v.unusable or not v.verified or v.revision != revision or not self.host.weights_awake:
                held = v.revision if v.verified and not (v.lost or v.unusable) and self.host.weights_awake else None
                raise PushError("order", f"the verifier must hold revision {revision} verified first (it holds {held})")
        if not self.host.weights_awake:
            raise PushError("order", f"the {target} weights are not mapped (asleep): wake_up(tags=weights) first")
        self.push = PushSession(target, revision, epoch, time.monotonic())
        slot.unclaim()  # its content is about to change: nothing is claimed until push_end verifies it
        slot.lost = False
        return {"ok": True, "target": target, "revision": revision, "epoch": epoch}

    def push_end(self, kw: dict[str, Any]) -> dict[str, Any]:
        abandon = kw.get("abandon", False) is True
        session = self.push
        if session is None:
            raise PushError("no_session", "no push session is open")
        self.push = None
        slot = self.slot(session.target)
        assert slot is not None
        required = self.required(session.target)
        missing = sorted(required - set(session.received)) if required is not None else []
        what = f"the {session.target} session of epoch {session.epoch} (revision {session.revision})"
        received = sum(r.nbytes for r in session.received.values())
        failure: PushError | None = None
        if abandon:
            sent = f"{len(session.received)} tensors ({received} bytes)"
            failure = PushError("abandoned", f"{what} was abandoned after {sent}")
        elif session.error is not None:
            failure = PushError("failed", f"an update into {what} failed: {session.error}")
        elif self.vllm is not None:
            failure = PushError("failed", f"vLLM's side of {what} is still open: /finish_weight_update first")
        elif not session.received:
            failure = PushError("incomplete", f"no tensor reached the {session.target}'s load_weights in {what}")
        elif missing:
            assert required is not None
            shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
            failure = PushError(
                "incomplete",
                f"load_weights did not load {len(missing)} of {len(required)} parameters of the {session.target} "
                f"in {what}: {shown}",
            )
        if failure is not None:
            for reached in self.reached(session.target):
                reached.unclaim()
                reached.destroyed = True
            raise failure
        digest = combined_digest(session.received)
        slot.revision, slot.digest, slot.path, slot.verified = session.revision, digest, None, True
        slot.lost = False
        return {
            "ok": True,
            "target": session.target,
            "revision": session.revision,
            "epoch": session.epoch,
            "path": None,
            "digest": digest,
            "bytes": received,
            "seconds": round(time.monotonic() - session.started, 6),
            "tensors": len(session.received),
            "skipped": sorted(session.skipped),
        }

    def repair(self) -> bool:
        """``wake_up(tags=weights)`` after a failed update (measured): the parameters leave ``meta`` and fresh
        sessions work again; what they hold is unknown (the simulator reads zeros) and nothing is claimed.
        The extension's ``destroyed`` verdict stays. True when something was repaired."""
        repaired = False
        for slot in self.slots():
            in_session = self.vllm is not None and self.slot(self.vllm.target) is slot
            if slot.broken and not in_session:
                slot.broken, slot.on_meta, slot.content, slot.lost = False, False, None, True
                slot.unclaim()
                repaired = True
        return repaired
