"""Tensor-parallel TinyGPT next to the same model on one process: equal losses, 1/W of the weights.

Every rank builds the same full TinyGPT from one seed, keeps its shard (ParallelGPT,
exercises 2.15-2.20) and trains it on the same tokens as a single-process twin. The
summary: both losses (equal up to float rounding), the parameters on each rank, and
the all-reduces of one step counted by CommLedger (4 per block, one for the
embedding, one for the head, three small ones for the vocab-parallel loss).

    RUN_MODE=tensor_parallel ./entrypoint.sh                 # 2 ranks, the solutions
    NPROC=4 RUN_MODE=tensor_parallel ./entrypoint.sh         # 4 ranks: one head each
    IMPL=templates RUN_MODE=tensor_parallel ./entrypoint.sh  # your template_tensor_parallel.py

``python -m demos.tensor_parallel`` runs it as one rank (no communication). The template
builds on the bench's conjugate functions (distlab.lessons.tp), so your 2.15-2.16 are graded by
the tests, not run here.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from demos.sizes import positive, transformer_dims
from distlab.comm import CommLedger
from distlab.data import synthetic_tokens
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress, sync_device
from distlab.models import GPTConfig, TinyGPT
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Tensor-parallel TinyGPT vs the same model on one process.")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=None, help="default: 16 per head")
    parser.add_argument("--n-head", type=int, default=None, help="default: 4, rounded up to a multiple of the ranks")
    parser.add_argument("--vocab", type=int, default=None, help="default: 64, rounded up to a multiple of the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Heads, width and vocabulary that split over ``world_size`` ranks (see demos/sizes.py)."""
    positive(args, "--steps", "--batch")
    transformer_dims(args, world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        tp = load("phase2_advanced", "tensor_parallel")
        cfg = GPTConfig(vocab_size=args.vocab, block_size=16, n_layer=2, n_head=args.n_head, n_embd=args.n_embd)
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its shard
        reference = TinyGPT(cfg)
        model = tp.ParallelGPT(reference, group=None).to(env.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0)
        tokens, targets = synthetic_tokens(n_seq=args.batch * args.steps, seq_len=16, vocab_size=args.vocab).tensors
        n_full = sum(p.numel() for p in reference.parameters())
        n_local = sum(p.numel() for p in model.parameters())
        log0(f"tensor parallel: TinyGPT over {env.world_size} ranks ({env.backend}); {n_full} parameters, "
             f"{n_local} on each rank")
        with torch.no_grad():  # before the progress bar, so an unfinished TODO ends the run in one line
            x, y = tokens[:args.batch], targets[:args.batch]
            first, ref_first = model(x.to(env.device), y.to(env.device))[1], reference(x, y)[1]
        log0(f"initial loss: {first.item():.4f} tensor parallel, {ref_first.item():.4f} one process")
        ledger, elapsed = CommLedger(), 0.0
        for step in progress(range(args.steps), desc="tensor parallel"):
            x = tokens[step * args.batch:(step + 1) * args.batch].to(env.device)
            y = targets[step * args.batch:(step + 1) * args.batch].to(env.device)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with ledger if step == args.steps - 1 else contextlib.nullcontext():  # count one step's communication
                loss = model(x, y)[1]
                loss.backward()
            opt.step()
            sync_device(env.device)  # CUDA work is queued: time it when it is done
            elapsed += time.perf_counter() - start
            ref_opt.zero_grad(set_to_none=True)  # the single-process twin, for the summary
            ref_loss = reference(x.cpu(), y.cpu())[1]
            ref_loss.backward()
            ref_opt.step()
        log0("\n" + format_table([{
            "ranks": env.world_size, "steps": args.steps, "loss (tensor parallel)": f"{loss.item():.4f}",
            "loss (one process)": f"{ref_loss.item():.4f}", "params/rank": n_local,
            "all-reduces/step": ledger.calls("all_reduce"),
            "all-reduced/step": format_bytes(ledger.bytes("all_reduce")),
            "steps/s": f"{args.steps / elapsed:.1f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
