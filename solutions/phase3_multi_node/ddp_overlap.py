"""DDP from scratch, step 1: one asynchronous all-reduce per gradient, launched from its hook.

Phase 1 all-reduced every gradient *after* backward: the network sat idle while
the CPU/GPU computed, then the CPU/GPU sat idle while the network worked. Backward
produces gradients last layer first, so the all-reduce of layer L's gradient can
run while layers L-1 ... 1 are still differentiating:

    backward  : [grad L][grad L-1][grad L-2] ... [grad 1]
    all-reduce:         [  L   ][  L-1  ][ L-2 ] ...    [1]  <- wait, then step

1. construction: broadcast parameters and buffers from rank 0 (replicas start equal);
2. ``register_post_accumulate_grad_hook`` on every trainable parameter: when
   autograd has finished accumulating ``p.grad``, launch ``all_reduce(p.grad,
   async_op=True)`` and keep the handle;
3. ``finish_gradient_synchronization()`` before ``optimizer.step()``: wait for every
   handle, divide by W.

Cost per step: one all-reduce per trainable parameter, |grads| bytes in all, hidden
behind backward except the last one. Many small all-reduces pay the per-call
latency many times: ``ddp_bucketed.py`` groups them.
See phase3_multi_node/guidelines_ddp_zero.md#ddp-overlap.

Run: ``RUN_MODE=data_parallel_overlap ./entrypoint.sh`` (TinyCNN on digits).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn


class DDPIndividualParameters(nn.Module):
    """Wrap ``module`` for data parallelism with one overlapped all-reduce per parameter.

    Args:
        module: the replica on this rank (any initialisation: rank 0's wins).
        group: the data-parallel group (None: WORLD).
        broadcast_buffers: like torch's DDP, copy rank 0's buffers before every forward.

    Equivalent to: ``torch.nn.parallel.DistributedDataParallel(module)``; after
    ``finish_gradient_synchronization()`` every rank holds the gradient of the mean
    loss over the global batch.
    Collective: construction, every forward (buffers) and every backward must happen
    on all ranks, with the same parameters receiving gradients (a parameter unused on
    one rank only makes the ranks' all-reduce sequences differ: a hang).
    Cost: |params| + |buffers| bytes broadcast once; |grads| bytes all-reduced per step.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True  # False inside no_sync(): gradients accumulate locally
        self._handles: list[tuple[dist.Work, torch.Tensor]] = []
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            # --- TODO 3.10: make every replica equal to rank 0's ---
            for t in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(t, src=src, group=group)
            # --- end TODO 3.10 ---
        # parameters() yields a tied Parameter once, so it gets one hook; frozen ones get none.
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Autograd has finished writing ``p.grad`` for this backward."""
        if not self.require_sync:
            return
        # --- TODO 3.11a: launch the all-reduce of p.grad now, without waiting ---
        # Overlaps with the backward of the layers before this one; |p.grad| bytes.
        handle = dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._handles.append((handle, p.grad))
        # --- end TODO 3.11a ---

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=src, group=self.group)
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce launched in this backward; gradients become means.

        Call after ``loss.backward()`` and before ``optimizer.step()``.
        Collective: every rank must call it after the same backward.
        """
        # --- TODO 3.11b: wait for each handle, then divide its gradient by W ---
        for handle, grad in self._handles:
            handle.wait()
            grad /= self.world_size
        self._handles.clear()
        # --- end TODO 3.11b ---

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate ``p.grad`` locally; the next synced backward reduces the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


# --------------------------------------------------------------------------- demo
def train_demo(wrap, description: str, argv: list[str] | None = None) -> None:
    """TinyCNN on digits under ``wrap(model) -> DDP wrapper``; a summary table on rank 0."""
    from distlab.comm import CommLedger
    from distlab.data import digits, per_rank_batch
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0, progress
    from distlab.models import TinyCNN
    from torch.utils.data import DataLoader, DistributedSampler

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bucket-mb", type=float, default=0.01, help="bucket size (bucketed wrapper only)")
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        per_rank_batch(args.global_batch, env.world_size)  # a clear error if it does not divide
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
    train_demo(lambda model, args: DDPIndividualParameters(model),
               "DDP, one overlapped all-reduce per parameter", argv)


if __name__ == "__main__":
    main()
