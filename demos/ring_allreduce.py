"""The ring all-reduce against gloo's own: correct first, then timed.

Checks that the step-by-step ring (3.1-3.3) and the pipelined ring (3.4) give what
``dist.all_reduce`` gives on a size that does not divide by the world size, then
prints the median time and bus bandwidth of each, per tensor size.

    RUN_MODE=ring_allreduce ./entrypoint.sh                             # 2 ranks
    NPROC=4 RUN_MODE=ring_allreduce ./entrypoint.sh --sizes-mb 1 16 64
    IMPL=templates RUN_MODE=ring_allreduce ./entrypoint.sh              # your template

Without torchrun (``python -m demos.ring_allreduce``) it runs as rank 0 of 1.
See phase3_multi_node/guidelines.md#ring-all-reduce.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from demos.sizes import positive
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, median, sync_device, time_repeats
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Nothing here depends on the world size; the sizes must be positive."""
    positive(args, "--repeats")
    if min(args.sizes_mb) <= 0:
        raise ValueError(f"--sizes-mb {min(args.sizes_mb)} must be positive: use --sizes-mb 0.25 4 16")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ring = load("phase3_multi_node", "ring_allreduce")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        torch.set_num_threads(1)  # one core per rank for the adds; gloo's I/O threads need the rest
        W = env.world_size
        contenders = {"ring": ring.ring_allreduce, "ring pipelined": ring.ring_allreduce_pipelined,
                      "dist.all_reduce": lambda t: dist.all_reduce(t)}
        # Correctness first: a size that does not divide by W, against the built-in.
        for fn in contenders.values():
            x = torch.randn(1001, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
            expected = x.clone()
            dist.all_reduce(expected)
            fn(x)
            torch.testing.assert_close(x, expected)  # summation order differs: float32 rounding
        log0(f"correct on {W} ranks: ring and pipelined ring match dist.all_reduce (1001 floats)")
        rows = []
        for mb in args.sizes_mb:
            x = torch.randn(int(mb * (1 << 20)) // 4).to(env.device)
            row = {"size": format_bytes(x.nbytes)}
            for name, fn in contenders.items():
                t = median(time_repeats(lambda: fn(x), args.repeats,
                                        sync=lambda: (sync_device(env.device), dist.barrier())))
                row[f"{name} ms"] = f"{t * 1e3:.2f}"
                row[f"{name} busbw GB/s"] = f"{x.nbytes / t * 2 * (W - 1) / W / 1e9:.2f}"
            rows.append(row)
        log0(f"\n== all-reduce on {W} ranks ({env.backend}), median of {args.repeats} ==")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
