"""Data-parallel TinyGPT with and without activation checkpointing: memory saved, same losses.

Trains TinyGPT (dropout 0.1) from the same seed three times: no block checkpointed,
every other block, every block. ``SavedActivationMeter`` counts the bytes autograd
keeps from forward to backward; the summary shows them against the plain run, an
estimate of the peak during backward (the saved inputs plus one recomputed block's
insides), the final loss (equal in all three: the recomputation replays the dropout
masks) and the time per step: the median over the steps after ``--warmup`` untimed ones,
with its range (the first steps pay one-time costs: without a warm-up the first run looks
slowest whatever it does, and checkpointing looked faster than it is).

    RUN_MODE=activation_checkpointing ./entrypoint.sh                  # the solutions, 2 ranks
    IMPL=templates RUN_MODE=activation_checkpointing ./entrypoint.sh   # your template
    RUN_MODE=activation_checkpointing ./entrypoint.sh --n-layer 8

Lesson: phase2_advanced/guidelines.md#activation-checkpointing (exercises 2.6-2.7).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from demos.sizes import global_batch, positive
from distlab.data import synthetic_tokens
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, median, progress, sync_device
from distlab.models import Block, GPTConfig, TinyGPT
from distlab.lessons.sync import allreduce_gradients
from distlab.testing import shard
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Data-parallel TinyGPT with and without activation checkpointing.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps at the start of each run")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 16, rounded up to a multiple of the world size")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A global batch the ranks share equally (see demos/sizes.py); some steps timed."""
    positive(args, "--steps", "--n-layer")
    args.global_batch = global_batch(args.global_batch, 16, world_size)
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps}: some steps must be timed; "
                         f"use --warmup {min(4, args.steps - 1)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ac = load("phase2_advanced", "activation_checkpointing")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        local_batch = args.global_batch // env.world_size
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=args.n_layer, n_head=4, n_embd=64, dropout=0.1)
        data = synthetic_tokens(n_seq=args.steps * args.global_batch, seq_len=32, vocab_size=64, seed=0)
        # What one block saves for backward (its input included), measured on a spare
        # block, plain and checkpointed (then it keeps its input only).
        x = torch.randn(local_batch, cfg.block_size, cfg.n_embd, requires_grad=True)
        block = Block(cfg)
        with ac.SavedActivationMeter(block.parameters()) as meter:
            block(x)
        block_bytes = meter.bytes
        with ac.SavedActivationMeter(block.parameters()) as meter:
            ac.checkpoint(block, x)
        log0(f"one block saves {format_bytes(block_bytes)} for backward; checkpointed, {format_bytes(meter.bytes)}")
        rows = []
        for every in (0, 2, 1):  # 0: no checkpointing
            torch.manual_seed(0)  # same weights and the same dropout masks in every run
            model = TinyGPT(cfg).to(env.device)
            wrapped = ac.apply_activation_checkpointing(model.blocks, every) if every else 0
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            saved, step_s = 0, []
            for step in progress(range(args.steps), desc=f"checkpoint {wrapped}/{cfg.n_layer} blocks"):
                x, y = (shard(t[step * args.global_batch:(step + 1) * args.global_batch], env.rank,
                              env.world_size).to(env.device) for t in data.tensors)
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with ac.SavedActivationMeter(model.parameters()) as meter:
                    _, loss = model(x, y)
                saved = max(saved, meter.bytes)
                loss.backward()
                allreduce_gradients(model.parameters())  # Phase 1's gradient average
                optimizer.step()
                sync_device(env.device)  # CUDA work is queued: time it when it is done
                step_s.append(time.perf_counter() - start)
            timed = sorted(step_s[args.warmup:])
            dist.all_reduce(loss)
            # While backward runs through a checkpointed block, that block's insides are
            # alive again: the peak is the saved inputs plus one recomputed block.
            peak = saved + (block_bytes if wrapped else 0)
            plain = rows[0]["_saved"] if rows else saved
            rows.append({"checkpointed blocks": f"{wrapped}/{cfg.n_layer}",
                         "saved fwd->bwd": format_bytes(saved), "vs none": f"{saved / plain:.0%}",
                         "peak in bwd (est.)": format_bytes(peak), "_saved": saved,
                         "final loss": f"{loss.item() / env.world_size:.4f}",
                         "ms/step (median, range)": f"{1000 * median(timed):.0f} "
                                                    f"({1000 * timed[0]:.0f}-{1000 * timed[-1]:.0f})"})
        for row in rows:
            del row["_saved"]
        log0(f"\nTinyGPT n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, T={cfg.block_size}, dropout {cfg.dropout}, "
             f"{env.world_size} ranks, local batch {local_batch}, {args.steps} steps ({args.warmup} untimed)")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
