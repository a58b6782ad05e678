# Generated from solutions/phase2_advanced/sequence_parallel.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Sequence parallelism (Korthikanti et al. 2022): split what tensor parallelism leaves replicated.

In a tensor-parallel block, the LayerNorms, the residual adds and dropout run on the
whole (B, T, d) activation on every rank: W copies of the same work and memory.
Sequence parallelism keeps those activations split along the sequence, T/W tokens
per rank, and changes the two boundary operators of each parallel region:

    tensor parallel:    x ─ LN ─ f (identity)            ─ column … row ─ g (all-reduce)            ─ + x
    sequence parallel:  x ─ LN ─ all-gather along T      ─ column … row ─ reduce-scatter along T    ─ + x
                        (B, T/W, d)   (B, T, d)                     partial (B, T, d)   (B, T/W, d)

Conjugates, as for f and g:

    gather_from_sequence_region        forward all-gather(T)       backward reduce-scatter(T)
    reduce_scatter_to_sequence_region  forward reduce-scatter(T)   backward all-gather(T)

An all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes on the
wire do not change; the activations outside attention and MLP shrink by W.
One new duty: replicated parameters (LayerNorms, the row layers' biases) now see
only this rank's tokens, so their gradients are partial sums over the sequence and
must be all-reduced over the group after backward.

Cost per block, per rank, forward and again backward: 2 all-gathers and 2
reduce-scatters of B*T*d/W elements each (the same bytes as tensor parallelism's 2
all-reduces); after backward, one all-reduce of the replicated parameters' gradients.
See phase2_advanced/guidelines_model_parallel.md#sequence-parallelism.
Run: ``NPROC=4 RUN_MODE=sequence_parallel ./entrypoint.sh`` (one block, both ways).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm import all_gather_single, reduce_scatter_single
from distlab.models import Block
from distlab.lessons.sync import check_divisible
from distlab.lessons.tp import mark_sharded, shard
from distlab.todo import todo


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/W, ...) on each rank -> (B, T, ...), chunks in rank order (the collectives work on dim 0)."""
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] * dist.get_world_size(group), *xt.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, xt, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/W, ...) chunk of their sum."""
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] // dist.get_world_size(group), *xt.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, xt, group=group)
    return out.transpose(0, 1)


