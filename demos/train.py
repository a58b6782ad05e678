"""Each rank's shard of a data set, epoch by epoch, from Phase 1's DistributedSampler (TODO 1.4-1.5).

Rank 0 prints the indices every rank would read in each epoch, and how many distinct
samples the ranks saw together: try a size the number of ranks does not divide, and
``--drop-last``, to see the padding (the head repeated) and the dropped tail.

    RUN_MODE=train ./entrypoint.sh                          # 2 ranks, 10 samples, the solution
    NPROC=3 RUN_MODE=train ./entrypoint.sh --size 10 --drop-last
    IMPL=templates RUN_MODE=train ./entrypoint.sh           # your sampler
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from demos.sizes import positive
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import log0
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Show each rank's shard of a data set, per epoch.")
    parser.add_argument("--size", type=int, default=10, help="data set size (try one that W does not divide)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--no-shuffle", action="store_true")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Any size works at any world size (a short shard is padded or dropped: that is the lesson)."""
    positive(args, "--size")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        sampler_cls = load("phase1_data_parallel", "data_loader").DistributedSampler
        dataset = list(range(args.size))
        sampler = sampler_cls(dataset, env.world_size, env.rank, shuffle=not args.no_shuffle,
                              drop_last=args.drop_last)
        log0(f"data set of {args.size} samples on {env.world_size} ranks: {len(sampler)} per rank "
             f"({'tail dropped' if args.drop_last else 'padded by repeating the head'})")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            shards = [None] * env.world_size
            dist.all_gather_object(shards, list(sampler))
            log0(f"epoch {epoch}:")
            for r, shard in enumerate(shards):
                log0(f"  rank {r}: {shard}")
            seen = [i for shard in shards for i in shard]
            log0(f"  distinct samples seen: {len(set(seen))}/{args.size}, repeated: {len(seen) - len(set(seen))}")
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
