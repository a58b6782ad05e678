"""Phase 2, part A: gradient accumulation, mixed precision, activation checkpointing.

Each worker rebuilds every rank's input itself, computes the single-process answer
(or drives PyTorch's own ``torch.amp.GradScaler``), runs the code under test on its
own shard, and compares at every step. The code under test comes from ``load(...)``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import load
from distlab.comm import CommLedger
from distlab.launch import run_distributed
from distlab.models import GPTConfig, TiedFrozenModel, TinyGPT, ToyMLP, seeded
from distlab.testing import assert_grads_close, assert_models_close, assert_ranks_identical, shard

PHASE = "phase2_advanced"
WORLD_SIZES = [1, 2, 3, 4]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# --------------------------------------------------------------------------- 2.1-2.2 gradient accumulation
ACC_GLOBAL_BATCH = 12  # divisible by 1-4: local batches of 12, 6, 4, 3
ACC_STEPS = 3


def _acc_model(kind: str, seed: int) -> nn.Module:
    if kind == "mlp":
        return seeded(ToyMLP, seed, 6, 10, 3).double()
    return seeded(TiedFrozenModel, seed, 11, 6, with_unused=True).double()


def _acc_batch(kind: str, step: int):
    g = torch.Generator().manual_seed(2000 + step)
    if kind == "mlp":
        return (torch.randn(ACC_GLOBAL_BATCH, 6, generator=g, dtype=torch.float64),
                torch.randint(3, (ACC_GLOBAL_BATCH,), generator=g))
    x = torch.randint(11, (ACC_GLOBAL_BATCH, 5), generator=g)
    return x, torch.roll(x, 1, dims=1)


def _worker_grad_accumulation(rank, world_size, kind):
    acc = load(PHASE, "grad_accumulation")
    local = ACC_GLOBAL_BATCH // world_size
    # Micro-batch sizes: 1 (k = local), 2 and 5 (uneven last micro-batch for most W,
    # e.g. local 3 -> 2 + 1, local 6 -> 5 + 1), and one larger than the batch (k = 1).
    for micro in (1, 2, 5, 64):
        baseline = _acc_model(kind, seed=0)
        model = acc.AccumulatingDataParallel(_acc_model(kind, seed=rank))  # broadcast fixes the seed
        params = [p for p in baseline.parameters() if p.requires_grad]
        base_opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        k = -(-local // micro)
        trainable = [p for p in model.module.parameters() if p.requires_grad]
        for step in range(ACC_STEPS):
            x, y = _acc_batch(kind, step)
            base_opt.zero_grad(set_to_none=True)
            _loss(baseline(x), y).backward()  # one step on the whole global batch
            base_opt.step()
            ledger = CommLedger()
            with ledger:
                acc.train_step(model, opt, _loss, shard(x, rank, world_size), shard(y, rank, world_size), micro)
            what = f"micro-batch {micro} ({k} micro-steps of local batch {local})"
            # float64: reordered sums differ by ~1e-16; 1e-10 still catches a 1/k instead
            # of n_i/n_local weighting (off by a whole factor on the uneven micro-batch),
            # a gradient reduced twice, or a missing 1/W.
            try:
                assert_models_close(model.module, baseline, rank=rank, step=step, rtol=1e-10, atol=1e-10)
            except AssertionError as e:
                raise AssertionError(f"{what}: {e}") from None
            # One all-reduce per trainable parameter that received a gradient (the tied
            # one once, the frozen and unused ones never) per optimizer step, whatever k is.
            with_grad = [p for p in trainable if p.grad is not None]
            expected_bytes = sum(p.numel() * p.element_size() for p in with_grad)
            assert ledger.calls("all_reduce") == len(with_grad), \
                f"rank {rank}, step {step}, {what}: {ledger.calls('all_reduce')} all-reduces per optimizer " \
                f"step, expected {len(with_grad)} (one per parameter, not one per micro-batch)"
            assert ledger.bytes("all_reduce") == expected_bytes, \
                f"rank {rank}, step {step}, {what}: {ledger.bytes('all_reduce')} B all-reduced, expected {expected_bytes}"
        assert_ranks_identical(model.module, step=f"end, {what}")


@pytest.mark.exercise("2.1-2.2 gradient accumulation")
@pytest.mark.parametrize("kind", ["mlp", "tied_frozen_unused"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_grad_accumulation_matches_single_process_global_batch(world_size, kind):
    run_distributed(_worker_grad_accumulation, world_size, kind)


def _worker_no_sync(rank, world_size):
    acc = load(PHASE, "grad_accumulation")
    model = acc.AccumulatingDataParallel(_acc_model("mlp", seed=0))
    baseline = _acc_model("mlp", seed=0)
    x, y = _acc_batch("mlp", 0)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    ledger = CommLedger()
    with ledger, model.no_sync():
        _loss(model(xs), ys).backward()
    assert ledger.calls() == 0, f"rank {rank}: backward inside no_sync() communicated: {ledger.summary()}"
    assert model.require_backward_grad_sync, f"rank {rank}: no_sync() must restore syncing on exit"
    # Inside no_sync the gradient is this rank's own: same ops, same order -> bitwise.
    _loss(baseline(xs), ys).backward()
    assert_grads_close(model.module, baseline, rank=rank, step="no_sync", rtol=0, atol=0)


@pytest.mark.exercise("2.1-2.2 gradient accumulation")
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_backward_matches_local_gradients(world_size):
    run_distributed(_worker_no_sync, world_size)


@pytest.mark.exercise("2.1-2.2 gradient accumulation")
@pytest.mark.scaffold
def test_split_micro_batches_rejects_bad_sizes():
    acc = load(PHASE, "grad_accumulation")
    x, y = torch.zeros(10, 2), torch.zeros(10)
    assert [len(a) for a, _ in acc.split_micro_batches(x, y, 4)] == [4, 4, 2]
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        acc.split_micro_batches(x, y, 0)
    with pytest.raises(ValueError, match="10 samples but targets hold 9"):
        acc.split_micro_batches(x, y[:9], 2)
