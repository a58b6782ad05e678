"""A distributed sampler from scratch: each rank reads its own shard of the data set.

Data parallelism only helps if the W ranks see *different* samples. The sampler
gives rank r the indices ``perm[r], perm[r + W], perm[r + 2W], ...`` of one
permutation that every rank computes identically (same seed + epoch, no
communication at all). When the data set does not divide by W, the permutation
is padded by repeating its head (or its tail is dropped with ``drop_last``), so
every rank takes the same number of steps, or the collectives of the last step
would wait for a rank that has run out of data.

Index for index the same as ``torch.utils.data.DistributedSampler``.
See phase1_data_parallel/guidelines.md#sharding-the-data.

Run the demo: ``RUN_MODE=train ./entrypoint.sh``.
"""
from __future__ import annotations

import argparse
import math
from typing import Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from distlab.todo import todo


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of the indices of ``dataset``, reshuffled each epoch.

    Args:
        dataset: anything with ``len()``.
        num_replicas: number of ranks W.
        rank: this rank, 0 <= rank < W.
        shuffle: permute the indices with ``torch.randperm`` seeded by ``seed + epoch``.
        seed: must be the same on every rank.
        drop_last: drop the tail so that len(dataset) divides by W, instead of padding.

    Equivalent to: ``torch.utils.data.DistributedSampler`` with the same arguments.
    Cost: no communication.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}] for num_replicas={num_replicas}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        n = len(dataset)
        # --- TODO 1.4: how many samples each rank gets ---
        # Set self.num_samples (per rank) and self.total_size (= num_samples * W):
        # with drop_last and n not divisible by W, drop the tail (floor(n / W) each,
        # written as ceil((n - W) / W) in torch); otherwise pad up to ceil(n / W) each.
        raise todo("1.4 sampler sizes", "guidelines.md#sharding-the-data")
        # --- end TODO 1.4 ---

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        # --- TODO 1.5: this rank's indices ---
        # 1. indices: torch.randperm(n) from a torch.Generator seeded with seed + epoch
        #    when shuffling (the same on every rank), else 0..n-1;
        # 2. drop the tail (drop_last) or pad by repeating the head up to total_size
        #    (the head may be shorter than the padding: repeat it as often as needed);
        # 3. take every W-th index starting at this rank.
        raise todo("1.5 sampler indices", "guidelines.md#sharding-the-data")
        # --- end TODO 1.5 ---

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch on every rank, or every epoch repeats epoch 0's order."""
        self.epoch = epoch


def distributed_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int,
                       shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                       num_workers: int = 0) -> DataLoader:
    """A DataLoader over this rank's shard; ``batch_size`` is per rank (global = W * batch_size)."""
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      drop_last=drop_last)


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import log0

    parser = argparse.ArgumentParser(description="Show each rank's shard of a data set, per epoch.")
    parser.add_argument("--size", type=int, default=10, help="data set size (try one that W does not divide)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--no-shuffle", action="store_true")
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        dataset = list(range(args.size))
        sampler = DistributedSampler(dataset, env.world_size, env.rank, shuffle=not args.no_shuffle,
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
    main()
