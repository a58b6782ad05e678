# Generated from solutions/phase4_production/compression.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Gradient compression as communication hooks: fewer bytes per step, nearly the same model.

Data parallelism all-reduces every gradient every step: |params| x 4 bytes (fp32)
per rank, which on a slow network is the step time. A *communication hook* replaces
that all-reduce. The contract is PyTorch DDP's ``register_comm_hook``:

    hook(state, bucket) -> torch.futures.Future[Tensor]

``bucket.buffer()`` is one flat tensor holding the gradients of several parameters
(``bucket.gradients()`` are views of it, ``bucket.index()`` tells buckets apart,
useful for per-bucket state); the future's value is the *averaged* flat gradient.
(No ``from __future__ import annotations`` here: DDP checks that a hook's return
annotation is the object ``torch.futures.Future[torch.Tensor]``, not a string.)
The same hooks plug into torch DDP (``ddp.register_comm_hook(state, hook)``) and
into a hand-written DDP that hands them a ``SimpleBucket`` (``apply_hook``).

| method              | bytes sent per rank (n = bucket elements)        | vs fp32 all-reduce |
|---------------------|--------------------------------------------------|--------------------|
| fp16 / bf16 cast    | all-reduce of n x 2 bytes                          | 1/2                |
| top-k, k = ratio n  | all-gather of k values + k int32 indices           | k(e+4) / (4n)      |
| PowerSGD, rank r    | all-reduce of P (a x r) and Q (b x r) per a x b matrix; vectors as they are | r(a+b) / ab |

Lossy methods keep what they did not send (**error feedback**, Seide et al. 2014;
Karimireddy et al. 2019) and add it to the next step's gradient, so nothing is lost,
only delayed. PowerSGD (Vogels et al., NeurIPS 2019) is one step of power iteration
per training step, **warm-started** from the previous step's Q.
See phase4_production/guidelines.md#gradient-compression; the demo, bytes per step and
accuracy per method: ``RUN_MODE=compression ./entrypoint.sh``.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_single  # noqa: F401 (all_gather_single: for TODO 4.9)
from distlab.todo import todo


def _matching(saved: dict, key, like_shape) -> torch.Tensor | None:
    """``saved[key]`` if it has ``like_shape``, else None.

    State is kept per bucket index, but torch's DDP rebuilds its buckets after the first
    step (in the order gradients actually arrived), so index i may then hold other
    parameters: state of another shape belongs to the old layout and is dropped.
    """
    t = saved.get(key)
    return t if t is not None and t.shape == like_shape else None


