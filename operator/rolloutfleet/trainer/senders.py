"""Senders: how the push client hands one session's tensors to one engine (``POST /update_weights``).

Called by ``rolloutfleet.trainer.push`` once per target and epoch: ``prepare`` turns the named tensors into
vLLM's ``update_info`` (once for all the pods of the epoch), then ``send`` posts it to each pod's engine
with the fleet's control token (the push client runs several sends at once, bounded), and ``release``
drops what the update kept alive once every send returned. Three senders:

- ``IpcSender``: real vLLM engines on the trainer's GPUs (vLLM's ``ipc`` weight-transfer backend over
  HTTP): ``{"names", "dtype_names", "shapes", "ipc_handles_pickled"}``, the handles a base64 pickle of one
  ``{gpu_uuid: reduce_tensor(t)[1]}`` per tensor (``torch.multiprocessing.reductions``: the arguments vLLM
  passes to ``rebuild_cuda_tensor``), dtypes in torch's spelling (``bfloat16``). The engine maps the
  tensors from the trainer's memory; they must stay alive and unchanged until its call returns
  (``Prepared.keepalive``, dropped by ``release``). Each engine worker looks its own GPU's UUID up, so a
  tensor reaches the engines whose workers share its GPU.
- ``NcclSender``: real vLLM engines on other GPUs or hosts (backend ``nccl``): the trainer is rank 0 of
  the fleet's transfer group (``join_group`` serves the rendezvous the operator's JoinGroup steps join);
  ``update_info`` is only ``{"names", "dtype_names", "shapes"}`` (plus ``packed``), and the bytes travel by
  one broadcast to every engine of the group at once, while each engine's ``/update_weights`` call waits
  for them (``collective``: ``deliver`` runs the broadcast beside all the posts).
- ``SimulatedSender``: the engine simulator (``rolloutfleet.sim``), GPU-free:
  ``{"names", "dtype_names", "shapes", "simulated_payload_b64"}``, each tensor's raw bytes in base64.

A sender owns its wire format; ``post_update`` is the one HTTP call and ``deliver`` sends one prepared
update to every engine of an epoch. A custom sender subclasses ``Sender``.
"""

from __future__ import annotations

import abc
import base64
import concurrent.futures
import dataclasses
import http.client
import json
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from rolloutfleet.api import common
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
    # One broadcast feeds every engine of an epoch at once (NCCL): ``deliver`` posts to all of them together
    # (never bounded by the push client's concurrency: a receiver left out would hang the broadcast) and
    # runs ``broadcast`` beside the posts.
    collective: ClassVar[bool] = False

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

    def configure(self, weight_transfer: dict[str, Any]) -> None:
        """Called with the fleet's ``spec.weightTransfer`` before anything is created: adopt or refuse
        (PushUnsupported) its options. The default takes none."""
        del weight_transfer  # point-to-point senders have no option the engines must agree on

    def broadcast(self, prepared: Prepared, timeout: float, cancel: threading.Event) -> None:
        """Collective senders: move the bytes of ``prepared`` to every receiver at once, returning when they
        have them; SendError after ``timeout`` seconds, or as soon as ``cancel`` is set (a receiver refused)."""
        raise SendError(f"the {self.name} sender does not broadcast")

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


def _gpu_tensors_only(items: Sequence[tuple[str, Any]], target: str, how: str) -> None:
    """InvalidTensors for the first item that is not a torch tensor on a GPU (``how``: "CUDA IPC sends")."""
    for name, value in items:
        if isinstance(value, RawTensor) or value.device.type != "cuda":
            where = "raw bytes" if isinstance(value, RawTensor) else f"on {value.device}"
            raise InvalidTensors(target, f"{name}: {how} torch tensors on a GPU, this one is {where}")


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
        _gpu_tensors_only(items, target, "CUDA IPC sends")

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


