# Generated from solutions/phase2_advanced/model_split.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Naive model parallelism: consecutive layers on consecutive ranks, one batch at a time.

A model too big for one device is cut into p consecutive stages; rank s holds
stage s. Forward passes the activation down the line with ``send``/``recv``;
backward passes the gradient of each activation back up:

    forward    rank 0 --x1--> rank 1 --x2--> rank 2 --> loss
    backward   rank 0 <-dx1-- rank 1 <-dx2-- rank 2 <-- loss.backward()

Autograd does not cross process boundaries, so each stage makes its received
activation a leaf that requires grad; after its local backward, that leaf's
``.grad`` is exactly what the previous stage needs to continue.

Only one rank computes at a time: the others wait (p-1)/p of the step. Pipelining
(pipeline.py) cuts the batch into micro-batches to fill that idle time.

Cost per step, per stage boundary: one activation forward and one gradient
backward (batch x hidden x bytes each); memory per rank: 1/p of the parameters.
See phase2_advanced/guidelines_model_parallel.md#naive-model-split.

Run: ``RUN_MODE=model_split ./entrypoint.sh`` (an MLP on digits, one stage per rank;
``IMPL=templates RUN_MODE=model_split ./entrypoint.sh`` runs your template).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab import p2p  # noqa: F401 (p2p: for TODO 2.10, 2.11)
from distlab.todo import todo


def forward_stage(module: nn.Module, x: torch.Tensor | None, recv_shape: tuple[int, ...],
                  dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the forward pass; returns (stage input, stage output).

    Args:
        x: the batch (stage 0 only; None elsewhere).
        recv_shape: the shape of the activation this stage receives (stages > 0).

    Equivalent to: the matching slice of ``full_model(x)``.
    Collective: every stage of ``group`` calls it, in order (each waits for its predecessor).
    Cost: stage s < p-1 sends its output once (|activation| bytes); stage s > 0 receives once.
    """
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)  # noqa: F841 (num_stages: for TODO 2.10)
    device = next(module.parameters()).device
    buf = torch.empty(recv_shape, dtype=dtype, device=device) if stage > 0 else None  # noqa: F841 (buf: for TODO 2.10)
    # --- TODO 2.10: model split forward ---
    # Goal: return (inp, out): this stage's input and its layers' output. Stage 0's input
    # is `x`; any other stage's comes from stage - 1 (into `buf`) and must let backward
    # recover dL/d(input). Every stage but the last hands its output on to stage + 1.
    # Contract: each send here is matched by the neighbour's recv (same shape and dtype);
    # stages are group ranks (`p2p.send(t, stage + 1, group)`, `p2p.recv(buf, stage - 1, group)`).
    raise todo("2.10 model split forward", "guidelines_model_parallel.md#naive-model-split")
    # --- end TODO 2.10 ---
    return inp, out  # noqa: F821 (inp, out: set by TODO 2.10)


def backward_stage(inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """This rank's part of the backward pass (on the last stage, ``out`` is the loss).

    Equivalent to: ``loss.backward()`` of the unsplit model, for this stage's parameters.
    Collective: every stage calls it, the last first (each waits for its successor).
    Cost: stage s > 0 sends dL/d(input) once; stage s < p-1 receives dL/d(output) once.
    """
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    grad = torch.empty_like(out) if stage < num_stages - 1 else None  # dL/d(out), from stage + 1  # noqa: F841 (grad: for TODO 2.11)
    # --- TODO 2.11: model split backward ---
    # Goal: fill the .grad of this stage's parameters as the unsplit model's backward would.
    # The last stage starts from its scalar loss; the others need dL/d(out) from stage + 1.
    # Every stage but the first then owes stage - 1 the gradient of its own input.
    # Contract: the mirror image of 2.10 (each send matched by the neighbour's recv).
    raise todo("2.11 model split backward", "guidelines_model_parallel.md#naive-model-split")
    # --- end TODO 2.11 ---


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
               x: torch.Tensor | None, y: torch.Tensor | None, recv_shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None) -> float | None:
    """One step of the split model; returns the loss on the last stage, None elsewhere.

    ``x`` is read on stage 0 and ``y`` on the last stage; each stage updates its own parameters.
    """
    is_last = dist.get_rank(group) == dist.get_world_size(group) - 1
    optimizer.zero_grad(set_to_none=True)
    inp, out = forward_stage(module, x, recv_shape, dtype, group)
    if is_last:
        out = loss_fn(out, y)
    backward_stage(inp, out, group)
    optimizer.step()
    return out.item() if is_last else None
