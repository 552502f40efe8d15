"""Configuration of simulated engines: model/draft shape, simulated latencies, injected faults.

Read by ``rolloutfleet.sim.fleet`` (embedding API), ``rolloutfleet.sim.commands`` (``--config FILE``)
and the admin routes (faults at runtime). Everything is plain frozen data parsed from JSON-like dicts:

    {"token_file": "...", "synthetic_root": "/synthetic", "defaults": {<EngineSpec>},
     "latencies": {"steps": {"pause": 0.01}, "load_bytes_per_s": 2e9, ...},
     "faults": [{"engine": "127.1.0.5:8000", "step": "rolloutfleet_load:draft", "kind": "http_error",
                 "status": 500, "body": {"error": "boom"}, "count": 1}]}

A fault's ``step`` is a route name (``pause``, ``wake_up``, ``reset_prefix_cache``, ``completions``,
``init_weight_transfer_engine``, ``update_weights``...), an RPC name (``rolloutfleet_load``,
``rolloutfleet_push_begin``), or a refined key: ``wake_up:weights``, ``wake_up:kv_cache``, ``sleep:2``,
``rolloutfleet_load:verifier``, ``rolloutfleet_load:draft``, ``rolloutfleet_push_begin:draft``,
``rolloutfleet_load:staged`` (a staged load, i.e. a commit: docs/staging.md); ``*`` matches every step.
Staged updates have two faults of their own: ``fail_stage`` on ``rolloutfleet_stage`` (the stage's readers
fail: phase ``failed``, code ``io``) and ``corrupt_load`` on a staged load (the extension's check of the
bytes that reached the GPU catches it: ``staged_mismatch``).

``EngineSpec.weight_transfer`` is vLLM's ``--weight-transfer-config`` (``{"backend": "ipc"|"nccl"}``;
None: the flag is absent and the session routes fail as vLLM's do); ``weight_transfer_from_args`` reads
it from a ``vllm serve`` argument list.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any


class FaultKind(enum.StrEnum):
    HTTP_ERROR = "http_error"  # answer status/body instead of acting (or after acting: phase="after")
    TIMEOUT = "timeout"  # never answer (the handler hangs until the client gives up)
    CRASH = "crash"  # drop the connection and stop listening; the engine restarts with fresh state
    SLOW = "slow"  # add ``delay`` seconds, then act normally
    CORRUPT_LOAD = "corrupt_load"  # the load "succeeds" but reports (and holds) a wrong digest
    SPLIT_RANKS = "split_ranks"  # rank 1 reports a different digest (a stage: revision) than rank 0 (TP disagreement)
    # A collective with a dead peer (weight-transfer steps: ``update_weights``, ``init_weight_transfer_engine``):
    # the call blocks inside the engine core, holding it (later RPCs and session calls queue behind it), and
    # a client that gives up frees nothing. ``delay`` > 0 ends it after that many seconds as a failure
    # (vLLM's 300 s TCPStore timeout at init); 0 blocks until the engine crashes or restarts.
    HANG = "hang"
    # ``rolloutfleet_stage``: the stage answers as usual, then its background readers fail (a file that
    # vanished, a short read) once its simulated time is half spent: phase ``failed``, code ``io``.
    FAIL_STAGE = "fail_stage"


@dataclasses.dataclass(frozen=True, slots=True)
class FaultRule:
    """One injected fault. ``count`` None = every matching call; ``skip`` lets the first N calls through."""

    step: str
    kind: FaultKind
    status: int = 500
    body: Any = None
    delay: float = 0.0
    count: int | None = 1
    skip: int = 0
    phase: str = "before"  # http_error only: "after" acts first, then answers the error (lost answer)
    restart_after: float | None = None  # crash only: listen again after this many seconds

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultRule:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known - {"engine"}
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        if data.get("phase", "before") not in ("before", "after"):
            raise ValueError("fault phase must be 'before' or 'after'")
        fields = {k: v for k, v in data.items() if k in known}
        fields["kind"] = FaultKind(fields["kind"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kind"] = str(self.kind)
        return out


STAGED_LOAD_KEY = "rolloutfleet_load:staged"  # the step key of a staged load (a commit), after its target's

Faults = dict[FaultKind, FaultRule]
"""The faults that fired for one step and act inside it (corrupt_load, split_ranks, hang, fail_stage), by kind."""


@dataclasses.dataclass(frozen=True, slots=True)
class Latencies:
    """Simulated durations. ``steps`` maps a step key (as for faults) to fixed seconds.

    Loads take ``steps['rolloutfleet_load']`` + bytes / ``load_bytes_per_s`` (0 = instant), so a 70B
    verifier is slower than its draft, as on a GPU. ``wake_up:weights`` re-maps memory: + bytes /
    ``wake_bytes_per_s``. ``token_s`` is the time per generated token of ``/v1/completions``.

    Staged updates (docs/staging.md): a stage fills its staging area in the background (the RPC answers at
    once) in ``stage_s`` + bytes / ``stage_bytes_per_s``, then reads and hashes the real files; a staged
    load (the commit) takes ``commit_s`` + bytes / ``commit_bytes_per_s`` *instead of* the load's latency
    (``steps`` keys of the load included): it copies from pinned host memory instead of reading files.
    """

    steps: dict[str, float] = dataclasses.field(default_factory=dict)
    load_bytes_per_s: float = 0.0
    wake_bytes_per_s: float = 0.0
    token_s: float = 0.0
    stage_s: float = 0.0
    stage_bytes_per_s: float = 0.0
    commit_s: float = 0.0
    commit_bytes_per_s: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Latencies:
        data = dict(data or {})
        return cls(
            steps={str(k): float(v) for k, v in (data.pop("steps", None) or {}).items()},
            **{k: float(v) for k, v in data.items()},
        )

    def fixed(self, keys: list[str]) -> float:
        """The fixed latency of the most specific key configured (keys go from generic to specific).

        A staged load (``rolloutfleet_load:staged`` among its keys) is a commit: ``commit_s``, whatever the
        load's own keys say."""
        if STAGED_LOAD_KEY in keys:
            return self.commit_s
        for key in reversed(keys):
            if key in self.steps:
                return self.steps[key]
        return 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpec:
    """The shape of one simulated engine, i.e. what ``vllm serve`` flags would give a real one."""

    verifier_path: str = "/synthetic/verifier/initial"
    draft_path: str | None = "/synthetic/draft/initial"  # None: no speculative decoding
    draft_method: str | None = "draft_model"
    draft_policy: str = "coUpdate"  # or "frozen"
    num_speculative_tokens: int = 3
    sleep_mode: bool = True  # --enable-sleep-mode
    tp_size: int = 1  # tensor-parallel ranks: collective_rpc answers one result per rank
    vllm_version: str = "0.33"  # "0.26": no /weight_info or /update_weight_version (404)
    served_model_name: str = "policy"
    vocab_size: int = 2048
    shared_tensors: tuple[str, ...] = ()  # tensors the draft shares with the verifier (EAGLE embed/lm_head)
    reject_while_paused: bool = True  # new requests in abort/wait pause: 503 (DESIGN §4) vs held like keep
    weight_transfer: dict[str, Any] | None = None  # --weight-transfer-config; None: the session routes fail
    # The image's extension stages (docs/staging.md). False plays an older image: no stage RPCs (a worker
    # AttributeError, 500), no ``staged`` in its state, and a load refuses the ``staged`` argument (500).
    staging: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> EngineSpec:
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown engine fields: {sorted(unknown)}")
        if "shared_tensors" in data:
            data["shared_tensors"] = tuple(data["shared_tensors"])
        if data.get("draft_policy", "coUpdate") not in ("coUpdate", "frozen"):
            raise ValueError("draft_policy must be coUpdate or frozen")
        if data.get("weight_transfer") is not None:
            data["weight_transfer"] = check_weight_transfer(data["weight_transfer"])
        return cls(**data)


