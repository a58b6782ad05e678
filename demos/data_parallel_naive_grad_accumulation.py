"""Data-parallel TinyCNN on digits with gradient accumulation: one all-reduce per optimizer step.

Each rank cuts its share of the global batch into micro-batches, runs forward and
backward on each inside ``no_sync()`` but the last, and steps once. The summary
counts, with ``CommLedger``, the gradient all-reduces and bytes of every optimizer
step against what reducing after every micro-batch would cost, and reports the
final loss, test accuracy and throughput.

    RUN_MODE=data_parallel_naive_grad_accumulation ./entrypoint.sh                 # the solutions, 2 ranks
    IMPL=templates RUN_MODE=data_parallel_naive_grad_accumulation ./entrypoint.sh  # your template
    RUN_MODE=data_parallel_naive_grad_accumulation ./entrypoint.sh --micro-batch 4

Lesson: phase2_advanced/guidelines.md#gradient-accumulation (exercises 2.1-2.2).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Data-parallel TinyCNN on digits with gradient accumulation.")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 64, rounded up to a multiple of the world size")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward on one rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--image-size", type=int, default=16)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A global batch the ranks share equally (see demos/sizes.py)."""
    positive(args, "--epochs", "--micro-batch", "--image-size")
    args.global_batch = global_batch(args.global_batch, 64, world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    acc = load("phase2_advanced", "grad_accumulation")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        local_batch = args.global_batch // env.world_size
        k = -(-local_batch // args.micro_batch)  # ceil: the last micro-batch may be smaller
        train, test = digits("train", args.image_size), digits("test", args.image_size)
        torch.manual_seed(0)
        model = acc.AccumulatingDataParallel(TinyCNN(num_classes=10).to(env.device))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loader = DataLoader(train, batch_size=local_batch, drop_last=True,
                            sampler=DistributedSampler(train, env.world_size, env.rank, drop_last=True))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
        loss_fn = nn.CrossEntropyLoss()
        trainable = [p for p in model.parameters() if p.requires_grad]
        log0(f"gradient accumulation: {env.world_size} ranks ({env.backend}), global batch {args.global_batch} "
             f"= {env.world_size} ranks x {k} micro-batches of <= {args.micro_batch}, {len(loader)} steps/epoch")
        ledger = CommLedger()
        start, steps = time.perf_counter(), 0
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            bar = progress(loader, desc=f"epoch {epoch}")
            for x, y in bar:
                with ledger:  # every step: the counts below are per optimizer step, measured
                    loss = acc.train_step(model, optimizer, loss_fn, x.to(env.device), y.to(env.device),
                                          args.micro_batch)
                scheduler.step()
                dist.all_reduce(loss)  # for display only
                steps += 1
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{loss.item() / env.world_size:.3f}")
        sync_device(env.device)  # CUDA work is queued: time it when it is done
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():  # the whole test set in one batch (360 small images)
            x_test, y_test = (t.to(env.device) for t in test.tensors)
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        # train_step also averages the BatchNorm statistics once per step: not gradients.
        grad_calls = ledger.calls("all_reduce") / steps - sum(1 for b in model.buffers() if b.is_floating_point())
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        log0("\n" + format_table([{
            "ranks": env.world_size, "global batch": args.global_batch, "micro-batch": args.micro_batch,
            "micro-steps/step": k, "steps": steps,
            "grad all-reduces/step": f"{grad_calls:.0f} (without no_sync: {k * len(trainable)})",
            "grad bytes/step": f"{format_bytes(grad_bytes)} (without no_sync: {format_bytes(k * grad_bytes)})",
            "final loss": f"{loss.item() / env.world_size:.4f}", "test accuracy": f"{accuracy:.1%}",
            "samples/s": f"{steps * args.global_batch / elapsed:.0f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
