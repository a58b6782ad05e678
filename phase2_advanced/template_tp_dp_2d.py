# Generated from solutions/phase2_advanced/tp_dp_2d.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""2D parallelism: data parallel x tensor parallel on a grid of ranks.

W = dp_size * tp_size ranks form a grid. Each row is a tensor-parallel group (one
model replica, split across tp_size ranks); each column a data-parallel group
(the ranks that hold the *same shard* of the model, on different data):

    world 4, tp_size 2:          tp group 0: ranks 0 1   (replica 0, data shard 0)
        tp_rank 0  tp_rank 1     tp group 1: ranks 2 3   (replica 1, data shard 1)
    dp 0   rank 0    rank 1      dp group 0: ranks 0 2   (both hold shard 0 of every matrix)
    dp 1   rank 2    rank 3      dp group 1: ranks 1 3

Ranks of one tensor-parallel group are neighbours (rank = dp_rank * tp_size + tp_rank):
TP talks after every layer, so it gets the fastest links (NVLink inside a node);
DP talks once per step.

One step: each replica (row) runs tensor-parallel forward/backward on its data
shard; then every rank averages its *shard's* gradients over its dp group.

Cost per step, per rank: TP's activation all-reduces inside the row (see
tensor_parallel.py) plus one all-reduce of |params|/tp_size bytes (+ the replicated
ones: LayerNorms, biases after a row layer) over the dp group.
See phase2_advanced/guidelines_model_parallel.md#2d-parallelism.

Run: ``NPROC=4 RUN_MODE=tp_dp_2d ./entrypoint.sh`` (TinyGPT; tp_size 2 by default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.lessons.sync import allreduce_gradients, check_divisible  # noqa: F401 (allreduce_gradients: for TODO 2.22)
from distlab.todo import todo


@dataclass(frozen=True)
class RankGrid:
    """This rank's place on the dp x tp grid and the two groups it belongs to (passed, never global)."""

    rank: int
    world_size: int
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_ranks: tuple[int, ...]  # global ranks of this rank's tensor-parallel group
    dp_ranks: tuple[int, ...]  # global ranks of this rank's data-parallel group

    def __post_init__(self) -> None:
        if self.tp_size * self.dp_size != self.world_size:
            raise ValueError(f"tp_size {self.tp_size} x dp_size {self.dp_size} != world size {self.world_size}")


def build_grid(tp_size: int) -> RankGrid:
    """Split the world into dp_size = W / tp_size rows of tp_size neighbouring ranks.

    Equivalent to: ``torch.distributed.device_mesh.init_device_mesh("cpu", (dp, tp))``.
    Collective: every rank must call it (``dist.new_group`` is collective over the
    world: each rank creates *every* group, in the same order, even those it is not in).
    Cost: one group creation per row and per column (setup only).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dp_size = check_divisible(world_size, tp_size, "world size", "tp_size")
    mine: dict[str, tuple] = {}  # "tp" / "dp" -> (this rank's group, its global ranks as a tuple)
    # --- TODO 2.21: rank grid ---
    # Goal: fill `mine` with this rank's row (its tp group: tp_size neighbouring ranks,
    # rank = dp_rank * tp_size + tp_rank) and its column (its dp group: the ranks with the same
    # tp_rank). Collective: creating a group involves the whole world, every group, every rank.
    raise todo("2.21 rank grid", "guidelines_model_parallel.md#2d-parallelism")
    # --- end TODO 2.21 ---
    return RankGrid(rank=rank, world_size=world_size, tp_size=tp_size, dp_size=dp_size,
                    tp_rank=rank % tp_size, dp_rank=rank // tp_size,
                    tp_group=mine["tp"][0], dp_group=mine["dp"][0],
                    tp_ranks=mine["tp"][1], dp_ranks=mine["dp"][1])


def allreduce_dp_gradients(model: nn.Module, grid: RankGrid) -> None:
    """Average every gradient of this rank's model shard over its data-parallel group.

    Equivalent to: the gradient of the mean loss over the whole global batch, on every
    replica (each dp rank saw an equal shard of it).
    Collective: every rank of ``grid.dp_group`` must call it with the same parameters.
    Cost: one all-reduce of |local params with gradients| bytes over the dp group
    (|params|/tp_size for the sharded ones).
    """
    # --- TODO 2.22: data-parallel gradient average ---
    # Goal: every gradient of this rank's shard becomes its mean over the ranks that hold the
    # SAME shard on other data, and only those. Collective: those ranks all call it.
    raise todo("2.22 data-parallel gradient average", "guidelines_model_parallel.md#2d-parallelism")
    # --- end TODO 2.22 ---


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
               inputs: torch.Tensor, targets: torch.Tensor, grid: RankGrid) -> torch.Tensor:
    """One 2D step on the *global* batch: this replica takes its dp shard; returns its loss.

    ``model`` is a tensor-parallel model built on ``grid.tp_group``; ``loss_fn(model, x, y)``
    returns the mean loss of a batch.
    """
    per = check_divisible(inputs.shape[0], grid.dp_size, "global batch", "dp_size")
    rows = slice(grid.dp_rank * per, (grid.dp_rank + 1) * per)  # the same shard on the whole tp row
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, inputs[rows], targets[rows])
    loss.backward()  # tensor-parallel communication happens in here, inside the tp group
    allreduce_dp_gradients(model, grid)
    optimizer.step()
    return loss.detach()
