# Generated from solutions/phase4_production/elastic.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Elastic training: resume at a different world size, and notice a hung peer in seconds.

A job saved by 4 ranks may come back with 3 (a node is gone) or 8 (more were
granted). Two kinds of state are laid out *per rank* and must be remapped:

1. **The data position.** Count it in *global samples* consumed this epoch, not in
   per-rank batches. Every step takes the next ``global_batch`` indices of one seeded
   permutation, and rank r takes its contiguous ``global_batch / W`` of them. Any W
   that divides the global batch then trains on exactly the samples a single process
   would have, in the same steps: the position survives the change of W.
2. **Sharded optimizer state.** ``FlatShardedAdam`` (ZeRO-1 in miniature) keeps
   Adam's two moments for one contiguous 1/W slice of the flattened parameters.
   The checkpoint holds each rank's slice with its ``[start, end)``; at the new W,
   each rank assembles its new slice from the overlapping pieces (``reshard_flat``).

A peer that hangs (deadlock, stuck I/O, a GPU fault) would otherwise stall every
collective until the process group's timeout, 30 minutes by default. ``heartbeat``
is a barrier with a short timeout that *names* the ranks that did not arrive
(``dist.monitored_barrier``, which gloo implements; NCCL jobs run it on a gloo side group).

Cost: the sampler needs no communication; ``FlatShardedAdam.step`` all-gathers the
updated parameters (|params| bytes per rank); a heartbeat is W-1 small messages to rank 0.
See phase4_production/guidelines.md#elastic-training.
"""
from __future__ import annotations

import itertools
import math
from datetime import timedelta  # noqa: F401 (timedelta: for TODO 4.7)
from typing import Iterable

import torch
import torch.distributed as dist

from distlab.comm import all_gather_single
from distlab.todo import todo


class PeerTimeoutError(RuntimeError):
    """A rank did not reach a heartbeat in time (the message names it)."""


# --------------------------------------------------------------------------- data position
class GlobalBatchSampler:
    """Rank ``rank``'s slice of each global batch, resumable at any world size that divides the batch.

    Epoch e visits ``torch.randperm(num_samples)`` seeded with ``seed + e``, one global
    batch at a time (the tail smaller than a global batch is dropped); ``position`` is
    the number of samples of the epoch already consumed, by all ranks together.

    Equivalent to: a single process reading the same permutation in batches of
    ``global_batch``, when the W slices of a step are concatenated in rank order.
    Cost: no communication.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int = 0) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size} "
                             f"({global_batch} % {world_size} = {global_batch % world_size})")
        if global_batch > num_samples:
            raise ValueError(f"global batch {global_batch} is larger than the data set ({num_samples} samples)")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def next_indices(self) -> list[int]:
        """This rank's sample indices for the next step; advances the global position."""
        per_rank = self.global_batch // self.world_size  # noqa: F841 (per_rank: for TODO 4.5)
        # --- TODO 4.5: resumable global sampler ---
        # Goal: this rank's `per_rank` indices of the next global batch, as a list. The global
        # batch is the next `global_batch` entries of this epoch's permutation (seeded seed + epoch,
        # the tail that no longer fills a global batch dropped), cut into W contiguous slices in
        # rank order. `position` counts the samples of the epoch taken by ALL ranks together.
        raise todo("4.5 resumable global sampler", "guidelines.md#elastic-training")
        # --- end TODO 4.5 ---

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "global_batch": self.global_batch, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position, whatever world size saved it."""
        for key in ("seed", "global_batch", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"saved sampler has {key}={state[key]} but this one has {getattr(self, key)}: "
                                 "the global data order would change")
        self.epoch = state["epoch"]
        self.position = state["position"]


# --------------------------------------------------------------------------- sharded optimizer state
def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank's slice when ``numel`` elements are cut into W padded chunks.

    Chunks are ``ceil(numel / W)`` long; the last ones may be shorter or empty.
    """
    chunk = math.ceil(numel / world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel)