class NcclTransport(Protocol):
    """What ``NcclSender`` needs of NCCL: ``rolloutfleet.trainer.nccl.VllmNccl`` (vLLM's), or a test's fake."""

    def current_device(self) -> int: ...

    def open_group(self, host: str, port: int, world_size: int, device: int) -> Any: ...

    def broadcast(self, group: Any, tensors: Sequence[tuple[str, Any]], packed: bool, device: int) -> None: ...


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the group's rendezvous binds it moments later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class NcclSender(Sender):
    """For vLLM engines on other GPUs (backend ``nccl``): rank 0 of the fleet's transfer group.

    ``host``: the address the engines reach this process at (the trainer pod's IP; the rendezvous and NCCL's
    own sockets listen there). ``port``: the rendezvous port (0: a free one, a new one per group; a fixed
    port must be free again when the operator forms a new group). ``packed``: vLLM's packed broadcast (many
    tensors per NCCL call; on vLLM 0.26 the flag travels in ``update_info``; on vLLM >= 0.28 the engines
    take it at the group's init, so the fleet's ``weightTransfer.nccl.packed`` must say the same: ``None``
    follows the fleet). ``join_timeout``: how long a broadcast waits for the group to be formed.

    The group is formed on a thread (vLLM's rank 0 blocks until every engine worker joined): ``join_group``
    returns at once with the address to publish. A broadcast that does not complete within its timeout
    (a receiver died or refused the update, and NCCL waits for it forever) leaves the group unusable: every
    later broadcast on it fails at once, until the operator forms a new group (a new epoch, after it
    restarted the engines that were stuck), which ``join_group`` then serves on a new communicator.
    The stuck broadcast's thread and its CUDA stream stay blocked for the life of this process (NCCL cannot
    be interrupted); the training loop's own stream is not affected.
    """

    name = "nccl"
    backends = frozenset({"nccl"})
    collective = True

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        packed: bool | None = None,
        join_timeout: float = 300.0,
        transport: NcclTransport | None = None,
    ) -> None:
        if not host or host in ("0.0.0.0", "::"):  # noqa: S104 - refused, not bound
            raise ValueError("NcclSender needs the address the engines reach this trainer at, not a wildcard")
        self.host = host
        self.fixed_port = port
        self.port = port or free_port(host)
        self.packed = packed
        self.join_timeout = join_timeout
        self._transport = transport
        self._group: concurrent.futures.Future[Any] | None = None
        self._device: int | None = None
        self._broken: str | None = None  # why the current group can no longer broadcast

    @property
    def transport(self) -> NcclTransport:
        if self._transport is None:
            from rolloutfleet.trainer.nccl import VllmNccl

            self._transport = VllmNccl()
        return self._transport

    def configure(self, weight_transfer: dict[str, Any]) -> None:
        fleet_packed = bool((weight_transfer.get("nccl") or {}).get("packed", False))
        if self.packed is None:
            self.packed = fleet_packed
        elif fleet_packed and not self.packed:
            # vLLM >= 0.28 engines took ``packed`` at the group's init: an unpacked broadcast would be misread.
            raise PushUnsupported(
                "the fleet's weightTransfer.nccl.packed is true (the engines expect packed broadcasts); "
                "this NcclSender was made with packed=False"
            )

    def check(self, items: Sequence[tuple[str, Any]], target: str = "tensors") -> None:
        super().check(items, target)
        _gpu_tensors_only(items, target, "NCCL broadcasts")
        for name, value in items:
            if not value.is_contiguous():
                # A broadcast sends the storage from the first element on: a strided view would send other bytes.
                raise InvalidTensors(target, f"{name}: NCCL broadcasts contiguous tensors (call .contiguous())")

    def update_info(self, items: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
        for name, value in items:
            if isinstance(value, RawTensor):
                raise ValueError(f"{name}: NCCL broadcasts torch tensors on a GPU, not raw bytes")
        info = _metadata(items)
        if self.packed:
            info["packed"] = True  # vLLM 0.26 reads it per update (later versions took it at init)
        # The keepalive is what the broadcast sends, in update_info's order.
        return info, [(name, value.detach()) for name, value in items]

    def join_group(self, epoch: int, world_size: int) -> str:
        if self._group is not None and not self.fixed_port:
            self.port = free_port(self.host)  # the previous group's store may still hold its port
        self._device = self.transport.current_device()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        host, port, device, transport = self.host, self.port, self._device, self.transport

        def form() -> None:
            try:
                future.set_result(transport.open_group(host, port, world_size, device))
            except BaseException as exc:  # handed to the broadcast that waits for the group
                future.set_exception(exc)

        threading.Thread(target=form, name=f"nccl-group-{epoch}", daemon=True).start()
        self._group, self._broken, self.group_epoch = future, None, epoch
        return self.rendezvous_address()

    def rendezvous_address(self) -> str:
        return common.host_port(self.host, self.port)

    def broadcast(self, prepared: Prepared, timeout: float, cancel: threading.Event) -> None:
        epoch = self.group_epoch
        if self._group is None or self._device is None:
            raise SendError("no NCCL transfer group: the operator has not formed one with this trainer yet")
        if self._broken is not None:
            raise SendError(f"transfer group {epoch} is unusable ({self._broken}); waiting for a new one")
        deadline = time.monotonic() + timeout
        group = self._wait(self._group, deadline, cancel, f"forming transfer group {epoch}")
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        tensors, device, transport = list(prepared.keepalive), self._device, self.transport

        def send() -> None:
            try:
                transport.broadcast(group, tensors, bool(self.packed), device)
                done.set_result(None)
            except BaseException as exc:  # handed to the caller that waits for it
                done.set_exception(exc)

        threading.Thread(target=send, name=f"nccl-broadcast-{epoch}", daemon=True).start()
        self._wait(done, deadline, cancel, f"the broadcast of {prepared.tensors} tensors in group {epoch}")

    def _wait(self, future: concurrent.futures.Future[Any], deadline: float, cancel: threading.Event, what: str) -> Any:
        while True:
            try:
                return future.result(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                pass
            except Exception as exc:
                self._broken = f"{what} failed: {type(exc).__name__}: {exc}"
                raise SendError(self._broken) from exc
            if cancel.is_set() or time.monotonic() >= deadline:
                why = "a receiving engine refused the update" if cancel.is_set() else "no completion in time"
                self._broken = f"{what} did not complete: {why}"
                raise SendError(self._broken + " (NCCL waits for every rank; the group cannot be used again)")


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


def deliver(
    sender: Sender, addresses: Sequence[str], token: str, prepared: Prepared, timeout: float, concurrency: int
) -> list[str | None]:
    """Send ``prepared`` to every engine at ``addresses``; per address, None or why it did not take it.

    Point-to-point senders post to at most ``concurrency`` engines at once. A collective sender's posts all
    run at once, with its broadcast beside them: each engine's ``/update_weights`` returns only when the
    broadcast gave it the bytes. An engine that refuses the update cancels the broadcast (the others then
    wait for bytes that will not come; the operator's deadline ends their sessions).
    """
    cancel = threading.Event()

    def one(address: str) -> str | None:
        try:
            sender.send(address, token, prepared, timeout)
        except SendError as exc:
            cancel.set()
            return str(exc)
        except Exception as exc:  # a custom sender's bug is still a failed send: never marked
            cancel.set()
            return f"{type(exc).__name__}: {exc}"
        return None

    if not addresses:
        return []
    if not sender.collective:
        with concurrent.futures.ThreadPoolExecutor(min(concurrency, len(addresses)), "push-send") as pool:
            return list(pool.map(one, addresses))
    with concurrent.futures.ThreadPoolExecutor(len(addresses) + 1, "push-send") as pool:
        posts = [pool.submit(one, address) for address in addresses]
        cast = pool.submit(sender.broadcast, prepared, timeout, cancel)
        try:
            cast.result()
            broadcast_error = None
        except SendError as exc:
            broadcast_error = str(exc)
        except Exception as exc:
            broadcast_error = f"{type(exc).__name__}: {exc}"
        errors = [post.result() for post in posts]
    # A post that failed says why; one that "succeeded" while the broadcast failed cannot have its bytes.
    return [e if e is not None else broadcast_error for e in errors]
