# Generated from solutions/phase3_multi_node/ddp_overlap.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""DDP from scratch, step 1: one asynchronous all-reduce per gradient, launched from its hook.

Phase 1 all-reduced every gradient *after* backward: the network sat idle while
the CPU/GPU computed, then the CPU/GPU sat idle while the network worked. Backward
produces gradients last layer first, so the all-reduce of layer L's gradient can
run while layers L-1 ... 1 are still differentiating:

    backward  : [grad L][grad L-1][grad L-2] ... [grad 1]
    all-reduce:         [  L   ][  L-1  ][ L-2 ] ...    [1]  <- wait, then step

1. construction: broadcast parameters and buffers from rank 0 (replicas start equal);
2. ``register_post_accumulate_grad_hook`` on every trainable parameter: when
   autograd has finished accumulating ``p.grad``, launch ``all_reduce(p.grad,
   async_op=True)`` and keep the handle;
3. ``finish_gradient_synchronization()`` before ``optimizer.step()``: wait for every
   handle, divide by W. The bench calls it for you when backward ends (an autograd
   callback, ``distlab.lessons.sync.FinishInBackwardMixin``, as torch's DDP does), so
   ``loss.backward(); optimizer.step()`` is enough; calling it again does nothing.

Cost per step: one all-reduce per trainable parameter, |grads| bytes in all, hidden
behind backward except the last one. Many small all-reduces pay the per-call
latency many times: ``ddp_bucketed.py`` groups them.
See phase3_multi_node/guidelines_ddp_zero.md#ddp-overlap.

Run: ``RUN_MODE=data_parallel_overlap ./entrypoint.sh`` (TinyCNN on digits; demos/data_parallel_overlap.py).
"""
from __future__ import annotations

import itertools  # noqa: F401 (itertools: for TODO 3.10)

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.lessons.sync import FinishInBackwardMixin, broadcast_tensors, group_root
from distlab.todo import todo


class DDPIndividualParameters(FinishInBackwardMixin, nn.Module):
    """Wrap ``module`` for data parallelism with one overlapped all-reduce per parameter.

    Args:
        module: the replica on this rank (any initialisation: rank 0's wins).
        group: the data-parallel group (None: WORLD).
        broadcast_buffers: like torch's DDP, copy rank 0's buffers before every forward.

    Equivalent to: ``torch.nn.parallel.DistributedDataParallel(module)``; after
    backward (whose end calls ``finish_gradient_synchronization()``) every rank holds the
    gradient of the mean loss over the global batch. A forward inside ``no_sync()`` (or
    with ``require_backward_grad_sync = False``) makes its backward's hooks skip: gradients
    accumulate locally until the next synced backward.
    Collective: construction, every forward (buffers) and every backward must happen
    on all ranks, with the same parameters receiving gradients (a parameter unused on
    one rank only makes the ranks' all-reduce sequences differ: a hang).
    Cost: |params| + |buffers| bytes broadcast once; |grads| bytes all-reduced per step.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True  # False inside no_sync(): the next backward accumulates locally
        self._handles: list[tuple[dist.Work, torch.Tensor]] = []
        src = group_root(group)  # group rank 0, as the global rank that src= expects  # noqa: F841 (src: for TODO 3.10)
        with torch.no_grad():
            # --- TODO 3.10: broadcast at construction ---
            # Goal: every replica starts equal to group rank 0's, parameters AND buffers,
            # however each rank initialised its own copy (`src` is rank 0's global rank).
            # Collective: every rank of `group` takes part, with the tensors in the same order.
            raise todo("3.10 broadcast at construction", "guidelines_ddp_zero.md#ddp-overlap")
            # --- end TODO 3.10 ---
        # parameters() yields a tied Parameter once, so it gets one hook; frozen ones get none.
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Autograd has finished writing ``p.grad`` for this backward."""
        if not self._sync_backward:  # its forward ran inside no_sync()
            return
        self._begin_backward()  # the end of this backward calls finish_gradient_synchronization()
        # --- TODO 3.11a: launch an async all-reduce from the hook ---
        # Goal: start summing `p.grad` over the ranks of `self.group` now and return at once,
        # so the reduction overlaps the backward of earlier layers; remember what is in flight
        # (in `self._handles`) for the finish. The buffer is being reduced: do not touch it yet.
        # Collective: every rank's hooks launch the same all-reduces, in the same order.
        raise todo("3.11a launch an async all-reduce from the hook", "guidelines_ddp_zero.md#ddp-overlap")
        # --- end TODO 3.11a ---

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1 and self._sync_buffers_next:
            broadcast_tensors(self.module.buffers(), self.group)  # e.g. BatchNorm's running stats
        return self._after_forward(self.module(*args, **kwargs))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce launched in this backward; gradients become means.

        Called by the autograd engine when a synced backward ends; calling it again, after
        ``loss.backward()`` and before ``optimizer.step()``, does nothing.
        Collective: every rank runs it after the same backward.
        """
        if not self._finish_owed:  # already finished (or nothing was launched)
            return
        self._finish_owed = False
        # --- TODO 3.11b: wait for the all-reduces ---
        # Goal: when this returns, every gradient launched in this backward holds the MEAN over
        # the W ranks (the all-reduces produced sums), and nothing is left in flight for the
        # next step.
        raise todo("3.11b wait for the all-reduces", "guidelines_ddp_zero.md#ddp-overlap")
        # --- end TODO 3.11b ---
