# Generated from solutions/phase2_advanced/mixed_precision.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Mixed precision: low-precision compute, fp32 master weights, a dynamic loss scaler.

Matrix multiplies run in bf16 or fp16 (``torch.autocast`` casts each op's inputs),
while the parameters, their gradients and the optimizer stay in fp32: the *master
weights*. An update of 1e-4 to a weight of 1.0 survives in fp32 but vanishes in
bf16 (8 bits of mantissa: 1 + 2^-9 rounds to 1).

fp16 has 10 bits of mantissa but only 5 of exponent: gradients below ~6e-8 flush
to zero. The loss scaler multiplies the loss by S (say 2^16) before backward, so
every gradient is S times larger and stays representable, then divides the fp32
gradients by S before the step. S is *dynamic*: when a step produces inf/nan
(overflow), the step is skipped and S halves; after ``growth_interval`` clean steps
in a row, S doubles. bf16 has fp32's exponent range and rarely needs scaling.

A skip at *every* step is not an overflow: the gradients are inf/nan whatever the
scale. The scaler warns after ``warn_skipped_steps`` skips in a row and stops after
``max_skipped_steps``, naming the first non-finite gradient (``distlab.lessons.skips``, given).

With data parallelism every rank must make the same skip decision, or replicas
diverge: the scaler all-reduces its found-inf flag (MAX, 4 bytes). After a full
gradient all-reduce the ranks agree anyway (an inf anywhere spreads through the
sum), but not when each rank checks different gradients (ZeRO shards, tensor or
pipeline parallelism), nor when a rank checks before communicating.

Cost per step: the gradient all-reduce in fp32 (|params| x 4 bytes) + 4 bytes for
the found-inf flag. See phase2_advanced/guidelines.md#mixed-precision.

Run the demo: ``RUN_MODE=mixed_precision ./entrypoint.sh`` (TinyGPT, fp32 vs bf16 vs fp16;
``IMPL=templates`` runs your template).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.lessons.skips import NonFiniteGradientsError, SkipWatch  # noqa: F401 (the error update() raises)
from distlab.todo import todo


def _fp32(x: float) -> float:
    """Round to the nearest float32, as GradScaler keeps its scale in a float32 tensor."""
    return torch.tensor(x, dtype=torch.float32).item()


class DynamicLossScaler:
    """Scale the loss up, unscale the gradients, skip steps that overflowed, adapt the scale.

    Usage (the same four calls as ``torch.amp.GradScaler``)::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)      # optional: step() calls it if you did not
        scaler.step(optimizer)          # skipped if any gradient is inf/nan on any rank
        scaler.update()                 # back off after an overflow, grow after a clean run

    Args:
        init_scale: the first scale S.
        growth_factor: S *= growth_factor after ``growth_interval`` clean steps in a row.
        backoff_factor: S *= backoff_factor after a step with inf/nan.
        growth_interval: clean steps needed before growing.
        group: the ranks that must agree on skipping (None: WORLD when initialised).
        warn_skipped_steps, max_skipped_steps, named_parameters: warn at that many skips in a row,
            raise ``NonFiniteGradientsError`` at that many (None: never), naming the first non-finite
            gradient by its name (``distlab.lessons.skips.SkipWatch``).

    Equivalent to: ``torch.amp.GradScaler`` with the same arguments: same scales,
        same skipped steps, same parameters.
    Collective: ``unscale_`` (and so ``step``) must be called by every rank of ``group``;
        so must ``update``, which gathers one string per rank when it stops the run.
    Cost: one all-reduce of 4 bytes per step.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group: dist.ProcessGroup | None = None,
                 warn_skipped_steps: int = 10, max_skipped_steps: int | None = 50,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        if init_scale <= 0 or not math.isfinite(init_scale):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale_value = _fp32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        self.growth_tracker = 0           # clean steps in a row since the last change
        self.found_inf: bool | None = None  # this step's verdict; None until unscale_
        self.skips = SkipWatch(warn_skipped_steps, max_skipped_steps, named_parameters, group)
        self._optimizer: torch.optim.Optimizer | None = None  # the last unscale_'s: its gradients are diagnosed

    def get_scale(self) -> float:
        return self.scale_value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: backward through it makes every gradient S times larger."""
        return loss * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by S in place and decide, with every rank, whether to skip.

        Collective: every rank of ``self.group`` must call it (the found-inf all-reduce).
        """
        if self.found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        self._optimizer = optimizer
        # GradScaler multiplies by a float32 reciprocal; for powers of two it is exact.
        inv_scale = 1.0 / self.scale_value  # noqa: F841 (inv_scale: for TODO 2.3)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = _comm_device(self.group) if dist.is_initialized() else (grads[0].device if grads else "cpu")
        found = torch.zeros(1, device=device)  # noqa: F841 (found: for TODO 2.3)
        # --- TODO 2.3: unscale and agree on overflow ---
        # Goal: multiply every gradient in `grads` by inv_scale, in place (even after an overflow,
        # as GradScaler does), and set self.found_inf to whether any gradient on ANY rank of
        # self.group held inf or nan (`found`: this rank's flag, on the device that communicates).
        # Read the verdict on the host ONCE per step: a check per gradient (`if not
        # isfinite(g).all()`) makes the CPU wait for the GPU once per parameter.
        # Collective: when torch.distributed is initialised, every rank of self.group joins one
        # 4-byte agreement; gloo reduces CPU tensors, NCCL CUDA ones (_comm_device).
        raise todo("2.3 unscale and agree on overflow", "guidelines.md#mixed-precision")
        # --- end TODO 2.3 ---

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless a gradient overflowed on some rank; returns whether it stepped."""
        if self.found_inf is None:
            self.unscale_(optimizer)
        # --- TODO 2.4a: skip the step on overflow ---
        # Goal: step the optimizer only if no rank overflowed this step; return whether it stepped.
        raise todo("2.4a skip the step on overflow", "guidelines.md#mixed-precision")
        # --- end TODO 2.4a ---

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps; start a new step."""
        if self.found_inf is None:
            raise RuntimeError("update() needs a step: call unscale_() or step() first")
        self.skips.observe(bool(self.found_inf), self.scale_value, self._optimizer)  # warn, or stop the run
        # --- TODO 2.4b: back off or grow the scale ---
        # Goal: adapt the scale as torch.amp.GradScaler does: shrink it after an overflow; grow
        # it after growth_interval clean steps in a row (never to inf); keep every new scale a
        # float32 value. Then forget this step's verdict, so the next step starts fresh.
        raise todo("2.4b back off or grow the scale", "guidelines.md#mixed-precision")
        # --- end TODO 2.4b ---


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL communicates CUDA tensors only ("nccl", or "cpu:gloo,cuda:nccl": CUDA too); gloo CPU ones."""
    if "nccl" in dist.get_backend(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allreduce_gradients_fp32(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average every gradient over the ranks, summing in fp32 whatever the gradient's dtype.

    Under autocast the gradients of fp32 master weights are already fp32. A model
    cast to bf16/fp16 has low-precision gradients; they are upcast for the sum.
    Why not all-reduce bf16 directly (half the bytes)? Measured with torch 2.14:
    gloo accepts bf16 and fp16 for all_reduce (SUM, AVG, MAX) but adds in that dtype:
    [256, 0.75, 0.75, -256] on 4 ranks summed to 0, 0.75, 1.5, 1.75 or 2 depending
    on the rank order and the element (exact: 1.5). NCCL also reduces bf16 in bf16.

    Equivalent to: Phase 1's ``allreduce_gradients``.
    Collective: every rank of ``group`` must call it.
    Cost: |params| x 4 bytes per step (fp32), not x 2.
    """
    world_size = dist.get_world_size(group)  # noqa: F841 (world_size: for TODO 2.5a)
    for p in model.parameters():
        if p.grad is None:
            continue
        # --- TODO 2.5a: fp32 gradient all-reduce ---
        # Goal: replace p.grad by its mean over the ranks of `group`, with the sum computed in
        # fp32 even when p.grad is bf16/fp16 (p.grad keeps its own dtype).
        # Collective: every rank reduces the same parameters, in the same order.
        raise todo("2.5a fp32 gradient all-reduce", "guidelines.md#mixed-precision")
        # --- end TODO 2.5a ---


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               inputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, bool]:
    """One mixed-precision data-parallel step on this rank's shard.

    Args:
        model: an fp32 replica (its parameters are the master weights).
        scaler: a ``DynamicLossScaler`` or a ``torch.amp.GradScaler`` (same four calls).
        dtype: the autocast compute dtype (bf16 or fp16; fp16 on CPU needs torch >= 2.1);
            float32 turns autocast off (the fp32 reference).

    Returns:
        (the local loss, detached; whether the optimizer stepped).

    Equivalent to: single-process autocast + GradScaler on the global batch, up to
        the rounding of low-precision sums over a shard instead of the whole batch.
    Collective: every rank must call it.
    Cost: |params| x 4 bytes (fp32 gradient all-reduce) + the scaler's 4 bytes.
    """
    optimizer.zero_grad(set_to_none=True)
    # --- TODO 2.5b: mixed-precision data-parallel step ---
    # Goal: forward and loss computed in `dtype` (autocast; off for float32), backward of the
    # scaled loss, gradients averaged over `group` in fp32, then the scaler's step and update.
    # Leave `loss` (the unscaled local loss) and `scale` (the scale before update) for the
    # return line: a skipped step is one after which the scale backed off.
    # Collective: every rank must call it (gradient all-reduce, the scaler's agreement).
    raise todo("2.5b mixed-precision data-parallel step", "guidelines.md#mixed-precision")
    # --- end TODO 2.5b ---
    # The scale backs off exactly when the step was skipped (GradScaler.step returns
    # None either way, so ask the scale).
    return loss.detach(), scaler.get_scale() >= scale  # noqa: F821 (loss, scale: set by TODO 2.5b)

