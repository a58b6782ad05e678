"""Skipped steps in a row, for lesson 2.4's loss scaler: warn, then stop naming the non-finite gradient.

A skip or a few is a loss scale finding its level. A skip at *every* step is not an overflow:
the gradients are inf/nan whatever the scale (nan in the inputs, a log of 0), and a run would
end with loss nan without a word. ``SkipWatch`` counts the skips in a row: it warns at
``warn_at`` (group rank 0) and raises ``NonFiniteGradientsError`` at ``stop_at``, naming the
first non-finite gradient (by name when the parameters' names were given, else its index in
the optimizer) and the lowest rank that holds one. Given to the lesson ready-made
(solutions/phase2_advanced/mixed_precision.py), as torch's GradScaler has no such guard.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
import torch.distributed as dist


class NonFiniteGradientsError(RuntimeError):
    """Every step for ``stop_at`` steps in a row had inf/nan gradients: no scale cures that."""


class SkipWatch:
    """Counts a scaler's skipped steps in a row (see the module docstring).

    Args:
        warn_at: warn when this many steps in a row were skipped (>= 1).
        stop_at: raise at this many (None: never). 50 halvings take a scale of 2^16 to 2^-34:
            an fp16 overflow has long been cured by then.
        named_parameters: ``model.named_parameters()``, to name the gradient.
        group: the ranks that agree on every skip (None: WORLD when initialised).

    Collective when it stops: one ``all_gather_object`` of a short string per rank (every rank
    stops at the same step, since the ranks agreed on every skip).
    """

    def __init__(self, warn_at: int = 10, stop_at: int | None = 50,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 group: dist.ProcessGroup | None = None, who: str = "DynamicLossScaler") -> None:
        if warn_at < 1:
            raise ValueError(f"warn_skipped_steps must be >= 1, got {warn_at}")
        if stop_at is not None and stop_at < 1:
            raise ValueError(f"max_skipped_steps must be >= 1 (or None: never stop), got {stop_at}")
        self.warn_at, self.stop_at, self.group, self.who = warn_at, stop_at, group, who
        self.names = {id(p): name for name, p in (named_parameters or ())}
        self.in_a_row = 0

    def observe(self, skipped: bool, scale: float, optimizer: torch.optim.Optimizer | None) -> None:
        """Count this step's verdict; warn or raise as the counts say (``optimizer`` holds the gradients)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        n = self.in_a_row
        if self.stop_at is not None and n >= self.stop_at:
            raise NonFiniteGradientsError(
                f"{self.who}: {n} steps in a row skipped for inf/nan gradients (max_skipped_steps={self.stop_at}), "
                f"the scale down to {scale:g}: no scale makes them finite; {self.first_non_finite(optimizer)}. "
                "Check the inputs and the loss for nan/inf (torch.isfinite), or raise max_skipped_steps")
        if n == self.warn_at and (not dist.is_initialized() or dist.get_rank(self.group) == 0):
            stop = f"stops at {self.stop_at}" if self.stop_at else "never stops (max_skipped_steps=None)"
            warnings.warn(f"{self.who}: {n} steps in a row skipped for inf/nan gradients, at scale {scale:g}; if "
                          f"every step overflows, the inputs or the loss hold nan/inf (the scaler {stop})",
                          RuntimeWarning, stacklevel=4)

    def first_non_finite(self, optimizer: torch.optim.Optimizer | None) -> str:
        """Where the first inf/nan gradient is: in optimizer order, on the lowest rank that has one."""
        mine, index = None, 0
        for param_group in optimizer.param_groups if optimizer is not None else []:
            for p in param_group["params"]:
                if mine is None and p.grad is not None and not torch.isfinite(p.grad).all():
                    kind = "nan" if torch.isnan(p.grad).any() else "inf"
                    mine = f"{self.names.get(id(p), f'parameter {index} of the optimizer')} {tuple(p.shape)} ({kind})"
                index += 1
        if not dist.is_initialized():
            return f"the first non-finite gradient is {mine}" if mine else "no gradient is non-finite any more"
        found: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(found, mine, group=self.group)  # once, when the run stops
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r
                 for r, f in enumerate(found) if f]
        if not ranks:
            return "no rank holds a non-finite gradient any more (freed after unscale_?)"
        also = f" (ranks {', '.join(map(str, ranks[1:]))} have one too)" if len(ranks) > 1 else ""
        return f"the first non-finite gradient is {next(f for f in found if f)} on rank {ranks[0]}{also}"
