"""Mixed-precision data-parallel TinyGPT: fp32 vs bf16 vs fp16, with the dynamic loss scaler.

Trains the same TinyGPT from the same seed once per compute dtype, each rank on its
shard of every global batch, with fp32 master weights and ``DynamicLossScaler``. fp16
starts from a deliberately too large scale (2^20) and backs off; fp32 and bf16 run
with S = 1. The summary: final loss and its difference from fp32, skipped steps, the
final scale, bytes all-reduced per step (fp32 gradients + the 4-byte overflow flag),
the master weights' dtype and the time per step.

    RUN_MODE=mixed_precision ./entrypoint.sh                     # the solutions, 2 ranks
    IMPL=templates RUN_MODE=mixed_precision ./entrypoint.sh      # your template
    RUN_MODE=mixed_precision ./entrypoint.sh --dtypes float32,float16 --steps 30

Lesson: phase2_advanced/guidelines.md#mixed-precision (exercises 2.3-2.5).
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from demos.sizes import global_batch, positive
from distlab.comm import CommLedger
from distlab.data import synthetic_tokens
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress, sync_device
from distlab.models import GPTConfig, TinyGPT
from distlab.testing import shard
from distlab.todo import run_demo


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Mixed-precision data-parallel TinyGPT: fp32 vs bf16 vs fp16.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 16, rounded up to a multiple of the world size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--max-skipped-steps", type=int, default=50,
                        help="stop when the scaler has skipped this many steps in a row (inf/nan gradients at "
                             "every scale: nan inputs or loss); 0: never stop")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A global batch the ranks share equally (see demos/sizes.py)."""
    positive(args, "--steps")
    if args.max_skipped_steps < 0:
        raise ValueError(f"--max-skipped-steps {args.max_skipped_steps} cannot be negative: "
                         "use --max-skipped-steps 50 (or 0 to never stop)")
    args.global_batch = global_batch(args.global_batch, 16, world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    mp = load("phase2_advanced", "mixed_precision")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
        data = synthetic_tokens(n_seq=args.steps * args.global_batch, seq_len=32, vocab_size=64, seed=0)
        rows, reference = [], None
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            torch.manual_seed(0)  # same initial weights on every rank and for every dtype
            model = TinyGPT(cfg).to(env.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            # fp16 needs the scaler. Its first scale is deliberately too large (the
            # gradient of the logits, S / (B*T), overflows fp16's 65504): watch it back off.
            # fp32 and bf16 have fp32's exponent range: S = 1, never grown.
            fp16 = dtype == torch.float16
            # A run that skips every step (nan inputs) stops with the first non-finite gradient's name.
            scaler = mp.DynamicLossScaler(init_scale=2.0 ** 20 if fp16 else 1.0,
                                          growth_interval=20 if fp16 else 10 ** 9,
                                          max_skipped_steps=args.max_skipped_steps or None,
                                          named_parameters=model.named_parameters())
            skipped, ledger = 0, CommLedger()
            start = time.perf_counter()
            for step in progress(range(args.steps), desc=name):
                x, y = (shard(t[step * args.global_batch:(step + 1) * args.global_batch], env.rank,
                              env.world_size).to(env.device) for t in data.tensors)
                with ledger:
                    loss, stepped = mp.train_step(model, optimizer, scaler, _lm_loss, x, y, dtype=dtype)
                skipped += not stepped
            sync_device(env.device)  # CUDA work is queued: time it when it is done
            elapsed = time.perf_counter() - start
            dist.all_reduce(loss)
            final = loss.item() / env.world_size
            reference = final if reference is None else reference  # the first dtype (float32)
            rows.append({"compute dtype": name, "final loss": f"{final:.4f}", "vs float32": f"{final - reference:+.1e}",
                         "skipped steps": skipped, "final scale": f"{scaler.get_scale():g}",
                         "bytes all-reduced/step": format_bytes(ledger.bytes("all_reduce") / args.steps),
                         "master weights": str(next(model.parameters()).dtype).replace("torch.", ""),
                         "ms/step": f"{1000 * elapsed / args.steps:.0f}"})
        log0(f"\nTinyGPT ({sum(p.numel() for p in model.parameters())} params), {env.world_size} ranks "
             f"({env.backend}), global batch {args.global_batch}, {args.steps} steps; chance loss {math.log(64):.2f}")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
