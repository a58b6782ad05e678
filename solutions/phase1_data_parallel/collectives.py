"""All-reduce three ways by hand, and a tour of the collective primitives.

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

Run the demo: ``RUN_MODE=comm ./entrypoint.sh`` (or ``torchrun --nproc_per_node=4 -m
solutions.phase1_data_parallel.collectives``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from distlab.comm import check_reduce_op


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
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, world_size):  # summed in rank order: the same on every run
            dist.recv(incoming, group=group, group_src=src)
            tensor += incoming
        if op == "avg":
            tensor /= world_size
        for dst in range(1, world_size):
            dist.send(tensor, group=group, group_dst=dst)
    else:
        dist.send(tensor, group=group, group_dst=0)
        dist.recv(tensor, group=group, group_src=0)
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
    root = dist.get_global_rank(group, 0) if group is not None else 0
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


# --------------------------------------------------------------------------- demo
def _demo_primitives(rank: int, world_size: int) -> None:
    from distlab.comm import reduce_scatter_single
    from distlab.metrics import log0

    def show(name: str, value) -> None:
        values = [None] * world_size
        dist.all_gather_object(values, value)  # collect for a tidy, rank-ordered print
        log0(f"{name:<36} " + "  ".join(f"r{r}:{v}" for r, v in enumerate(values)))

    log0(f"== the primitives on {world_size} ranks; rank r starts from tensor([r]) ==")
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=0)
    show("broadcast from 0", t.tolist())
    t = torch.tensor([float(rank)])
    dist.reduce(t, dst=0)
    show("reduce(sum) to 0 (others undefined)", t.tolist() if rank == 0 else "-")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    show("all_reduce(sum)", t.tolist())
    gathered = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gathered, dst=0)
    show("gather to 0", [x.item() for x in gathered] if rank == 0 else "-")
    out = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    show("all_gather", [x.item() for x in out])
    piece = torch.zeros(1)
    dist.scatter(piece, [torch.tensor([10.0 * r]) for r in range(world_size)] if rank == 0 else None, src=0)
    show("scatter [0, 10, 20, ...] from 0", piece.tolist())
    mine = torch.zeros(1)
    reduce_scatter_single(mine, torch.arange(world_size, dtype=torch.float32) + rank)
    show("reduce_scatter(arange(W) + r)", mine.tolist())
    got = torch.zeros(1)
    if world_size > 1 and rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif world_size > 1 and rank == 1:
        dist.recv(got, src=0)
    show("send 42 from 0 to 1 / recv", got.tolist())


def _time(fn, tensor: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        work = tensor.clone()
        dist.barrier()
        start = time.perf_counter()
        fn(work)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    from distlab.comm import CommLedger
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements in the benchmark tensor")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        _demo_primitives(env.rank, env.world_size)
        tensor = torch.randn(args.numel, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
        rows = []
        contenders = dict(STRATEGIES, **{"dist.all_reduce (built-in)": lambda t: dist.all_reduce(t)})
        for name, fn in contenders.items():
            seconds = _time(fn, tensor, args.repeats)
            ledger = CommLedger()
            with ledger:
                fn(tensor.clone())
            calls = ", ".join(f"{op} x{v['calls']} ({format_bytes(v['bytes'])})"
                              for op, v in ledger.summary().items())
            rows.append({"strategy": name, "median ms": f"{seconds * 1e3:.2f}",
                         "rank 0's calls (payload bytes)": calls})
        log0(f"\n== all-reduce of {format_bytes(tensor.nbytes)} on {env.world_size} ranks "
             f"({env.backend}), median of {args.repeats} ==")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
