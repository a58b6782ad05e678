"""One transformer block, whole and sequence-parallel: same output, 1/W of the activations.

Every rank builds the same Block and the same whole input; the full block runs on all
T tokens, the SequenceParallelBlock (exercises 2.23-2.24) on this rank's T/W. The
summary, per rank: the activations saved for backward (counted with saved-tensor
hooks), the bytes sent in forward + backward (all-gathers and reduce-scatters, as many
as tensor parallelism's all-reduces), and the largest difference from the full block's
output and LayerNorm gradients.

    NPROC=4 RUN_MODE=sequence_parallel ./entrypoint.sh                 # 16 of 64 tokens per rank
    IMPL=templates NPROC=4 RUN_MODE=sequence_parallel ./entrypoint.sh  # your template_sequence_parallel.py

``python -m demos.sequence_parallel`` runs it as one rank (no communication).
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.distributed as dist

from demos.sizes import multiple_of, positive, transformer_dims
from distlab.comm import CommLedger
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0
from distlab.models import Block, GPTConfig
from distlab.todo import run_demo


def forward_counting_saved(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``fn()`` and the bytes of the tensors autograd saved for its backward."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="A sequence-parallel transformer block against the full block.")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 64, rounded up to a multiple of the ranks")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=None, help="default: 16 per head")
    parser.add_argument("--n-head", type=int, default=None, help="default: 4, rounded up to a multiple of the ranks")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Tokens and heads that split over ``world_size`` ranks (see demos/sizes.py)."""
    positive(args, "--batch")
    args.seq_len = multiple_of(args.seq_len, 64, world_size, "--seq-len", "the tensor-parallel size")
    transformer_dims(args, world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        sp_lesson = load("phase2_advanced", "sequence_parallel")
        W, rank = env.world_size, env.rank
        torch.manual_seed(0)  # every rank: the same full block and the same whole input
        block = Block(GPTConfig(block_size=args.seq_len, n_head=args.n_head, n_embd=args.n_embd)).to(env.device)
        x = torch.randn(args.batch, args.seq_len, args.n_embd).to(env.device)
        sp = sp_lesson.SequenceParallelBlock(block)

        full, full_saved = forward_counting_saved(lambda: block(x))
        full.square().mean().backward()
        mine = x.chunk(W, dim=1)[rank]
        ledger = CommLedger()
        with ledger:
            out, sp_saved = forward_counting_saved(lambda: sp(mine))
            (out.square().sum() / full.numel()).backward()  # the ranks' losses sum to the full mean
            sp_lesson.allreduce_sequence_parallel_grads(sp)
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
    run_demo(main)
