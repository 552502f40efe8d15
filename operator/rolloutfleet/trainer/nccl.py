"""The trainer client's NCCL transport: rank 0 of a weight-transfer group, through vLLM's own trainer side.

Called by ``rolloutfleet.trainer.senders.NcclSender`` (which owns the group's lifecycle, deadlines and
errors; this module only talks to vLLM and torch). vLLM and torch are imported inside functions only: the
operator image and a trainer that does not push over NCCL never import them (both are the trainer side's
optional extra ``trainer-push``; vLLM must be the engines' version, see docs/push.md).

What it uses of vLLM, the same in 0.26 and 0.33 (checked on both sources): the group is
``vllm.distributed.weight_transfer.nccl_common.trainer_init`` (a ``StatelessProcessGroup`` whose TCP store
rank 0 serves at ``master_address:master_port``, then a ``PyNcclCommunicator`` on the current CUDA device;
it returns once every engine worker joined through ``/init_weight_transfer_engine``); a send is what the
engines' ``receive_weights`` consumes: one ``broadcast`` from rank 0 per tensor in ``update_info`` order, or,
packed, ``packed_tensor.packed_nccl_broadcast_producer`` with vLLM's default buffer geometry. The broadcasts
run on streams of their own, so a hung receiver never blocks the training loop's stream, and on a thread
the caller can give up on at its own deadline (NCCL has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class VllmNccl:
    """Rank 0 of vLLM's NCCL weight transfer (the real transport; tests hand ``NcclSender`` a fake)."""

    def current_device(self) -> int:
        """The CUDA device this thread's group and broadcasts use (the trainer's current device)."""
        import torch

        return int(torch.cuda.current_device())

    def open_group(self, host: str, port: int, world_size: int, device: int) -> Any:
        """Serve the rendezvous at ``host:port`` as rank 0 and return the communicator once all
        ``world_size`` ranks joined (blocks until then: vLLM's store waits up to 300 s)."""
        import torch
        from vllm.distributed.weight_transfer import nccl_common

        torch.cuda.set_device(device)
        return nccl_common.trainer_init({"master_address": host, "master_port": port, "world_size": world_size})

    def broadcast(self, group: Any, tensors: Sequence[tuple[str, Any]], packed: bool, device: int) -> None:
        """Broadcast ``tensors`` (in order) from rank 0 and return once every receiver has its bytes.

        Blocks for as long as a receiver does not take them, without a deadline of its own (NCCL has none):
        ``NcclSender`` runs it on a thread it can give up on. The broadcasts run on streams of their own
        (vLLM's packed producer makes its own), after the work already queued on the device, and
        the end is a device synchronize because the packed producer leaves its last buffers in flight."""
        import torch

        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)  # the tensors' last writes (any stream) land before a stream reads them
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            if packed:
                from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

                packed_nccl_broadcast_producer(
                    iterator=iter(tensors), group=group, src=0, post_iter_func=lambda item: item[1]
                )
            else:
                for _, tensor in tensors:
                    group.broadcast(tensor, src=0, stream=stream)
        torch.cuda.synchronize(device)
