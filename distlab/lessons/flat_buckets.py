"""Pre-written flat buffers: the layout of ZeRO stages 1-2 (phase3_multi_node/zero.py) and its
optimizer state dicts, and the messages of the parameter server (phase3_multi_node/parameter_server.py:
``pack``, ``unpack``).

Trainable parameters are packed end to end in flat buckets padded to a multiple of W;
rank r owns chunk r of every bucket. The parameters become views into their bucket, so an
all-gather into a bucket updates the model in place.
Guide: phase3_multi_node/guidelines_ddp_zero.md#zero-1-optimizer-state-sharded.
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

from distlab.lessons.clipping import chunk_count


@dataclass
class FlatBucket:
    """Parameters packed end to end in one flat buffer of W equal chunks; ``rank`` owns one."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor              # padded; the params are views into it
    world_size: int
    rank: int

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat tensor shaped like ``flat``."""
        n = self.flat.numel() // self.world_size
        return t[self.rank * n:(self.rank + 1) * n]


def make_flat_bucket(params: list[nn.Parameter], world_size: int, rank: int) -> FlatBucket:
    """Copy ``params`` into one zero-padded flat buffer and make them views into it."""
    offsets = [0, *itertools.accumulate(p.numel() for p in params)]
    padded = math.ceil(offsets[-1] / world_size) * world_size
    flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for p, start in zip(params, offsets):
            flat[start:start + p.numel()].copy_(p.reshape(-1))
            p.data = flat[start:start + p.numel()].view_as(p)
    return FlatBucket(params, offsets[:-1], flat, world_size, rank)


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


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened end to end into one new 1-D tensor (detached: a message, not a view)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (the inverse of ``pack``), in place."""
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))


# ---------------------------------------------------------------------- optimizer state of flat chunks
# ZeroOptimizer's state_dict plumbing (phase3_multi_node/zero.py). Its inner optimizer holds one
# state entry per chunk (inner index i <-> bucket i); a torch optimizer holds one per parameter,
# indexed in the order the parameters were given (frozen ones included). A *sharded* state is the
# inner one plus the layout it is only valid in; a *consolidated* one is torch's per-parameter
# format (what AdamW(model.parameters()).state_dict() or a consolidated ZeroRedundancyOptimizer
# gives): it loads into any world size, bucket size, or a plain torch optimizer.

def bucket_layout(buckets: list[FlatBucket], index: dict[nn.Parameter, int]) -> list[dict]:
    """Per bucket: the global indices, shapes and offsets of its parameters and its padded size."""
    return [{"params": [index[p] for p in b.params], "shapes": [list(p.shape) for p in b.params],
             "offsets": list(b.offsets), "padded": b.flat.numel()} for b in buckets]


def check_sharded_state(saved: dict, rank: int, world_size: int, layout: list[dict]) -> None:
    """A ValueError, in one line, naming what differs between a saved sharded state and this optimizer."""
    fix = ("load the state_dict() this rank saved, or call consolidate_state_dict(to=0) on every rank "
           "before saving rank 0's state_dict() (a consolidated state loads at any world size)")
    if (saved["rank"], saved["world_size"]) != (rank, world_size):
        raise ValueError(f"optimizer state of rank {saved['rank']} of {saved['world_size']} cannot load into "
                         f"rank {rank} of {world_size}: {fix}")
    if len(saved["layout"]) != len(layout):
        raise ValueError(f"optimizer state has {len(saved['layout'])} flat buckets, this optimizer "
                         f"{len(layout)} (other parameters or bucket_size_mb): {fix}")
    for i, (a, b) in enumerate(zip(saved["layout"], layout)):
        if a != b:
            what = next(k for k in ("params", "shapes", "offsets", "padded") if a[k] != b[k])
            raise ValueError(f"optimizer state's bucket {i} has {what} {a[what]}, this optimizer's {b[what]} "
                             f"(other parameters or bucket_size_mb): {fix}")


