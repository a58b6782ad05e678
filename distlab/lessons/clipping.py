"""Pre-written: gradient clipping and unused parameters on the sharded wrappers, as torch users expect.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` clips by the norm of the whole
averaged gradient. Torch's wrappers make the plain call right in two ways: DDP's ``.grad`` holds the
averaged gradient (every rank computes the same norm), and FSDP2's ``.grad`` is a DTensor whose norm
is a collective. The course's wrappers (phase3_multi_node/zero.py, fsdp.py):

* ``FullyShardedDataParallel``: ``flat_shard.grad`` is a ``GlobalNormGrad``: a norm of it is the norm
  of the whole unit's gradient (a collective over the group, as a DTensor's; FSDP2 reduces the same
  ``local ** p`` partials), so the plain call clips by the global norm. Every rank must call it.
* ``ZeroOptimizer``: no rank holds what the global norm needs (stage 1: ``.grad`` is this rank's
  un-averaged gradient until ``step``; stage 2: it was reduce-scattered away). ``.grad`` is a
  ``GuardedGrad`` (stage 2: a zero-byte stand-in, stride 0): a norm or clamp of it raises at once,
  naming ``optimizer.clip_grad_norm_``, instead of clipping by a per-rank norm (stage 1) or returning
  0.0 and clipping nothing (stage 2). Raising at the call, not at ``step``: the traceback points at
  the line to change, and code that reads ``p.grad`` otherwise (``is None``, shapes, ``zero_``) works.

Unused parameters: torch leaves ``.grad`` None for a parameter no rank used, so AdamW neither decays
it nor creates state for it, and its own ``step`` count does not advance. The wrappers' flat chunks hold
such a parameter with a zero gradient, and the optimizer steps a chunk as a whole: ``UnusedParameters``
learns which parameters some rank used from a used bitmap all-reduced in every step (DDP's
find_unused_parameters; 4 B per parameter, read on the host only where a parameter sat out), puts back
the values and per-element state of those no rank used, and steps a used parameter whose count fell
behind its chunk's (it sat out before) again with its own count, by the optimizer's own class: the
steps of torch's optimizer on the parameters, bitwise (tests/test_phase3_torch_conformance.py).
Saved per-parameter states carry each parameter's own count, sharded ones ``behind`` beside the chunk's;
a loaded chunk counts its parameters' largest, and each is behind by the difference (``loaded``).
Guide: phase3_multi_node/guidelines_ddp_zero.md#gradient-clipping-and-unused-parameters.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

_T = torch.Tensor
NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, _T.norm, torch._foreach_norm}
CLAMPS = {torch.clamp, torch.clamp_, torch.clip, torch.clip_, _T.clamp, _T.clamp_, _T.clip, _T.clip_,
          _T.clamp_min_, _T.clamp_max_, torch._foreach_clamp_min_, torch._foreach_clamp_max_}


def _plain(t: Any) -> Any:
    return t.as_subclass(torch.Tensor) if isinstance(t, ShardedGrad) else t


class ShardedGrad(torch.Tensor):
    """A gradient tensor that behaves as a plain one, except for what ``_handle`` takes over."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            found = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, cls)]
            if found and (out := found[0]._handle(func, args, kwargs)) is not NotImplemented:
                return out
            return func(*args, **kwargs)  # results are plain tensors (in-place ones: the same object)

    def _handle(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        return NotImplemented

    def __reduce_ex__(self, protocol):  # saved and sent (all_gather_object) as a plain tensor
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__reduce_ex__(_plain(self), protocol)


def _ord(func: Callable, args: tuple, kwargs: dict) -> float:
    """The p of a norm over every element; a ValueError for a norm over some dims."""
    if func is torch._foreach_norm:
        return float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is not None:
        raise ValueError(f"{func.__name__} over dim={dim} of a sharded gradient (my chunk of a flat unit): "
                         f"only norms over every element are defined (as clip_grad_norm_ takes them)")
    p = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    return 2.0 if p in (None, "fro") else float(p)


def global_norm(local: torch.Tensor, p: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Norms of every rank's parts -> norms of the wholes (elementwise over ``local``). Collective.
    As DTensor's partial norm: sum of ``local ** p`` (max for inf, min for -inf), then ``** (1/p)``."""
    if math.isinf(p):
        out = local.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN, group=group)
        return out
    out = local if p == 0 else local.pow(p)
    dist.all_reduce(out, group=group)
    return out if p == 0 else out.pow(1.0 / p)


class GlobalNormGrad(ShardedGrad):
    """My chunk of a unit's averaged gradient, whose norms are the unit's (collective over ``_group``)."""

    _group: dist.ProcessGroup | None = None

    def _handle(self, func, args, kwargs):
        if func not in NORMS:
            return NotImplemented
        p = _ord(func, args, kwargs)
        if func is torch._foreach_norm:  # one all-reduce for the list; plain tensors in it are whole already
            tensors = args[0]
            local = torch.stack([torch.linalg.vector_norm(_plain(t), p) for t in tensors])
            sharded = torch.tensor([isinstance(t, GlobalNormGrad) for t in tensors], device=local.device)
            total = torch.where(sharded, global_norm(torch.where(sharded, local, 0), p, self._group), local)
            return list(total.unbind())
        return global_norm(func(_plain(args[0]), *args[1:], **kwargs), p, self._group)


def global_norm_grad(grad: torch.Tensor, group: dist.ProcessGroup | None) -> GlobalNormGrad:
    out = grad.as_subclass(GlobalNormGrad)
    out._group = group
    return out


class ModuleClipGradNorm:  # FullyShardedDataParallel's (phase3_multi_node/fsdp.py)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """FSDP1's spelling of ``torch.nn.utils.clip_grad_norm_(fsdp.parameters(), ...)``: clips by the global
        norm and returns it. Collective: every rank, after backward (the shards' gradient norms are)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach)


# Copies and views of a guarded gradient stay guarded: ``p.grad.detach().double().norm()`` (a monitor's
# gradient norm) raises too, instead of reading this rank's part as the whole.
COPIES = {_T.detach, _T.view, _T.view_as, _T.reshape, _T.reshape_as, _T.flatten, torch.flatten, torch.reshape,
          _T.__getitem__, _T.to, _T.double, _T.float, _T.half, _T.bfloat16, _T.clone, torch.clone, _T.contiguous,
          _T.data.__get__, _T.cpu}
# Values read out to the host (a norm taken in numpy or Python) raise as norms do: this rank's part is not the whole.
HOST_READS = {_T.tolist, _T.numpy, _T.item, _T.__array__}


class GuardedGrad(ShardedGrad):
    """A ``.grad`` no per-rank norm can be taken of: norms and clamps raise ``_message``."""

    _message = "this gradient is sharded"

    def _handle(self, func, args, kwargs):
        if func in NORMS or func in CLAMPS or func in HOST_READS:
            raise RuntimeError(self._message)
        if func is _T.zero_ and self.stride() == (0,) * self.dim():  # model.zero_grad(set_to_none=False)
            return self
        if func in COPIES and args and args[0] is self:
            out = func(*args, **kwargs)
            return guarded_grad(out, out, self._message) if isinstance(out, torch.Tensor) else out
        return NotImplemented


def guarded_grad(grad: torch.Tensor | None, like: torch.Tensor, message: str) -> GuardedGrad:
    """``grad`` (a view, kept), or without one a zero-byte stand-in shaped like ``like``, that raises
    ``message`` from norms and clamps (``clip_grad_norm_``, ``clip_grad_value_``)."""
    if grad is None:
        grad = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
    out = grad.as_subclass(GuardedGrad)
    out._message = message
    return out


def zero_clip_message(stage: int) -> str:
    why = ("each rank holds its own un-averaged gradient until step()" if stage == 1 else
           "the full gradient was reduce-scattered away (each rank keeps 1/W of it)")
    return clip_message(f"ZeroOptimizer(stage={stage})", why, "optimizer.clip_grad_norm_")


def clip_message(wrapper: str, why: str, method: str) -> str:
    return (f"torch.nn.utils.clip_grad_norm_ (or clip_grad_value_, a norm of p.grad) on {wrapper}'s "
            f"gradients: {why}, so no rank can take the global norm here. Call {method}(max_norm, norm_type, "
            f"error_if_nonfinite, foreach) instead: it clips by the global norm and returns it "
            f"(as FSDP1's FullyShardedDataParallel.clip_grad_norm_)")


# ---------------------------------------------------------------------- unused parameters
def _per_element(v: Any, t: torch.Tensor) -> bool:  # exp_avg, momentum_buffer: not a step count
    return torch.is_tensor(v) and v.shape == t.shape


def chunks_of(optimizer: torch.optim.Optimizer, segments: dict) -> list[torch.Tensor]:
    return [t for g in optimizer.param_groups for t in g["params"] if t in segments]


class UnusedParameters:
    """Step each parameter's part of a flat chunk as torch steps the parameter itself.

    ``segments``: per chunk tensor the optimizer steps, ``(param, start, end)`` of each parameter's part
    of it. ``used(p)``: p got a gradient on this rank since the last step (backward hooks call it).
    Torch steps a parameter iff some rank used it (DDP: ``.grad`` stays None otherwise), with its own
    ``step`` count. Around every step of an optimizer over chunks of ``group``'s ranks:

    * used: the bitmap of this rank's ``local`` set, all-reduced (MAX) over ``group``, as DDP's
      find_unused_parameters does: exact, and the same on every rank. Collective: every rank's step.
      Cost: one all-reduce of 4 bytes (int32) per parameter of the chunks it steps. Read on the host (one
      sync, as DDP's) only on a rank where a parameter sat out, now or before: where each was used here at
      every step, each was used, none is behind, and nothing else runs.
    * a parameter no rank used: its values and per-element state are put back (not decayed, no moments
      created), and its own count does not advance (``behind[p]``: the chunk's count minus its own);
    * a used one whose count is behind the chunk's (it sat out before): its part is stepped again from
      the values before the step, by the optimizer's own class on a temporary parameter with its own
      count, state slices and group hyperparameters, and written back.
    """

    def __init__(self, segments: dict[torch.Tensor, list[tuple[Any, int, int]]],
                 group: dist.ProcessGroup | None = None) -> None:
        self.segments, self.group = segments, group
        self.local: set[Any] = set()     # used on this rank since the last step (a set: by identity)
        every = [p for segs in segments.values() for p, _, _ in segs]
        self.updated: dict[Any, bool] = {p: False for p in every}  # stepped at least once (torch: has state)
        self.behind: dict[Any, int] = {p: 0 for p in every}        # steps of its chunk it sat out
        self._doubt: set[Any] = set()    # not used here at a step: maybe unused, or behind (read the bitmap)
        self._recount: set[Any] = set()  # loaded without state: behind by the chunk's count
        self._saved: list = []
        self._stepped: list = []

    def used(self, p: Any) -> None:
        self.local.add(p)

    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        chunks = chunks_of(optimizer, self.segments)
        if not chunks:
            return
        params = [p for t in chunks for p, _, _ in self.segments[t]]
        flags = torch.tensor([p in self.local for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)  # used on some rank (model's device: NCCL)
        stepped = [t for t in chunks if t.grad is not None]
        for t, p in [(t, p) for t in stepped for p, _, _ in self.segments[t] if p in self._recount]:
            step = optimizer.state.get(t, {}).get("step", 0)  # the chunk's count (torch's own: 0, no state)
            self.behind[p] = int(step)
            self._doubt.add(p)
            self._recount.discard(p)
        self._doubt |= {p for t in stepped for p, _, _ in self.segments[t] if p not in self.local}
        if self._doubt.isdisjoint(params):  # used here, so everywhere, at every step: the chunk's count
            used = dict.fromkeys(params, True)
        else:
            used = dict(zip(params, map(bool, flags.tolist())))  # the host waits (DDP's find_unused_parameters too)
        self._saved, self._stepped = [], [(t, used) for t in stepped]
        for t, _ in self._stepped:
            state = optimizer.state.get(t, {})
            for p, a, b in self.segments[t]:
                self.updated[p] = self.updated[p] or used[p]
                if a < b and (not used[p] or self.behind[p]):  # put back, or stepped again with its own count
                    saved = {k: v[a:b].clone() for k, v in state.items() if _per_element(v, t)}
                    self._saved.append((t, p, a, b, used[p], t[a:b].clone(), saved))

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for t, p, a, b, used, value, saved in self._saved:
            state = optimizer.state.get(t, {})
            if used:
                value, saved = self._own_step(optimizer, t, t.grad[a:b], value, saved, self.behind[p])
            t[a:b] = value
            for k, v in state.items():  # the moments it would not have (unused, new state): zeros
                if _per_element(v, t):
                    v[a:b] = saved.get(k, 0)
        for t, used in self._stepped:
            counts = "step" in optimizer.state.get(t, {})  # a per-parameter step count (Adam's)
            for p, _, _ in self.segments[t]:
                self.behind[p] += int(counts and not used[p])
                if not self.behind[p] and used[p]:
                    self._doubt.discard(p)  # used on another rank, as always before: level with its chunk
        self.local -= {p for t in chunks_of(optimizer, self.segments) for p, _, _ in self.segments[t]}
        self._saved, self._stepped = [], []

    @staticmethod
    def _own_step(optimizer: torch.optim.Optimizer, t: torch.Tensor, grad: torch.Tensor, value: torch.Tensor,
                  saved: dict, behind: int) -> tuple[torch.Tensor, dict]:
        """``value`` stepped by ``optimizer``'s class with ``t``'s hyperparameters and its own count
        (the chunk's before this step, less ``behind``): torch's step of the parameter, bitwise."""
        group = next(g for g in optimizer.param_groups if any(x is t for x in g["params"]))
        tmp = torch.nn.Parameter(value)
        tmp.grad = grad.clone()
        solo = type(optimizer)([{**{k: v for k, v in group.items() if k != "params"}, "params": [tmp]}])
        step = optimizer.state[t]["step"]  # the chunk's, after this step
        solo.state[tmp] = {**saved, "step": step.clone() - (1 + behind) if torch.is_tensor(step) else step - 1 - behind}
        solo.step()
        return tmp.detach(), {k: v for k, v in solo.state[tmp].items() if _per_element(v, tmp)}

    def never_updated(self, params: Iterable[Any], group: dist.ProcessGroup | None) -> set[Any]:
        """Those of ``params`` no rank ever stepped (torch: no optimizer state). Collective."""
        params = list(params)
        flags = torch.tensor([bool(self.updated.get(p, True)) for p in params], dtype=torch.float32)
        flags = flags.to(params[0].device)  # the model's device (NCCL), not an offloaded chunk's
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return {p for p, f in zip(params, flags.tolist()) if not f}

    def drop_never_updated(self, state: dict[str, Any], units: list, group: dist.ProcessGroup | None,
                           local: bool = False) -> dict:
        """``state`` by parameter name without the parameters of ``units`` no rank ever stepped (collective),
        or with ``local``, that this rank never stepped (no communication)."""
        params = [p for u in units for p in u.params]
        never = ({p for p in params if not bool(self.updated.get(p, True))} if local else
                 self.never_updated(params, group))
        drop = {n for u in units for p, n in zip(u.params, u.names) if p in never}
        return {n: s for n, s in state.items() if n not in drop}

    def own_count(self, p: Any, key: str, value: Any) -> Any:
        """A saved per-parameter state's ``value`` of ``key``: for ``"step"``, p's own count (its chunk's
        less the steps p sat out, as torch's optimizer counts it); a copy of anything else."""
        value = value - self.behind.get(p, 0) if key == "step" else value
        return value.clone() if torch.is_tensor(value) else value

    def loaded(self, has_state: Callable[[Any], bool], own: Callable[[Any], Any] | None = None,
               behind: dict[Any, int] | None = None) -> None:
        """After loading a state: a parameter without state there counts as never updated, its own count
        0 (behind by the chunk's, read at the next step). One with state is behind by ``behind[p]`` (a
        sharded state's), or by its chunk's count (the largest own count of its parameters with state:
        ``chunk_count``) less ``own(p)``, its own (a per-parameter state's ``"step"``), else by none."""
        self.updated = {p: has_state(p) for p in self.updated}
        self.behind, self._doubt = {p: 0 for p in self.behind}, set()
        self._recount = {p for p, u in self.updated.items() if not u}
        for segs in self.segments.values():
            counts = {p: float(own(p)) for p, _, _ in segs if own and self.updated[p] and own(p) is not None}
            for p, _, _ in segs:
                n = behind.get(p, 0) if behind is not None else max(counts.values()) - counts[p] if p in counts else 0
                if self.updated[p] and n:
                    self.behind[p] = int(n)
                    self._doubt.add(p)  # the used bitmap is read while it is behind


def chunk_count(states: list[dict | None], key: str) -> Any:
    """A chunk's per-tensor state ``key`` from its parameters' saved ``states`` (None: no state): for a step
    count, the largest (a parameter that sat out steps has a smaller own count); else the first's."""
    values = [s[key] for s in states if s is not None and key in s]
    value = max(values, key=float) if key == "step" else values[0]
    return value.clone() if torch.is_tensor(value) else value


def chunk_segments(params: list, offsets: list[int], rank: int, world_size: int,
                   padded: int | None = None) -> list[tuple[Any, int, int]]:
    """Each parameter's part ``[start, end)`` of rank ``rank``'s chunk of a flat buffer (padded to a multiple of W)."""
    if padded is None:
        padded = math.ceil((offsets[-1] + params[-1].numel()) / world_size) * world_size
    chunk = padded // world_size
    lo = rank * chunk
    return [(p, max(s, lo) - lo, max(min(s + p.numel(), lo + chunk), max(s, lo)) - lo) for p, s in zip(params, offsets)]


class ZeroGradViews:
    """ZeroOptimizer's ``.grad`` bookkeeping (phase3_multi_node/zero.py): stage 1's views into its flat
    gradient buffers (``grad_flats``), stage 2's stand-ins; both raise ``_clip_message`` from a norm."""

    def _collect_stage1_grads(self) -> None:
        """Point every p.grad back at its flat view (``set_to_none`` or ``model.zero_grad()`` drop it)."""
        for p in self._where:
            self._collect_stage1_grad(p)

    def _collect_stage1_grad(self, p: torch.nn.Parameter) -> None:
        view = self._grad_view(p)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)  # accumulated since the last set_to_none: the whole gradient
        p.grad = guarded_grad(view, p, self._clip_message)  # torch's clip_grad_norm_ on it raises

    def _grad_view(self, p: torch.nn.Parameter) -> torch.Tensor:  # stage 1: p's gradient in its flat buffer
        i, j = self._where[p]
        return self.grad_flats[i][self.buckets[i].offsets[j]:self.buckets[i].offsets[j] + p.numel()].view_as(p)

    def _on_stage1_grad(self, p: torch.nn.Parameter) -> None:
        if self._averaged:  # it would add this rank's gradient to everyone's mean, which step would not redo
            raise RuntimeError("ZeroOptimizer(stage=1): backward after clip_grad_norm_ and before step(): "
                               "clip after the last backward of a step (as torch's clip_grad_norm_ is meant)")
        self._unused.used(p)
        self._collect_stage1_grad(p)  # after model.zero_grad(): autograd made a new tensor

    def _drop_stand_in(self, p: torch.nn.Parameter) -> None:  # stage 2: autograd would add to the stand-in
        if p.grad is not None and p.grad.untyped_storage().nbytes() < p.numel() * p.element_size():
            p.grad = None
