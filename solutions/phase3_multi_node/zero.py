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

Flat-buffer sharding: the trainable parameters are packed (in backward order) into
flat buckets, each padded to a multiple of W; rank r owns chunk r of every bucket,
so every rank holds the same number of elements (+- padding), whatever the tensor
shapes. (torch's ZeroRedundancyOptimizer hands out whole tensors instead: balanced
only as well as the tensor sizes allow.) The model's parameters are views into the
buckets, so an all-gather into a bucket updates the model in place.

    stage 1, after backward: all_reduce(grad bucket)  -> step on my chunk -> all_gather(param bucket)
    stage 2, during backward: reduce_scatter(grad bucket) as each bucket fills -> step -> all_gather

Cost per step: stage 1: all-reduce |grads| + all-gather |params| (3 Psi in a ring);
stage 2: reduce-scatter + all-gather = 2 Psi, the same as DDP's all-reduce.
Parameters unused in a step get a zero gradient (a chunk is one tensor for the optimizer).
See phase3_multi_node/guidelines_ddp_zero.md#zero-1-optimizer-state-sharded.

Run: ``RUN_MODE=zero ./entrypoint.sh --stage 2`` (demos/zero.py; stage 3 is fsdp.py).
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_single, reduce_scatter_single
from distlab.sync import broadcast_module


