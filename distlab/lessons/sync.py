"""Building blocks that several lessons reuse once they have been taught.

Phase 1 teaches these (1.6-1.7: broadcast the initial model, average the
gradients); later phases, whose lesson is something else, call the bench's copy
here instead of re-writing them, so each exists once. A template may import
them: they are the "built-in" of a building block taught elsewhere.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree
from torch.autograd import Variable


def group_root(group: dist.ProcessGroup | None = None) -> int:
    """The global rank of ``group``'s rank 0 (what ``src=``/``dst=`` arguments expect)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def broadcast_tensors(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Overwrite each tensor, in place, with group rank 0's.

    Collective: every rank of ``group`` must call it with tensors of the same shapes, in
    the same order, or the ranks pair the wrong tensors (a hang or garbage).
    Cost: sum of the tensors' bytes, from group rank 0.
    """
    src = group_root(group)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, src=src, group=group)


def broadcast_module(module: nn.Module, group: dist.ProcessGroup | None = None, buffers: bool = True) -> None:
    """Make every replica of ``module`` equal to group rank 0's (parameters, and buffers if asked).

    Equivalent to: loading group rank 0's ``state_dict`` on every rank.
    Collective: every rank of ``group`` must call it, with the same model structure.
    Cost: |params| (+ |buffers|) bytes from group rank 0.
    """
    tensors = itertools.chain(module.parameters(), module.buffers() if buffers else ())
    broadcast_tensors(tensors, group)


def broadcast_buffers_in_forward(module: nn.Module, group: dist.ProcessGroup | None = None) -> list:
    """torch DDP's ``broadcast_buffers=True`` for a module no wrapper owns (ZeRO-1/2 shard in the optimizer).

    Group rank 0's buffers (BatchNorm's running statistics) overwrite every rank's now and before
    a forward whenever the previous forward ran with gradients enabled and synchronised (torch's
    ``require_forward_param_sync``). A bare module has no ``no_sync()``: nanoGPT's spelling,
    ``module.require_backward_grad_sync = False``, marks a forward as not synchronised. So an
    evaluation under ``no_grad`` and the micro-batch after a non-synchronised one keep this rank's.
    Returns the hooks' handles (``.remove()`` them to stop).
    Collective: every rank of ``group`` runs the same forwards. Cost: |buffers| bytes per broadcast.
    """
    synced = [True]  # torch starts with require_forward_param_sync = True

    def before(m: nn.Module, args: Any) -> None:
        if synced[0]:
            broadcast_tensors(m.buffers(), group)

    def after(m: nn.Module, args: Any, out: Any) -> None:
        synced[0] = torch.is_grad_enabled() and bool(getattr(m, "require_backward_grad_sync", True))

    broadcast_tensors(module.buffers(), group)  # DDP's construction syncs buffers with the parameters
    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def allreduce_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None,
                        average: bool = True) -> None:
    """Replace every ``p.grad`` by its sum (``average``: its mean) over the ranks of ``group``.

    Parameters without a gradient are skipped; a tied parameter listed once is reduced once.
    Equivalent to: the gradient of the mean loss over the global batch, when every rank's
    shard has the same size.
    Collective: every rank must call it with the same parameters holding gradients.
    Cost: one all-reduce per gradient; 2(W-1)/W * |grads| bytes per rank with a ring.
    """
    world_size = dist.get_world_size(group)
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            if average:
                p.grad /= world_size


def average_buffers(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average the floating-point buffers (BatchNorm running statistics) over ``group``, in place.

    Integer buffers (``num_batches_tracked``) advance identically on every rank and are left alone.
    Collective: every rank of ``group`` must call it, with the same model structure.
    Cost: one all-reduce per floating buffer; |floating buffers| bytes.
    """
    world_size = dist.get_world_size(group)
    with torch.no_grad():
        for b in module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, op=dist.ReduceOp.SUM, group=group)
                b /= world_size


class NoSyncMixin:
    """``no_sync()`` for a data-parallel wrapper whose hooks look at ``self.require_sync``.

    Inside ``with wrapper.no_sync():`` backwards accumulate ``p.grad`` locally; the next
    backward outside reduces the accumulated sum, as in ``torch.nn.parallel.DistributedDataParallel``.
    ``require_backward_grad_sync`` is torch's name for the flag (nanoGPT sets it instead of
    entering ``no_sync()``): reading or setting it reads or sets ``require_sync``.
    """

    require_sync: bool = True

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.require_sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


class FinishInBackwardMixin(NoSyncMixin):
    """Finish a data-parallel wrapper's gradient synchronisation when backward ends, as torch's DDP does.

    A wrapper whose gradient hooks launch communication owes a wait at the end of backward.
    torch's DDP pays it in an autograd callback, so ``loss.backward(); optimizer.step()`` is
    all a user writes. The wrapper calls ``self._after_forward(out)`` at the end of its forward
    and ``self._begin_backward()`` from its gradient hooks; the autograd engine then calls
    ``self.finish_gradient_synchronization()`` once, after the last hook of that backward. The
    wrapper's finish returns at once unless ``self._finish_owed`` (and clears it), so calling it
    again by hand is harmless.

    As in torch, the forward decides: a forward run inside ``no_sync()`` (or with
    ``require_backward_grad_sync = False``) makes its backward accumulate locally, wherever that
    backward runs. Buffers are broadcast before a forward only if the previous forward with
    gradients enabled synchronised (torch's ``require_forward_param_sync``): the first forward
    after an evaluation under ``no_grad`` or a ``no_sync`` micro-batch keeps this rank's buffers.
    """

    _sync_backward: bool = True          # what the next backward does: decided by the last forward
    _sync_buffers_next: bool = True      # torch's require_forward_param_sync
    _finish_owed: bool = False           # a backward launched communication not yet waited for

    def _after_forward(self, out: Any) -> Any:
        if torch.is_grad_enabled():
            self._sync_backward = self._sync_buffers_next = self.require_sync
            if self.require_sync:  # a backward through any output finishes, even one reaching no parameter
                for t in torch.utils._pytree.tree_leaves(out):
                    if torch.is_tensor(t) and t.requires_grad:
                        t.register_hook(self._on_output_grad)
        else:
            self._sync_buffers_next = False
        return out

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._begin_backward()

    def _begin_backward(self) -> None:
        """Called from inside backward: make sure the finish runs when this backward ends."""
        if not self._finish_owed:
            self._finish_owed = True
            Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)


def check_divisible(n: int, parts: int, what: str, by_what: str) -> int:
    """``n // parts``, or a ValueError that shows the arithmetic.

    >>> check_divisible(10, 3, "hidden size", "tensor-parallel size")
    Traceback (most recent call last):
    ValueError: hidden size 10 is not divisible by tensor-parallel size 3 (10 = 3 * 3 + 1)
    """
    if parts <= 0:
        raise ValueError(f"{by_what} must be positive, got {parts}")
    if n % parts:
        raise ValueError(f"{what} {n} is not divisible by {by_what} {parts} "
                         f"({n} = {n // parts} * {parts} + {n % parts})")
    return n // parts
