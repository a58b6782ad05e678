"""Naive model split: an MLP on digits, one stage per rank, trained one batch at a time.

Every rank builds the whole seeded model and keeps its own stage (a Linear + ReLU
block; the last rank also the head); each step sends the activation down the line and
its gradient back up (``phase2_advanced/model_split.py``, exercises 2.10-2.11). The
summary shows the final loss, the bytes rank 0 sends per step and the throughput.

    RUN_MODE=model_split ./entrypoint.sh                   # 2 stages (NPROC=4 for 4)
    IMPL=templates RUN_MODE=model_split ./entrypoint.sh    # the same with your template
    python -m demos.model_split                            # 1 stage, no torchrun

See phase2_advanced/guidelines_model_parallel.md#naive-model-split.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from demos.sizes import positive
from distlab.comm import CommLedger
from distlab.data import digits
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress, sync_device
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="An MLP split across ranks, one stage each, on digits.")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """One stage per rank, any number of them; the sizes must be positive."""
    positive(args, "--epochs", "--batch", "--hidden")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ms = load("phase2_advanced", "model_split")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        p = env.world_size
        x_all, y_all = digits("train", flatten=True).tensors
        torch.manual_seed(0)  # every rank builds the whole model and keeps its stage
        blocks = [nn.Sequential(nn.Linear(x_all.shape[1] if i == 0 else args.hidden, args.hidden), nn.ReLU())
                  for i in range(p)]
        head = nn.Linear(args.hidden, 10)
        module = nn.Sequential(blocks[env.rank], *([head] if env.rank == p - 1 else [])).to(env.device)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        steps = x_all.shape[0] // args.batch
        log0(f"model split: {p} stages, {sum(q.numel() for q in module.parameters())} parameters on rank 0")
        ledger, loss, start = CommLedger(), None, time.perf_counter()
        for epoch in range(args.epochs):
            perm = torch.randperm(x_all.shape[0], generator=torch.Generator().manual_seed(epoch))
            for i in progress(range(steps), desc=f"epoch {epoch}"):
                idx = perm[i * args.batch:(i + 1) * args.batch]
                ledger.reset()  # keep the last step's bytes only
                with ledger:
                    loss = ms.train_step(module, opt, nn.functional.cross_entropy, x_all[idx].to(env.device),
                                         y_all[idx].to(env.device), (args.batch, args.hidden), group=None)
        sync_device(env.device)  # CUDA work is queued: time it when it is done
        elapsed = time.perf_counter() - start
        last = [loss]
        dist.broadcast_object_list(last, src=p - 1)  # the loss lives on the last stage
        log0("\n" + format_table([{
            "stages": p, "epochs": args.epochs, "final loss": f"{last[0]:.4f}",
            "p2p sent/step (rank 0)": format_bytes(ledger.sent_bytes()),
            "samples/s": f"{args.epochs * steps * args.batch / elapsed:.0f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
