# Generated from solutions/phase3_multi_node/fsdp.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""ZeRO-3 / FSDP from scratch: parameters sharded too, gathered just in time, freed after use.

Each *unit* (by default every child module that owns trainable parameters; a
parameter shared by two units, e.g. tied embeddings, belongs to the root) keeps
only a flat chunk of its parameters, 1/W of them, in fp32 (the master weights).

    forward of unit u:   all_gather(chunks -> full flat, compute dtype) ; run u ; free the full flat
    backward of unit u:  all_gather again ; run u's backward ; free ;
                         reduce_scatter(u's full fp32 gradient) -> my gradient chunk (async)
    step:                the optimizer updates my fp32 chunks; nothing to gather until the next forward

Per rank at rest: parameters, gradients and optimizer state are all 1/W
(Rajbhandari et al. 2020: (2 + 2 + K) Psi / W for mixed-precision Adam); in flight:
one or two units' full parameters. Cost per step: two all-gathers (forward,
backward) and one reduce-scatter of |params|: 3 Psi (W-1)/W bytes per rank in a
ring, 1.5x DDP's all-reduce (2 Psi (W-1)/W).

``compute_dtype`` (e.g. torch.bfloat16): chunks are cast before the all-gather, so
the wire and the gathered weights are half-size; gradients are cast to fp32 before
the reduce-scatter and kept in fp32. Frozen parameters and buffers are not sharded.
See phase3_multi_node/guidelines_ddp_zero.md#zero-3-fsdp.

Run: ``RUN_MODE=zero ./entrypoint.sh --stage 3 [--compute-dtype bfloat16]`` (demos/zero.py).
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_single, reduce_scatter_single
from distlab.sync import broadcast_module
from distlab.todo import todo


@dataclass
class Unit:
    """One module's trainable parameters, sharded: a fp32 chunk at rest, a full flat buffer in use."""

    module: nn.Module
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    full: torch.Tensor            # padded flat buffer (compute dtype); the params are views into it
    shard: nn.Parameter           # my chunk of it, in fp32: what the optimizer updates
    ready: set[int] = field(default_factory=set)
    grad_full: torch.Tensor | None = None   # fp32 full gradient, only while waiting for the reduce-scatter
    handle: tuple[dist.Work, torch.Tensor] | None = None

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().size() > 0


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and views into it) for a later ``alloc_storage``."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().size() == 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())


