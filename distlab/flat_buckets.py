"""Pre-written flat buffers: the layout of ZeRO stages 1-2 (phase3_multi_node/zero.py), and the
messages of the parameter server (phase3_multi_node/parameter_server.py: ``pack``, ``unpack``).

Trainable parameters are packed end to end in flat buckets padded to a multiple of W;
rank r owns chunk r of every bucket. The parameters become views into their bucket, so an
all-gather into a bucket updates the model in place.
Guide: phase3_multi_node/guidelines_ddp_zero.md#zero-1-optimizer-state-sharded.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class FlatBucket:
    """Parameters packed end to end in one flat buffer of W equal chunks; ``rank`` owns one."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor              # padded; the params are views into it
    world_size: int
    rank: int

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat tensor shaped like ``flat``."""
        n = self.flat.numel() // self.world_size
        return t[self.rank * n:(self.rank + 1) * n]


def make_flat_bucket(params: list[nn.Parameter], world_size: int, rank: int) -> FlatBucket:
    """Copy ``params`` into one zero-padded flat buffer and make them views into it."""
    offsets = [0, *itertools.accumulate(p.numel() for p in params)]
    padded = math.ceil(offsets[-1] / world_size) * world_size
    flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for p, start in zip(params, offsets):
            flat[start:start + p.numel()].copy_(p.reshape(-1))
            p.data = flat[start:start + p.numel()].view_as(p)
    return FlatBucket(params, offsets[:-1], flat, world_size, rank)


def group_params(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive groups of at most ``bucket_size_mb`` (a bigger tensor alone), one dtype each."""
    cap, groups, size = bucket_size_mb * 2**20, [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > cap or p.dtype != groups[-1][0].dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened end to end into one new 1-D tensor (detached: a message, not a view)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (the inverse of ``pack``), in place."""
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
