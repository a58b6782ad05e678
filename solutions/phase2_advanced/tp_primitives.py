"""Tensor parallelism's communication primitives: the conjugate autograd functions (Megatron-LM).

A tensor-parallel region (a column-parallel layer, then a row-parallel one) starts
from a replicated input and ends with a replicated output. Two operators stand at
its boundaries, each the other's transpose, so their forward and backward swap
(Shoeybi et al. 2019, section 3):

    f = copy_to_region      forward: identity       backward: all-reduce (sum)
    g = reduce_from_region  forward: all-reduce     backward: identity

and, to gather a split output or split a whole input, the pair
``gather_from_region`` (all-gather / keep own slice) and ``scatter_to_region``
(keep own slice / all-gather). Getting a backward wrong (an all-reduce where the
identity belongs) multiplies every gradient upstream by the tensor-parallel size:
the tests run at W = 2, 3 and 4 and count the collectives.

Cost per rank: f and g one all-reduce of |x| (f's backward, g's forward); the gather
pair one all-gather receiving (W-1)|slice|. The layers that use them live in
tensor_parallel.py (whose template uses the bench's copy, ``distlab.lessons.tp``).
See phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions.
Run: ``RUN_MODE=tensor_parallel ./entrypoint.sh`` (TinyGPT built on these).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.lessons.sync import check_divisible


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # ### BEGIN SOLUTION 2.15a: copy_to_region forward [guidelines_model_parallel.md#the-conjugate-functions]
        # Goal: the identity, as a NEW tensor node (x's values, not the object x itself),
        # so that autograd records this Function and calls its backward. No communication.
        return x.view_as(x)
        # ### END SOLUTION 2.15a

    @staticmethod
    def backward(ctx, grad):
        # ### BEGIN SOLUTION 2.15b: copy_to_region backward [guidelines_model_parallel.md#the-conjugate-functions]
        # Each rank holds a partial dL/dx (its slice of the next layer used all of x): return
        # their sum over ctx.group, without modifying `grad` itself, then None for `group`.
        # Collective: every rank of the group runs this backward.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # ### END SOLUTION 2.15b


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # ### BEGIN SOLUTION 2.15c: reduce_from_region forward [guidelines_model_parallel.md#the-conjugate-functions]
        # Goal: the sum over `group` of every rank's partial x, in a new tensor (x unchanged).
        # Collective: every rank of the group calls it, with the same shape.
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out
        # ### END SOLUTION 2.15c

    @staticmethod
    def backward(ctx, grad):
        # ### BEGIN SOLUTION 2.15d: reduce_from_region backward [guidelines_model_parallel.md#the-conjugate-functions]
        # The output is replicated: every rank already holds the whole dL/dout. What is
        # dL/dx for each rank's partial sum? (The tests run at W = 2, 3, 4 and count collectives.)
        return grad, None  # an all-reduce here would multiply every gradient upstream by W
        # ### END SOLUTION 2.15d


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # ### BEGIN SOLUTION 2.16a: gather_from_region forward [guidelines_model_parallel.md#the-conjugate-functions]
        # Goal: every rank's slice, concatenated along the last dim in group-rank order.
        # Collective: every rank of `group` calls it with equal shapes.
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)
        # ### END SOLUTION 2.16a

    @staticmethod
    def backward(ctx, grad):
        # ### BEGIN SOLUTION 2.16b: gather_from_region backward [guidelines_model_parallel.md#the-conjugate-functions]
        # The forward's transpose: this rank's input only fed its own slice of the output.
        # No communication. Return (gradient for x, None).
        world_size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world_size, dim=-1)[rank].contiguous(), None
        # ### END SOLUTION 2.16b


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # ### BEGIN SOLUTION 2.16c: scatter_to_region forward [guidelines_model_parallel.md#the-conjugate-functions]
        # Goal: this rank's contiguous slice of the replicated x's last dim. No communication.
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(world_size, dim=-1)[rank].contiguous()
        # ### END SOLUTION 2.16c

    @staticmethod
    def backward(ctx, grad):
        # ### BEGIN SOLUTION 2.16d: scatter_to_region backward [guidelines_model_parallel.md#the-conjugate-functions]
        # The forward's transpose: the replicated input's gradient is every rank's slice
        # gradient, side by side in group-rank order. Collective: every rank of the group.
        grad = grad.contiguous()
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad, group=ctx.group)
        return torch.cat(parts, dim=-1), None
        # ### END SOLUTION 2.16d


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input ("f" in Megatron).

    Equivalent to: ``x`` (forward); the gradient is the sum of every rank's gradient.
    Collective: in backward, every rank of ``group`` all-reduces (so all must run backward).
    Cost: none forward; one all-reduce of |x| bytes backward (none when W == 1).
    """
    return x if dist.get_world_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results ("g" in Megatron).

    Equivalent to: ``sum(x_r for r in ranks)`` (forward); the gradient passes through unchanged.
    Collective: every rank of ``group`` must call it in forward.
    Cost: one all-reduce of |x| bytes forward; none backward (none at all when W == 1).
    """
    return x if dist.get_world_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dim (a column layer's full output).

    Equivalent to: ``torch.cat([x_0, ..., x_{W-1}], dim=-1)``; backward keeps this rank's slice.
    Collective: every rank of ``group`` must call it in forward, with equal shapes.
    Cost: one all-gather of |x| bytes per rank forward (receives (W-1)|x|); none backward.
    """
    return x if dist.get_world_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim of a replicated ``x`` (a row layer's input).

    Equivalent to: ``x.chunk(W, -1)[rank]``; backward all-gathers the slices' gradients.
    Collective: in backward, every rank of ``group`` all-gathers.
    Cost: none forward; one all-gather of |x|/W bytes per rank backward.
    """
    world_size = dist.get_world_size(group)
    check_divisible(x.shape[-1], world_size, "last dimension", "tensor-parallel size")
    return x if world_size == 1 else _ScatterToRegion.apply(x, group)
