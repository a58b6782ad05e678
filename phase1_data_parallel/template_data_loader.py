# Generated from solutions/phase1_data_parallel/data_loader.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
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

Run the demo, which prints each rank's shard per epoch: ``RUN_MODE=train ./entrypoint.sh``
(``IMPL=templates RUN_MODE=train ./entrypoint.sh`` for yours).
"""
from __future__ import annotations

import math  # noqa: F401 (math: for TODO 1.4, 1.5)
from typing import Iterator, Sized

import torch  # noqa: F401 (torch: for TODO 1.5)
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
        n = len(dataset)  # noqa: F841 (n: for TODO 1.4)
        # --- TODO 1.4: sampler sizes ---
        # Set self.num_samples (how many indices this rank yields) and self.total_size (the
        # length of the padded or trimmed index list, = num_samples * W). Every rank must get
        # the same count: pad up to the next multiple of W, or, with drop_last and n not
        # divisible by W, drop the tail instead. Same sizes as torch's DistributedSampler.
        raise todo("1.4 sampler sizes", "guidelines.md#sharding-the-data")
        # --- end TODO 1.4 ---

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # noqa: F841 (n: for TODO 1.5)
        # --- TODO 1.5: sampler indices ---
        # Return an iterator over this rank's num_samples indices. All ranks start from one
        # order they compute alike with no communication (a permutation that depends only on
        # seed + epoch, or 0..n-1 without shuffle), bring it to total_size (drop_last: cut;
        # else pad from its head, even when n < W), and take disjoint, interleaved shares.
        # Index for index the same as torch.utils.data.DistributedSampler.
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
