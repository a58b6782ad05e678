# Generated from solutions/phase3_multi_node/allreduce_algorithms.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Two more all-reduce algorithms: recursive halving-doubling, and hierarchical (node-aware).

* Recursive halving-doubling (Rabenseifner; Thakur, Rabenseifner & Gropp 2005):
  reduce-scatter by halving (log2 W steps: exchange half of what you still own
  with the rank whose id differs in one bit, keep and add the other half), then
  all-gather by doubling (the same steps backwards). Same bytes as the ring,
  2(W-1)/W * N per rank, in 2 log2(W) steps instead of 2(W-1): better when the
  latency term dominates (small tensors, many ranks). A world that is not a
  power of two folds its extra ranks into partners first (2 extra transfers of N).
* Hierarchical: ranks are grouped into "nodes" (consecutive blocks, like the
  GPUs of one machine). Reduce inside each node to its leader, all-reduce across
  the leaders only, broadcast inside each node. Only one rank per node touches
  the slow inter-node network, and the inter-node ring has M (nodes) steps, not W.

Cost (alpha = per-message latency, beta = seconds per byte, n = bytes):
  ring             2(W-1) alpha + 2(W-1)/W n beta
  halving-doubling 2 log2(W) alpha + 2(W-1)/W n beta          (W a power of two)
  hierarchical     2 log2(G) alpha_intra + 2 n beta_intra      (tree reduce + broadcast, G per node)
                   + 2(M-1) alpha_inter + 2(M-1)/M n beta_inter (ring over M leaders)
See phase3_multi_node/guidelines.md#recursive-halving-doubling and #hierarchical-all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab import p2p
from distlab.comm import check_reduce_op
from distlab.todo import todo


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """Swap tensors with group rank ``peer``: ``send`` out and ``recv`` in, as one grouped launch.

    Two separate sends first would each wait for the other's receive on NCCL: the pair is
    posted together (``distlab.p2p.exchange``). Empty tensors are skipped (both sides know
    the sizes). Cost: send.nbytes out, recv.nbytes in.
    """
    p2p.exchange(send, recv, peer, group)


# --------------------------------------------------------------------------- halving-doubling
def halving_doubling_allreduce(tensor: torch.Tensor, op: str = "sum",
                               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in place by recursive halving (reduce-scatter) then recursive doubling (all-gather).

    Equivalent to: ``dist.all_reduce(tensor)`` (then ``/ W`` for "avg").
    Collective: every rank of ``group`` must call it, with the same shape and dtype.
    Cost: W a power of two: 2 log2(W) steps, 2(W-1)/W * N bytes sent per rank.
    Otherwise, with p the largest power of two below W: ranks p..W-1 send N to rank r-p
    and get N back; ranks 0..p-1 run the power-of-two algorithm on p ranks.
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    p = 1 << (world_size.bit_length() - 1)  # largest power of two <= W
    if rank >= p:  # an extra rank: hand the data to a partner, get the answer back
        # One way, then back: the partner receives first and sends last, so nothing crosses.
        p2p.send(flat, rank - p, group)
        p2p.recv(flat, rank - p, group)
    else:
        if rank + p < world_size:  # fold in the extra partner's tensor
            incoming = torch.empty_like(flat)
            p2p.recv(incoming, rank + p, group)
            flat += incoming
        # p blocks (tensor_split's sizes); block b ends up fully reduced on rank b.
        sizes = [b.numel() for b in flat.tensor_split(p)]
        starts = [sum(sizes[:b]) for b in range(p + 1)]
        span = lambda lo, hi: (starts[lo], starts[hi])  # blocks [lo, hi) -> elements  # noqa: F841 (span: for TODO 3.5)
        lo, hi = 0, p  # the blocks this rank is still responsible for  # noqa: F841 (lo, hi: for TODO 3.5)
        buf = torch.empty(starts[max(1, p // 2)], dtype=flat.dtype, device=flat.device)  # the larger half  # noqa: F841 (buf: for TODO 3.5)
        # --- TODO 3.5: recursive halving-doubling ---
        # Goal: all-reduce `flat` over ranks 0..p-1 in 2 log2(p) exchanges. Halving: at each
        # distance, pair with the rank differing in that bit, keep half of your block range
        # [lo, hi) and trade the other half for the partner's copy of yours, adding it in, until
        # you own block `rank` alone ("avg": divide it there). Doubling: the same pairs in
        # reverse, swapping whole owned ranges, received in place. Both partners call `exchange`.
        raise todo("3.5 recursive halving-doubling", "guidelines.md#recursive-halving-doubling")
        # --- end TODO 3.5 ---
        if rank + p < world_size:
            p2p.send(flat, rank + p, group)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --------------------------------------------------------------------------- hierarchical
@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in a world cut into nodes of ``ranks_per_node`` consecutive ranks.

    ``intra`` holds the ranks of this rank's node; ``leaders`` the first rank of every
    node (None on ranks that are not leaders). Build it with ``make_node_groups``.
    """

    ranks_per_node: int
    num_nodes: int
    node: int
    local_rank: int
    intra: dist.ProcessGroup
    leaders: dist.ProcessGroup | None

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0


def make_node_groups(ranks_per_node: int) -> NodeGroups:
    """Cut the world into nodes of ``ranks_per_node`` consecutive ranks (the last may be smaller).

    Under torchrun, ``ranks_per_node`` is LOCAL_WORLD_SIZE: ranks of one machine are consecutive.
    Collective: every rank must call it (``dist.new_group`` is collective), with the same argument.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    num_nodes = -(-world_size // ranks_per_node)  # ceil(W / ranks_per_node)
    intra = None
    for node in range(num_nodes):  # every rank creates every group, in the same order
        members = list(range(node * ranks_per_node, min((node + 1) * ranks_per_node, world_size)))
        g = dist.new_group(members)
        if rank in members:
            intra = g
    leader_ranks = list(range(0, world_size, ranks_per_node))
    leaders = dist.new_group(leader_ranks)
    return NodeGroups(ranks_per_node, num_nodes, rank // ranks_per_node, rank % ranks_per_node,
                      intra, leaders if rank in leader_ranks else None)


def hierarchical_allreduce(tensor: torch.Tensor, groups: NodeGroups, op: str = "sum") -> torch.Tensor:
    """All-reduce in place: reduce to each node's leader, all-reduce across leaders, broadcast in the node.

    Equivalent to: ``dist.all_reduce(tensor)`` over the whole world (then ``/ W`` for "avg").
    Collective: every rank of the world must call it with the same ``NodeGroups`` layout.
    Cost: inside a node, a reduce and a broadcast of N bytes; across nodes, one
    all-reduce of N bytes among the M leaders only (2(M-1)/M * N per leader with a ring).
    """
    check_reduce_op(op, tensor)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    # --- TODO 3.6: hierarchical all-reduce ---
    # Goal: the world-wide all-reduce of `flat`, where only node leaders (local rank 0) talk
    # across nodes: gather the node's sum on its leader, combine the leaders' sums among the
    # leaders only ("avg": divide by the world size once), then give the result to the whole
    # node. Use torch.distributed's built-ins on `groups.intra` and `groups.leaders`.
    raise todo("3.6 hierarchical all-reduce", "guidelines.md#hierarchical-all-reduce")
    # --- end TODO 3.6 ---
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
