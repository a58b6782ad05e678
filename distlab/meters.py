"""Memory and overlap meters for the sharded wrappers (ZeRO-1/2, ZeRO-3/FSDP).

The wrappers call ``MemoryMeter.sample`` at every hook (each gradient arriving,
each unit gathered or freed, each collective launched or finished) with the
bytes they hold at that moment, so the *peak* during backward is recorded, not
only the state at rest. On GPU ``max_memory_allocated`` is reported beside it
(everything the allocator holds, activations included).

``OverlapMeter`` counts gradient hooks and collective launches inside one
backward: ``first_launch_hook`` is the index (1-based) of the gradient hook at
which the first reduce-scatter/all-reduce started; overlap means it is smaller
than ``hooks`` (the number of hooks in the backward), i.e. communication
started while autograd still had gradients to compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes actually held by ``t`` (0 for None or a tensor whose storage was freed)."""
    if t is None or t.untyped_storage().size() == 0:
        return 0
    return t.numel() * t.element_size()


@dataclass
class MemoryMeter:
    """Peak bytes per category ("params", "grads", "optimizer", ...) and of their sum."""

    peak: dict[str, int] = field(default_factory=dict)
    peak_total: int = 0
    samples: int = 0
    peak_cuda: int = 0

    def sample(self, **held: int) -> None:
        self.samples += 1
        for k, v in held.items():
            self.peak[k] = max(self.peak.get(k, 0), v)
        self.peak_total = max(self.peak_total, sum(held.values()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.peak_cuda = max(self.peak_cuda, torch.cuda.max_memory_allocated())

    def reset(self) -> None:
        self.peak, self.peak_total, self.samples, self.peak_cuda = {}, 0, 0, 0


@dataclass
class OverlapMeter:
    """Per backward: gradient hooks seen, collectives launched, and when the first one launched."""

    hooks: int = 0
    launches: int = 0
    first_launch_hook: int | None = None
    launched_before_end: int = 0    # collectives started before the last gradient hook ran
    history: list[dict[str, int | None]] = field(default_factory=list)

    def hook(self) -> None:
        """A gradient arrived: whatever launched so far started before this (maybe last) hook."""
        self.launched_before_end = self.launches
        self.hooks += 1

    def launch(self) -> None:
        self.launches += 1
        if self.first_launch_hook is None:
            self.first_launch_hook = self.hooks

    def end_backward(self) -> None:
        """Close one backward: record it in ``history`` and start counting the next."""
        self.history.append({"hooks": self.hooks, "launches": self.launches,
                             "first_launch_hook": self.first_launch_hook,
                             "launched_before_end": self.launched_before_end})
        self.hooks, self.launches, self.first_launch_hook, self.launched_before_end = 0, 0, None, 0
