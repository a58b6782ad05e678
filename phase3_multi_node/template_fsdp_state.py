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
``module``, ``optimizer``, ``group``, ``rank`` and ``world_size``.
See phase3_multi_node/guidelines_ddp_zero.md#state-dicts.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from distlab.comm import all_gather_single
from distlab.todo import todo


def _sharded_params(fsdp: nn.Module) -> set[nn.Parameter]:
    return {p for u in fsdp.units for p in u.params}


@torch.no_grad()
def full_state_dict(fsdp: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (full, master dtype) and buffer by name, on every rank.

    Equivalent to: ``model.state_dict()`` of the single-process model (fp32 masters).
    Collective: every rank of ``fsdp.group`` calls it. Cost: Psi (W-1)/W bytes per rank.
    """
    sharded = _sharded_params(fsdp)
    state = {n: t.detach().clone() for n, t in fsdp.module.state_dict(keep_vars=True).items()
             if not any(t is p for p in sharded)}  # buffers and frozen parameters
    for u in fsdp.units:
        # --- TODO 3.19a: gather a full state dict ---
        # Goal: `state[name]` for each of u's params: the full tensor, in the master dtype
        # (u.shard's), rebuilt from every rank's chunk; an independent copy, not a view.
        # Collective: every rank of `fsdp.group` calls it, unit by unit.
        raise todo("3.19a gather a full state dict", "guidelines_ddp_zero.md#state-dicts")
        # --- end TODO 3.19a ---
    first = {}
    for alias, p in fsdp.module.named_parameters(remove_duplicate=False):
        first.setdefault(p, alias)
        state.setdefault(alias, state[first[p]])  # a tied weight under its second name
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
    sharded = _sharded_params(fsdp)
    for name, t in fsdp.module.state_dict(keep_vars=True).items():
        if not any(t is p for p in sharded):  # buffers and frozen parameters: replicated
            t.copy_(state[name])


def sharded_state_dict(fsdp: nn.Module) -> dict[str, Any]:
    """My chunks and optimizer state, with the layout a resharder needs (names, offsets, padding)."""
    layout = [{"names": u.names, "offsets": u.offsets, "numels": [p.numel() for p in u.params],
               "padded": u.full.numel()} for u in fsdp.units]
    return {"world_size": fsdp.world_size, "rank": fsdp.rank, "layout": layout,
            "shards": [u.shard.detach().clone() for u in fsdp.units],
            "optimizer": copy.deepcopy(fsdp.optimizer.state_dict())}  # a snapshot, not live tensors


@torch.no_grad()
def load_sharded_state_dict(fsdp: nn.Module, state: dict[str, Any]) -> None:
    """Restore my chunks and optimizer state, saved by this rank at this world size."""
    if state["world_size"] != fsdp.world_size or state["rank"] != fsdp.rank:
        raise ValueError(f"state of rank {state['rank']} of {state['world_size']} cannot load into rank "
                         f"{fsdp.rank} of {fsdp.world_size}: reshard it first")
    for u, s in zip(fsdp.units, state["shards"]):
        u.shard.copy_(s)
    fsdp.optimizer.load_state_dict(state["optimizer"])
