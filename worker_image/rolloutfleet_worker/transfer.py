"""Inside one of vLLM's weight-transfer sessions: wrap, hash, count, and judge what was received.

Called by ``rolloutfleet_worker.push`` (the session RPCs' rules): begin opens a ``Session`` and installs it,
end asks it for a ``verdict`` and removes it. This module owns the mechanism: for the length of a session
it wraps, at instance level, the ``load_weights`` of the model vLLM's weight-transfer engine applies the
trainer's tensors to (the unwrapped verifier, or the drafter's model in a draft session: never a
CUDA-graph wrapper, whose attributes do not reach the module), so that every ``(name, tensor)`` received
passes through ``Session._load_weights``, which hashes it, records it for the digest
(``digest.DigestBuilder``: the project's one definition), counts it, and then hands it to the model's own
``load_weights``, keeping the names that returns. It also wraps the engine's ``update_weights``, so an
update that fails outside ``load_weights`` (a malformed ``update_info``, a missing IPC handle, a broken
collective) marks the session failed too.

vLLM calls ``load_weights`` with a list per call: one per ``/update_weights`` (IPC), one per tensor (NCCL),
or one per ~1 GiB chunk of views into a receive buffer that is reused (packed NCCL). Every tensor of a call
is hashed before the call is handed on. vLLM's session start moves the target's parameters to the meta
device until its finish (layerwise reload), so nothing here reads a parameter between the two except for
metadata (names, shapes, devices).

Tensor parallelism: every worker of an engine receives the full tensors (NCCL broadcasts them to every
rank; IPC gives each rank a handle on its own GPU), and each rank's ``load_weights`` keeps its shard. Each
rank hashes the full tensors it received, so every rank reports the same digest when the trainer sent the
same bytes to all of them; the operator compares the ranks' answers and refuses a disagreement. The
parameter names and element counts a rank checks are its own shards'.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch

import rolloutfleet_digest as digest
from rolloutfleet_worker import blake3_device, loader_base, models
from rolloutfleet_worker.payloads import ErrorCode

# torch dtype -> safetensors spelling (the digest's), the inverse of the loader's table.
SAFETENSORS_NAMES: dict[torch.dtype, str] = {
    dt: st
    for st, attr in loader_base.TORCH_DTYPE_NAMES.items()
    if isinstance(dt := getattr(torch, attr, None), torch.dtype)
}
CHUNK_LEN = blake3_device.CHUNK_LEN  # tensors of at most one BLAKE3 chunk are hashed on the host
HOST_BATCH_BYTES = 64 << 20  # device bytes copied to host in one go (small tensors and hash tails)
ALIGN = 16  # the device hash reads int32 words: a view at an odd offset into a buffer is copied first
MAX_NAMED = 5  # names quoted in a message; the count says how many more

DeviceHash = Callable[[torch.device], bool]


class ReceiveError(ValueError):
    """A received tensor that cannot be hashed or recorded (bad name, unknown dtype, no data, twice)."""


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes in row-major order as a 1-D uint8 tensor on its device (a copy only when not
    dense: the digest is of the bytes a safetensors file would hold)."""
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _host_hash(data: torch.Tensor) -> bytes:
    h: bytes = blake3.blake3(data.numpy().data, max_threads=blake3.blake3.AUTO).digest()
    return h


