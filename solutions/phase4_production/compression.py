"""Gradient compression as communication hooks: fewer bytes per step, nearly the same model.

Data parallelism all-reduces every gradient every step: |params| x 4 bytes (fp32)
per rank, which on a slow network is the step time. A *communication hook* replaces
that all-reduce. The contract is PyTorch DDP's ``register_comm_hook``:

    hook(state, bucket) -> torch.futures.Future[Tensor]

``bucket.buffer()`` is one flat tensor holding the gradients of several parameters
(``bucket.gradients()`` are views of it, ``bucket.index()`` tells buckets apart,
useful for per-bucket state); the future's value is the *averaged* flat gradient.
(Hooks carry real annotations, not ``from __future__ import annotations`` strings:
DDP checks that the return annotation is ``torch.futures.Future[torch.Tensor]``.)
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
See phase4_production/guidelines.md#gradient-compression.

Run: ``RUN_MODE=compression ./entrypoint.sh`` (bytes per step and accuracy per method).
"""
import argparse
import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_single


def _matching(saved: dict, key, like_shape) -> torch.Tensor | None:
    """``saved[key]`` if it has ``like_shape``, else None.

    State is kept per bucket index, but torch's DDP rebuilds its buckets after the first
    step (in the order gradients actually arrived), so index i may then hold other
    parameters: state of another shape belongs to the old layout and is dropped.
    """
    t = saved.get(key)
    return t if t is not None and t.shape == like_shape else None


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
        if buffer.numel() != sum(p.numel() for p in params):
            raise ValueError(f"bucket buffer has {buffer.numel()} elements but its parameters have "
                             f"{sum(p.numel() for p in params)}")
        self._index, self._buffer, self._params, self._is_last = index, buffer, params, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

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
    offset = 0
    for p in params:
        p.grad.copy_(averaged[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


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
    buffer = bucket.buffer()
    # Divide before the cast: W fp16 gradients summed could overflow 65504; their means cannot.
    compressed = buffer.div(dist.get_world_size(group)).to(dtype)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value()[0])  # back to the buffer's dtype, in place
        return buffer

    return fut.then(decompress)


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
    residual = _matching(state.residuals, bucket.index(), buffer.shape)
    compensated = buffer + residual if (state.error_feedback and residual is not None) else buffer.clone()
    indices = compensated.abs().topk(k, sorted=False).indices
    values = compensated[indices]
    if state.error_feedback:
        state.residuals[bucket.index()] = compensated.index_fill(0, indices, 0)  # compensated - sent
    all_values = torch.empty(world_size * k, dtype=values.dtype, device=values.device)
    all_indices = torch.empty(world_size * k, dtype=torch.int32, device=values.device)
    all_gather_single(all_values, values, group=state.group)
    all_gather_single(all_indices, indices.to(torch.int32), group=state.group)
    buffer.zero_().index_add_(0, all_indices.long(), all_values).div_(world_size)
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
    world_size, r, idx = dist.get_world_size(state.group), state.rank, bucket.index()
    error = _matching(state.errors, idx, buffer.shape)
    if state.error_feedback and error is not None:
        buffer.add_(error)
    compensated = buffer.clone() if state.error_feedback else None
    grads = bucket.gradients()
    mats = [(i, g.view(g.shape[0], -1)) for i, g in enumerate(grads)
            if g.dim() > 1 and r * (g.shape[0] + g[0].numel()) < g.numel()]
    compressed = {i for i, _ in mats}
    rest = [g for i, g in enumerate(grads) if i not in compressed]
    if rest:  # uncompressed: one all-reduce for all of them
        flat = torch.cat([g.reshape(-1) for g in rest])
        dist.all_reduce(flat, group=state.group)
        flat /= world_size
        offset = 0
        for g in rest:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    if mats:
        qs = []
        for i, m in mats:
            q = _matching(state.qs, (idx, i), (m.shape[1], r)) if state.warm_start else None
            if q is None:  # the same seed on every rank: P = sum of M_w Q needs one shared Q
                gen = torch.Generator().manual_seed(state.seed + 1000 * idx + i)
                q = torch.randn(m.shape[1], r, generator=gen, dtype=m.dtype).to(m.device)
            qs.append(q)
        ps = [m @ q for (_, m), q in zip(mats, qs)]
        flat_p = torch.cat([p.reshape(-1) for p in ps])
        dist.all_reduce(flat_p, group=state.group)  # sum of M_w Q over ranks
        flat_p /= world_size
        ps = [_orthonormalize(p) for p in _split(flat_p, [p.shape for p in ps])]
        qs = [m.t() @ p for (_, m), p in zip(mats, ps)]
        flat_q = torch.cat([q.reshape(-1) for q in qs])
        dist.all_reduce(flat_q, group=state.group)  # sum of M_w^T P over ranks
        flat_q /= world_size
        qs = _split(flat_q, [q.shape for q in qs])
        for (i, m), p, q in zip(mats, ps, qs):
            m.copy_(p @ q.t())  # writes through the view into the bucket buffer
            state.qs[(idx, i)] = q  # warm start: next step's power iteration starts here
    if state.error_feedback:
        state.errors[idx] = compensated - buffer  # what this rank meant to send minus what all agreed on
    return _completed(buffer)


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


# --------------------------------------------------------------------------- demo
def make_hook(method: str, group: dist.ProcessGroup | None = None):
    """(hook, state) for a method name: ddp (torch DDP's own all-reduce, no hook), none, fp16, bf16, topk, powersgd."""
    if method == "ddp":
        return None, None
    if method == "none":
        return allreduce_hook, group
    if method == "fp16":
        return fp16_compress_hook, group
    if method == "bf16":
        return bf16_compress_hook, group
    if method == "topk":
        return topk_hook, TopKState(ratio=0.1, group=group)
    if method == "powersgd":
        return powersgd_hook, PowerSGDState(rank=2, group=group)
    raise ValueError(f"unknown method {method!r}; choose ddp, none, fp16, bf16, topk or powersgd")


def train_digits(method: str, rank: int, world_size: int, epochs: int = 4, global_batch: int = 64,
                 lr: float = 0.1, seed: int = 0, hook_and_state: tuple | None = None) -> dict:
    """Train an MLP on digits under torch DDP with ``method``'s hook (or ``hook_and_state``).

    Returns the median bytes per step this rank sent through ``torch.distributed`` (hooks
    that start uncompressed, like torch's PowerSGD, count from their steady state) and
    the test accuracy.
    """
    from distlab.comm import CommLedger
    from distlab.data import digits

    train, test = digits("train", flatten=True), digits("test", flatten=True)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    hook, state = hook_and_state or make_hook(method)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    x, y = train.tensors
    per_rank = global_batch // world_size
    ledger, per_step = CommLedger(), []
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(y) - global_batch + 1, global_batch):
            idx = perm[start + rank * per_rank:start + (rank + 1) * per_rank]
            optimizer.zero_grad(set_to_none=True)
            with ledger:  # the hooks run inside backward
                nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            optimizer.step()
            per_step.append(ledger.bytes())
            ledger.reset()
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    return {"method": method, "bytes_per_step": statistics.median(per_step), "accuracy": accuracy,
            "steps": len(per_step)}


def main(argv: list[str] | None = None) -> None:
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0

    parser = argparse.ArgumentParser(description="Gradient compression hooks under torch DDP on digits.")
    parser.add_argument("--methods", nargs="+", default=["none", "fp16", "bf16", "topk", "powersgd"])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        rows = []
        for method in args.methods:
            result = train_digits(method, env.rank, env.world_size, epochs=args.epochs)
            rows.append(result)
            log0(f"{method:>9}: {format_bytes(result['bytes_per_step'])}/step, accuracy {result['accuracy']:.1%}")
        base = rows[0]["bytes_per_step"] if rows[0]["method"] == "none" else float("nan")
        log0("\n" + format_table([{"method": r["method"], "bytes/step/rank": format_bytes(r["bytes_per_step"]),
                                   "vs fp32": f"{r['bytes_per_step'] / base:.3f}x",
                                   "test accuracy": f"{r['accuracy']:.1%}"} for r in rows]))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
