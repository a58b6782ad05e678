"""DDP from scratch, step 2: buckets. One flat all-reduce per bucket, launched when it fills.

``ddp_overlap.py`` launched one all-reduce per parameter: a ResNet has ~60, a
transformer hundreds, and each call pays a fixed latency (alpha in the alpha-beta
model: time = alpha + bytes / bandwidth). Buckets trade a little overlap for far
fewer calls:

    parameters, reverse order (the order backward produces their gradients):
      fc.bias fc.weight | conv2.weight bn2.* | conv1.weight bn1.*
      '---- bucket 0 ---' '--- bucket 1 ----' '--- bucket 2 ----'
    each bucket: one flat buffer; each p.grad becomes a view of its slice (the hook
    moves it there once); when the last gradient of bucket b arrives,
    all_reduce(buffer_b, async_op=True) reduces the gradients in place.

* Buckets launch in index order on every rank (bucket 1 waits for bucket 0), so
  every rank issues the same sequence of all-reduces even if hooks fire in a
  different order.
* ``finish_gradient_synchronization()``: launch what is left, wait (gradients were
  divided by W on their way into the bucket, and ``p.grad`` are views: nothing to copy back).
* ``no_sync()``: hooks do nothing; gradients accumulate in ``p.grad``.
* Unused parameters: a bucket holding one never fills. With
  ``find_unused_parameters=True`` they are marked ready (zeros) at the finish and one
  extra all-reduce of a "used" bitmap tells which ones no rank used: those keep
  ``grad=None`` (as torch's DDP does), so the optimizer skips them everywhere.

Cost per step: one all-reduce per bucket, |grads| bytes in all (+ one bitmap of
n_params int32 with find_unused_parameters); no extra memory: gradients live in the buckets.
See phase3_multi_node/guidelines_ddp_zero.md#ddp-buckets.

Run: ``RUN_MODE=data_parallel_bucket_overlap ./entrypoint.sh [--bucket-mb 0.01]``.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.todo import todo


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[nn.Parameter]
    buffer: torch.Tensor                   # flat, sum of the params' numels
    offsets: list[int]                     # where each param's gradient starts in ``buffer``
    views: list[torch.Tensor]              # views[i]: params[i]'s slice of ``buffer``, shaped like it
    ready: set[int] = field(default_factory=set)   # indices into params whose grad is in the buffer
    handle: dist.Work | None = None        # the in-flight all-reduce

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float,
                   first_bucket_mb: float | None = None) -> list[list[nn.Parameter]]:
    """Group ``params`` (in backward order) into consecutive buckets of at most ``bucket_size_mb``.

    A bucket closes when the next parameter would take it past the cap, or when
    dtype or device change (one flat buffer has one of each). A parameter larger than
    the cap gets a bucket to itself. ``bucket_size_mb=0`` gives one bucket per parameter.
    The first bucket's cap is ``min(first_bucket_mb, bucket_size_mb)`` if given: a small
    first bucket starts communication early (torch's DDP uses 1 MiB).
    """
    if bucket_size_mb < 0:
        raise ValueError(f"bucket_size_mb must be >= 0, got {bucket_size_mb}")
    cap = bucket_size_mb * 1024 * 1024
    first_cap = min(first_bucket_mb * 1024 * 1024, cap) if first_bucket_mb is not None else cap
    buckets: list[list[nn.Parameter]] = []
    # --- TODO 3.12: fill buckets in order, closing one when the next param would overflow it ---
    # Keep `size` (bytes in the open bucket). Start a new bucket (buckets.append([]), size 0)
    # when there is none yet, when size + this param's bytes would exceed the open bucket's
    # cap (first_cap while len(buckets) == 1, cap after), or when dtype/device differ from
    # the bucket's first param. Then append p and add its bytes.
    raise todo("3.12 assign parameters to buckets", "guidelines_ddp_zero.md#ddp-buckets")
    # --- end TODO 3.12 ---
    return buckets


class DDPBucketed(nn.Module):
    """Data parallelism with gradients all-reduced in buckets, overlapped with backward.

    Args:
        module: the replica on this rank (rank 0's initialisation wins).
        bucket_size_mb: cap of one bucket in MiB (torch's DDP default: 25).
        first_bucket_mb: cap of the first bucket (the last layers' gradients), 1 MiB like torch.
        group: the data-parallel group (None: WORLD).
        find_unused_parameters: allow parameters that get no gradient in a step.
        broadcast_buffers: copy rank 0's buffers before every forward, like torch's DDP.

    Equivalent to: ``torch.nn.parallel.DistributedDataParallel(module,
    bucket_cap_mb=bucket_size_mb, find_unused_parameters=...)``.
    Collective: construction, forward, backward and ``finish_gradient_synchronization``
    on every rank of ``group``.
    Cost: one all-reduce per bucket per step, |grads| bytes in all.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, first_bucket_mb: float | None = 1.0) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(t, src=self.src, group=group)
        # Reverse registration order approximates the order gradients become ready.
        trainable = [p for p in module.parameters() if p.requires_grad][::-1]
        self.names = {p: n for n, p in module.named_parameters()}
        self.buckets: list[Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}  # param -> (bucket, index in bucket)
        for b, params in enumerate(assign_buckets(trainable, bucket_size_mb, first_bucket_mb)):
            offsets = [0, *itertools.accumulate(p.numel() for p in params)]
            buffer = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
            views = [buffer[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:])]
            self.buckets.append(Bucket(params, buffer, offsets[:-1], views))
            for i, p in enumerate(params):
                self._where[p] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._next = 0  # the next bucket to launch: buckets launch in index order on every rank

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            # Buffers are coalesced like gradients: one broadcast per dtype, not one per
            # tensor (ResNet-18 has 60 BatchNorm buffers; 60 small calls cost 60 latencies).
            with torch.no_grad():
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
                for b in self.module.buffers():
                    by_dtype.setdefault(b.dtype, []).append(b)
                for tensors in by_dtype.values():
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                    dist.broadcast(flat, src=self.src, group=self.group)
                    for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
                        t.copy_(part.view_as(t))
        return self.module(*args, **kwargs)

    def _launch_ready_buckets(self) -> None:
        """All-reduce, in index order, every full bucket that is next in line."""
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._next += 1

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_sync:
            return
        b, i = self._where[p]
        bucket = self.buckets[b]
        # --- TODO 3.13: make p.grad (divided by W) a view of its bucket slice, mark it ready, launch ---
        # view = bucket.views[i] is p's slice of the bucket, shaped like p. If p.grad is not that
        # view yet (compare data_ptr()), write p.grad / W into it in one pass
        # (torch.div(..., out=view)) and make p.grad = view: from then on autograd accumulates
        # straight into the bucket and nothing needs copying back. Otherwise divide the view
        # by W in place. Then add i to bucket.ready and call self._launch_ready_buckets().
        raise todo("3.13 fill the bucket from the gradient hook", "guidelines_ddp_zero.md#ddp-buckets")
        # --- end TODO 3.13 ---

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the means back into ``p.grad``.

        Call after ``loss.backward()``, before ``optimizer.step()``.
        Collective: every rank of ``group`` must call it after the same backward.
        Raises RuntimeError if a parameter got no gradient and ``find_unused_parameters`` is off.
        """
        if not self.require_sync:
            return
        # --- TODO 3.14: mark unused parameters ready, launch the rest, wait ---
        # 1. locally_used: p -> (its index is in bucket.ready). Unused ones got no gradient here.
        #    Without self.find_unused_parameters raise RuntimeError naming them (self.names[p]).
        #    Otherwise zero their views, mark them ready, and self._launch_ready_buckets().
        # 2. With find_unused_parameters: all_reduce an int32 tensor of the locally_used flags
        #    (same order everywhere): a parameter with sum 0 was used by no rank.
        # 3. For every bucket: handle.wait() (the used params' p.grad are views, already / W);
        #    a param unused here but used elsewhere gets p.grad = its view; one used nowhere keeps None.
        # 4. Reset for the next step: bucket.ready.clear(), handle None, self._next = 0.
        raise todo("3.14 finish: unused parameters, wait", "guidelines_ddp_zero.md#ddp-buckets")
        # --- end TODO 3.14 ---

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate ``p.grad`` locally; the next synced backward reduces the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


# --------------------------------------------------------------------------- demo
def _train_demo(wrap, description: str, argv: list[str] | None = None) -> None:
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
    _train_demo(lambda model, args: DDPBucketed(model, bucket_size_mb=args.bucket_mb),
               "DDP, bucketed all-reduce overlapped with backward", argv)


if __name__ == "__main__":
    main()
