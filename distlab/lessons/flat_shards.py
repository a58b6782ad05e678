"""Pre-written plumbing of ZeRO-3 (phase3_multi_node/fsdp.py): its shards become the model's parameters.

As PyTorch's FSDP does, the wrapper *replaces* a model's trainable parameters: each unit's
flat chunk is registered on the unit's module as one 1-D parameter ``flat_shard``, and
the originals stop being parameters (they stay plain attributes: the views forward
computes with). So a torch optimizer built on ``model.parameters()`` *after* wrapping
steps the shards; one built before would hold the originals, which never get a gradient
again, and ``guard_optimizers`` makes its first step raise instead of training nothing.
The lesson (gather, reduce-scatter) is in fsdp.py; this is how it meets ``torch.optim``.
Guide: phase3_multi_node/guidelines_ddp_zero.md#zero-3-fsdp.
"""
from __future__ import annotations

import itertools
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from distlab.comm import all_gather_single
from distlab.lessons.clipping import ModuleClipGradNorm, UnusedParameters, chunk_count, chunk_segments


@dataclass(eq=False)
class Unit:
    """One module's trainable parameters, sharded: a fp32 chunk at rest, a full flat buffer in use."""

    module: nn.Module
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    full: torch.Tensor            # padded flat buffer (compute dtype); the params are views into it
    shard: nn.Parameter           # my chunk of it, in fp32: ``module.flat_shard``, what the optimizer updates
    ready: set[int] = field(default_factory=set)
    grad_full: torch.Tensor | None = None   # fp32 full gradient: from the end of u's backward to its reduce-scatter
    grad_acc: torch.Tensor | None = None    # fp32 full gradient summed by backwards without sync (no_sync())
    handle: tuple[dist.Work, torch.Tensor] | None = None
    gather: dist.Work | None = None         # an all-gather in flight into `full`

    def is_gathered(self) -> bool:  # the storage is resized to 0 when freed
        return self.full.untyped_storage().size() > 0


def free_storage(t: torch.Tensor) -> None:  # keeps t (and views of it) for a later alloc_storage
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())

def shard_unit(module: nn.Module, params: list[nn.Parameter], names: list[str], rank: int, world_size: int,
               compute_dtype: torch.dtype | None) -> Unit:
    """``params`` packed into a padded flat buffer: my chunk copied out in fp32 (fp64 stays fp64) as the
    unit's ``shard``; the params become views of a ``full`` buffer in the compute dtype (not yet filled)."""
    offsets = [0, *itertools.accumulate(p.numel() for p in params)]
    padded = math.ceil(offsets[-1] / world_size) * world_size
    chunk, master = padded // world_size, torch.float64 if params[0].dtype == torch.float64 else torch.float32
    flat = torch.zeros(padded, dtype=master, device=params[0].device)
    with torch.no_grad():
        for p, start in zip(params, offsets):
            flat[start:start + p.numel()].copy_(p.reshape(-1))
    shard = nn.Parameter(flat[rank * chunk:(rank + 1) * chunk].clone())
    full = torch.empty(padded, dtype=compute_dtype or params[0].dtype, device=params[0].device)
    for p, start in zip(params, offsets):
        p.data = full[start:start + p.numel()].view_as(p)
    return Unit(module, params, names, offsets[:-1], full, shard)


def default_units(model: nn.Module) -> list[nn.Module]:
    """Blocks of repeated containers (ModuleList/Sequential of >= 2 same-type modules) as units;
    children holding such a container are opened; every other child with parameters is a unit."""
    def trainable(m: nn.Module) -> bool:
        return any(p.requires_grad for p in m.parameters())

    def repeated(m: nn.Module) -> bool:
        kids = [k for k in m.children() if trainable(k)]
        return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2 and len({type(k) for k in kids}) == 1

    units = []
    for child in model.children():
        if repeated(child) or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [k for k in child.children() if trainable(k)]
        elif any(repeated(m) for m in child.modules()):
            units += default_units(child)
        elif trainable(child):
            units.append(child)
    return units