@dataclass
class FlatBucket:
    """Parameters packed end to end in one flat buffer of W equal chunks; ``rank`` owns one."""

    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    flat: torch.Tensor              # padded; the params are views into it
    world_size: int
    rank: int

    @property
    def shard_size(self) -> int:
        return self.flat.numel() // self.world_size

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat tensor shaped like ``flat``."""
        return t[self.rank * self.shard_size:(self.rank + 1) * self.shard_size]


def make_flat_bucket(params: list[nn.Parameter], names: list[str], world_size: int, rank: int) -> FlatBucket:
    """Copy ``params`` into one zero-padded flat buffer and make them views into it."""
    offsets = [0, *itertools.accumulate(p.numel() for p in params)]
    padded = math.ceil(offsets[-1] / world_size) * world_size
    flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for p, start in zip(params, offsets):
            flat[start:start + p.numel()].copy_(p.reshape(-1))
            p.data = flat[start:start + p.numel()].view_as(p)
    return FlatBucket(params, names, offsets[:-1], flat, world_size, rank)


def group_params(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive groups of at most ``bucket_size_mb`` (a bigger tensor alone), one dtype each."""
    cap, groups, size = bucket_size_mb * 2**20, [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > cap or p.dtype != groups[-1][0].dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


class ZeroOptimizer:
    """Any ``torch.optim`` optimizer, with its state (stage 1) and gradients (stage 2) sharded.

    Args:
        model: this rank's replica; rank 0's parameters are broadcast into all ranks.
        optimizer_cls: e.g. ``torch.optim.AdamW``; built on this rank's flat chunks.
        stage: 1 (optimizer state sharded) or 2 (+ gradients reduce-scattered, sharded).
        bucket_size_mb: size of one flat bucket (the unit of communication).
        group: the data-parallel group (None: WORLD).
        **optim_kwargs: passed to ``optimizer_cls`` (lr, weight_decay, ...).

    Equivalent to: DDP + ``optimizer_cls(model.parameters(), **optim_kwargs)``; stage 1
    is ``torch.distributed.optim.ZeroRedundancyOptimizer`` with flat (balanced) shards.
    Collective: construction, ``step`` (and with stage 2 every backward) on all ranks.
    Cost: see the module docstring; optimizer state K * Psi / W bytes per rank.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *, stage: int = 1,
                 bucket_size_mb: float = 25.0, group: dist.ProcessGroup | None = None, **optim_kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (stage 3 is FullyShardedDataParallel), got {stage}")
        self.model, self.stage, self.group = model, stage, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        broadcast_module(model, group)  # replicas start equal to rank 0's (Phase 1's lesson)
        names = {p: n for n, p in model.named_parameters()}
        trainable = [p for p in model.parameters() if p.requires_grad][::-1]  # backward order
        self.buckets = [make_flat_bucket(ps, [names[p] for p in ps], self.world_size, self.rank)
                        for ps in group_params(trainable, bucket_size_mb)]
        # The optimizer sees one flat chunk per bucket: views into the buckets, updated in place.
        self.shards = [nn.Parameter(b.chunk(b.flat)) for b in self.buckets]
        self.optimizer = optimizer_cls(self.shards, **optim_kwargs)
        self._where = {p: (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        if stage == 1:
            # Gradients live in flat buffers too: autograd accumulates into these views in place.
            self.grad_flats = [torch.zeros_like(b.flat) for b in self.buckets]
            for b, g in zip(self.buckets, self.grad_flats):
                for p, start in zip(b.params, b.offsets):
                    p.grad = g[start:start + p.numel()].view_as(p)
        else:
            for s in self.shards:
                s.grad = torch.zeros_like(s)
            self._pending: list[torch.Tensor | None] = [None] * len(self.buckets)  # full grads in flight
            self._ready: list[set[int]] = [set() for _ in self.buckets]
            self._handles: list[tuple[dist.Work, torch.Tensor] | None] = [None] * len(self.buckets)
            self._next = 0
            for p in trainable:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ stage 2
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        i, j = self._where[p]
        bucket = self.buckets[i]
        if self._pending[i] is None:  # a full-size gradient buffer only while in flight
            self._pending[i] = torch.zeros_like(bucket.flat)
        start = bucket.offsets[j]
        self._pending[i][start:start + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # the full gradient is not kept: that is stage 2's saving
        self._ready[i].add(j)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce-scatter, in bucket order, every bucket whose gradients have all arrived."""
        while self._next < len(self.buckets):
            i, bucket = self._next, self.buckets[self._next]
            if not force and len(self._ready[i]) < len(bucket.params):
                return
            if self._pending[i] is None:  # no gradient at all on this rank: zeros
                self._pending[i] = torch.zeros_like(bucket.flat)
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
            self._next += 1

    def _finish_stage2(self) -> None:
        self._launch_ready(force=True)  # buckets with unused parameters: what is missing is zero
        # ### BEGIN SOLUTION 3.16b: wait for the reduce-scatters [guidelines_ddp_zero.md#zero-2-gradients-reduce-scattered]
        # Goal: once every reduce-scatter is done, each shard's gradient holds the MEAN over the
        # ranks of its chunk; accumulate into it (several backwards before one step add up).
        for i, (handle, out) in enumerate(self._handles):
            handle.wait()
            self.shards[i].grad += out / self.world_size
        # ### END SOLUTION 3.16b
        self._pending = [None] * len(self.buckets)
        self._handles = [None] * len(self.buckets)
        self._ready = [set() for _ in self.buckets]
        self._next = 0

    # ------------------------------------------------------------------ both stages
    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients, update this rank's chunks, all-gather the parameters.

        Collective: every rank must call it after the same backward(s).
        """
        if self.stage == 2:
            self._finish_stage2()
        # ### BEGIN SOLUTION 3.15: sharded optimizer step [guidelines_ddp_zero.md#zero-1-optimizer-state-sharded]
        # Goal: (stage 1 only) average each flat gradient over the ranks and give each shard its
        # chunk of it as gradient; then (both stages) update only this rank's chunks, and make
        # every rank's full buckets (the model's parameters are views of them) hold everyone's
        # updated chunks. Collective: every rank, every bucket, in the same order.
        if self.stage == 1:
            for g, bucket, shard in zip(self.grad_flats, self.buckets, self.shards):
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.group)
                g /= self.world_size
                shard.grad = bucket.chunk(g)
        self.optimizer.step()  # only on my chunks: K * Psi / W bytes of state
        for bucket, shard in zip(self.buckets, self.shards):
            # In place: my chunk is already where it belongs in the output.
            all_gather_single(bucket.flat, shard.detach(), group=self.group)
        # ### END SOLUTION 3.15

    def zero_grad(self) -> None:
        """Zero the flat gradients (stage 1) or the gradient chunks (stage 2); never frees them."""
        for t in (self.grad_flats if self.stage == 1 else [s.grad for s in self.shards]):
            t.zero_()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (trainable only)."""
        params = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)
        grads = sum(t.numel() * t.element_size() for t in
                    (self.grad_flats if self.stage == 1 else [s.grad for s in self.shards]))
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0)  # not the scalar step
        return {"params": params, "grads": grads, "optimizer": state}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state with the layout needed to reshard it (names, offsets, sizes)."""
        layout = [{"names": b.names, "offsets": b.offsets, "numels": [p.numel() for p in b.params],
                   "padded": b.flat.numel()} for b in self.buckets]
        return {"world_size": self.world_size, "rank": self.rank, "layout": layout,
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}  # a snapshot, not live tensors

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(f"state of rank {state['rank']} of {state['world_size']} cannot load into rank "
                             f"{self.rank} of {self.world_size}: reshard it first")
        self.optimizer.load_state_dict(state["optimizer"])
