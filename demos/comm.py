"""The collective primitives on every rank, then Phase 1's three all-reduces timed against gloo's.

First each primitive (broadcast, reduce, all_reduce, gather, all_gather, scatter,
reduce_scatter, send/recv) runs on a one-element tensor holding the rank, and rank 0
prints what every rank ends with. Then the three hand-made all-reduces of
phase1_data_parallel/collectives.py (TODO 1.1-1.3) and ``dist.all_reduce`` reduce the
same tensor: a table gives the median time and the calls and payload bytes rank 0 made
(counted by CommLedger). With one rank there is nobody to talk to: 1.1 makes no call.

    RUN_MODE=comm ./entrypoint.sh                       # 2 ranks, the solutions
    NPROC=4 RUN_MODE=comm ./entrypoint.sh --numel 4096  # 4 ranks, a small tensor
    IMPL=templates RUN_MODE=comm ./entrypoint.sh        # your all-reduces (stops at the first TODO)
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.distributed as dist

from demos.sizes import positive
from distlab import p2p
from distlab.comm import CommLedger, reduce_scatter_single
from distlab.launch import DistEnv, init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, median, sync_device, time_repeats
from distlab.todo import run_demo


def show_primitives(rank: int, world_size: int, device: torch.device) -> None:
    """Run each primitive once on ``tensor([rank])`` (on ``device``) and print every rank's result on rank 0."""

    def show(name: str, value) -> None:
        values = [None] * world_size
        dist.all_gather_object(values, value)  # collect for a tidy, rank-ordered print
        log0(f"{name:<36} " + "  ".join(f"r{r}:{v}" for r, v in enumerate(values)))

    log0(f"== the primitives on {world_size} ranks; rank r starts from tensor([r]) ==")
    t = torch.tensor([float(rank)], device=device)
    dist.broadcast(t, src=0)
    show("broadcast from 0", t.tolist())
    t = torch.tensor([float(rank)], device=device)
    dist.reduce(t, dst=0)
    show("reduce(sum) to 0 (others undefined)", t.tolist() if rank == 0 else "-")
    t = torch.tensor([float(rank)], device=device)
    dist.all_reduce(t)
    show("all_reduce(sum)", t.tolist())
    gathered = [torch.zeros(1, device=device) for _ in range(world_size)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)], device=device), gathered, dst=0)
    show("gather to 0", [x.item() for x in gathered] if rank == 0 else "-")
    out = [torch.zeros(1, device=device) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([float(rank)], device=device))
    show("all_gather", [x.item() for x in out])
    piece = torch.zeros(1, device=device)
    pieces = [torch.tensor([10.0 * r], device=device) for r in range(world_size)] if rank == 0 else None
    dist.scatter(piece, pieces, src=0)
    show("scatter [0, 10, 20, ...] from 0", piece.tolist())
    mine = torch.zeros(1, device=device)
    reduce_scatter_single(mine, torch.arange(world_size, dtype=torch.float32, device=device) + rank)
    show("reduce_scatter(arange(W) + r)", mine.tolist())
    got = torch.zeros(1, device=device)
    if world_size > 1 and rank == 0:
        p2p.send(torch.tensor([42.0], device=device), 1)  # NCCL-safe point-to-point: distlab/p2p.py
    elif world_size > 1 and rank == 1:
        p2p.recv(got, 0)
    show("send 42 from 0 to 1 / recv", got.tolist())


def time_allreduce(fn: Callable[[torch.Tensor], object], tensor: torch.Tensor, repeats: int,
                   device: torch.device) -> float:
    """Median seconds of ``fn`` on a copy of ``tensor``, every repeat started and ended together."""

    def together() -> None:
        # A barrier before each clock read: all ranks start at once, and a rank that
        # finishes early still waits for the collective to finish everywhere.
        sync_device(device)
        dist.barrier()

    work = tensor.clone()  # the all-reduces work in place: keep the caller's tensor intact
    return median(time_repeats(lambda: fn(work), repeats, sync=together))


def compare_allreduces(env: DistEnv, numel: int, repeats: int) -> list[dict]:
    """One table row per all-reduce: median time and rank 0's calls (payload bytes)."""
    strategies = load("phase1_data_parallel", "collectives").STRATEGIES
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    contenders = dict(strategies, **{"dist.all_reduce (built-in)": lambda t: dist.all_reduce(t)})
    rows = []
    for name, fn in contenders.items():
        seconds = time_allreduce(fn, tensor, repeats, env.device)
        ledger = CommLedger()
        with ledger:
            fn(tensor.clone())
        calls = ", ".join(f"{op} x{v['calls']} ({format_bytes(v['bytes'])})" for op, v in ledger.summary().items())
        rows.append({"strategy": name, "median ms": f"{seconds * 1e3:.2f}", "rank 0's calls (payload bytes)": calls})
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements in the benchmark tensor")
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Nothing here depends on the world size; the sizes must be positive."""
    positive(args, "--numel", "--repeats")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        show_primitives(env.rank, env.world_size, env.device)
        rows = compare_allreduces(env, args.numel, args.repeats)
        log0(f"\n== all-reduce of {format_bytes(args.numel * 4)} on {env.world_size} ranks "
             f"({env.backend}), median of {args.repeats} ==")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