def replicated_parameters(model: nn.Module, replicate: str | Iterable[str]) -> list[nn.Parameter]:
    """The trainable parameters named in ``replicate`` (a parameter's name, or a module's: all of
    its parameters), in the model's order; a ValueError names what matches nothing."""
    every = list(model.named_parameters(remove_duplicate=False))
    kept = {s: {p for n, p in every if p.requires_grad and (n == s or n.startswith(s + "."))}
            for s in ([replicate] if isinstance(replicate, str) else replicate)}
    if missing := sorted(s for s, ps in kept.items() if not ps):
        raise ValueError(f"replicate: no trainable parameter is named, or lives in a module named, {missing}")
    whole = set().union(*kept.values())  # a set: `in` compares tensors by identity
    return [p for p in dict.fromkeys(p for _, p in every) if p in whole]


def cast_floating(obj: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors in obj (a tensor, or a tuple/list/dict of them) cast to dtype (None: as they are)."""
    if dtype is None:
        return obj
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if type(obj) in (tuple, list):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    return {k: cast_floating(v, dtype) for k, v in obj.items()} if type(obj) is dict else obj


def keep_full_precision(model: nn.Module, sharded: set[nn.Parameter], compute_dtype: torch.dtype) -> None:
    """Modules holding unsharded parameters (frozen, replicated) run in those parameters' dtype: floating
    inputs cast to it, outputs back to ``compute_dtype`` (FSDP1's MixedPrecision does so for norms)."""
    names = {p: n for n, p in model.named_parameters()}
    done: set[nn.Module] = set()
    for name, m in model.named_modules():
        whole = [p for p in m.parameters(recurse=False) if p not in sharded]
        if m in done or not whole:
            continue
        if clash := [names[p] for p in m.parameters() if p in sharded]:
            raise ValueError(f"compute_dtype: {name or 'the root'} holds {names[whole[0]]!r} (frozen or replicated, "
                             f"kept in {whole[0].dtype}) and sharded {clash[0]!r}: keep whole modules unsharded")
        done.update(m.modules())
        m.register_forward_pre_hook(lambda m, a, kw, dt=whole[0].dtype: (cast_floating(a, dt), cast_floating(kw, dt)),
                                    with_kwargs=True)
        m.register_forward_hook(lambda m, a, out: cast_floating(out, compute_dtype))


def replace_parameters(model: nn.Module, units: list, owner: Any) -> None:
    """Register each unit's ``shard`` as ``<unit.module>.flat_shard``; its ``params`` stop being parameters.

    ``units``: objects with ``module``, ``shard``, ``params`` and ``names`` (fsdp.py's ``Unit``);
    ``owner``: the wrapper, told by ``guard_optimizers`` which optimizers step its shards (it gets
    ``owner._optimizers``, a WeakSet) and when (it calls ``owner._sample()`` after each step).
    """
    owner._optimizers = weakref.WeakSet()
    owner._unused = UnusedParameters({u.shard: chunk_segments(u.params, u.offsets, owner.rank, owner.world_size)
                                      for u in units}, owner.group)  # what no rank used: not stepped
    owner._state_names = list(model.state_dict(keep_vars=True))  # the single-process order, for state_dict()
    where = {m: n for n, m in model.named_modules()}
    for u in units:
        if hasattr(u.module, "flat_shard"):
            raise ValueError(f"{where[u.module] or 'the root'} already has a flat_shard: wrap a model once")
        u.module.register_parameter("flat_shard", u.shard)
        u.shard._flat_shard_of = weakref.ref(owner)
        for p, name in zip(u.params, u.names):  # what an optimizer still holding p is told
            p._replaced_by = (name, f"{where[u.module]}.flat_shard".lstrip("."))
    sharded = {p for u in units for p in u.params}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p in sharded:  # a plain attribute now: the view forward computes with
                del m._parameters[name]
                object.__setattr__(m, name, p)
    guard_optimizers()


def _owners(optimizer: torch.optim.Optimizer) -> set:
    refs = {getattr(p, "_flat_shard_of", None) for g in optimizer.param_groups for p in g["params"]}
    return {r() for r in refs if r is not None} - {None}


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        if (replaced := getattr(p, "_replaced_by", None)) is not None:
            raise RuntimeError(f"this optimizer holds {replaced[0]!r} {tuple(p.shape)}, which FullyShardedDataParallel "
                               f"replaced by {replaced[1]!r}: it would never get a gradient. Build the optimizer after "
                               f"wrapping, on fsdp.parameters()")
    for owner in _owners(optimizer):
        owner._optimizers.add(optimizer)  # so its memory_bytes() counts this optimizer's state
        owner._unused.before_step(optimizer)  # what no rank used is put back after the step


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for owner in _owners(optimizer):
        owner._unused.after_step(optimizer)
        owner._sample()  # the optimizer state the step may just have created


_HOOKS: list = []


def guard_optimizers() -> None:
    """Once per process: every torch optimizer's ``step`` checks its parameters (a global step hook)."""
    if not _HOOKS:
        _HOOKS.extend([register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step)])


# ---------------------------------------------------------------------- torch's names in state dicts
# ``fsdp.state_dict()`` holds the single-process names, as FSDP2's does, not ``<unit>.flat_shard``:
# each sharded parameter's value is the part of it this rank's chunk holds (1-D, the parameter's
# elements [lo, hi) in row-major order; empty if none), so saving and loading need no communication.
# The state's ``_metadata`` records rank, world size and every [lo, hi) and shape, checked on load.
# The whole tensors (a *full* state dict) come from fsdp_state.full_state_dict (3.19), a collective.

def _pieces(fsdp: nn.Module) -> dict[str, tuple[Any, int, int, int, tuple[int, ...]]]:
    """Every sharded parameter's name (tied: each name) -> (unit, start in my chunk, lo, hi, shape)."""
    out = {}
    for u in fsdp.units:
        chunk = u.shard.numel()
        mine = fsdp.rank * chunk
        for p, name, start in zip(u.params, u.names, u.offsets):
            a, b = max(start, mine), min(start + p.numel(), mine + chunk)
            lo, hi = (a - start, b - start) if a < b else (0, 0)
            out[name] = (u, start + lo - mine, lo, hi, tuple(p.shape))
    for alias, name in fsdp.aliases.items():
        out[alias] = out[name]
    return out


def named_shard_state_dict(fsdp: nn.Module, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """What stays whole (buffers, frozen, replicated) and my part of every sharded parameter, by name."""
    out = OrderedDict() if destination is None else destination
    whole = {n: t for n, t in fsdp.module.state_dict(keep_vars=keep_vars).items() if not n.endswith("flat_shard")}
    pieces = _pieces(fsdp)
    for name in fsdp._state_names:  # the single-process model's order
        if name in pieces:
            u, at, lo, hi, _ = pieces[name]
            piece = u.shard[at:at + hi - lo]
            out[prefix + name] = piece if keep_vars else piece.detach()
        else:
            out[prefix + name] = whole[name]
    meta = getattr(out, "_metadata", None)
    if meta is None:
        meta = out._metadata = OrderedDict()
    meta[prefix + "#flat_shards"] = {"rank": fsdp.rank, "world_size": fsdp.world_size,
                                     "pieces": {n: (lo, hi, shape) for n, (_, _, lo, hi, shape) in pieces.items()}}
    return out


@torch.no_grad()
def load_named_shard_state_dict(fsdp: nn.Module, state: dict, strict: bool = True):
    """The inverse of ``named_shard_state_dict`` (same rank, world size and layout: else a ValueError)."""
    pieces = _pieces(fsdp)
    here = {n: (lo, hi, shape) for n, (_, _, lo, hi, shape) in pieces.items()}
    saved = getattr(state, "_metadata", {}).get("#flat_shards")
    fix = "load the state_dict() this rank saved at this world size"
    full = "; a full state dict loads with fsdp_state.load_full_state_dict(fsdp, state) (torch: set_model_state_dict " \
           "with StateDictOptions(full_state_dict=True))"
    if saved is not None and (saved["rank"], saved["world_size"]) != (fsdp.rank, fsdp.world_size):
        raise ValueError(f"FSDP state of rank {saved['rank']} of {saved['world_size']} cannot load into rank "
                         f"{fsdp.rank} of {fsdp.world_size}: {fix}, or save a full one (fsdp_state.full_state_dict)")
    for name, (u, at, lo, hi, shape) in pieces.items():
        if name not in state:
            continue
        t = state[name]
        if (saved is not None and tuple(saved["pieces"].get(name, ())) != (lo, hi, shape)) or t.numel() != hi - lo:
            what = f"{name} has {t.numel()} elements, shape {tuple(t.shape)}; this rank holds elements [{lo}, {hi}) of {shape}"
            raise ValueError(f"FSDP state: {what}: {fix}" + (full if tuple(t.shape) == shape else ""))
        u.shard[at:at + hi - lo].copy_(t.reshape(-1))
    whole = {n: t for n, t in named_shard_state_dict(fsdp, keep_vars=True).items() if n not in pieces}
    for name, t in whole.items():
        if name in state:
            t.detach().copy_(state[name])
    missing = [n for n in [*whole, *pieces] if n not in state]
    unexpected = [n for n in state if n not in whole and n not in pieces]
    if strict and (missing or unexpected):
        raise RuntimeError(f"FSDP load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------- optimizer state by parameter name
# A torch optimizer on fsdp.parameters() keys its state by the flat shards' indices. As torch's
# get_optimizer_state_dict / set_optimizer_state_dict do for FSDP2, these key it by the single-process
# names: full (every moment whole, a collective) or sharded (my part of each, [lo, hi) as in state_dict(),
# with rank, world size and layout under "fsdp", checked on load). Both load into another FSDP's optimizer.

def _named_params(fsdp: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[tuple[Any, list[str]]]]:
    """Per param group, per parameter: (its Unit or None, the names it stands for)."""
    units = {u.shard: u for u in fsdp.units}
    names = {p: n for n, p in reversed(list(fsdp.module.named_parameters(remove_duplicate=False)))}
    return [[(units[p], units[p].names) if p in units else (None, [names[p]]) for p in g["params"]]
            for g in optimizer.param_groups]


def _in_model_order(fsdp: nn.Module, names: Iterable[str]) -> list[str]:  # a unit packs in backward order
    where = {n: i for i, n in enumerate(fsdp._state_names)}
    return sorted(names, key=lambda n: where.get(n, len(where)))


def _is_moment(v: Any, unit) -> bool:  # per element (exp_avg, momentum_buffer), not per tensor (step)
    return unit is not None and torch.is_tensor(v) and v.shape == unit.shard.shape


@torch.no_grad()
def optimizer_state_dict(fsdp: nn.Module, optimizer: torch.optim.Optimizer, full: bool = False) -> dict[str, Any]:
    """``optimizer``'s state by parameter name: ``{"state": {name: {key: tensor}}, "param_groups": [...,
    "params": [names]]}``; ``full``: whole tensors (collective, Psi (W-1)/W bytes per moment per rank),
    else my [lo, hi) part of each (1-D) and ``"fsdp"``: rank, world size, layout.
    Equivalent to: torch's ``get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
    full_state_dict=full))`` on FSDP2 (sharded: 1-D pieces where torch has DTensor shards)."""
    inner, pieces, index = optimizer.state_dict(), _pieces(fsdp), 0
    state, groups = {}, []
    for group, params in zip(inner["param_groups"], _named_params(fsdp, optimizer)):
        names = []
        for unit, unit_names in params:
            saved, index = inner["state"].get(index, {}), index + 1  # torch numbers parameters across groups
            names += unit_names
            flat = {}
            for key, v in saved.items():
                if _is_moment(v, unit) and full:  # every rank's chunk, then cut by parameter
                    flat[key] = torch.empty(unit.full.numel(), dtype=v.dtype, device=v.device)
                    all_gather_single(flat[key], v, group=fsdp.group)
            for j, name in enumerate(unit_names):
                entry = {}
                for key, v in saved.items():
                    if not _is_moment(v, unit):  # a step count: p's own, as torch's optimizer has it
                        entry[key] = fsdp._unused.own_count(unit.params[j] if unit else None, key, v)
                    elif full:
                        start, shape = unit.offsets[j], tuple(unit.params[j].shape)
                        entry[key] = flat[key][start:start + unit.params[j].numel()].view(shape).clone()
                    else:
                        _, at, lo, hi, _ = pieces[name]
                        entry[key] = v[at:at + hi - lo].clone()
                state[name] = entry
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": _in_model_order(fsdp, names)})
    # a parameter no rank ever stepped has no state in torch (full: agreed by a collective; sharded: mine)
    state = fsdp._unused.drop_never_updated(state, fsdp.units, fsdp.group, local=not full)
    out = {"state": {n: state[n] for n in _in_model_order(fsdp, state)}, "param_groups": groups}
    if not full:
        out["fsdp"] = {"rank": fsdp.rank, "world_size": fsdp.world_size,
                       "pieces": {n: (lo, hi, shape) for n, (_, _, lo, hi, shape) in pieces.items()}}
    return out


@torch.no_grad()
def load_optimizer_state_dict(fsdp: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load ``optimizer_state_dict``'s output (full: from any world size, no communication; sharded: this
    rank's at this world size and layout, else a ValueError saying what differs) into ``optimizer``.
    Equivalent to: torch's ``set_optimizer_state_dict``."""
    pieces, meta = _pieces(fsdp), state_dict.get("fsdp")
    if meta is not None:
        fix = "load the one this rank saved, or a full one (optimizer_state_dict(fsdp, optimizer, full=True))"
        if (meta["rank"], meta["world_size"]) != (fsdp.rank, fsdp.world_size):
            raise ValueError(f"FSDP optimizer state of rank {meta['rank']} of {meta['world_size']} cannot load into "
                             f"rank {fsdp.rank} of {fsdp.world_size}: {fix}")
        for name, (_, _, lo, hi, shape) in pieces.items():
            if name in meta["pieces"] and tuple(meta["pieces"][name]) != (lo, hi, shape):
                raise ValueError(f"FSDP optimizer state: {name} was saved as elements {tuple(meta['pieces'][name][:2])}"
                                 f" of {meta['pieces'][name][2]}; this rank holds [{lo}, {hi}) of {shape}: {fix}")
    if len(state_dict["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state with {len(state_dict['param_groups'])} param groups cannot load into an "
                         f"optimizer with {len(optimizer.param_groups)}: build its groups as when it was saved")
    inner_state, groups, index = {}, [], 0
    for saved_group, params in zip(state_dict["param_groups"], _named_params(fsdp, optimizer)):
        names = _in_model_order(fsdp, [n for _, unit_names in params for n in unit_names])
        if _in_model_order(fsdp, saved_group["params"]) != names:
            raise ValueError(f"optimizer state: a param group saved with {list(saved_group['params'])} cannot load "
                             f"into one with {names}: build the optimizer's groups as when it was saved")
        for unit, unit_names in params:
            saved = [state_dict["state"].get(n) for n in unit_names]
            if any(s is not None for s in saved):  # one without state (torch: never stepped): zeros
                entry = {}
                for key, v in next(s for s in saved if s is not None).items():
                    if unit is None or not torch.is_tensor(v) or v.dim() == 0:  # a whole parameter's; a step count
                        entry[key] = chunk_count(saved, key)  # the unit's: its parameters' largest own count
                        continue
                    chunk = torch.zeros_like(unit.shard)  # the padding's moments are zero
                    for name, s in [(n, s) for n, s in zip(unit_names, saved) if s is not None]:
                        _, at, lo, hi, shape = pieces[name]
                        t = s[key].reshape(-1)
                        part = t[lo:hi] if meta is None else t
                        if part.numel() != hi - lo:
                            raise ValueError(f"optimizer state {name}.{key} has {t.numel()} elements; this rank "
                                             f"holds [{lo}, {hi}) of {shape}: a sharded state loads at its own rank")
                        chunk[at:at + hi - lo].copy_(part)
                    entry[key] = chunk
                inner_state[index] = entry
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                       "params": list(range(index - len(params), index))})
    optimizer.load_state_dict({"state": inner_state, "param_groups": groups})
    saved = {p: state_dict["state"].get(n) for u in fsdp.units for p, n in zip(u.params, u.names)}  # own counts
    fsdp._unused.loaded(lambda p: saved[p] is not None, lambda p: (saved[p] or {}).get("step"))


class TorchModuleAPI(ModuleClipGradNorm):  # FullyShardedDataParallel's torch spellings (phase3_multi_node/fsdp.py)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.require_sync = bool(requires_gradient_sync)  # FSDP2's name for leaving no_sync()

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        return named_shard_state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return load_named_shard_state_dict(self, state_dict, strict)

    def step(self) -> None:  # with optimizer_cls (zero_grad is nn.Module's: it clears every .grad)
        if self.optimizer is None:
            raise RuntimeError("built without optimizer_cls: step the optimizer you built on fsdp.parameters()")
        self.optimizer.step()

