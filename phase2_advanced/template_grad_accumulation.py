"""Gradient accumulation: k micro-batches per optimizer step, one all-reduce per step.

A batch too large for memory is cut into k micro-batches of b samples. Each
micro-batch runs forward and backward; the gradients add up in ``p.grad``; the
optimizer steps once. On W data-parallel ranks this equals one step on a batch of
k*b*W samples, provided that:

1. each micro-batch loss is weighted by its share of the rank's samples
   (n_i / n_local, not 1/k: the last micro-batch may be smaller), so the sum over
   micro-batches is the mean over the rank's batch; the all-reduce then averages
   over ranks (every rank has the same n_local, as in Phase 1);
2. the gradients are communicated once, after the last micro-batch: reducing
   after every micro-batch gives the same numbers but costs k times the traffic.

Here the all-reduce is triggered by backward itself (a hook fires when a
parameter's gradient is complete), as in PyTorch's DistributedDataParallel, so
skipping it needs a switch: the ``no_sync()`` context, entered for every
micro-batch but the last.

Cost per optimizer step: one all-reduce per parameter, |params| bytes in all,
whatever k is. Activation memory scales with b, not k*b.
See phase2_advanced/guidelines.md#gradient-accumulation.

Run: ``RUN_MODE=data_parallel_naive_grad_accumulation ./entrypoint.sh`` (TinyCNN on digits).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.todo import todo


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor,
                        micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples; the last one may be smaller.

    10 samples in micro-batches of 4 -> sizes 4, 4, 2.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs hold {inputs.shape[0]} samples but targets hold {targets.shape[0]}")
    if inputs.shape[0] == 0:
        raise ValueError("the batch is empty: nothing to split into micro-batches")
    return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))


class AccumulatingDataParallel(nn.Module):
    """A replica whose backward averages gradients over the ranks, except inside ``no_sync()``.

    Wrap the model once; parameters and buffers are broadcast from the group's first
    rank. Every backward outside ``no_sync()`` all-reduces each gradient as soon as
    it is complete (a post-accumulate-grad hook), averaging whatever has
    accumulated in ``p.grad`` since the last ``zero_grad``: the sum of all the
    micro-batches' contributions.

    Args:
        module: the model (frozen parameters are left alone; a tied parameter is
            one Parameter, so it gets one hook and one all-reduce).
        group: the data-parallel group (None: WORLD).

    Equivalent to: the single-process gradient of the mean loss over the global
        batch, when every rank's batch has the same size.
    Collective: every rank must run backward outside ``no_sync()`` on the same
        steps, or the all-reduces pair up wrongly and hang.
    Cost: |trainable params| bytes per synchronised backward; nothing inside ``no_sync()``.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.require_backward_grad_sync = True
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():  # Phase 1's broadcast_parameters, with built-ins (1.6 is graded apart)
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=src, group=group)
        self._hooks = [p.register_post_accumulate_grad_hook(self._reduce_gradient)
                       for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context accumulate gradients locally and communicate nothing."""
        # --- TODO 2.1a: turn gradient syncing off for the body of the `with`, then back on ---
        # Set self.require_backward_grad_sync = False, `yield`, and restore the previous
        # value in a `finally:` (an exception inside the `with` must not leave it off).
        raise todo("2.1 no_sync and the gradient hook", "guidelines.md#gradient-accumulation")
        yield  # (keeps this a generator until you write the real yield)
        # --- end TODO 2.1a ---

    def _reduce_gradient(self, param: nn.Parameter) -> None:
        # Called by autograd once p.grad holds this backward's contribution added to
        # what earlier micro-batches left there, so one all-reduce covers them all.
        # --- TODO 2.1b: average param.grad over the group, unless syncing is off ---
        # Return at once when self.require_backward_grad_sync is False. Otherwise
        # dist.all_reduce(param.grad, op=SUM, group=self.group), then divide by the
        # group's world size (in place: param.grad is what the optimizer reads).
        raise todo("2.1 no_sync and the gradient hook", "guidelines.md#gradient-accumulation")
        # --- end TODO 2.1b ---


def train_step(model: AccumulatingDataParallel, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """One optimizer step on this rank's batch, in micro-batches; returns the local mean loss.

    Args:
        model: the wrapped replica.
        loss_fn: a loss that is a *mean* over the samples it is given.
        inputs, targets: this rank's batch (n_local samples; the same n_local on every rank).
        micro_batch_size: samples per forward/backward (the last micro-batch may be smaller).

    Equivalent to: one Phase 1 data-parallel step on the whole batch.
    Collective: every rank must call it, with the same number of micro-batches.
    Cost: one gradient all-reduce (|params| bytes), after the last micro-batch.
    """
    micro_batches = split_micro_batches(inputs, targets, micro_batch_size)
    n_local = inputs.shape[0]
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # --- TODO 2.2: forward + backward one micro-batch, communicating only on the last ---
        # * weight the micro-batch's mean loss by its share of the rank's samples,
        #   x.shape[0] / n_local (not 1/k: the last micro-batch may be smaller);
        # * run forward and backward inside model.no_sync() unless `last`
        #   (contextlib.nullcontext() is a do-nothing context);
        # * add the weighted loss, detached, to `total`.
        raise todo("2.2 micro-batch loop", "guidelines.md#gradient-accumulation")
        # --- end TODO 2.2 ---
    optimizer.step()
    with torch.no_grad():  # Phase 1's sync_buffers (BatchNorm statistics), with built-ins
        for b in model.module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, group=model.group)
                b /= dist.get_world_size(model.group)
    return total


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from distlab.comm import CommLedger
    from distlab.data import digits, per_rank_batch
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0, progress
    from distlab.models import TinyCNN

    parser = argparse.ArgumentParser(description="Data-parallel TinyCNN on digits with gradient accumulation.")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward on one rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--image-size", type=int, default=16)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        per_rank_batch(args.global_batch, env.world_size)  # a clear error if it does not divide
        local_batch = args.global_batch // env.world_size
        k = -(-local_batch // args.micro_batch)  # ceil: the last micro-batch may be smaller
        train, test = digits("train", args.image_size), digits("test", args.image_size)
        torch.manual_seed(0)
        model = AccumulatingDataParallel(TinyCNN(num_classes=10).to(env.device))
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
                    loss = train_step(model, optimizer, loss_fn, x.to(env.device), y.to(env.device),
                                      args.micro_batch)
                scheduler.step()
                dist.all_reduce(loss)  # for display only
                steps += 1
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{loss.item() / env.world_size:.3f}")
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():  # the whole test set in one batch (360 small images)
            x_test, y_test = (t.to(env.device) for t in test.tensors)
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
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
    main()
