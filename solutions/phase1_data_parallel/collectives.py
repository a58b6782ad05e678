"""All-reduce three ways by hand: reduce + broadcast, all-gather + sum, gather + scatter.

All-reduce leaves every rank holding the element-wise sum (or mean) of every
rank's tensor. Before using ``dist.all_reduce`` as a black box, build it from
simpler pieces and count what each way costs (N = the tensor's bytes, W ranks):

* reduce to a root, then broadcast, with send/recv: the root receives (W-1)N and
  sends (W-1)N; everyone else sends N and receives N. The root is the bottleneck.
* all-gather, then sum locally: each rank receives (W-1)N and holds W copies.
* gather to a root, sum, scatter the result back: the root's traffic as in the
  first way, but through two collectives.

A ring all-reduce (Phase 3) moves only 2(W-1)/W * N per rank, whatever W is.
See phase1_data_parallel/guidelines.md#all-reduce-three-ways.

Run the demo, which shows every primitive and times these three against
``dist.all_reduce``: ``RUN_MODE=comm ./entrypoint.sh`` (``IMPL=templates`` for yours).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab import p2p
from distlab.comm import check_reduce_op
from distlab.lessons.sync import group_root


def allreduce_reduce_broadcast(tensor: torch.Tensor, op: str = "sum",
                               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in place by sending everything to group rank 0 and sending the result back.

    Args:
        tensor: any shape; overwritten with the result on every rank.
        op: "sum" or "avg".
        group: the process group (None: the whole world).

    Equivalent to: ``dist.all_reduce(tensor)`` (then ``/ W`` for "avg").
    Collective: every rank of ``group`` must call it, or the root waits forever.
    Cost: root sends (W-1)N and receives (W-1)N bytes; other ranks N each way.
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # ### BEGIN SOLUTION 1.1: all-reduce by reduce + broadcast [guidelines.md#all-reduce-three-ways]
    # Goal: every rank of `group` ends with the sum ("avg": the mean) of all ranks' `tensor`,
    # written into `tensor`, using only point-to-point messages with group rank 0 as the hub.
    # The result must be bitwise the same on every rank and on every run.
    # Collective: every rank of `group` calls it; peers are named by their rank inside `group`,
    # and a message nobody receives leaves its sender waiting forever. Use `p2p.send`/`p2p.recv`
    # (NCCL-safe: no tags, no receive from "anyone": the hub names the rank it expects).
    data = tensor if tensor.is_contiguous() else tensor.contiguous()  # messages are contiguous
    if rank == 0:
        incoming = torch.empty_like(data)
        for src in range(1, world_size):  # summed in rank order: the same on every run
            p2p.recv(incoming, src, group)
            data += incoming
        if op == "avg":
            data /= world_size
        for dst in range(1, world_size):
            p2p.send(data, dst, group)
    else:
        p2p.send(data, 0, group)
        p2p.recv(data, 0, group)
    if data is not tensor:
        tensor.copy_(data)
    # ### END SOLUTION 1.1
    return tensor


def allreduce_allgather_sum(tensor: torch.Tensor, op: str = "sum",
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in place by all-gathering every rank's tensor and summing locally.

    Equivalent to: ``dist.all_reduce(tensor)`` (then ``/ W`` for "avg").
    Collective: every rank of ``group`` must call it.
    Cost: each rank receives (W-1)N bytes and holds W*N bytes at once.
    """
    check_reduce_op(op, tensor)
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    # ### BEGIN SOLUTION 1.2: all-reduce by all-gather + local sum [guidelines.md#all-reduce-three-ways]
    # Goal: every rank collects all W tensors into `gathered` with one collective, then
    # reduces them itself; `tensor` ends as the sum ("avg": mean), bitwise equal on all ranks.
    # Collective: every rank of `group` calls it, with a tensor of the same shape and dtype.
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    total = gathered[0].clone()
    for other in gathered[1:]:  # rank order, identical on every rank
        total += other
    if op == "avg":
        total /= world_size
    tensor.copy_(total)
    # ### END SOLUTION 1.2
    return tensor


def allreduce_gather_scatter(tensor: torch.Tensor, op: str = "sum",
                             group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in place with ``dist.gather`` to group rank 0, a local sum, and ``dist.scatter`` back.

    Equivalent to: ``dist.all_reduce(tensor)`` (then ``/ W`` for "avg").
    Collective: every rank of ``group`` must call it.
    Cost: root receives (W-1)N and sends (W-1)N bytes; other ranks N each way.
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    root = group_root(group)  # collectives' dst=/src= take global ranks
    data = tensor.contiguous()
    gathered = [torch.empty_like(data) for _ in range(world_size)] if rank == 0 else None
    result = torch.empty_like(data)
    # ### BEGIN SOLUTION 1.3: all-reduce by gather + scatter [guidelines.md#all-reduce-three-ways]
    # Goal: the same result as 1.1, with two collectives instead of point-to-point: bring
    # every rank's `data` to the root (global rank `root`), reduce there, and hand each rank
    # its copy of the total in `result`. Only the root holds `gathered` (None elsewhere).
    dist.gather(data, gather_list=gathered, dst=root, group=group)
    scatter_list = None
    if rank == 0:
        total = gathered[0].clone()
        for other in gathered[1:]:
            total += other
        if op == "avg":
            total /= world_size
        scatter_list = [total] * world_size
    dist.scatter(result, scatter_list=scatter_list, src=root, group=group)
    # ### END SOLUTION 1.3
    tensor.copy_(result)
    return tensor


STRATEGIES = {
    "reduce+broadcast (send/recv)": allreduce_reduce_broadcast,
    "all_gather + local sum": allreduce_allgather_sum,
    "gather + scatter": allreduce_gather_scatter,
}