def _batches(parts: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
    """``parts`` grouped by device into runs of at most ``HOST_BATCH_BYTES`` (a larger part goes alone)."""
    out: list[list[tuple[int, torch.Tensor]]] = []
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for part in parts:
        by_device.setdefault(part[1].device, []).append(part)
    for group in by_device.values():
        run: list[tuple[int, torch.Tensor]] = []
        size = 0
        for key, t in group:
            if run and size + t.numel() > HOST_BATCH_BYTES:
                out.append(run)
                run, size = [], 0
            run.append((key, t))
            size += t.numel()
        if run:
            out.append(run)
    return out


def _to_host(run: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """The parts of one run as host uint8 tensors, with one device-to-host copy for the whole run."""
    if len(run) == 1:
        return [run[0][1].cpu()]
    host = torch.cat([t for _, t in run]).cpu()
    sizes = [int(t.numel()) for _, t in run]
    return list(torch.split(host, sizes))


def hash_received(tensors: Sequence[torch.Tensor], device_hash: DeviceHash) -> tuple[list[bytes], int]:
    """The BLAKE3 of each tensor's raw bytes (32 bytes each, in order), and how many bytes the device hashed.

    Tensors of more than one chunk on a device ``device_hash`` accepts are hashed there
    (``blake3_device``, queued on the current stream, read back with one sync per device); the others
    (and the tails shorter than a chunk) cross to host in batches and are hashed there. The results do not
    depend on where a tensor was hashed.
    """
    out: list[bytes | None] = [None] * len(tensors)
    on_device: list[tuple[int, torch.Tensor]] = []
    to_host: list[tuple[int, torch.Tensor]] = []  # key i: whole tensor i; key -1-i: the tail of tensor i
    for i, tensor in enumerate(tensors):
        flat = _flat(tensor)
        if int(flat.numel()) > CHUNK_LEN and device_hash(flat.device):
            if flat.data_ptr() % ALIGN:
                flat = flat.clone()
            on_device.append((i, flat))
            full = int(flat.numel()) // CHUNK_LEN * CHUNK_LEN
            if full < flat.numel():
                to_host.append((-1 - i, flat[full:]))
        elif flat.device.type == "cpu":
            out[i] = _host_hash(flat)
        else:
            to_host.append((i, flat))
    tails: dict[int, bytes] = {}
    for run in _batches(to_host):
        for (key, _), data in zip(run, _to_host(run), strict=True):
            if key >= 0:
                out[key] = _host_hash(data)
            else:
                tails[-1 - key] = bytes(data.numpy())
    results: dict[torch.device, list[tuple[int, Any]]] = {}
    for i, flat in on_device:
        if flat.device.type == "cuda":
            with torch.cuda.device(flat.device):
                words = blake3_device.hash_on_device(flat, tails.get(i))
        else:  # the unit tests: Triton's interpreter on the CPU
            words = blake3_device.hash_on_device(flat, tails.get(i))
        results.setdefault(flat.device, []).append((i, words))
    for queued in results.values():
        rows = torch.stack([w for _, w in queued]).cpu().tolist()
        for (i, _), row in zip(queued, rows, strict=True):
            out[i] = blake3_device.words_to_bytes([w & 0xFFFFFFFF for w in row])
    hashes = [h for h in out if h is not None]
    assert len(hashes) == len(tensors)
    return hashes, sum(int(flat.numel()) for _, flat in on_device)


def _names(value: object) -> bool:
    """Whether ``value`` is what vLLM's ``load_weights`` returns: a collection of parameter names."""
    return isinstance(value, Collection) and not isinstance(value, str) and all(isinstance(n, str) for n in value)


def named(names: Collection[str]) -> str:
    """A few of ``names`` for a message, sorted, with how many more there are."""
    shown = sorted(names)[:MAX_NAMED]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more > 0 else "")


@dataclass
class _Wrap:
    """One instance attribute a session set, and what to put back."""

    owner: Any
    name: str
    had: bool  # the instance held the attribute itself before (not only its class)
    previous: Any
    wrapper: Any


@dataclass(eq=False)
class Session:
    """One open weight-transfer session on one worker: what it receives, and whether it was complete.

    ``required``: the target's parameter names (shared ones excluded) that ``load_weights`` must report
    loaded, recorded at begin, before vLLM's start moved them to meta (None: a quantized target, whose
    quantization may create parameters no trainer sends: then only ``need_elements`` and the feed count);
    ``need_elements``: how many elements of this rank's parameters the fed tensors must at least hold
    (None: not checked); ``skip``: received names that land in parameters the draft shares with the
    verifier (hashed and counted, never applied: the draft does not overwrite the verifier).
    """

    target: str
    revision: int
    epoch: int
    model: Any
    required: list[str] | None
    need_elements: int | None
    skip: Callable[[str], bool] = lambda _name: False
    device_hash: DeviceHash = lambda _device: False
    opened: float = field(default_factory=time.monotonic)
    builder: digest.DigestBuilder = field(default_factory=digest.DigestBuilder)
    tensors: int = 0
    bytes: int = 0
    device_hashed_bytes: int = 0
    elements: int = 0  # elements of the tensors handed to load_weights
    calls: int = 0  # load_weights calls seen
    loaded: set[str] = field(default_factory=set)
    unreported: bool = False  # a load_weights call returned None: it cannot say what it filled
    malformed: str | None = None  # a load_weights call returned something that is not a set of names
    skipped: list[str] = field(default_factory=list)
    error: str | None = None  # the first exception an update raised
    wraps: list[_Wrap] = field(default_factory=list)

    @property
    def age(self) -> float:
        return time.monotonic() - self.opened

    # -- the wrappers ----------------------------------------------------------------------------------

    def install(self, engine: Any | None) -> None:
        """Wrap ``model.load_weights`` (and ``engine.update_weights`` when vLLM's engine is given)."""
        original = self.model.load_weights

        def load_weights(weights: Any) -> Any:
            return self._load_weights(original, weights)

        self._set(self.model, "load_weights", load_weights)
        update = getattr(engine, "update_weights", None) if engine is not None else None
        if callable(update):

            def update_weights(*args: Any, **kwargs: Any) -> Any:
                try:
                    return update(*args, **kwargs)
                except BaseException as exc:
                    self._failed(exc)
                    raise

            self._set(engine, "update_weights", update_weights)

    def _set(self, owner: Any, name: str, wrapper: Any) -> None:
        own = getattr(owner, "__dict__", {})
        self.wraps.append(_Wrap(owner, name, name in own, own.get(name), wrapper))
        setattr(owner, name, wrapper)

    def uninstall(self) -> list[str]:
        """Remove every wrapper this session set (idempotent); names of the ones someone replaced since."""
        replaced = []
        while self.wraps:
            w = self.wraps.pop()
            current = getattr(w.owner, "__dict__", {}).get(w.name)
            if current is not w.wrapper:
                replaced.append(f"{type(w.owner).__name__}.{w.name}")  # leave the newer one alone
            elif w.had:
                setattr(w.owner, w.name, w.previous)
            else:
                delattr(w.owner, w.name)
        return replaced

    def _failed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def _load_weights(self, original: Callable[[Any], Any], weights: Any) -> Any:
        try:
            items = list(weights)  # vLLM passes a list; anything else is read once, here
            self.calls += 1
            self._receive(items)
            fed = [(name, t) for name, t in items if not self.skip(name)]
            self.skipped.extend(name for name, _ in items if self.skip(name))
            loaded = original(fed) if fed else set()
            self.elements += sum(int(t.numel()) for _, t in fed)
            if loaded is None:
                self.unreported = True
            elif _names(loaded):
                self.loaded.update(loaded)
            else:
                self.malformed = type(loaded).__name__
            return loaded
        except BaseException as exc:
            self._failed(exc)
            raise

    def _receive(self, items: list[Any]) -> None:
        """Hash and record one call's tensors (before the model sees them: a packed buffer is reused)."""
        metas = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ReceiveError(f"load_weights got {type(item).__name__}, not a (name, tensor) pair")
            name, tensor = item
            if not isinstance(name, str) or not name:
                raise ReceiveError(f"a received tensor's name must be a non-empty string, got {name!r}")
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.device.type == "meta":
                raise ReceiveError(f"{name}: received {type(tensor).__name__} without raw bytes to hash")
            dtype = SAFETENSORS_NAMES.get(tensor.dtype)
            if dtype is None:
                raise ReceiveError(f"{name}: dtype {tensor.dtype} has no safetensors name, so no digest")
            nbytes = int(tensor.numel()) * tensor.element_size()
            metas.append((name, dtype, tuple(int(d) for d in tensor.shape), nbytes))
        counts = collections.Counter(m[0] for m in metas)
        twice = {n for n, c in counts.items() if c > 1 or n in self.builder}
        if twice:
            raise ReceiveError(f"received twice in one session: {named(twice)}")
        hashes, on_device = hash_received([t for _, t in items], self.device_hash)
        for (name, dtype, shape, nbytes), h in zip(metas, hashes, strict=True):
            info = digest.TensorInfo(name, dtype, shape, Path(f"<{self.target} session {self.epoch}>"), 0, nbytes)
            self.builder.add(info, h)
        self.tensors += len(items)
        self.bytes += sum(m[3] for m in metas)
        self.device_hashed_bytes += on_device

    # -- the end ---------------------------------------------------------------------------------------

    def verdict(self, *, abandon: bool, vllm_open: bool) -> tuple[ErrorCode, str] | None:
        """Why the session cannot be trusted, as (code, message); None when it was complete.

        ``vllm_open``: vLLM still has its session open (``/finish_weight_update`` was not called, so the
        layerwise reload never committed). Reads parameter metadata only.
        """
        what = f"the {self.target} session of epoch {self.epoch} (revision {self.revision})"
        if abandon:
            return "abandoned", f"{what} was abandoned after {self.tensors} tensors ({self.bytes} bytes)"
        if self.error is not None:
            return "failed", f"an update into {what} failed: {self.error}"
        if vllm_open:
            return "failed", f"vLLM's side of {what} is still open: /finish_weight_update first"
        if self.tensors == 0:
            return "incomplete", f"no tensor reached the {self.target}'s load_weights in {what}"
        if self.malformed is not None:
            return "incomplete", f"load_weights returned {self.malformed}, not the set of loaded names"
        if self.required is not None and not self.unreported:
            missing = set(self.required) - self.loaded
            if missing:
                return "incomplete", (
                    f"load_weights did not load {len(missing)} of {len(set(self.required))} parameters of the "
                    f"{self.target} in {what} (not sent, or sent under names the model does not map?): "
                    f"{named(missing)}"
                )
        if self.need_elements is not None and self.elements < self.need_elements:
            return "incomplete", (
                f"the {self.tensors - len(self.skipped)} tensors applied in {what} hold {self.elements} elements; "
                f"the {self.target}'s parameters on this rank need {self.need_elements}"
            )
        on_meta = models.on_meta(self.model)
        if on_meta:
            return "failed", f"{len(on_meta)} parameters are still on the meta device after {what}: {named(on_meta)}"
        return None