@torch.no_grad()
def consolidated_state_dict(inner: dict, buckets: list[FlatBucket], index: dict[nn.Parameter, int],
                            given: list[list[nn.Parameter]], to: int, group=None) -> dict | None:
    """On group rank ``to``: the state_dict a torch optimizer on ``given`` (its parameter groups, in
    order) would have, built from every rank's ``inner`` (the state_dict of the optimizer on the
    chunks); None elsewhere. Collective: every rank of ``group``, after the same steps."""
    state = gather_flat_state(inner, buckets, index, to, group)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in ps]}
              for g, ps in zip(inner["param_groups"], given)]
    return None if state is None else {"state": dict(sorted(state.items())), "param_groups": groups}


def chunk_state_dict(state_dict: dict, buckets: list[FlatBucket], index: dict[nn.Parameter, int],
                     given: list[list[nn.Parameter]], inner_groups: list[dict]) -> dict:
    """The inverse, on every rank, without communication: from a per-parameter ``state_dict``, the
    state_dict of the optimizer on the chunks (its ``inner_groups``)."""
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    if saved != [len(ps) for ps in given]:
        raise ValueError(f"optimizer state has groups of {saved} parameters, this optimizer "
                         f"{[len(ps) for ps in given]}: build it on the same parameters")
    names = {p: f"parameter {i}" for p, i in index.items()}
    starts = [0, *itertools.accumulate(len(g["params"]) for g in inner_groups)]
    return {"state": shard_flat_state(state_dict["state"], buckets, index, names),
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(a, b))}
                             for g, a, b in zip(state_dict["param_groups"], starts, starts[1:])]}


@torch.no_grad()
def gather_flat_state(inner: dict, buckets: list[FlatBucket], index: dict[nn.Parameter, int], to: int,
                      group=None) -> dict[int, dict] | None:
    """Per-parameter state (torch's format, on the CPU) on group rank ``to``; None elsewhere.

    ``inner``: the state_dict of an optimizer built on the chunks (inner index i: bucket i).
    Collective: every rank of ``group`` calls it after the same steps. Cost: K Psi (W-1)/W bytes into ``to``.
    """
    rank, dst = dist.get_rank(group), dist.get_global_rank(group, to) if group is not None else to
    out: dict[int, dict] = {}
    for i, b in enumerate(buckets):
        for key, value in inner["state"].get(i, {}).items():  # same keys on every rank: same steps
            if torch.is_tensor(value) and value.dim() > 0:  # shaped like my chunk: gather the others'
                mine = value.to(b.flat.device)
                parts = [torch.empty_like(mine) for _ in range(b.world_size)] if rank == to else None
                dist.gather(mine, parts, dst=dst, group=group)
                value = torch.cat(parts).cpu() if rank == to else None
            if rank != to:
                continue
            for p, start in zip(b.params, b.offsets):  # scalars (Adam's step) are the same on every rank
                shaped = torch.is_tensor(value) and value.dim() > 0
                v = value[start:start + p.numel()].view(p.shape) if shaped else value
                out.setdefault(index[p], {})[key] = v.clone() if torch.is_tensor(v) else v
    return out if rank == to else None


def shard_flat_state(state: dict[int, dict], buckets: list[FlatBucket], index: dict[nn.Parameter, int],
                     names: dict[nn.Parameter, str]) -> dict[int, dict]:
    """The inverse: this rank's chunk of every bucket's state (inner index i: bucket i), from per-parameter ``state``."""
    out: dict[int, dict] = {}
    for i, b in enumerate(buckets):
        have = [index[p] in state for p in b.params]
        if not any(have):
            continue
        first = state[index[b.params[have.index(True)]]]  # one without state (torch: never stepped): zeros
        out[i] = {}
        for key, value in first.items():
            if not (torch.is_tensor(value) and value.dim() > 0):  # a step count: the largest own one
                out[i][key] = chunk_count([state.get(index[p]) for p in b.params], key)
                continue
            flat = torch.zeros(b.flat.numel(), dtype=value.dtype, device=value.device)
            for p, start in zip(b.params, b.offsets):
                t = state.get(index[p], {}).get(key, torch.zeros(p.shape, dtype=value.dtype))
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {key!r} of {names[p]} (index {index[p]}) has shape "
                                     f"{tuple(t.shape)}, the parameter {tuple(p.shape)}: a state of another model")
                flat[start:start + p.numel()].copy_(t.reshape(-1))
            out[i][key] = b.chunk(flat).clone()
    return out


