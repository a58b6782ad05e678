"""TinyGPT on a dp x tp grid of ranks, next to the same model on one process.

The ranks form dp_size = W / tp_size rows of tp_size neighbours (build_grid, exercise
2.21); each row holds one tensor-parallel replica (ParallelGPT from tensor_parallel)
and trains on its shard of the global batch; each column averages its shard's
gradients (allreduce_dp_gradients, 2.22). The summary: the 2D loss beside the
single-process loss on the whole global batch (equal), the parameters per rank, and
the bytes rank 0 all-reduces per step (tensor parallelism's activations in the row +
the gradient shard in the column).

    NPROC=4 RUN_MODE=tp_dp_2d ./entrypoint.sh                  # 2 x 2
    NPROC=4 RUN_MODE=tp_dp_2d ./entrypoint.sh --tp-size 4      # pure tensor parallelism
    IMPL=templates NPROC=4 RUN_MODE=tp_dp_2d ./entrypoint.sh   # your template_tp_dp_2d.py (and tensor_parallel)

``python -m demos.tp_dp_2d`` runs it as one rank (a 1 x 1 grid).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from demos.sizes import grid_2d, positive
from distlab.comm import CommLedger
from distlab.data import synthetic_tokens
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress, sync_device
from distlab.models import GPTConfig, TinyGPT
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="TinyGPT, data parallel x tensor parallel.")
    parser.add_argument("--tp-size", type=int, default=None,
                        help="default: 2 where it divides the world size, else 1")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 16, rounded up to a multiple of the data-parallel size")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A tp size that divides the ranks, TinyGPT's 4 heads and its vocabulary of 64; a batch the replicas share."""
    positive(args, "--steps")
    grid_2d(args, world_size, {"TinyGPT's n_head": 4, "vocabulary": 64}, 16)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        lesson = load("phase2_advanced", "tp_dp_2d")
        tp = load("phase2_advanced", "tensor_parallel")  # the layers of exercises 2.17-2.20
        grid = lesson.build_grid(args.tp_size)
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=64)
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its tp shard
        reference = TinyGPT(cfg)
        model = tp.ParallelGPT(reference, group=grid.tp_group).to(env.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0)
        tokens, targets = synthetic_tokens(n_seq=args.global_batch * args.steps, seq_len=16, vocab_size=64).tensors
        log0(f"2D: {env.world_size} ranks = dp {grid.dp_size} x tp {grid.tp_size}; "
             f"rank 0's tp group {list(grid.tp_ranks)}, dp group {list(grid.dp_ranks)}")
        ledger, elapsed = CommLedger(), 0.0
        for step in progress(range(args.steps), desc="2D"):
            x = tokens[step * args.global_batch:(step + 1) * args.global_batch]
            y = targets[step * args.global_batch:(step + 1) * args.global_batch]
            start = time.perf_counter()
            with ledger:
                loss = lesson.train_step(model, opt, lambda m, a, b: m(a, b)[1], x.to(env.device),
                                         y.to(env.device), grid)
            sync_device(env.device)  # CUDA work is queued: time it when it is done
            elapsed += time.perf_counter() - start
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = reference(x, y)[1]  # single process, whole global batch
            ref_loss.backward()
            ref_opt.step()
        dist.all_reduce(loss, group=grid.dp_group)  # mean over replicas = the global batch's loss
        log0("\n" + format_table([{
            "ranks": env.world_size, "dp x tp": f"{grid.dp_size} x {grid.tp_size}", "steps": args.steps,
            "loss (2D)": f"{loss.item() / grid.dp_size:.4f}", "loss (one process)": f"{ref_loss.item():.4f}",
            "params/rank": sum(p.numel() for p in model.parameters()),
            "all-reduced/step (rank 0)": format_bytes(ledger.bytes("all_reduce") / args.steps),
            "steps/s": f"{args.steps / elapsed:.1f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