TRANSFER_BACKENDS = ("ipc", "nccl")  # what the simulator plays (vLLM also has sparse_nccl)
WEIGHT_TRANSFER_FLAG = "--weight-transfer-config"


def check_weight_transfer(config: object) -> dict[str, Any]:
    """A ``--weight-transfer-config`` payload the simulator can play, or ValueError."""
    if not isinstance(config, dict) or config.get("backend", "nccl") not in TRANSFER_BACKENDS:
        raise ValueError(f"weight_transfer must be an object with backend in {TRANSFER_BACKENDS}, got {config!r}")
    return {"backend": "nccl", **config}  # vLLM's WeightTransferConfig defaults the backend to nccl


def weight_transfer_from_args(args: list[str]) -> dict[str, Any] | None:
    """``--weight-transfer-config JSON`` (or ``=JSON``) from a ``vllm serve`` argument list; None when absent."""
    for i, arg in enumerate(args):
        if arg == WEIGHT_TRANSFER_FLAG and i + 1 < len(args):
            return check_weight_transfer(json.loads(args[i + 1]))
        if arg.startswith(WEIGHT_TRANSFER_FLAG + "="):
            return check_weight_transfer(json.loads(arg.partition("=")[2]))
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class WeightsConfig:
    """Synthetic weights: paths under ``synthetic_root`` are not read (benchmarks of 1,000 engines).

    Their digest is ``blake3:`` + BLAKE3 of the path (deterministic, so every engine loading the same path
    agrees), their size ``verifier_bytes`` / ``draft_bytes`` (selected by the load target).
    """

    synthetic_root: str | None = "/synthetic"
    verifier_bytes: int = 16 * 2**30
    draft_bytes: int = 1 * 2**30
    tensors: int = 291

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> WeightsConfig:
        return cls(**dict(data or {}))
