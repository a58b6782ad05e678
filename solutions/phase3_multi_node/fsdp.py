"""ZeRO-3 / FSDP from scratch: parameters sharded too, gathered just in time, freed after use.

Each *unit* (by default every repeated block: TinyGPT/ViT layers, ResNet residual blocks,
and every other child with parameters; a parameter shared by two units, e.g. tied
embeddings, belongs to the root) keeps a flat chunk, 1/W, of its parameters in fp32 (the
master weights), registered on its module as the parameter ``flat_shard``: any torch
optimizer built after wrapping, ``AdamW(fsdp.parameters())``, trains the shards.

    forward of unit u:   all_gather(chunks -> full flat, compute dtype) ; run u ; free the full flat
    backward of unit u:  all_gather again (prefetched while the unit before it runs backward) ;
                         run u's backward (into p.grads) ; free ; p.grads -> fp32 flat ; reduce_scatter -> my chunk

Reduce-scatters launch as soon as a unit's gradients are complete, in one order every rank
agrees on: first the reverse of the units with the root (tied gradients arrive last) at the
end, then rank 0's order observed in the first backward. Gathered at once: the root, the
unit in backward and ``prefetch`` ahead; at most ``max_in_flight`` full gradients in flight.
At rest everything is 1/W ((2 + 2 + K) Psi / W, mixed-precision Adam, Rajbhandari et al.
2020); per step two all-gathers and a reduce-scatter: 3 Psi (W-1)/W bytes per rank, 1.5x DDP.
Flat chunks per unit (FSDP1), not per-parameter shards (FSDP2): one collective per unit, no
copies, the lesson here; but the optimizer sees no names or shapes (groups by name: ``replicate``).
Plumbing (the ``Unit`` record, sharding, storage, state dicts): distlab/lessons/flat_shards.py;
guide: phase3_multi_node/guidelines_ddp_zero.md#zero-3-fsdp.

Run: ``RUN_MODE=zero ./entrypoint.sh --stage 3 [--compute-dtype bfloat16]`` (demos/zero.py).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_single, reduce_scatter_single
from distlab.lessons.clipping import global_norm_grad
from distlab.lessons.flat_shards import (TorchModuleAPI, Unit, alloc_storage, cast_floating, default_units, free_storage,
                                 keep_full_precision, replace_parameters, replicated_parameters, shard_unit)
from distlab.meters import MemoryMeter, OverlapMeter, nbytes
from distlab.lessons.sync import NoSyncMixin, allreduce_gradients, broadcast_module, group_root


class FullyShardedDataParallel(TorchModuleAPI, NoSyncMixin, nn.Module):
    """ZeRO-3: parameters, gradients and optimizer state sharded over ``group``.

    Args:
        model: this rank's replica (rank 0's parameters are broadcast); its trainable parameters
            become one 1-D ``flat_shard`` per unit. Build the optimizer after wrapping.
        optimizer_cls, **optim_kwargs: optional: ``self.optimizer = optimizer_cls(self.parameters(),
            **optim_kwargs)``, stepped by ``self.step()``.
        units: modules gathered and freed as one, not nested (default: ``default_units(model)``);
            the root holds every parameter no single unit owns.
        replicate: names of parameters (or of modules: all their parameters) kept whole on every
            rank, e.g. norms: own names and shapes, gradients all-reduced at the end of backward.
        compute_dtype: dtype of the gathered parameters (None: their own); modules holding
            frozen or replicated parameters run in those parameters' dtype (inputs cast, outputs back).
        prefetch: units gathered ahead in backward; max_in_flight: reduce-scatters in flight; group: None: WORLD.
        overlap_comm: False: each collective is waited for when launched, as FSDP2 on a CPU: none (nor
            gloo's copy of its unit) in flight during compute. None (default): False with CPU shards (process
            peak 0.92-0.96x FSDP2's; overlapped 1.14-1.28x at W=2-4: bench_zero.py), True on GPUs (NCCL stream).

    ``state_dict()`` holds the single-process names (my part of each sharded parameter; whole
    tensors: ``fsdp_state.full_state_dict``; an optimizer's state by these names, full or sharded:
    ``distlab.lessons.flat_shards.optimizer_state_dict``). Inside ``no_sync()`` (or after
    ``set_requires_gradient_sync(False)``, FSDP2's spelling) backwards skip the reduce-scatters
    and sum each unit's full fp32 gradient locally (+|params| bytes); the next synced backward
    reduce-scatters that sum with its own gradients.
    After backward (backwards accumulate, as in torch): ``flat_shard.grad`` is my chunk of the
    unit's flattened mean gradient over ranks, shaped like the shard (zeros in the padding), in
    its dtype (fp32; fp64 models: fp64); a replicated parameter's ``.grad`` is its whole mean
    gradient, its own shape and dtype; a frozen one's stays None. A norm of a ``flat_shard.grad`` is the
    whole unit's (a collective, as FSDP2's DTensors): ``torch.nn.utils.clip_grad_norm_(fsdp.parameters(),
    ...)`` on every rank clips by the global norm, as does ``fsdp.clip_grad_norm_`` (FSDP1's spelling). A
    parameter no rank used is not stepped (torch: its ``.grad`` stays None; distlab/lessons/clipping.py).
    Equivalent to: any torch optimizer on the single-process ``model.parameters()``, global batch.
    Collective: construction, every forward and backward on all ranks of ``group``, and every step of an
    optimizer on the shards (it all-reduces a used bitmap, 4 B per parameter, as DDP's find_unused_parameters).
    Cost: 3 Psi (W-1)/W bytes per rank per step (1.5x DDP); memory (2 + 2 + K) Psi / W at rest.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer] | None = None, *,
                 units: list[nn.Module] | None = None, replicate: Iterable[str] = (),
                 compute_dtype: torch.dtype | None = None, prefetch: int = 1, max_in_flight: int = 2,
                 overlap_comm: bool | None = None, group: dist.ProcessGroup | None = None, **optim_kwargs: Any) -> None:
        super().__init__()
        if optim_kwargs and optimizer_cls is None:
            raise TypeError(f"optimizer arguments {sorted(optim_kwargs)} without optimizer_cls: build the "
                            f"optimizer on fsdp.parameters() after wrapping")
        self.module, self.group, self.compute_dtype = model, group, compute_dtype
        self.prefetch, self.max_in_flight = prefetch, max(1, max_in_flight)
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        broadcast_module(model, group)  # replicas start equal to rank 0's (Phase 1's lesson)
        units = default_units(model) if units is None else list(units)
        for u in units:
            inner = [m for m in u.modules() if m is not u and any(m is v for v in units)]
            if inner or u is model:
                raise ValueError(f"units must not nest or include the root: {type(u).__name__} contains "
                                 f"{len(inner)} other unit(s)" if inner else "the root is always a unit")
        every = list(model.named_parameters(remove_duplicate=False))  # tied: one parameter, several names
        names = {p: n for n, p in reversed(every)}  # its first name
        self.replicated = replicated_parameters(model, replicate)  # kept whole, gradients all-reduced
        whole = set(self.replicated)  # a set: `in` compares tensors by identity
        owners: dict[nn.Parameter, list[nn.Module]] = {p: [] for p in names if p.requires_grad and p not in whole}
        for u, p in [(u, p) for u in units for p in u.parameters() if p in owners]:
            owners[p].append(u)
        self.units: list[Unit] = []
        for module in [*units, model]:  # the root last: it keeps what no single unit owns
            mine = [p for p, us in owners.items() if (us == [module]) or (module is model and len(us) != 1)]
            if mine:
                self.units.append(shard_unit(module, mine, [names[p] for p in mine], self.rank, self.world_size,
                                             compute_dtype))
        if not self.units:
            raise ValueError("nothing to shard: every parameter is frozen or in replicate")
        sharded = {p for u in self.units for p in u.params}
        self.overlap_comm = self.units[0].shard.device.type != "cpu" if overlap_comm is None else overlap_comm
        if compute_dtype is not None:
            keep_full_precision(model, sharded, compute_dtype)
        replace_parameters(model, self.units, owner=self)  # model.parameters(): the flat shards now
        self.aliases = {n: names[p] for n, p in every if p in sharded and n != names[p]}  # tied: name -> first
        self._where = {p: (u, j) for u in self.units for j, p in enumerate(u.params)}
        # Launch (and prefetch) order: reverse of the units, root last, until the first backward's is known.
        self._order = [*self.units[-2::-1], self.units[-1]] if self.units[-1].module is model else self.units[::-1]
        self._next, self._completed, self._recorded, self._in_backward = 0, [], False, False
        self.memory, self.overlap, self.max_gathered = MemoryMeter(), OverlapMeter(), 0
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._unshard(u, wait=True))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._reshard(u))
            u.module.register_full_backward_pre_hook(lambda m, grad_out, u=u: self._backward_pre(u))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            self._reshard(u)
        for p in self.replicated:  # reduced when the backward ends, which this makes sure is noticed
            p.register_post_accumulate_grad_hook(lambda p: self._begin_backward())
        self.optimizer = optimizer_cls(self.parameters(), **optim_kwargs) if optimizer_cls else None

    # ------------------------------------------------------------------ bookkeeping (pre-written)
    def _sample(self) -> None:
        held = self.memory_bytes()
        held["grads"] += sum(nbytes(g) for u in self.units for g in [u.grad_full, u.grad_acc, *(p.grad for p in u.params)])
        self.memory.sample(**held)
        self.max_gathered = max(self.max_gathered, sum(u.is_gathered() for u in self.units))

    def _begin_backward(self) -> None:
        if not self._in_backward:  # once per backward: finish the reduce-scatters when it ends
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _backward_pre(self, u: Unit) -> None:
        self._begin_backward()
        self._unshard(u, wait=True)
        later = self._order[self._order.index(u) + 1:]
        for v in [v for v in later if not v.ready][:self.prefetch]:
            # prefetch: its all-gather overlaps u's backward (overlap_comm=False: done before it starts)
            self._unshard(v, wait=not self.overlap_comm)

    # ------------------------------------------------------------------ gather / free
    @torch.no_grad()
    def _unshard(self, u: Unit, wait: bool) -> None:
        """Materialise u's full parameters from every rank's chunk (no-op if already there)."""
        if not u.is_gathered():
            # ### BEGIN SOLUTION 3.17: gather a unit's parameters [guidelines_ddp_zero.md#zero-3-fsdp]
            # Goal: give `u.full` its memory back (u's params are views of it) and START filling it
            # with every rank's chunk, in the compute dtype `u.full.dtype` (cast before sending: in
            # bf16 half the bytes on the wire), keeping the handle in `u.gather` (the caller waits).
            # Collective: every rank of `self.group` gathers the same units in the same order.
            alloc_storage(u.full)
            u.gather = all_gather_single(u.full, u.shard.detach().to(u.full.dtype), group=self.group,
                                         async_op=True)
            # ### END SOLUTION 3.17
        if wait and u.gather is not None:
            u.gather.wait()
            u.gather = None
        self._sample()

    def _reshard(self, u: Unit) -> None:
        if u.gather is not None:  # never free memory an all-gather is still writing into
            u.gather.wait()
            u.gather = None
        free_storage(u.full)  # the params stay views: valid again after the next _unshard

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self.overlap.hook()
        self._unused.used(p)  # not stepped if no rank used it (flat_shards: around every optimizer step)
        u, j = self._where[p]
        u.ready.add(j)  # p.grad stays where autograd put it (p's shape and dtype) until u's backward is over
        if len(u.ready) == len(u.params):
            self._collect(u)
            if not self.require_sync:  # no_sync(): keep the full gradient, summed locally
                self._stash(u)
            else:
                self._completed.append(self.units.index(u))
        if self.require_sync:
            self._launch_ready()
        self._sample()

    def _stash(self, u: Unit) -> None:  # after _collect(u), in a backward without sync
        u.grad_acc = u.grad_full if u.grad_acc is None else u.grad_acc.add_(u.grad_full)
        u.grad_full = None

    def _collect(self, u: Unit) -> None:  # u's backward (with unused parameters: the whole one) is over
        # ### BEGIN SOLUTION 3.18a: collect gradients into the unit's flat fp32 buffer [guidelines_ddp_zero.md#zero-3-fsdp]
        # Goal: free u's gathered parameters FIRST (one unit less at the peak, FSDP2's order); then create
        # u's flat gradient `u.grad_full` (zeros, `u.full`'s numel, u.shard's dtype and device), copy each
        # `p.grad` there is (as fp32) into its place (no gradient, unused: stays zero) and drop it.
        self._reshard(u)  # u's backward is over: its full parameters can go
        u.grad_full = torch.zeros(u.full.numel(), dtype=u.shard.dtype, device=u.shard.device)
        for p, start in zip(u.params, u.offsets):
            if p.grad is not None:
                u.grad_full[start:start + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        # ### END SOLUTION 3.18a

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce-scatter complete units, in ``self._order`` (the same sequence on every rank)."""
        for v in [v for v in self.units if v.handle and v.handle[0].is_completed()]:
            self._retire(v)  # free every full gradient whose reduce-scatter is over
        while self._next < len(self._order):
            u = self._order[self._next]
            if not force and len(u.ready) < len(u.params):
                return
            if u.grad_full is None:  # incomplete on this rank (unused parameters): what arrived, zeros for the rest
                self._collect(u)
            if u.grad_acc is not None:  # what backwards inside no_sync() summed: reduce-scattered now, once
                u.grad_full, u.grad_acc = u.grad_full.add_(u.grad_acc), None
            while len(flying := [v for v in self._order if v.handle]) >= self.max_in_flight:
                self._retire(flying[0])  # bound the full gradients alive: wait for the oldest
            # ### BEGIN SOLUTION 3.18b: reduce-scatter a unit's gradient [guidelines_ddp_zero.md#zero-3-fsdp]
            # Goal: start (without waiting) the sum over the ranks of `u.grad_full`, of which this
            # rank receives only its chunk, in a fresh tensor shaped like `u.shard`; keep the
            # handle and that tensor in `u.handle`. Collective: same units, same order everywhere.
            out = torch.empty_like(u.shard)
            u.handle = (reduce_scatter_single(out, u.grad_full, op=dist.ReduceOp.SUM, group=self.group,
                                              async_op=True), out)
            # ### END SOLUTION 3.18b
            self.overlap.launch()
            if not self.overlap_comm:
                self._retire(u)
            self._next += 1

    @torch.no_grad()
    def _retire(self, u: Unit) -> None:
        """Wait for u's reduce-scatter; my gradient chunk gains the mean; the full gradient goes."""
        handle, out = u.handle
        handle.wait()
        out /= self.world_size
        u.shard.grad = global_norm_grad(out, self.group) if u.shard.grad is None else u.shard.grad.add_(out)
        u.grad_full, u.handle = None, None

    def _end_backward(self) -> None:
        if not self.require_sync:  # no_sync(): no communication; units left incomplete keep what arrived
            for u in self.units:
                if u.ready and len(u.ready) < len(u.params):
                    self._collect(u)
                    self._stash(u)
                u.ready = set()
                self._reshard(u)
            self._completed, self._in_backward = [], False
            self._sample()
            return
        self._launch_ready(force=True)  # units with unused parameters: what is missing is zero
        for u in self._order:
            if u.handle:
                self._retire(u)
            u.ready = set()
            self._reshard(u)  # the root, and units whose gradients never all arrived, were still gathered
        if not self._recorded:  # from now on: the order gradients really complete in (rank 0's)
            seen = [*dict.fromkeys(self._completed)]
            order = [seen + [i for i in range(len(self.units)) if i not in seen]]
            dist.broadcast_object_list(order, src=group_root(self.group), group=self.group)
            self._order, self._recorded = [self.units[i] for i in order[0]], True
        for p in self.replicated:  # .grad before this backward is the same on every rank (None, zeros or
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # the last mean): mean(it + mine) =
        allreduce_gradients(self.replicated, self.group)  # it + mean(mine). One per (small: norm) parameter
        self._next, self._completed, self._in_backward = 0, [], False
        self._sample()
        self.overlap.end_backward()

    # ------------------------------------------------------------------ training API
    def forward(self, *args, **kwargs):  # floating inputs meet the gathered weights in their dtype
        return self.module(*cast_floating(args, self.compute_dtype), **cast_floating(kwargs, self.compute_dtype))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for sharded parameters (+ any gathered), gradients, optimizer state."""
        mine = [u.shard for u in self.units] + self.replicated
        params = sum(nbytes(p) for p in mine) + sum(nbytes(u.full) for u in self.units)
        grads = sum(nbytes(p.grad) for p in mine)
        state = sum(nbytes(v) for opt in self._optimizers for p in mine for v in opt.state.get(p, {}).values()
                    if torch.is_tensor(v) and v.dim() > 0)  # of every torch optimizer that stepped them
        return {"params": params, "grads": grads, "optimizer": state}
