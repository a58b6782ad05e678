"""Gradient accumulation: k micro-batches per optimizer step, one all-reduce per step.

A batch too large for memory is cut into k micro-batches of b samples. Each
micro-batch runs forward and backward; the gradients add up in ``p.grad``; the
optimizer steps once. On W data-parallel ranks this equals one step on a batch of
k*b*W samples, provided that:

1. each micro-batch loss is weighted by its share of the rank's samples
   (n_i / n_local, not 1/k: the last micro-batch may be smaller), so the sum over
   micro-batches is the mean over the rank's batch; the all-reduce then averages
   over ranks (every rank has the same n_local, as in Phase 1);
2. the gradients are communicated once, after the last micro-batch: reducing
   after every micro-batch gives the same numbers but costs k times the traffic.

Here the all-reduce is triggered by backward itself (a hook fires when a
parameter's gradient is complete), as in PyTorch's DistributedDataParallel, so
skipping it needs a switch: the ``no_sync()`` context (``distlab.lessons.sync.NoSyncMixin``),
entered for every micro-batch but the last.

Cost per optimizer step: one all-reduce per parameter, |params| bytes in all,
whatever k is. Activation memory scales with b, not k*b.
See phase2_advanced/guidelines.md#gradient-accumulation.

Run the demo: ``RUN_MODE=data_parallel_naive_grad_accumulation ./entrypoint.sh`` (TinyCNN on
digits; ``IMPL=templates`` runs your template).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.lessons.sync import NoSyncMixin, average_buffers, broadcast_module


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor,
                        micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples; the last one may be smaller.

    10 samples in micro-batches of 4 -> sizes 4, 4, 2.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs hold {inputs.shape[0]} samples but targets hold {targets.shape[0]}")
    if inputs.shape[0] == 0:
        raise ValueError("the batch is empty: nothing to split into micro-batches")
    return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))


class AccumulatingDataParallel(NoSyncMixin, nn.Module):
    """A replica whose backward averages gradients over the ranks, except inside ``no_sync()``.

    Wrap the model once; parameters and buffers are broadcast from the group's first
    rank. Every backward outside ``no_sync()`` all-reduces each gradient as soon as
    it is complete (a post-accumulate-grad hook), averaging whatever has
    accumulated in ``p.grad`` since the last ``zero_grad``: the sum of all the
    micro-batches' contributions. ``no_sync()`` (from ``NoSyncMixin``) sets
    ``self.require_sync`` to False for the body of its ``with``.

    Args:
        module: the model (frozen parameters are left alone; a tied parameter is
            one Parameter, so it gets one hook and one all-reduce).
        group: the data-parallel group (None: WORLD).

    Equivalent to: the single-process gradient of the mean loss over the global
        batch, when every rank's batch has the same size.
    Collective: every rank must run backward outside ``no_sync()`` on the same
        steps, or the all-reduces pair up wrongly and hang.
    Cost: |trainable params| bytes per synchronised backward; nothing inside ``no_sync()``.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.require_sync = True
        broadcast_module(module, group)  # replicas start equal: |params| + |buffers| bytes once
        self._hooks = [p.register_post_accumulate_grad_hook(self._reduce_gradient)
                       for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reduce_gradient(self, param: nn.Parameter) -> None:
        # Called by autograd once p.grad holds this backward's contribution added to
        # what earlier micro-batches left there, so one all-reduce covers them all.
        # ### BEGIN SOLUTION 2.1: gradient hook that honours no_sync [guidelines.md#gradient-accumulation]
        # Goal: outside no_sync() (self.require_sync is True), replace param.grad, in place,
        # by its mean over the ranks of self.group; inside no_sync(), communicate nothing and
        # leave the local sum where it is.
        # Collective: every rank fires this hook for the same parameters, in the same backwards.
        if not self.require_sync:
            return
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.group)  # |p| bytes
        param.grad /= dist.get_world_size(self.group)
        # ### END SOLUTION 2.1


def train_step(model: AccumulatingDataParallel, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """One optimizer step on this rank's batch, in micro-batches; returns the local mean loss.

    Args:
        model: the wrapped replica.
        loss_fn: a loss that is a *mean* over the samples it is given.
        inputs, targets: this rank's batch (n_local samples; the same n_local on every rank).
        micro_batch_size: samples per forward/backward (the last micro-batch may be smaller).

    Equivalent to: one Phase 1 data-parallel step on the whole batch.
    Collective: every rank must call it, with the same number of micro-batches.
    Cost: one gradient all-reduce (|params| bytes), after the last micro-batch.
    """
    micro_batches = split_micro_batches(inputs, targets, micro_batch_size)
    n_local = inputs.shape[0]
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # ### BEGIN SOLUTION 2.2: micro-batch loop [guidelines.md#gradient-accumulation]
        # Goal: forward and backward micro-batch (x, y) so that after the loop p.grad holds the
        # gradient of the mean loss over the rank's n_local samples (micro-batches may differ
        # in size), and the ranks communicate only during the last micro-batch's backward.
        # Add the micro-batch's share of that mean loss, detached, to `total`.
        weight = x.shape[0] / n_local  # sizes 4, 4, 2: the last counts half; 1/k would over-weight it
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y) * weight
            loss.backward()
        total += loss.detach()
        # ### END SOLUTION 2.2
    optimizer.step()
    average_buffers(model.module, model.group)  # BatchNorm statistics: |float buffers| bytes
    return total