def default_units(model: nn.Module) -> list[nn.Module]:
    """Direct children with parameters (ModuleLists/Dicts opened up), in registration order."""
    units = []
    for child in model.children():
        kids = child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        units += [m for m in kids if any(p.requires_grad for p in m.parameters())]
    return units


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3: parameters, gradients and optimizer state sharded over ``group``.

    Args:
        model: this rank's replica (rank 0's parameters are broadcast).
        optimizer_cls, **optim_kwargs: any ``torch.optim`` optimizer, built on the fp32 chunks.
        units: modules gathered and freed as one, not nested (default: ``default_units(model)``);
            the root holds every parameter no single unit owns.
        compute_dtype: dtype of the gathered parameters (None: the parameters' own).
        group: the data-parallel group (None: WORLD).

    Equivalent to: single-process ``optimizer_cls(model.parameters())`` on the global batch
    (with ``compute_dtype``: forward/backward in that dtype, fp32 master weights).
    Collective: construction, every forward, backward and ``step`` on all ranks of ``group``.
    Cost: 3 Psi (W-1)/W bytes per rank per step (1.5x DDP); memory (2 + 2 + K) Psi / W at rest.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 units: list[nn.Module] | None = None, compute_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None, **optim_kwargs: Any) -> None:
        super().__init__()
        self.module, self.group, self.compute_dtype = model, group, compute_dtype
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        broadcast_module(model, group)  # replicas start equal to rank 0's (Phase 1's lesson)
        units = default_units(model) if units is None else list(units)
        for u in units:
            inner = [m for m in u.modules() if m is not u and any(m is v for v in units)]
            if inner or u is model:
                raise ValueError(f"units must not nest or include the root: {type(u).__name__} contains "
                                 f"{len(inner)} other unit(s)" if inner else "the root is always a unit")
        names = self._names = {p: n for n, p in model.named_parameters()}
        owners: dict[nn.Parameter, list[nn.Module]] = {p: [] for p in names if p.requires_grad}
        for u in units:
            for p in u.parameters():
                if p.requires_grad:
                    owners[p].append(u)
        self.units: list[Unit] = []
        for module in [*units, model]:  # the root last: it keeps what no single unit owns
            mine = [p for p, us in owners.items() if (us == [module]) or (module is model and len(us) != 1)]
            if mine:
                self.units.append(self._shard(module, mine, [names[p] for p in mine], compute_dtype))
        self.optimizer = optimizer_cls([u.shard for u in self.units], **optim_kwargs)
        self._where = {p: (u, j) for u in self.units for j, p in enumerate(u.params)}
        self._next = len(self.units) - 1  # reduce-scatters launch in reverse unit order on every rank
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._unshard(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._reshard(u))
            u.module.register_full_backward_pre_hook(lambda m, grad_out, u=u: self._unshard(u))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            self._reshard(u)

    def _shard(self, module: nn.Module, params: list[nn.Parameter], names: list[str],
               compute_dtype: torch.dtype | None) -> Unit:
        offsets = [0, *itertools.accumulate(p.numel() for p in params)]
        padded = math.ceil(offsets[-1] / self.world_size) * self.world_size
        chunk = padded // self.world_size
        flat = torch.zeros(padded, dtype=torch.float32 if params[0].dtype != torch.float64 else torch.float64,
                           device=params[0].device)
        with torch.no_grad():
            for p, start in zip(params, offsets):
                flat[start:start + p.numel()].copy_(p.reshape(-1))
        shard = nn.Parameter(flat[self.rank * chunk:(self.rank + 1) * chunk].clone())
        shard.grad = torch.zeros_like(shard)
        full = torch.empty(padded, dtype=compute_dtype or params[0].dtype, device=params[0].device)
        for p, start in zip(params, offsets):
            p.data = full[start:start + p.numel()].view_as(p)
        return Unit(module, params, names, offsets[:-1], full, shard)

    # ------------------------------------------------------------------ gather / free
    @torch.no_grad()
    def _unshard(self, u: Unit) -> None:
        """Materialise u's full parameters from every rank's chunk (no-op if already there)."""
        if u.is_gathered():
            return
        # --- TODO 3.17: gather a unit's parameters ---
        # Goal: give `u.full` its memory back (u's params are views of it) and fill it with every
        # rank's chunk, in the compute dtype `u.full.dtype` (cast before sending: in bf16 half the
        # bytes on the wire). Collective: every rank of `self.group` gathers the same unit.
        raise todo("3.17 gather a unit's parameters", "guidelines_ddp_zero.md#zero-3-fsdp")
        # --- end TODO 3.17 ---

    def _reshard(self, u: Unit) -> None:
        free_storage(u.full)  # the params stay views: valid again after the next _unshard

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        u, j = self._where[p]
        # --- TODO 3.18a: collect gradients into the unit's flat fp32 buffer ---
        # Goal: p's gradient moves, as fp32, into its place in u's full flat gradient (created on
        # first use, like `u.full` in u.shard's dtype) and the full-size `p.grad` is dropped;
        # p is marked ready, and once all of u's params are, u's gathered parameters are freed.
        raise todo("3.18a collect gradients into the unit's flat fp32 buffer", "guidelines_ddp_zero.md#zero-3-fsdp")
        # --- end TODO 3.18a ---
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce-scatter complete units, in reverse unit order (the same sequence on every rank)."""
        while self._next >= 0:
            u = self.units[self._next]
            if not force and len(u.ready) < len(u.params):
                return
            if u.grad_full is None:  # no gradient on this rank (unused): zeros
                u.grad_full = torch.zeros(u.full.numel(), dtype=u.shard.dtype, device=u.shard.device)
            # --- TODO 3.18b: reduce-scatter a unit's gradient ---
            # Goal: start (without waiting) the sum over the ranks of `u.grad_full`, of which this
            # rank receives only its chunk, in a fresh tensor shaped like `u.shard`; keep the
            # handle and that tensor in `u.handle`. Collective: same units, same order everywhere.
            raise todo("3.18b reduce-scatter a unit's gradient", "guidelines_ddp_zero.md#zero-3-fsdp")
            # --- end TODO 3.18b ---
            self._next -= 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter; my gradient chunks become means over the ranks."""
        self._launch_ready(force=True)
        for u in self.units:
            handle, out = u.handle
            handle.wait()
            u.shard.grad += out / self.world_size
            u.grad_full, u.handle, u.ready = None, None, set()
            self._reshard(u)  # a unit whose gradients never all arrived was still gathered
        self._next = len(self.units) - 1

    # ------------------------------------------------------------------ training API
    def forward(self, *args, **kwargs):
        if self.compute_dtype is None:
            return self.module(*args, **kwargs)
        dtype = self.compute_dtype  # floating inputs meet the gathered weights in their dtype
        cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return self.module(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    def step(self) -> None:
        """Finish the gradient reduce-scatters and update my chunks (collective)."""
        self.finish_gradient_synchronization()
        self.optimizer.step()

    def zero_grad(self) -> None:
        for u in self.units:
            u.shard.grad.zero_()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for sharded parameters (+ any gathered), gradients, optimizer state."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        params = sum(nbytes(u.shard) + (nbytes(u.full) if u.is_gathered() else 0) for u in self.units)
        grads = sum(nbytes(u.shard.grad) for u in self.units)
        state = sum(nbytes(v) for s in self.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": state}

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (full, master dtype) and buffer by name, on every rank (collective)."""
        state = {n: t.detach().clone() for n, t in self.module.state_dict(keep_vars=True).items()
                 if not any(t is p for p in self._where)}  # buffers and frozen parameters
        for u in self.units:
            # --- TODO 3.19a: gather a full state dict ---
            # Goal: `state[name]` for each of u's params: the full tensor, in the master dtype
            # (u.shard's), rebuilt from every rank's chunk; an independent copy, not a view.
            # Collective: every rank of `self.group` calls it, unit by unit.
            raise todo("3.19a gather a full state dict", "guidelines_ddp_zero.md#state-dicts")
            # --- end TODO 3.19a ---
        for alias, p in self.module.named_parameters(remove_duplicate=False):
            state.setdefault(alias, state[self._names[p]])  # a tied weight under its second name
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Keep my chunk of every sharded parameter in ``state`` (no communication); copy the rest."""
        for u in self.units:
            # --- TODO 3.19b: load a full state dict into shards ---
            # Goal: `u.shard` becomes this rank's chunk of u's padded flat layout built from the
            # named tensors in `state` (zeros in the padding). No communication: every rank
            # reads the whole dict.
            raise todo("3.19b load a full state dict into shards", "guidelines_ddp_zero.md#state-dicts")
            # --- end TODO 3.19b ---
        for name, t in self.module.state_dict(keep_vars=True).items():
            if not any(t is p for p in self._where):  # buffers and frozen parameters: replicated
                t.copy_(state[name])

    def sharded_state_dict(self) -> dict[str, Any]:
        """My chunks and optimizer state, with the layout a resharder needs (names, offsets, padding)."""
        layout = [{"names": u.names, "offsets": u.offsets, "numels": [p.numel() for p in u.params],
                   "padded": u.full.numel()} for u in self.units]
        return {"world_size": self.world_size, "rank": self.rank, "layout": layout,
                "shards": [u.shard.detach().clone() for u in self.units],
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}  # a snapshot, not live tensors

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(f"state of rank {state['rank']} of {state['world_size']} cannot load into rank "
                             f"{self.rank} of {self.world_size}: reshard it first")
        for u, s in zip(self.units, state["shards"]):
            u.shard.copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])
