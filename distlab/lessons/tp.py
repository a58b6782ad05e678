"""The bench's reference copy of the tensor-parallel conjugate functions (Megatron's f and g).

Phase 2 teaches these in exercises 2.15-2.16 (``solutions/phase2_advanced/tp_primitives.py``).
The later tensor-parallel exercises (the layers, attention, the vocab-parallel parts,
TinyGPT: ``template_tensor_parallel.py``) call this copy instead of the learner's, so an
unfinished 2.15 never fails their tests: it is their "built-in", as ``distlab.lessons.sync`` is
for Phase 1's broadcast and gradient average. Keep it equal to the solution.

    f = copy_to_region      forward: identity                backward: all-reduce
    g = reduce_from_region  forward: all-reduce              backward: identity
    gather_from_region      forward: all-gather (last dim)   backward: keep own slice
    scatter_to_region       forward: keep own slice          backward: all-gather

It also holds the scaffolding that shards a full model's weights (``shard``,
``mark_sharded``, ``load_shards``): slicing, not communication, so no exercise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.lessons.sync import check_divisible


def _all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _own_slice(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # never all-reduce the tensor autograd handed us
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # the output is replicated: every rank already holds the whole gradient


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """f: identity forward; the gradient is summed over ``group`` (one all-reduce of |x| backward)."""
    return x if dist.get_world_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """g: sum over ``group`` forward (one all-reduce of |x|); the gradient passes unchanged."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dim; backward keeps this rank's slice."""
    return x if dist.get_world_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's slice of the last dim; backward all-gathers the slices' gradients."""
    world_size = dist.get_world_size(group)
    check_divisible(x.shape[-1], world_size, "last dimension", "tensor-parallel size")
    return x if world_size == 1 else _ScatterToRegion.apply(x, group)


def shard(t: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous slice of ``t`` along ``dim`` (a detached copy; no communication)."""
    world_size = dist.get_world_size(group)
    check_divisible(t.shape[dim], world_size, f"dimension {dim} of size", "tensor-parallel size")
    return t.detach().chunk(world_size, dim)[dist.get_rank(group)].clone()


def mark_sharded(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag a sharded parameter with the dim it is split along (``load_shards`` and the tests read it)."""
    param.partition_dim = dim
    return param


def load_shards(layer: nn.Module, full: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Copy into ``layer`` its slice of every same-named parameter of ``full``; returns ``layer``.

    A parameter tagged by ``mark_sharded`` gets this rank's slice along its ``partition_dim``;
    an untagged one (replicated: LayerNorms, a row layer's bias) the whole tensor.
    """
    params = dict(full.named_parameters())
    layer.to(next(iter(params.values())).device)  # on the full layer's device (cuda on NCCL), tags kept
    with torch.no_grad():
        for name, p in layer.named_parameters():
            dim = getattr(p, "partition_dim", None)
            p.copy_(params[name] if dim is None else shard(params[name], dim, group))
    return layer
