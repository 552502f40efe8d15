"""Senders: how the push client hands one session's tensors to one engine (``POST /update_weights``).

Called by ``rolloutfleet.trainer.push`` once per target and epoch: ``prepare`` turns the named tensors into
vLLM's ``update_info`` (once for all the pods of the epoch), then ``send`` posts it to each pod's engine
with the fleet's control token (the push client runs several sends at once, bounded), and ``release``
drops what the update kept alive once every send returned. Two senders:

- ``IpcSender``: real vLLM engines on the trainer's GPUs (vLLM's ``ipc`` weight-transfer backend over
  HTTP): ``{"names", "dtype_names", "shapes", "ipc_handles_pickled"}``, the handles a base64 pickle of one
  ``{gpu_uuid: reduce_tensor(t)[1]}`` per tensor (``torch.multiprocessing.reductions``: the arguments vLLM
  passes to ``rebuild_cuda_tensor``), dtypes in torch's spelling (``bfloat16``). The engine maps the
  tensors from the trainer's memory; they must stay alive and unchanged until its call returns
  (``Prepared.keepalive``, dropped by ``release``). Each engine worker looks its own GPU's UUID up, so a
  tensor reaches the engines whose workers share its GPU.
- ``SimulatedSender``: the engine simulator (``rolloutfleet.sim``), GPU-free:
  ``{"names", "dtype_names", "shapes", "simulated_payload_b64"}``, each tensor's raw bytes in base64.

A sender owns its wire format; ``post_update`` is the one HTTP call. A custom sender subclasses ``Sender``.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import http.client
import json
import pickle
from collections.abc import Sequence
from typing import Any, ClassVar

from rolloutfleet.trainer import digest as tensor_digest
from rolloutfleet.trainer import tensors as torch_tensors
from rolloutfleet.trainer.digest import RawTensor
from rolloutfleet.trainer.errors import InvalidTensors, PushUnsupported, SendError

UPDATE_PATH = "/update_weights"
_BODY_PREVIEW = 600  # bytes of an error answer kept for the message


@dataclasses.dataclass
class Prepared:
    """One ``update_info`` ready to post to every pod of an epoch; drop it once every send returned."""

    body: bytes  # the JSON request body, encoded once
    tensors: int
    nbytes: int
    keepalive: list[Any] = dataclasses.field(default_factory=list)  # what the body's handles point into


class Sender(abc.ABC):
    """Turns named tensors into an ``update_info`` and posts it to one engine."""

    name: ClassVar[str] = "sender"
    backends: ClassVar[frozenset[str] | None] = None  # fleet weightTransfer backends it can feed (None: any)

    @abc.abstractmethod
    def update_info(self, items: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
        """``(update_info, keepalive)`` for these tensors, in this order; ValueError for one it cannot send."""

    def check(self, items: Sequence[tuple[str, Any]], target: str = "tensors") -> None:
        """Refuse (InvalidTensors) what this sender cannot send, before the revision exists; override to add.

        ``items`` are ``TensorSource.items()``: ``(name, torch tensor or RawTensor)`` pairs.
        """
        tensor_digest.describe_all(items, target)

    def prepare(self, tensors: tensor_digest.TensorProvider, target: str = "tensors") -> Prepared:
        """The request body for these tensors (any tensor provider, in its order); InvalidTensors names the
        one this sender cannot send."""
        items = tensor_digest.TensorSource(tensors, target).items()
        self.check(items, target)
        metas = tensor_digest.describe_all(items, target)
        try:
            info, keep = self.update_info(items)
        except ValueError as exc:
            raise InvalidTensors(target, str(exc)) from None
        body = json.dumps({"update_info": info}, separators=(",", ":")).encode()
        return Prepared(body, len(metas), sum(m.nbytes for m in metas), keep)

    def send(self, address: str, token: str, prepared: Prepared, timeout: float) -> None:
        """POST the prepared update to the engine at ``address``; SendError if it did not take it."""
        post_update(address, token, prepared.body, timeout)

    def release(self, prepared: Prepared) -> None:
        """Called once every send of ``prepared`` returned: drop what it kept alive."""
        prepared.keepalive.clear()

    group_epoch: int | None = None  # NCCL: the transfer group this sender is rank 0 of

    def join_group(self, epoch: int, world_size: int) -> str:
        """NCCL: start waiting as rank 0 of a transfer group of ``world_size`` ranks and return the
        ``host:port`` the engines join at. Senders that cannot drive a NCCL group refuse."""
        raise PushUnsupported(f"the {self.name} sender cannot join a NCCL transfer group")

    def rendezvous_address(self) -> str:
        """NCCL: the ``host:port`` where this sender waits as rank 0 (before or after a join)."""
        raise PushUnsupported(f"the {self.name} sender cannot join a NCCL transfer group")


def _metadata(items: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    metas = [tensor_digest.describe(name, value) for name, value in items]
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.torch_dtype for m in metas],  # vLLM's spelling: torch's
        "shapes": [list(m.shape) for m in metas],
    }


class SimulatedSender(Sender):
    """For the engine simulator: the raw bytes of every tensor, base64, beside vLLM's metadata.

    For a NCCL fleet it also plays rank 0 of the group: the simulated engines join at once (the simulator
    opens no socket), so ``join_group`` only names the address (``rendezvous``, loopback by default) and
    every engine still gets its own copy of the bytes instead of one broadcast.
    """

    name = "simulated"

    def __init__(self, rendezvous: str = "127.0.0.1:29600") -> None:
        self.rendezvous = rendezvous

    def join_group(self, epoch: int, world_size: int) -> str:
        self.group_epoch = epoch
        return self.rendezvous

    def rendezvous_address(self) -> str:
        return self.rendezvous

    def update_info(self, items: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
        payload = []
        for _, value in items:
            data = value.data if isinstance(value, RawTensor) else torch_tensors.host_bytes(value)
            payload.append(base64.b64encode(data).decode("ascii"))
        return {**_metadata(items), "simulated_payload_b64": payload}, []


class IpcSender(Sender):
    """For vLLM on the trainer's GPUs (backend ``ipc``): CUDA IPC handles of the trainer's own tensors."""

    name = "ipc"
    backends = frozenset({"ipc"})

    def check(self, items: Sequence[tuple[str, Any]], target: str = "tensors") -> None:
        super().check(items, target)
        for name, value in items:
            if isinstance(value, RawTensor) or value.device.type != "cuda":
                where = "raw bytes" if isinstance(value, RawTensor) else f"on {value.device}"
                raise InvalidTensors(target, f"{name}: CUDA IPC sends torch tensors on a GPU, this one is {where}")

    def update_info(self, items: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
        for name, value in items:
            if isinstance(value, RawTensor):
                raise ValueError(f"{name}: CUDA IPC sends torch tensors on a GPU, not raw bytes")
        handles, keep = torch_tensors.ipc_handles(items)
        pickled = base64.b64encode(pickle.dumps(handles)).decode("ascii")
        return {**_metadata(items), "ipc_handles_pickled": pickled}, keep

    def release(self, prepared: Prepared) -> None:
        super().release(prepared)
        torch_tensors.ipc_collect()


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as the operator lists it; ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"engine address {address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _answer_message(status: int, body: bytes) -> str:
    text = body[:_BODY_PREVIEW].decode("utf-8", "replace")
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error")
        detail = (err.get("message") if isinstance(err, dict) else err) or parsed.get("detail") or parsed.get("message")
        if detail:
            text = str(detail)
    text = " ".join(text.split())[:_BODY_PREVIEW]
    return f"HTTP {status}" + (f": {text}" if text else " (empty answer)")


def post_update(address: str, token: str, body: bytes, timeout: float) -> None:
    """``POST http://ADDRESS/update_weights`` with the bearer token; return once the engine answered 200.

    The engine answers when the tensors are loaded, so ``timeout`` (seconds per connect and per read) must
    cover the load. SendError carries the engine's message (HTTP status and its error text), or why no
    answer came (refused, reset, timed out).
    """
    try:
        host, port = split_address(address)
    except ValueError as exc:
        raise SendError(str(exc)) from None
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            "POST",
            UPDATE_PATH,
            body=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        response = conn.getresponse()
        answer = response.read()
        if response.status != 200:
            raise SendError(_answer_message(response.status, answer))
    except TimeoutError:
        raise SendError(f"no answer within {timeout:g}s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise SendError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    finally:
        conn.close()