class FlatStateDicts:
    """ZeroOptimizer's state dicts (phase3_multi_node/zero.py): its ``optimizer`` (on the chunks),
    ``buckets``, ``_index``, ``_given``, ``_where``, ``_layout``, ``_unused`` and ``_consolidated``."""

    def state_dict(self) -> dict[str, Any]:
        """After ``consolidate_state_dict(to=this rank)`` and no step since: every parameter's state in
        torch's format; otherwise this rank's chunk state, with ``"zero"``: rank, world size, layout."""
        if self._consolidated is not None:
            return self._consolidated
        meta = dict(rank=self.rank, world_size=self.world_size, stage=self.stage, layout=self._layout,
                    updated=[bool(self._unused.updated[p]) for p in self._where],  # stepped by this rank yet
                    behind=[self._unused.behind[p] for p in self._where])  # steps of its chunk each sat out
        return {**self.optimizer.state_dict(), "zero": meta}  # live tensors, as torch's state_dict()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's chunk state on group rank ``to``, whose next ``state_dict()`` returns it
        per parameter (torch's format, on the CPU), as torch's ``ZeroRedundancyOptimizer`` does: a
        parameter no rank ever stepped (unused) has no state, as in torch, and each its own step count.
        Collective: every rank of ``group``. Cost: K Psi (W-1)/W bytes into ``to``."""
        never = {self._index[p] for p in self._unused.never_updated(self._where, self.group)}
        state = consolidated_state_dict(self.optimizer.state_dict(), self.buckets, self._index, self._given, to,
                                        self.group)
        if state is not None:
            own = {self._index[p]: p for p in self._where}  # the chunk's count less the steps p sat out
            state["state"] = {i: {k: self._unused.own_count(own[i], k, v) for k, v in s.items()}
                              for i, s in state["state"].items() if i not in never}
        self._consolidated = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # after the model's (offload: copied)
        """A sharded state (checked: same rank, world size and layout, else a ValueError saying what
        differs) or a per-parameter one (consolidated, or any torch optimizer's on the same parameters)."""
        if "zero" in state_dict:
            check_sharded_state(state_dict["zero"], self.rank, self.world_size, self._layout)
            inner = {k: v for k, v in state_dict.items() if k != "zero"}
            flags = dict(zip(self._where, state_dict["zero"].get("updated", [True] * len(self._where))))
            behind = dict(zip(self._where, state_dict["zero"].get("behind", [0] * len(self._where))))
            self._unused.loaded(lambda p: flags[p], behind=behind)
        else:  # my chunks of every parameter's state
            inner = chunk_state_dict(state_dict, self.buckets, self._index, self._given, self.optimizer.param_groups)
            saved = {p: state_dict["state"].get(self._index[p]) for p in self._where}  # own counts: torch's
            self._unused.loaded(lambda p: saved[p] is not None, lambda p: (saved[p] or {}).get("step"))
        self.optimizer.load_state_dict(inner)
        # torch's load_state_dict gives the inner optimizer new param_groups and state objects:
        # point at them again, or an LR scheduler on this optimizer stops reaching the inner one.
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def sharded_state_dict(self) -> dict[str, Any]:  # a snapshot of this rank's chunk state, with its layout
        consolidated, self._consolidated = self._consolidated, None
        state, self._consolidated = copy.deepcopy(self.state_dict()), consolidated
        return state

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
