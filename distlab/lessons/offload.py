"""ZeRO-Offload's pre-written plumbing (Ren et al. 2021) for phase3_multi_node/zero.py.

The inner optimizer is built on copies of this rank's chunks on the offload device, so its
state and its step live there. Around every inner step (hooks, wherever ``step`` is called
from) the gradient chunks move there once and the updated chunks come back once, before the
all-gather: Psi / W bytes each way per rank. When the model is on CUDA and the offload device
is the CPU, the copies use pinned host memory (a path not yet run on a GPU).
Guide: phase3_multi_node/guidelines_ddp_zero.md#zero-offload-and-deepspeed-style-configs.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlab.metrics import nbytes


class OffloadedShards:
    """Copies of ``shards`` (a rank's flat chunks) and their gradient buffers on ``device``."""

    def __init__(self, shards: list[torch.Tensor], device: torch.device) -> None:
        self.shards = shards
        # Pinned host memory lets the copies to and from a GPU run asynchronously (non_blocking).
        self.pin = device.type == "cpu" and shards[0].device.type == "cuda"
        self.masters, self.grads = [], []
        for s in shards:  # a reused gradient buffer per chunk: pinning memory is slow
            m = torch.empty(s.shape, dtype=s.dtype, device=device, pin_memory=self.pin)
            self.masters.append(nn.Parameter(m.copy_(s.detach())))
            self.grads.append(torch.empty(s.shape, dtype=s.dtype, device=device, pin_memory=self.pin))

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """``groups`` (on the shards, in order) with the copies in place of the shards."""
        masters = iter(self.masters)
        return [{**g, "params": [next(masters) for _ in g["params"]]} for g in groups]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the gradients before, and the parameters back after, every step of ``optimizer``;
        re-copy the chunks after every ``load_state_dict`` (called after the model's was loaded)."""
        optimizer.register_step_pre_hook(self.grads_to_offload)
        optimizer.register_step_post_hook(self.params_from_offload)
        optimizer.register_load_state_dict_post_hook(self.masters_from_model)

    def grads_to_offload(self, *_) -> None:
        """Before the inner step: the gradient chunks move to the offload device (Psi / W bytes)."""
        for s, m, buf in zip(self.shards, self.masters, self.grads):
            m.grad = None if s.grad is None else buf.copy_(s.grad, non_blocking=self.pin)
        if self.pin:  # the CPU reads them next: wait for the device-to-host copies
            torch.cuda.current_stream(self.shards[0].device).synchronize()

    def params_from_offload(self, *_) -> None:
        """After it: the updated chunks go back into the buckets, before step's all-gather."""
        for s, m in zip(self.shards, self.masters):  # queued before the all-gather on the same stream
            s.detach().copy_(m.detach(), non_blocking=self.pin)

    def masters_from_model(self, *_) -> None:
        """After the model's parameters were loaded: the offloaded copies follow them."""
        for s, m in zip(self.shards, self.masters):
            m.detach().copy_(s.detach())

    def nbytes(self) -> int:
        """Bytes of the copies and their gradient buffers (the optimizer's state is counted apart)."""
        return sum(nbytes(m) + nbytes(g) for m, g in zip(self.masters, self.grads))