def reshard_flat(pieces: Iterable[tuple[int, int, torch.Tensor]], start: int, end: int) -> torch.Tensor:
    """Assemble the flat slice ``[start, end)`` from saved ``(piece_start, piece_end, values)`` slices.

    The pieces are the slices some other world size held; together they cover
    ``[start, end)`` (any piece may overlap it partly or not at all).

    Equivalent to: ``torch.cat([values for the pieces, in order])[start:end]``.
    Raises:
        ValueError: some element of ``[start, end)`` is in no piece.
    """
    pieces = list(pieces)
    dtype = pieces[0][2].dtype if pieces else torch.float32
    out = torch.empty(end - start, dtype=dtype)
    covered = torch.zeros(end - start, dtype=torch.bool)
    # --- TODO 4.6: reshard flat optimizer state ---
    # Goal: `out` holds element i of the flat tensor at out[i - start], taken from whichever
    # piece covers i (pieces come in any order and may miss [start, end) entirely), and
    # `covered` marks every element written, for the check below.
    raise todo("4.6 reshard flat optimizer state", "guidelines.md#elastic-training")
    # --- end TODO 4.6 ---
    if not bool(covered.all()):
        missing = start + int((~covered).nonzero()[0])
        raise ValueError(f"element {missing} of [{start}, {end}) is in none of the saved pieces")
    return out


