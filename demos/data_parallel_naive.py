"""Naive data parallelism for real: TinyCNN trained on scikit-learn's digits by W ranks.

Every rank starts from a different random init (the broadcast of TODO 1.6 makes the
replicas equal), reads its own shard of each global batch, and runs Phase 1's
``train_step`` (TODO 1.7-1.8: gradients and BatchNorm buffers averaged over the ranks).
A progress bar on rank 0 shows the mean loss over the ranks; at the end a table gives
the final loss, the test accuracy (about 94% after 6 epochs; chance is 10%) and the
throughput.

    RUN_MODE=data_parallel_naive ./entrypoint.sh                  # 2 ranks, the solution
    NPROC=4 RUN_MODE=data_parallel_naive ./entrypoint.sh --epochs 2
    IMPL=templates RUN_MODE=data_parallel_naive ./entrypoint.sh   # your trainer
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from demos.sizes import global_batch, positive
from distlab.data import digits
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_table, log0, progress
from distlab.models import TinyCNN
from distlab.todo import run_demo


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 512) -> float:
    """Accuracy of ``model`` on the whole of ``dataset`` (every rank computes the same)."""
    model.eval()
    correct = 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    model.train()
    return correct / len(dataset)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Naive data-parallel training of TinyCNN on digits.")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 48 (it divides by 1, 2, 3, 4, 6, 8, 12, 16 and 24 ranks), "
                             "else rounded up to a multiple of the world size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--image-size", type=int, default=16)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A global batch the ranks share equally (see demos/sizes.py)."""
    positive(args, "--epochs", "--image-size")
    args.global_batch = global_batch(args.global_batch, 48, world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        trainer = load("phase1_data_parallel", "trainer")
        train, test = digits("train", args.image_size), digits("test", args.image_size)
        torch.manual_seed(env.rank)  # deliberately different: the broadcast makes replicas equal
        model = TinyCNN(num_classes=10).to(env.device)
        trainer.broadcast_parameters(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        # torch's sampler, index for index the same as Phase 1's: this run needs only TODO
        # 1.6-1.8 done (the sampler, 1.4-1.5, has its own demo: RUN_MODE=train).
        loader = DataLoader(train, batch_size=args.global_batch // env.world_size, drop_last=True,
                            sampler=DistributedSampler(train, env.world_size, env.rank, drop_last=True))
        # Cosine decay to zero: the weights settle at the end, so BatchNorm's running
        # statistics (used at evaluation) describe the final weights, not a blur of them.
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
        loss_fn = nn.CrossEntropyLoss()
        log0(f"naive data parallel: {env.world_size} ranks ({env.backend}), global batch {args.global_batch}, "
             f"{len(loader)} steps/epoch, {sum(p.numel() for p in model.parameters())} parameters")
        start = time.perf_counter()
        steps = 0
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            bar = progress(loader, desc=f"epoch {epoch}")
            for x, y in bar:
                loss = trainer.train_step(model, optimizer, loss_fn, x.to(env.device), y.to(env.device))
                scheduler.step()
                dist.all_reduce(loss)  # for display only: the mean loss over ranks
                steps += 1
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{loss.item() / env.world_size:.3f}")
        elapsed = time.perf_counter() - start
        accuracy = evaluate(model, test, env.device)
        log0("\n" + format_table([{
            "ranks": env.world_size, "epochs": args.epochs, "steps": steps,
            "final loss": f"{loss.item() / env.world_size:.4f}", "test accuracy": f"{accuracy:.1%}",
            "chance": "10.0%", "samples/s": f"{steps * args.global_batch / elapsed:.0f}",
            "wall s": f"{elapsed:.1f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