# --------------------------------------------------------------------------- primitives
class _GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # --- TODO 2.23a: sequence gather forward ---
        # Goal: every rank's (B, T/W, d) shard, concatenated along T in group-rank order.
        # Collective: every rank of `group` calls it. (The dim-0 helpers above are written.)
        raise todo("2.23a sequence gather forward", "guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23a ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.23b: sequence gather backward ---
        # The conjugate: each rank's gradient of the full sequence is partial (its heads or
        # hidden slice). What does this rank's shard need? Return (gradient for x, None).
        raise todo("2.23b sequence gather backward", "guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23b ---


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # --- TODO 2.23c: sequence reduce-scatter forward ---
        # Goal: sum the ranks' partial (B, T, d) and keep only this rank's T/W tokens.
        # Collective: every rank of `group` calls it.
        raise todo("2.23c sequence reduce-scatter forward", "guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23c ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.23d: sequence reduce-scatter backward ---
        # The conjugate: every rank's partial sum fed every token. What gradient does its
        # input need? Return (gradient for x, None).
        raise todo("2.23d sequence reduce-scatter backward", "guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23d ---


def gather_from_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, T/W, d) sequence shards -> (B, T, d), entering a tensor-parallel region.

    Equivalent to: ``torch.cat([x_0, ..., x_{W-1}], dim=1)``; its gradient is reduce-scattered.
    Collective: every rank of ``group`` calls it, forward and backward.
    Cost: one all-gather of |x| per rank forward; one reduce-scatter of W|x| backward.
    """
    return x if dist.get_world_size(group) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, T, d) partial sums -> this rank's (B, T/W, d) chunk of their sum, leaving the region.

    Equivalent to: ``sum(x_r).chunk(W, dim=1)[rank]``; its gradient is all-gathered.
    Collective: every rank of ``group`` calls it, forward and backward.
    Cost: one reduce-scatter of |x| forward; one all-gather of |x|/W per rank backward.
    """
    return x if dist.get_world_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


# --------------------------------------------------------------------------- the block
def _shard_linear(linear: nn.Linear, dim: int, group, keep_bias: bool = True) -> nn.Linear:
    """A copy of ``linear`` holding this rank's slice of the weight along ``dim`` (0: rows, 1: columns)."""
    check_divisible(linear.weight.shape[dim], dist.get_world_size(group),
                    "out_features" if dim == 0 else "in_features", "tensor-parallel size")
    out = copy.deepcopy(linear)
    out.weight = mark_sharded(nn.Parameter(shard(linear.weight, dim, group)), dim)
    if linear.bias is not None and dim == 0:
        out.bias = mark_sharded(nn.Parameter(shard(linear.bias, 0, group)), 0)
    return out


class SequenceParallelBlock(nn.Module):
    """A ``distlab.models.Block`` with tensor-parallel attention/MLP and sequence-split everything else.

    Input and output: (B, T/W, d), this rank's tokens [rank*T/W, (rank+1)*T/W).
    Parameter names match Block's; sharded ones carry ``partition_dim``; the
    replicated ones whose gradients are partial carry ``sequence_parallel = True``.

    Equivalent to: ``block(x).chunk(W, dim=1)[rank]`` for the full ``x``.
    Collective: every rank of ``group`` runs forward and backward, then
    ``allreduce_sequence_parallel_grads``.
    Cost: forward 2 all-gathers + 2 reduce-scatters of |x| per rank; backward the same.
    """

    def __init__(self, block: Block, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        world_size = dist.get_world_size(group)
        self.local_heads = check_divisible(block.attn.n_head, world_size, "n_head", "tensor-parallel size")
        self.head_dim = block.attn.head_dim
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn, self.mlp = nn.Module(), nn.Module()
        for name in ("q", "k", "v"):
            setattr(self.attn, name, _shard_linear(getattr(block.attn, name), 0, group))
        self.attn.proj = _shard_linear(block.attn.proj, 1, group)
        self.mlp.fc = _shard_linear(block.mlp.fc, 0, group)
        self.mlp.proj = _shard_linear(block.mlp.proj, 1, group)
        for p in (*self.ln1.parameters(), *self.ln2.parameters(), self.attn.proj.bias, self.mlp.proj.bias):
            if p is not None:
                p.sequence_parallel = True  # replicated, but fed by this rank's tokens only

    def _row_out(self, y: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        y = reduce_scatter_to_sequence_region(F.linear(y, proj.weight), self.group)
        return y + proj.bias if proj.bias is not None else y  # once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.24a: sequence-parallel block ---
        # Goal: Block(x) for this rank's (B, T/W, d) tokens. LayerNorms and residuals run on the
        # shard; attention (this rank's heads) and the MLP (its hidden slice) need every token,
        # and their row layers' partial sums come back as this rank's shard (self._row_out).
        # Per sub-layer: one gather in, one reduce-scatter out; nothing else communicates.
        raise todo("2.24a sequence-parallel block", "guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.24a ---


def allreduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum, over ``group``, the gradients of parameters marked ``sequence_parallel``.

    Each rank's gradient of a replicated LayerNorm weight (or row bias) sums over its
    own T/W tokens only; the full gradient sums over all T.
    Collective: every rank of ``group`` must call it after backward.
    Cost: one all-reduce of |replicated parameters| bytes.
    """
    # --- TODO 2.24b: sequence-parallel gradients ---
    # Goal: each parameter marked `sequence_parallel` saw only this rank's tokens: make its
    # gradient the one over all T tokens (a sum, not a mean). Leave every other gradient alone.
    # Collective: every rank of `group` calls it, after backward.
    raise todo("2.24b sequence-parallel gradients", "guidelines_model_parallel.md#sequence-parallelism")
    # --- end TODO 2.24b ---