class FlatShardedAdam(torch.optim.Optimizer):
    """Adam whose moments are sharded: rank r updates only its slice of the flat parameters.

    Gradients must already be averaged over the ranks (all-reduce before ``step``).
    The same update as ``torch.optim.Adam`` (no weight decay), element for element, with each
    parameter group's own ``lr``, ``betas`` and ``eps``. The moments live in ``self.state`` as
    torch's do: ``state[p]`` holds the part of p inside my slice (1-D; empty where my slice misses
    p: after a step every rank has state for every parameter, the keys of torch's Adam, whatever
    its rank), so ``state_dict()`` and ``load_state_dict()`` carry them; ``state_dict()`` adds my range, rank and world size,
    and a load checks them (a slice saved by another rank or at another W is refused: reshard
    it with ``shard_state_dict``/``load_shards``); a per-parameter state (``torch.optim.Adam``'s)
    loads as my part of each tensor.

    Collective: ``step`` must be called on every rank (it all-gathers the parameters).
    Cost: optimizer memory 2 |params| / W per rank; |params| bytes all-gathered per step.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.group = group
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.numel = sum(p.numel() for p in self.params)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.start, self.end = shard_range(self.numel, self.rank, self.world_size)
        # (param, its first flat index, [lo, hi) of my slice inside it), for every param: one my slice
        # misses gets an empty range, and state with empty moments, so that every rank's state_dict()
        # has the keys torch.optim.Adam's has (as FSDP2's sharded state: every parameter, a local part)
        offsets = [0, *itertools.accumulate(p.numel() for p in self.params)]
        self._mine = [(p, a, lo, max(min(self.end - a, p.numel()), lo))
                      for p, a in zip(self.params, offsets) for lo in [min(max(self.start - a, 0), p.numel())]]

    def _moments(self, p: torch.Tensor, n: int) -> dict:
        if not self.state[p]:  # torch's Adam layout: a float32 step tensor, moments like (my part of) p
            self.state[p].update(step=torch.tensor(0.0), exp_avg=p.new_zeros(n), exp_avg_sq=p.new_zeros(n))
        return self.state[p]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        mine = []
        for param, _, lo, hi in self._mine:
            (beta1, beta2), lr, eps = group_of[param]["betas"], group_of[param]["lr"], group_of[param]["eps"]
            p = param.reshape(-1)[lo:hi].clone()
            g = param.grad.reshape(-1)[lo:hi] if param.grad is not None else torch.zeros_like(p)
            st = self._moments(param, hi - lo)
            st["step"] += 1
            step = int(st["step"].item())
            st["exp_avg"].lerp_(g, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
            denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(eps)
            mine.append(p.addcdiv_(st["exp_avg"], denom, value=-lr / bias1))
        # Everyone gets everyone's updated slice: padded to equal chunks for the all-gather.
        like = self.params[0]
        chunk = math.ceil(self.numel / self.world_size)
        padded = torch.zeros(chunk, dtype=like.dtype, device=like.device)
        if mine:
            padded[:self.end - self.start] = torch.cat(mine)
        gathered = torch.empty(chunk * self.world_size, dtype=like.dtype, device=like.device)
        all_gather_single(gathered, padded, group=self.group)
        offset = 0
        for param in self.params:
            param.copy_(gathered[offset:offset + param.numel()].view_as(param))
            offset += param.numel()

    @property
    def step_count(self) -> int:
        return int(self.state[self._mine[0][0]]["step"].item()) if self._mine and self.state[self._mine[0][0]] else 0

    def _flat(self, key: str) -> torch.Tensor:
        """My slice of one moment, end to end (zeros before the first step)."""
        return torch.cat([self.state[p][key] if self.state[p] else p.new_zeros(hi - lo)
                          for p, _, lo, hi in self._mine]) if self._mine else self.params[0].new_zeros(0)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "flat_shard": {"rank": self.rank, "world_size": self.world_size,
                                                       "start": self.start, "end": self.end, "numel": self.numel}}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("flat_shard")
        here = {"rank": self.rank, "world_size": self.world_size, "start": self.start, "end": self.end,
                "numel": self.numel}
        if saved is None:  # a per-parameter state (torch.optim.Adam's, whole tensors): keep my part of each
            where = {i: (lo, hi) for i, p in enumerate(self.params) for q, _, lo, hi in self._mine if q is p}
            state = {i: {k: v.reshape(-1)[slice(*where[i])] if torch.is_tensor(v) and v.dim() > 0 else v
                         for k, v in st.items()} for i, st in state_dict["state"].items() if i in where}
            state_dict, saved = {**state_dict, "state": state}, here
        if saved != here:
            raise ValueError(f"FlatShardedAdam state of rank {saved['rank']} of {saved['world_size']} (elements "
                             f"[{saved['start']}, {saved['end']}) of {saved['numel']}) cannot load into rank {self.rank} "
                             f"of {self.world_size} ([{self.start}, {self.end}) of {self.numel}): load this rank's own "
                             f"file, or reshard every rank's shard_state_dict() with load_shards()")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "flat_shard"})

    def shard_state_dict(self) -> dict:
        """This rank's slice of the moments, with the range it covers, and the hyperparameters
        (the learning rate an LR scheduler has set lives in ``param_groups``, not in the scheduler)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"step": self.step_count, "start": self.start, "end": self.end, "numel": self.numel,
                "param_groups": groups, "exp_avg": self._flat("exp_avg").cpu(), "exp_avg_sq": self._flat("exp_avg_sq").cpu()}

    def load_shards(self, shards: list[dict]) -> None:
        """Load the slices saved by *any* number of ranks (every rank passes all of them)."""
        if shards[0]["numel"] != self.numel:
            raise ValueError(f"saved optimizer state covers {shards[0]['numel']} parameters, "
                             f"this model has {self.numel}")
        for group, saved in zip(self.param_groups, shards[0]["param_groups"]):
            group.update(saved)
        if not shards[0]["step"]:
            return  # saved before the first step: no moments yet
        for key in ("exp_avg", "exp_avg_sq"):
            flat = reshard_flat([(s["start"], s["end"], s[key]) for s in shards], self.start, self.end)
            for (p, _, lo, hi), piece in zip(self._mine, flat.split([hi - lo for _, _, lo, hi in self._mine])):
                st = self._moments(p, hi - lo)
                st[key].copy_(piece)
                st["step"].fill_(shards[0]["step"])


# --------------------------------------------------------------------------- hung peers
def heartbeat(timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` arrives, at most ``timeout_s``; else name the missing ranks.

    Equivalent to: ``dist.barrier(group)``, which would wait for the full process-group timeout.
    Collective: every rank of ``group`` must call it; ``group`` must be a gloo group.
    Cost: W-1 small messages to rank 0 and back.
    Raises:
        PeerTimeoutError: on rank 0, naming every rank that did not arrive; on the
            others, saying rank 0 did not answer.
    """
    rank = dist.get_rank(group)  # noqa: F841 (rank: for TODO 4.7)
    # --- TODO 4.7: hung-peer heartbeat ---
    # Goal: return once every rank of `group` has arrived; after `timeout_s` without them,
    # raise PeerTimeoutError("rank {rank}: heartbeat timed out after {timeout_s:g} s: ...")
    # that keeps the backend's own message: on rank 0 it lists EVERY rank that did not come.
    # gloo only: an NCCL job passes a gloo side group.
    raise todo("4.7 hung-peer heartbeat", "guidelines.md#detecting-a-hung-peer")
    # --- end TODO 4.7 ---