def _split(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:  # views: writing them writes flat
    out, offset = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def _completed(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


class SimpleBucket:
    """The parts of ``dist.GradBucket`` a hook uses, for a hand-written DDP and for tests.

    ``buffer`` is the flat gradient; ``params`` are the parameters whose gradients it
    holds, end to end in this order.
    """

    def __init__(self, index: int, buffer: torch.Tensor, params: list[torch.nn.Parameter],
                 is_last: bool = True) -> None:
        if buffer.numel() != (total := sum(p.numel() for p in params)):
            raise ValueError(f"bucket buffer has {buffer.numel()} elements but its parameters have {total}")
        self._index, self._buffer, self._params, self._is_last = index, buffer, params, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return _split(self._buffer, [p.shape for p in self._params])

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return self._is_last


def apply_hook(model: nn.Module, hook, state, bucket_index: int = 0) -> None:
    """Average ``model``'s gradients with ``hook`` (one bucket holding every gradient).

    Equivalent to: torch DDP with ``register_comm_hook(state, hook)`` and one bucket.
    Collective: every rank must call it.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    averaged = hook(state, SimpleBucket(bucket_index, flat, params)).wait()
    for p, mean in zip(params, _split(averaged, [p.shape for p in params])):
        p.grad.copy_(mean)


# --------------------------------------------------------------------------- baseline
def allreduce_hook(group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The uncompressed baseline: mean all-reduce of the bucket (what DDP does without a hook).

    Collective: every rank of ``group``. Cost: n x element size bytes, all-reduced.
    """
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# --------------------------------------------------------------------------- casting
def _cast_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket,
               dtype: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()  # noqa: F841 (buffer: for TODO 4.8)
    # --- TODO 4.8: fp16/bf16 compression ---
    # Goal: a future whose value is `buffer` itself (in place, its own dtype) holding the mean over
    # `group`, sent in `dtype` (n x 2 bytes, one asynchronous all-reduce) without overflowing 65504.
    # Divide before the cast: W fp16 gradients summed could overflow 65504; their means cannot.
    raise todo("4.8 fp16/bf16 compression", "guidelines.md#gradient-compression")
    # --- end TODO 4.8 ---


def fp16_compress_hook(group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in float16: half the bytes, ~3 significant digits.

    Equivalent to: ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``.
    Collective: every rank of ``group``. Cost: n x 2 bytes all-reduced.
    """
    return _cast_hook(group, bucket, torch.float16)


def bf16_compress_hook(group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16: half the bytes, fp32's range, ~2 significant digits.

    Collective: every rank of ``group``. Cost: n x 2 bytes all-reduced.
    """
    return _cast_hook(group, bucket, torch.bfloat16)


# --------------------------------------------------------------------------- top-k
@dataclass
class TopKState:
    """Top-k settings and, per bucket index, the residual not sent yet (error feedback)."""

    ratio: float = 0.01
    group: dist.ProcessGroup | None = None
    error_feedback: bool = True
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")


def topk_hook(state: "TopKState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send only the k = ceil(ratio x n) largest-magnitude entries of (gradient + residual).

    Every rank all-gathers the others' (values, indices) and scatter-adds them: the
    result is the mean of the W sparse vectors. What was not sent stays in
    ``state.residuals[bucket.index()]`` and is added to the next step's gradient.

    Collective: every rank of ``state.group``.
    Cost: all-gather of k values and k int32 indices per rank: k (element size + 4) bytes.
    """
    buffer = bucket.buffer()
    n, world_size = buffer.numel(), dist.get_world_size(state.group)
    k = max(1, min(n, math.ceil(state.ratio * n)))
    all_values = torch.empty(world_size * k, dtype=buffer.dtype, device=buffer.device)  # noqa: F841 (all_values: for TODO 4.9)
    all_indices = torch.empty(world_size * k, dtype=torch.int32, device=buffer.device)  # noqa: F841 (all_indices: for TODO 4.9)
    # --- TODO 4.9: top-k with error feedback ---
    # Goal: `buffer` becomes the mean over ranks of each rank's sparse vector: the k entries of
    # largest magnitude of (its gradient + its residual, found by `_matching`). With error feedback,
    # what was not sent is the bucket's new residual. Per rank on the wire: k values, k int32 indices.
    raise todo("4.9 top-k with error feedback", "guidelines.md#top-k-with-error-feedback")
    # --- end TODO 4.9 ---
    return _completed(buffer)


# --------------------------------------------------------------------------- PowerSGD
@dataclass
class PowerSGDState:
    """PowerSGD settings and per-bucket state: error feedback and warm-started Q per matrix."""

    rank: int = 2
    group: dist.ProcessGroup | None = None
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    qs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    # Reduced QR: columns of the result are an orthonormal basis of P's column space.
    # Every rank holds the same P (after the all-reduce), so every rank gets the same basis.
    return torch.linalg.qr(p, mode="reduced").Q


def powersgd_hook(state: "PowerSGDState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Rank-r approximation of every matrix gradient of the bucket by one warm-started power iteration.

    For each gradient viewed as an a x b matrix M (with error feedback: M + error):
    P = mean over ranks of M Q; P = orthonormal(P); Q = mean over ranks of M^T P; M ~ P Q^T.
    Vectors (biases) and matrices too small to gain are all-reduced uncompressed.

    Equivalent to: ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (1 power iteration).
    Collective: every rank of ``state.group``.
    Cost: three all-reduces: r(a + b) elements per compressed matrix, the rest as they are.
    """
    buffer = bucket.buffer()
    world_size, r, idx = dist.get_world_size(state.group), state.rank, bucket.index()  # noqa: F841 (idx: for TODO 4.10a, 4.10b)
    grads = bucket.gradients()  # views of `buffer`: writing them writes the bucket
    mats = [(i, g.view(g.shape[0], -1)) for i, g in enumerate(grads)
            if g.dim() > 1 and r * (g.shape[0] + g[0].numel()) < g.numel()]
    rest = [g for i, g in enumerate(grads) if i not in dict(mats)]  # vectors, small matrices
    # --- TODO 4.10a: PowerSGD (error feedback in) ---
    # Goal: with error feedback, add this bucket's saved error (if `_matching` finds one of this
    # shape) to `buffer`, and keep `compensated`: a copy of what this rank means to send (None
    # without error feedback), for 4.10b.
    raise todo("4.10a PowerSGD (error feedback in)", "guidelines.md#powersgd")
    # --- end TODO 4.10a ---
    if rest:  # uncompressed, one all-reduce for all of them
        flat = torch.cat([g.reshape(-1) for g in rest])
        dist.all_reduce(flat, group=state.group)
        for g, mean in zip(rest, _split(flat / world_size, [g.shape for g in rest])):
            g.copy_(mean)
    # --- TODO 4.10b: PowerSGD (power iteration, error out) ---
    # Goal: each matrix m of `mats` (a x b) becomes P Q^T, the rank-r approximation of the mean over
    # ranks of m, by one power iteration: two all-reduces in all (every P, then every Q); Q warm-
    # started from `state.qs[(idx, i)]`, else seeded state.seed + 1000 * idx + i (one Q on all ranks).
    # Then, with error feedback, the bucket's error = what this rank meant to send - what all agreed on.
    raise todo("4.10b PowerSGD (power iteration, error out)", "guidelines.md#powersgd")
    # --- end TODO 4.10b ---
    return _completed(buffer)


# --------------------------------------------------------------------------- by name
def make_hook(method: str, group: dist.ProcessGroup | None = None):
    """(hook, state) for a method name: ddp (torch DDP's own all-reduce, no hook), none, fp16, bf16, topk, powersgd."""
    makers = {"ddp": lambda: (None, None), "none": lambda: (allreduce_hook, group),
              "fp16": lambda: (fp16_compress_hook, group), "bf16": lambda: (bf16_compress_hook, group),
              "topk": lambda: (topk_hook, TopKState(ratio=0.1, group=group)),
              "powersgd": lambda: (powersgd_hook, PowerSGDState(rank=2, group=group))}
    if method not in makers:
        raise ValueError(f"unknown method {method!r}; choose ddp, none, fp16, bf16, topk or powersgd")
    return makers[method]()
