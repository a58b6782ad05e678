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
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm import all_gather_single, reduce_scatter_single
from distlab.models import Block
from distlab.todo import todo


def _check_divisible(n: int, world_size: int, what: str) -> int:
    if n % world_size:
        raise ValueError(f"{what} {n} is not divisible by tensor-parallel size {world_size} "
                         f"({n} = {n // world_size} * {world_size} + {n % world_size})")
    return n // world_size


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
        # --- TODO 2.23: gather along the sequence ---
        # Forward: every rank's (B, T/W, d) shard, concatenated along T (_all_gather_seq).
        raise todo("2.23 sequence gather forward", "phase2_advanced/guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23 ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.23: its conjugate ---
        # Each rank's gradient of the full sequence is partial (its heads / hidden slice).
        # What does this rank's shard need? (_reduce_scatter_seq / _all_gather_seq are written.)
        raise todo("2.23 sequence gather backward", "phase2_advanced/guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23 ---


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # --- TODO 2.23: reduce-scatter along the sequence ---
        # Forward: sum the ranks' partial (B, T, d) and keep this rank's T/W tokens.
        raise todo("2.23 sequence reduce-scatter forward", "phase2_advanced/guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23 ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.23: its conjugate ---
        # Every rank's partial sum fed every token: what gradient does its input need?
        raise todo("2.23 sequence reduce-scatter backward", "phase2_advanced/guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.23 ---


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
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_divisible(linear.weight.shape[dim], world_size, "out_features" if dim == 0 else "in_features")
    out = copy.deepcopy(linear)
    with torch.no_grad():
        out.weight = nn.Parameter(linear.weight.detach().chunk(world_size, dim)[rank].clone())
        out.weight.partition_dim = dim
        if linear.bias is not None and dim == 0:
            out.bias = nn.Parameter(linear.bias.detach().chunk(world_size, 0)[rank].clone())
            out.bias.partition_dim = 0
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
        self.local_heads = _check_divisible(block.attn.n_head, world_size, "n_head")
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
        # --- TODO 2.24: the sequence-parallel block ---
        # x is (B, T/W, d). For attention and for the MLP:
        # 1. LayerNorm on the shard, then gather_from_sequence_region -> (B, T, d);
        # 2. the local heads (q, k, v: F.linear with this rank's rows; causal attention) or
        #    the local hidden slice (fc, gelu);
        # 3. self._row_out(y, proj): the row layer, reduce-scattered back to (B, T/W, d), bias once;
        # 4. the residual add, on the shard.
        raise todo("2.24 sequence-parallel block", "phase2_advanced/guidelines_model_parallel.md#sequence-parallelism")
        # --- end TODO 2.24 ---


def allreduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum, over ``group``, the gradients of parameters marked ``sequence_parallel``.

    Each rank's gradient of a replicated LayerNorm weight (or row bias) sums over its
    own T/W tokens only; the full gradient sums over all T.
    Collective: every rank of ``group`` must call it after backward.
    Cost: one all-reduce of |replicated parameters| bytes.
    """
    # --- TODO 2.24: complete the replicated gradients ---
    # Parameters marked p.sequence_parallel saw only this rank's tokens: sum their
    # gradients over the group (a sum, not a mean: the full gradient sums over all tokens).
    raise todo("2.24 sequence-parallel gradients", "phase2_advanced/guidelines_model_parallel.md#sequence-parallelism")
    # --- end TODO 2.24 ---


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    import argparse

    from distlab.comm import CommLedger
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0
    from distlab.models import GPTConfig

    parser = argparse.ArgumentParser(description="A sequence-parallel transformer block against the full block.")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        W, rank = env.world_size, env.rank
        _check_divisible(args.seq_len, W, "sequence length")
        torch.manual_seed(0)  # every rank: the same full block and the same whole input
        block = Block(GPTConfig(block_size=args.seq_len, n_head=args.n_head, n_embd=args.n_embd))
        x = torch.randn(args.batch, args.seq_len, args.n_embd)
        sp = SequenceParallelBlock(block)

        def forward_counting_saved(fn):
            saved = [0]

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved[0] += t.numel() * t.element_size()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return fn(), saved[0]

        full, full_saved = forward_counting_saved(lambda: block(x))
        full.square().mean().backward()
        mine = x.chunk(W, dim=1)[rank]
        ledger = CommLedger()
        with ledger:
            out, sp_saved = forward_counting_saved(lambda: sp(mine))
            (out.square().sum() / full.numel()).backward()  # the ranks' losses sum to the full mean
            allreduce_sequence_parallel_grads(sp)
        out_diff = (out - full.chunk(W, dim=1)[rank]).abs().max()
        grad_diff = max((getattr(sp, n).weight.grad - getattr(block, n).weight.grad).abs().max() for n in ("ln1", "ln2"))
        worst = torch.stack([out_diff, grad_diff]).detach()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        log0(f"sequence parallel: one block, batch {args.batch} x {args.seq_len} tokens x {args.n_embd}, {W} ranks")
        log0(format_table([
            {"block": "full (one process)", "saved activations/rank": format_bytes(full_saved),
             "sent/rank, fwd+bwd": "0 B", "max |diff|": "-"},
            {"block": f"sequence parallel ({args.seq_len // W} tokens/rank)",
             "saved activations/rank": format_bytes(sp_saved), "sent/rank, fwd+bwd": format_bytes(ledger.wire_bytes()),
             "max |diff|": f"out {worst[0]:.1e}, LayerNorm grads {worst[1]:.1e}"}]))
        log0(f"calls: {ledger.summary()}")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
