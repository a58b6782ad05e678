# Generated from solutions/phase3_multi_node/ddp_bucketed.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
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
  The end of backward calls it (an autograd callback, ``distlab.lessons.sync.FinishInBackwardMixin``,
  as torch's DDP does): ``loss.backward(); optimizer.step()`` is enough, a second call does nothing.
* ``no_sync()`` (or torch's ``require_backward_grad_sync = False``): a forward inside it makes
  its backward's hooks do nothing; gradients accumulate in ``p.grad``.
* Unused parameters: a bucket holding one never fills. With
  ``find_unused_parameters=True`` they are marked ready (zeros) at the finish and one
  extra all-reduce of a "used" bitmap tells which ones no rank used: those keep
  ``grad=None`` (as torch's DDP does), so the optimizer skips them everywhere.

Cost per step: one all-reduce per bucket, |grads| bytes in all (+ one bitmap of
n_params int32 with find_unused_parameters); no extra memory: gradients live in the buckets.
See phase3_multi_node/guidelines_ddp_zero.md#ddp-buckets.

Run: ``RUN_MODE=data_parallel_bucket_overlap ./entrypoint.sh [--bucket-mb 0.01]``
(demos/data_parallel_bucket_overlap.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.lessons.sync import FinishInBackwardMixin, broadcast_module, group_root
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
    first_cap = min(first_bucket_mb * 1024 * 1024, cap) if first_bucket_mb is not None else cap  # noqa: F841 (first_cap: for TODO 3.12)
    buckets: list[list[nn.Parameter]] = []
    # --- TODO 3.12: assign parameters to buckets ---
    # Goal: cut `params`, kept in their order, into consecutive buckets: a bucket closes when
    # the next parameter would take its bytes past its cap (`first_cap` for the first bucket,
    # `cap` after) or has another dtype or device. A parameter bigger than the cap sits alone.
    raise todo("3.12 assign parameters to buckets", "guidelines_ddp_zero.md#ddp-buckets")
    # --- end TODO 3.12 ---
    return buckets


class DDPBucketed(FinishInBackwardMixin, nn.Module):
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
    Collective: construction, forward and backward (whose end runs
    ``finish_gradient_synchronization``) on every rank of ``group``.
    Cost: one all-reduce per bucket per step, |grads| bytes in all.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, first_bucket_mb: float | None = 1.0) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.src = group_root(group)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True  # False inside no_sync(): the next backward accumulates locally
        broadcast_module(module, group)  # replicas start equal to rank 0's (Phase 1's lesson)
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
        if self.broadcast_buffers and self.world_size > 1 and self._sync_buffers_next:
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
        return self._after_forward(self.module(*args, **kwargs))

    def _launch_ready_buckets(self) -> None:
        """All-reduce, in index order, every full bucket that is next in line."""
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._next += 1

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync_backward:  # its forward ran inside no_sync()
            return
        self._begin_backward()  # the end of this backward calls finish_gradient_synchronization()
        b, i = self._where[p]
        bucket = self.buckets[b]  # noqa: F841 (bucket: for TODO 3.13)
        # --- TODO 3.13: fill the bucket from the gradient hook ---
        # Goal: p's gradient, already divided by W, ends up in p's slice of its bucket, and from
        # then on `p.grad` IS that slice (autograd accumulates there, nothing to copy back).
        # Then mark p ready and launch every bucket that is complete and next in line: the
        # launch order is the bucket index order on every rank, whatever order hooks fire in.
        raise todo("3.13 fill the bucket from the gradient hook", "guidelines_ddp_zero.md#ddp-buckets")
        # --- end TODO 3.13 ---

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the means back into ``p.grad``.

        Called by the autograd engine when a synced backward ends; calling it again, after
        ``loss.backward()`` and before ``optimizer.step()``, does nothing.
        Collective: every rank of ``group`` runs it after the same backward.
        Raises RuntimeError (from ``backward()``) if a parameter got no gradient and
        ``find_unused_parameters`` is off.
        """
        if not self._finish_owed:  # already finished (or nothing was launched)
            return
        self._finish_owed = False
        # --- TODO 3.14: finish: unused parameters, wait ---
        # Goal: every bucket gets launched and waited for, even one holding a parameter that got
        # no gradient here (an error naming it, unless find_unused_parameters: then it adds zeros,
        # and a parameter NO rank used keeps grad None on every rank, which needs one more
        # collective). Leave the buckets ready for the next step.
        raise todo("3.14 finish: unused parameters, wait", "guidelines_ddp_zero.md#ddp-buckets")
        # --- end TODO 3.14 ---
