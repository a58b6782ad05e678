"""Naive data parallelism: same model everywhere, different data, averaged gradients.

Every rank holds a full replica. One step:

1. (once, at start) broadcast parameters and buffers from rank 0, so replicas
   start identical even if each rank initialised its own;
2. forward + backward on this rank's shard of the global batch;
3. all-reduce every gradient and divide by W: each rank now holds the gradient of
   the mean loss over the *global* batch (shards of equal size);
4. optimizer step: identical gradients + identical parameters -> identical updates;
5. BatchNorm's running statistics were computed on the local shard: average the
   floating buffers, so replicas stay identical (integer counters are equal already).

Cost per step: one all-reduce per parameter, |params| bytes in all, after backward
has finished (no overlap: Phase 3 buckets and overlaps it).
See phase1_data_parallel/guidelines.md#naive-data-parallelism.

Run: ``RUN_MODE=data_parallel_naive ./entrypoint.sh`` (TinyCNN on digits).
"""
from __future__ import annotations

import argparse
import itertools
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn


def broadcast_parameters(model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s.

    Equivalent to: loading rank ``src``'s ``state_dict`` on every rank.
    Collective: every rank of ``group`` must call it, with the same model structure.
    Cost: |params| + |buffers| bytes from ``src``.
    """
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t, src=src, group=group)


def allreduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Replace every gradient by its mean over the ranks of ``group``.

    Parameters without a gradient (frozen, or unused in this step on every rank)
    are skipped. A parameter shared by two modules (tied weights) appears once
    in ``model.parameters()``, so it is reduced once.

    Equivalent to: the gradient of the mean loss over the global batch, when every
    rank's shard has the same size.
    Collective: every rank must call it with the same set of gradients present.
    Cost: one all-reduce per parameter with a gradient; |grads| bytes in all.
    """
    world_size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad /= world_size


def sync_buffers(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average floating-point buffers (BatchNorm running mean/var) over the ranks.

    Integer buffers (``num_batches_tracked``) advance identically on every rank and
    are left alone.

    Collective: every rank of ``group`` must call it.
    Cost: |floating buffers| bytes.
    """
    world_size = dist.get_world_size(group)
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, op=dist.ReduceOp.SUM, group=group)
                b /= world_size


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               inputs: torch.Tensor, targets: torch.Tensor,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """One data-parallel step on this rank's shard; returns the local loss (detached)."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    allreduce_gradients(model, group)
    optimizer.step()
    sync_buffers(model, group)
    return loss.detach()


# --------------------------------------------------------------------------- demo
@torch.no_grad()
def evaluate(model: nn.Module, dataset, device: torch.device, batch_size: int = 512) -> float:
    """Accuracy of ``model`` on the whole of ``dataset`` (every rank computes the same)."""
    model.eval()
    correct = 0
    for x, y in torch.utils.data.DataLoader(dataset, batch_size=batch_size):
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    model.train()
    return correct / len(dataset)


def main(argv: list[str] | None = None) -> None:
    from distlab.data import digits, per_rank_batch
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_table, log0, progress
    from distlab.models import TinyCNN
    from solutions.phase1_data_parallel.data_loader import distributed_loader

    parser = argparse.ArgumentParser(description="Naive data-parallel training of TinyCNN on digits.")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=48,
                        help="divisible by 1, 2, 3, 4, 6, 8, 12, 16 and 24 ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--image-size", type=int, default=16)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        per_rank_batch(args.global_batch, env.world_size)  # a clear error if it does not divide
        train, test = digits("train", args.image_size), digits("test", args.image_size)
        torch.manual_seed(env.rank)  # deliberately different: the broadcast makes replicas equal
        model = TinyCNN(num_classes=10).to(env.device)
        broadcast_parameters(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loader = distributed_loader(train, args.global_batch // env.world_size, env.rank, env.world_size,
                                    drop_last=True)
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
                loss = train_step(model, optimizer, loss_fn, x.to(env.device), y.to(env.device))
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
    main()
