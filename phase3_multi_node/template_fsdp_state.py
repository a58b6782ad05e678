# Generated from solutions/phase3_multi_node/fsdp_state.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""ZeRO-3 / FSDP state dicts: gather a full one, load one into shards, save and restore shards.

A sharded model has two kinds of checkpoint (PyTorch's FSDP has the same pair):

* **full**: every parameter whole, by name, as the single-process model's ``state_dict``
  would have it. Rebuilding one is a collective (each unit all-gathers its chunks,
  Psi (W-1)/W bytes per rank); loading one needs no communication: every rank reads
  the whole dict and keeps its own chunk. Portable across world sizes and strategies.
* **sharded**: each rank saves its chunks and optimizer state with the layout
  (names, offsets, padding) a resharder needs. No communication, 1/W of the bytes per
  rank; loads only at the same world size (phase 4 reshards it for another).

These functions take a ``FullyShardedDataParallel`` from fsdp.py (3.17-3.18): its
``units`` (params, names, offsets, the padded ``full`` buffer, the fp32 ``shard``),
``aliases`` (tied names), ``module``, ``group``, ``rank`` and ``world_size``; the sharded
pair also takes the torch optimizer built on ``fsdp.parameters()``. Names are the
single-process model's: the ``flat_shard`` parameters never appear in a state dict, and
what is not sharded (buffers, frozen and replicated parameters) is copied by name.
See phase3_multi_node/guidelines_ddp_zero.md#state-dicts.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from distlab.comm import all_gather_single  # noqa: F401 (all_gather_single: for TODO 3.19a)
from distlab.todo import todo


def _unsharded(fsdp: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and the parameters kept whole (frozen, replicated), by name: all but the flat shards."""
    shards = {u.shard for u in fsdp.units}  # a set: `in` compares tensors by identity
    return {n: t for n, t in fsdp.module.state_dict(keep_vars=True).items() if t not in shards}


@torch.no_grad()
def full_state_dict(fsdp: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (full, master dtype) and buffer by name, on every rank (``rank0_only``: on
    group rank 0, ``{}`` elsewhere, as FSDP1's ``FullStateDictConfig(rank0_only=True)``).

    Equivalent to: ``model.state_dict()`` of the single-process model (fp32 masters).
    Collective: every rank of ``fsdp.group`` calls it. Cost: Psi (W-1)/W bytes per rank.
    """
    drop = rank0_only and fsdp.rank != 0  # gathered unit by unit everywhere, kept on rank 0 only
    state = {n: t.detach().clone() for n, t in _unsharded(fsdp).items()}
    for u in fsdp.units:
        # --- TODO 3.19a: gather a full state dict ---
        # Goal: `state[name]` for each of u's params: the full tensor, in the master dtype
        # (u.shard's), rebuilt from every rank's chunk; an independent copy, not a view.
        # Collective: every rank of `fsdp.group` calls it, unit by unit.
        raise todo("3.19a gather a full state dict", "guidelines_ddp_zero.md#state-dicts")
        # --- end TODO 3.19a ---
        if drop:  # one unit at a time, never the whole model, on the other ranks
            for name in u.names:
                state.pop(name, None)
    if drop:
        return {}
    for alias, name in fsdp.aliases.items():
        state[alias] = state[name]  # a tied weight under its second name
    return state


@torch.no_grad()
def load_full_state_dict(fsdp: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Keep my chunk of every sharded parameter in ``state`` (no communication); copy the rest."""
    for u in fsdp.units:
        # --- TODO 3.19b: load a full state dict into shards ---
        # Goal: `u.shard` becomes this rank's chunk of u's padded flat layout built from the
        # named tensors in `state` (zeros in the padding). No communication: every rank
        # reads the whole dict.
        raise todo("3.19b load a full state dict into shards", "guidelines_ddp_zero.md#state-dicts")
        # --- end TODO 3.19b ---
    for name, t in _unsharded(fsdp).items():  # buffers, frozen and replicated parameters
        t.copy_(state[name])


def sharded_state_dict(fsdp: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """My chunks, what is not sharded, and ``optimizer``'s state (default: ``fsdp.optimizer``, if
    built with ``optimizer_cls``; none: weights only), with the layout a resharder needs."""
    optimizer = optimizer if optimizer is not None else fsdp.optimizer
    layout = [{"names": u.names, "offsets": u.offsets, "numels": [p.numel() for p in u.params],
               "padded": u.full.numel()} for u in fsdp.units]
    return {"world_size": fsdp.world_size, "rank": fsdp.rank, "layout": layout,
            "shards": [u.shard.detach().clone() for u in fsdp.units],
            "unsharded": {n: t.detach().clone() for n, t in _unsharded(fsdp).items()},
            "optimizer": None if optimizer is None else copy.deepcopy(optimizer.state_dict())}  # a snapshot


@torch.no_grad()
def load_sharded_state_dict(fsdp: nn.Module, state: dict[str, Any],
                            optimizer: torch.optim.Optimizer | None = None) -> None:
    """Restore what ``sharded_state_dict`` saved, by this rank at this world size, into ``fsdp``
    and ``optimizer`` (default: ``fsdp.optimizer``)."""
    optimizer = optimizer if optimizer is not None else fsdp.optimizer
    if state["world_size"] != fsdp.world_size or state["rank"] != fsdp.rank:
        raise ValueError(f"state of rank {state['rank']} of {state['world_size']} cannot load into rank "
                         f"{fsdp.rank} of {fsdp.world_size}: reshard it first")
    if (state["optimizer"] is None) != (optimizer is None):
        raise ValueError("the state has optimizer state but no optimizer was given" if optimizer is None else
                         "the state has no optimizer state (saved without an optimizer): nothing to load into it")
    for u, s in zip(fsdp.units, state["shards"]):
        u.shard.copy_(s)
    for name, t in _unsharded(fsdp).items():
        t.copy_(state["unsharded"][name])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
