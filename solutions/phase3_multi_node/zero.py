"""ZeRO stages 1 and 2 from scratch: shard the optimizer state, then the gradients.

Data parallelism keeps W copies of everything. For mixed-precision Adam,
Rajbhandari et al. (2020, "ZeRO", fig. 1) count per parameter 2 bytes (fp16
weights) + 2 (fp16 gradients) + K = 12 (fp32 master weights, momentum, variance):
16 bytes, of which 12 are optimizer state that only the optimizer step reads.

    per-rank bytes        params    grads     optimizer state
    DDP                   2Psi      2Psi      K Psi
    ZeRO-1 (this, stage=1) 2Psi     2Psi      K Psi / W
    ZeRO-2 (this, stage=2) 2Psi     2Psi / W  K Psi / W
    ZeRO-3 (fsdp.py)      2Psi / W  2Psi / W  K Psi / W

Flat-buffer sharding (given, distlab/lessons/flat_buckets.py): trainable parameters are packed (in backward order) into
flat buckets padded to a multiple of W; rank r owns chunk r of every bucket, so ranks hold equal shares whatever
the tensor shapes (torch's ZeroRedundancyOptimizer hands out whole tensors). The model's parameters are views
into the buckets: an all-gather into a bucket updates the model in place.

    stage 1, after backward: all_reduce(grad bucket)  -> step on my chunk -> all_gather(param bucket)
    stage 2, during backward: reduce_scatter(grad bucket) as each bucket fills; the full
             bucket is freed as soon as its reduce-scatter completes (at most ``max_in_flight``
             in flight) -> at the end of backward, my chunk += mean -> step -> all_gather

Peak gradient bytes per rank in stage 2: the 1/W chunks + the bucket being filled + the in-flight window
(asserted by the tests with ``self.memory``, sampled at every hook). Cost per step: stage 1: all-reduce
|grads| + all-gather |params| (3 Psi in a ring, 1.5x DDP); stage 2: reduce-scatter + all-gather = 2 Psi,
the same as DDP's all-reduce. Several backwards before one ``step`` accumulate (stage 2: into the chunks,
each backward's reduce-scatters finish when it ends). A parameter no rank used is not stepped (torch: its
``.grad`` is None; a used bitmap, 4 B per parameter, all-reduced in ``step`` as DDP's find_unused_parameters
does); clip with ``optimizer.clip_grad_norm_`` (torch's function on ``.grad`` raises: it cannot see the
global norm; distlab/lessons/clipping.py). See guidelines_ddp_zero.md#zero-1-optimizer-state-sharded.

ZeRO-Offload (given code, distlab/lessons/offload.py): with ``offload_device="cpu"`` the optimizer
state and step live on the CPU; per step my gradient chunks go there and the updated chunks
come back (Psi / W bytes each way per rank). See guidelines_ddp_zero.md#zero-offload-and-deepspeed-style-configs.

Run: ``RUN_MODE=zero ./entrypoint.sh --stage 2`` (demos/zero.py; stage 3 is fsdp.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_single, reduce_scatter_single
from distlab.lessons.clipping import (UnusedParameters, ZeroGradViews, chunk_segments, global_norm_grad, guarded_grad,
                                     zero_clip_message)
from distlab.lessons.flat_buckets import FlatStateDicts, bucket_layout, group_params, make_flat_bucket
from distlab.meters import MemoryMeter, OverlapMeter, nbytes
from distlab.lessons.offload import OffloadedShards
from distlab.lessons.sync import broadcast_buffers_in_forward, broadcast_tensors


class ZeroOptimizer(FlatStateDicts, ZeroGradViews, torch.optim.Optimizer):
    """Any ``torch.optim`` optimizer, with its state (stage 1) and gradients (stage 2) sharded.

    Args:
        params: the model's parameters or parameter groups (dicts with per-group options), as
            for any torch optimizer; frozen ones are skipped. Rank 0's values are broadcast.
        optimizer_class: e.g. ``torch.optim.AdamW``; built on this rank's flat chunks.
        stage: 1 (optimizer state sharded) or 2 (+ gradients reduce-scattered, sharded).
        bucket_size_mb: size of one flat bucket (the unit of communication).
        max_in_flight: stage 2: reduce-scatters in flight at once. group: None for WORLD.
        offload_device: None, or where the optimizer keeps its copies of my chunks, its
            state and takes its step (``"cpu"``: ZeRO-Offload).
        module: the model: its buffers (BatchNorm's statistics) broadcast from rank 0 before forwards, as
            torch's DDP does (``distlab.lessons.sync.broadcast_buffers_in_forward``). None: each rank keeps its own.
        **defaults: passed to ``optimizer_class`` (lr, weight_decay, ...).

    ``param_groups``/``state`` are the inner optimizer's (my chunks): LR schedulers work. State dicts
    (distlab/lessons/flat_buckets.py's ``FlatStateDicts``): ``state_dict()``: my chunks' state with rank, world size and layout (checked on load); after
    ``consolidate_state_dict(to=0)`` rank 0's is torch's per-parameter format (ZeroRedundancyOptimizer's
    only one), which loads at any world size and into a plain torch optimizer.
    Equivalent to: DDP + ``optimizer_class(params, **defaults)``; stage 1 is
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` with flat (balanced) shards.
    Collective: construction, ``step`` (and with stage 2 every backward) on all ranks.
    Cost: see the module docstring; optimizer state K * Psi / W bytes per rank.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], *, stage: int = 1,
                 bucket_size_mb: float = 25.0, max_in_flight: int = 2, group: dist.ProcessGroup | None = None,
                 offload_device: str | torch.device | None = None, module: nn.Module | None = None, **defaults: Any):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (stage 3 is FullyShardedDataParallel), got {stage}")
        if isinstance(params, nn.Module):  # like any torch optimizer
            raise ValueError("ZeroOptimizer takes parameters, not a module: pass model.parameters(), module=model")
        groups = list(params)
        groups = groups if groups and isinstance(groups[0], dict) else [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        # torch's indexing of the parameters in a state_dict: in the order given, frozen ones included
        self._given, self._consolidated = [g["params"] for g in groups], None
        self._index = {p: i for i, p in enumerate(p for g in groups for p in g["params"])}
        self.stage, self.group, self.max_in_flight = stage, group, max(1, max_in_flight)
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.buckets, inner_groups = [], []
        for g in groups:
            trainable = [p for p in g["params"] if p.requires_grad][::-1]  # backward order
            broadcast_tensors(trainable, group)  # replicas start equal to rank 0's (Phase 1's lesson)
            mine = [make_flat_bucket(ps, self.world_size, self.rank) for ps in group_params(trainable, bucket_size_mb)]
            self.buckets += mine
            inner_groups.append({**g, "params": [nn.Parameter(b.chunk(b.flat)) for b in mine]})  # views: in place
        if not self.buckets:
            raise ValueError("ZeroOptimizer got no trainable parameters: pass model.parameters()")
        self.shards = [s for g in inner_groups for s in g["params"]]
        self.offload = None if offload_device is None else torch.device(offload_device)
        self._offloaded = None if self.offload is None else OffloadedShards(self.shards, self.offload)
        if self._offloaded is not None:  # the inner optimizer steps on copies of my chunks there
            inner_groups = self._offloaded.param_groups(inner_groups)
        self.optimizer = optimizer_class(inner_groups, **defaults)
        self._buffer_hooks = [] if module is None else broadcast_buffers_in_forward(module, group)  # DDP's job
        inner = [t for g in self.optimizer.param_groups for t in g["params"]]  # bucket i <-> inner parameter i
        self._unused = UnusedParameters({t: chunk_segments(b.params, b.offsets, self.rank, self.world_size)
                                         for t, b in zip(inner, self.buckets)}, group)  # unused: not stepped
        self.optimizer.register_step_post_hook(lambda o, *_: self._unused.after_step(o))  # before offload's copy back
        if self._offloaded is not None:
            self._offloaded.attach(self.optimizer)
        self.optimizer.register_step_pre_hook(lambda o, *_: self._unused.before_step(o))  # after offload's grads
        self._clip_message, self._averaged = zero_clip_message(stage), False
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state  # one source
        self._where = {p: (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._layout = bucket_layout(self.buckets, self._index)  # what a sharded state_dict is valid in
        self.memory, self.overlap = MemoryMeter(), OverlapMeter()
        if stage == 1:
            # Gradients live in flat buffers too: autograd accumulates into these views in place.
            self.grad_flats = [torch.zeros_like(b.flat) for b in self.buckets]
            self._collect_stage1_grads()
            for p in self._where:
                p.register_post_accumulate_grad_hook(self._on_stage1_grad)
        else:
            self._pending: list[torch.Tensor | None] = [None] * len(self.buckets)  # full grads in flight
            self._ready: list[set[int]] = [set() for _ in self.buckets]
            self._handles: list[tuple[dist.Work, torch.Tensor] | None] = [None] * len(self.buckets)
            self._next, self._in_backward = 0, False
            for p in self._where:
                p.register_hook(lambda g, p=p: self._drop_stand_in(p))  # before autograd accumulates into it
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ bookkeeping (pre-written)
    def _sample(self) -> None:
        held = self.memory_bytes()
        held["grads"] += sum(nbytes(t) for t in getattr(self, "_pending", []))  # full buckets alive
        self.memory.sample(**held)

    # ------------------------------------------------------------------ stage 2
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._in_backward:  # once per backward: finish the reduce-scatters when it ends
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.overlap.hook()
        i, j = self._where[p]
        bucket = self.buckets[i]
        if self._pending[i] is None:  # a full-size gradient buffer only while it fills / is in flight
            self._pending[i] = torch.zeros_like(bucket.flat)
        start = bucket.offsets[j]
        self._pending[i][start:start + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = guarded_grad(None, p, self._clip_message)  # not kept: stage 2's saving (a 0-byte stand-in)
        self._unused.used(p)
        self._ready[i].add(j)
        self._launch_ready()
        self._sample()

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce-scatter, in bucket order, every bucket whose gradients have all arrived."""
        for k in [k for k, h in enumerate(self._handles) if h and h[0].is_completed()]:
            self._retire(k)  # free every full bucket whose reduce-scatter is over
        while self._next < len(self.buckets):
            i, bucket = self._next, self.buckets[self._next]
            if not force and len(self._ready[i]) < len(bucket.params):
                return
            if self._pending[i] is None:  # no gradient at all on this rank: zeros
                self._pending[i] = torch.zeros_like(bucket.flat)
            while len(flying := [k for k, h in enumerate(self._handles) if h]) >= self.max_in_flight:
                self._retire(flying[0])  # bound the full buckets alive: wait for the oldest
            # ### BEGIN SOLUTION 3.16a: reduce-scatter a full bucket [guidelines_ddp_zero.md#zero-2-gradients-reduce-scattered]
            # Goal: start (without waiting) the sum over the ranks of bucket i's full gradient
            # `self._pending[i]`, of which this rank receives only ITS chunk, in a fresh tensor
            # shaped like `self.shards[i]`; remember it and the handle in `self._handles[i]`.
            # Collective: every rank launches the same buckets in the same (index) order.
            out = torch.empty_like(self.shards[i])
            handle = reduce_scatter_single(out, self._pending[i], op=dist.ReduceOp.SUM, group=self.group,
                                           async_op=True)
            self._handles[i] = (handle, out)
            # ### END SOLUTION 3.16a
            self.overlap.launch()
            self._next += 1

    @torch.no_grad()
    def _retire(self, i: int) -> None:
        """Wait for bucket i's reduce-scatter, add the mean to my chunk's gradient, free the bucket."""
        # ### BEGIN SOLUTION 3.16b: wait for a reduce-scatter [guidelines_ddp_zero.md#zero-2-gradients-reduce-scattered]
        # Goal: once bucket i's reduce-scatter is done, shard i's gradient gains the MEAN over the
        # ranks of its chunk: added to what is there (several backwards before one step add up),
        # or set if the gradient is None (after `zero_grad(set_to_none=True)`).
        handle, out = self._handles[i]
        handle.wait()
        out /= self.world_size
        grad = self.shards[i].grad
        self.shards[i].grad = out if grad is None else grad.add_(out)
        # ### END SOLUTION 3.16b
        self._handles[i] = None
        self._pending[i] = None  # the full bucket goes as soon as its reduce-scatter is over

    def _end_backward(self) -> None:
        self._launch_ready(force=True)  # buckets with unused parameters: what is missing is zero
        for i in [k for k, h in enumerate(self._handles) if h]:
            self._retire(i)
        self._ready, self._next, self._in_backward = [set() for _ in self.buckets], 0, False
        self._sample()
        self.overlap.end_backward()

    # ------------------------------------------------------------------ both stages
    @torch.no_grad()
    def _average(self) -> None:
        """Stage 1, once per step (in ``step``, or earlier in ``clip_grad_norm_``). Collective."""
        self._collect_stage1_grads()
        # ### BEGIN SOLUTION 3.15a: average the flat gradients [guidelines_ddp_zero.md#zero-1-optimizer-state-sharded]
        # Goal: average each flat gradient over the ranks, in place (the model's .grads are views of
        # them), and give each shard its chunk of it as gradient. Collective: every rank, every
        # bucket, in the same order.
        if self.stage == 1:
            for g, bucket, shard in zip(self.grad_flats, self.buckets, self.shards):
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.group)
                g /= self.world_size
                shard.grad = bucket.chunk(g)
        # ### END SOLUTION 3.15a
        self._averaged = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the averaged gradient by its global norm; return that norm (on every rank).

        Equivalent to: DDP + ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (stage 1:
        the same function on the averaged gradients, bitwise). Collective: every rank, between the
        last backward and ``step``. Cost: stage 1 averages here (``step`` then does not); stage 2
        all-reduces one number per call.
        """
        if self.stage == 1:
            if not self._averaged:
                self._average()
            grads, params = [self._grad_view(p) for p in self._index if p in self._where], list(self._where)
        else:  # my chunks: a norm of each is the norm of the whole bucket (collective)
            grads = [global_norm_grad(s.grad, self.group) for s in self.shards if s.grad is not None]
            params = self.shards
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Average the gradients, update this rank's chunks, all-gather the parameters.

        Collective: every rank must call it after the same backward(s).
        """
        if closure is not None:  # a closure would re-run forward/backward: collectives inside a step
            raise ValueError("ZeroOptimizer.step takes no closure: call backward, then step()")
        self._consolidated = None  # a consolidated state is a snapshot: this step makes it stale
        if self.stage == 1 and not self._averaged:
            self._average()
        # ### BEGIN SOLUTION 3.15b: sharded optimizer step [guidelines_ddp_zero.md#zero-1-optimizer-state-sharded]
        # Goal: update only this rank's chunks (their .grad: my chunk of the mean), and make every
        # rank's full buckets (the model's parameters are views of them) hold everyone's updated
        # chunks. Collective: every rank, every bucket, in the same order.
        self.optimizer.step()  # only on my chunks: K * Psi / W bytes of state
        for bucket, shard in zip(self.buckets, self.shards):
            # In place: my chunk is already where it belongs in the output.
            all_gather_single(bucket.flat, shard.detach(), group=self.group)
        # ### END SOLUTION 3.15b
        self._averaged = False
        for p in self._where if self.stage == 2 else ():
            p.grad = None  # the stand-ins
        self._sample()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stage 1: zero the flat gradients (kept: autograd accumulates into them); stage 2: the chunks."""
        self._averaged = False
        if self.stage == 1:
            for g in self.grad_flats:
                g.zero_()
            self._collect_stage1_grads()
        for s in self.shards:
            if self.stage == 1 or set_to_none:
                s.grad = None
            elif s.grad is not None:
                s.grad.zero_()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state (trainable only)."""
        params = sum(nbytes(b.flat) for b in self.buckets)
        grads = sum(nbytes(t) for t in (self.grad_flats if self.stage == 1 else [s.grad for s in self.shards]))
        state = sum(nbytes(v) for s in self.optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0)  # not the scalar step
        if self._offloaded is not None:  # nothing on the model's device; copies, gradients, state offloaded
            return {"params": params, "grads": grads, "optimizer": 0, "offloaded": self._offloaded.nbytes() + state}
        return {"params": params, "grads": grads, "optimizer": state}
