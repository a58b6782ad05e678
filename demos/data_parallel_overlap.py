"""RUN_MODE=data_parallel_overlap: TinyCNN on digits under DDP with one overlapped all-reduce per parameter.

    RUN_MODE=data_parallel_overlap ./entrypoint.sh [--epochs 6] [--global-batch 64]
    IMPL=templates RUN_MODE=data_parallel_overlap ./entrypoint.sh   # your template_ddp_overlap.py

Every rank initialises its replica differently on purpose (the wrapper's broadcast
makes them equal), trains with SGD and a cosine schedule, and rank 0 prints a table:
final loss, test accuracy, all-reduces per step (one per parameter here) and
gradient bytes per step (``distlab.comm.CommLedger``), samples/s.
``train_demo`` is shared with demos/data_parallel_bucket_overlap.py.
See phase3_multi_node/guidelines_ddp_zero.md#ddp-overlap.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

from demos.sizes import global_batch, positive
from distlab.comm import CommLedger
from distlab.data import digits
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress, sync_device
from distlab.models import TinyCNN
from distlab.todo import run_demo


def build_parser(description: str = "TinyCNN on digits under a DDP wrapper.") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 64, rounded up to a multiple of the world size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bucket-mb", type=float, default=0.01, help="bucket size (bucketed wrapper only)")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A global batch the ranks share equally (see demos/sizes.py)."""
    positive(args, "--epochs")
    args.global_batch = global_batch(args.global_batch, 64, world_size)
    return args


def train_demo(wrap: Callable[[nn.Module, argparse.Namespace], nn.Module], description: str,
               argv: list[str] | None = None) -> None:
    """TinyCNN on digits under ``wrap(model, args) -> DDP wrapper``; a summary table on rank 0.

    The wrapper must offer ``finish_gradient_synchronization()`` (called after each backward).
    """
    args = build_parser(description).parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        train, test = digits("train", 16), digits("test", 16)
        torch.manual_seed(env.rank)  # deliberately different: the wrapper's broadcast makes replicas equal
        model = wrap(TinyCNN(num_classes=10).to(env.device), args)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loader = DataLoader(train, batch_size=args.global_batch // env.world_size, drop_last=True,
                            sampler=DistributedSampler(train, env.world_size, env.rank, drop_last=True))
        # Cosine decay to zero, so BatchNorm's running statistics settle with the weights.
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
        loss_fn, ledger, steps = nn.CrossEntropyLoss(), CommLedger(), 0
        log0(f"{description}: {env.world_size} ranks ({env.backend}), global batch {args.global_batch}")
        start = time.perf_counter()
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in progress(loader, desc=f"epoch {epoch}"):
                optimizer.zero_grad(set_to_none=True)
                with ledger:
                    loss = loss_fn(model(x.to(env.device)), y.to(env.device))
                    loss.backward()
                    model.finish_gradient_synchronization()
                optimizer.step()
                scheduler.step()
                steps += 1
        sync_device(env.device)  # CUDA work is queued: time it when it is done
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            xs, ys = zip(*[(x, y) for x, y in DataLoader(test, batch_size=len(test))])
            accuracy = (model(xs[0].to(env.device)).argmax(1) == ys[0].to(env.device)).float().mean().item()
        log0("\n" + format_table([{
            "ranks": env.world_size, "steps": steps, "final loss (rank 0)": f"{loss.item():.4f}",
            "test accuracy": f"{accuracy:.1%}", "all-reduces/step": ledger.calls("all_reduce") // steps,
            "grad bytes/step": format_bytes(ledger.bytes("all_reduce") / steps),
            "samples/s": f"{steps * args.global_batch / elapsed:.0f}"}]))
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> None:
    ddp = load("phase3_multi_node", "ddp_overlap")
    train_demo(lambda model, args: ddp.DDPIndividualParameters(model),
               "DDP, one overlapped all-reduce per parameter", argv)


if __name__ == "__main__":
    run_demo(main)
