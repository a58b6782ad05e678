"""Phase 3 (part B): DDP from scratch (overlap, buckets) and ZeRO-1/2/3.

Every worker builds the single-process baseline itself (same seed, the whole
global batch) and, where PyTorch has one, the built-in twin (torch's DDP,
ZeroRedundancyOptimizer) on the same shard, then compares at every step. The code
under test comes from ``load(...)``: the solutions by default, the templates with
``--impl templates``.
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
from distlab.models import TiedFrozenModel, ToyMLP, seeded
from distlab.testing import (assert_grads_close, assert_models_close, assert_ranks_identical,
                             assert_tensors_close, max_abs_diff, shard)

PHASE = "phase3_multi_node"
WORLD_SIZES = [1, 2, 3, 4]
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: every rank gets an equal shard
STEPS = 3
# float64 models: reordered sums differ by ~1e-16 per op; 1e-10 still catches a
# missing 1/W (a factor of 2), a gradient reduced twice, or a stale bucket.
TOL = dict(rtol=1e-10, atol=1e-10)


class Branchy(nn.Module):
    """A branch used only when asked: unused on some ranks, used on others (or on none)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _make(kind: str, seed: int) -> nn.Module:
    if kind == "mlp":
        return seeded(ToyMLP, seed, 6, 10, 3).double()
    if kind == "tied_frozen":
        return seeded(TiedFrozenModel, seed, 11, 6).double()
    if kind == "tied_frozen_unused":
        return seeded(TiedFrozenModel, seed, 11, 6, with_unused=True).double()
    return seeded(Branchy, seed).double()


def _batch(kind: str, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if kind.startswith("tied_frozen"):
        x = torch.randint(11, (GLOBAL_BATCH, 5), generator=g)
        return x, torch.roll(x, 1, dims=1)
    return torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64), torch.randint(3, (GLOBAL_BATCH,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)


def _use_b(kind: str, rank: int) -> dict:
    # Branchy: branch b is used by even ranks only (so with W=1 always, and unused on odd ranks).
    return {"use_b": rank % 2 == 0} if kind == "branchy" else {}


def _baseline_step(model, optimizer, kind, x, y, world_size, micro_batches=1):
    """Single process on the global batch: the mean of the W shard losses (x micro-batches)."""
    optimizer.zero_grad(set_to_none=True)
    for r in range(world_size):
        xs, ys = shard(x, r, world_size), shard(y, r, world_size)
        for m in range(micro_batches):
            xm, ym = shard(xs, m, micro_batches), shard(ys, m, micro_batches)
            (_loss(model(xm, **_use_b(kind, r)), ym) / (world_size * micro_batches)).backward()
    optimizer.step()


# --------------------------------------------------------------------------- 3.10-3.14 DDP
# ToyMLP(6, 10, 3) in float64, gradients in backward order: fc3.bias 24 B, fc3.weight 240,
# fc2.bias 80, fc2.weight 800, fc1.bias 80, fc1.weight 480 (1704 B in all). Caps that give:
MB = 1 / (1024 * 1024)
BUCKET_CAPS = {
    1: 100.0,          # everything fits
    2: 1144 * MB,      # [24 240 80 800] [80 480]
    3: 880 * MB,       # [24 240 80] [800 80] [480]
    6: 0.0,            # one per parameter ("many")
}


def _wrap(impl: str, model: nn.Module, bucket_mb: float, find_unused: bool):
    if impl == "overlap":
        return load(PHASE, "ddp_overlap").DDPIndividualParameters(model)
    return load(PHASE, "ddp_bucketed").DDPBucketed(model, bucket_size_mb=bucket_mb,
                                                   find_unused_parameters=find_unused)


def _worker_ddp(rank, world_size, impl, kind, n_buckets_list, find_unused=False):
    for n_buckets in n_buckets_list:
        bucket_mb = BUCKET_CAPS[n_buckets]
        baseline = _make(kind, seed=0)
        builtin = nn.parallel.DistributedDataParallel(_make(kind, seed=0), bucket_cap_mb=max(bucket_mb, 1e-6),
                                                      find_unused_parameters=find_unused)
        model = _make(kind, seed=rank)  # different on purpose: the wrapper's broadcast must fix it
        ddp = _wrap(impl, model, bucket_mb, find_unused)
        assert_models_close(model, baseline, rank=rank, step="after construction", rtol=0, atol=0)
        base_opt, opt, builtin_opt = _adamw(baseline), _adamw(model), _adamw(builtin.module)
        trainable = [p for p in model.parameters() if p.requires_grad]
        initial = [p.detach().clone() for p in trainable]
        first = model.fc1.weight if kind == "mlp" else None
        calls_when_first_ready = []
        if first is not None:  # registered after the wrapper's hook, so it runs after it
            first.register_post_accumulate_grad_hook(lambda p: calls_when_first_ready.append(ledger.calls("all_reduce")))
        for step in range(STEPS):
            what = f"rank {rank}, {impl}, {kind}, {n_buckets} bucket(s), step {step}"
            x, y = _batch(kind, step)
            xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
            _baseline_step(baseline, base_opt, kind, x, y, world_size)
            builtin.zero_grad(set_to_none=True)
            _loss(builtin(xs, **_use_b(kind, rank)), ys).backward()
            opt.zero_grad(set_to_none=True)
            ledger = CommLedger()
            with ledger:
                _loss(ddp(xs, **_use_b(kind, rank)), ys).backward()
                ddp.finish_gradient_synchronization()
            # Same shard, same bucketed sum: only the summation order of gloo may differ.
            assert_grads_close(model, builtin.module, rank=rank, step=f"{step} ({what}) vs torch DDP", **TOL)
            opt.step()
            builtin_opt.step()
            assert_models_close(model, baseline, rank=rank, step=f"{step} ({what})", **TOL)
            # Every gradient once (with find_unused_parameters: zeros for the unused too).
            grad_bytes = sum(p.numel() * p.element_size() for p in trainable if find_unused or p.grad is not None)
            buckets = len(trainable) if impl == "overlap" or bucket_mb == 0 else n_buckets  # cap 0: one each
            expected_calls = buckets + int(impl == "bucketed" and find_unused)
            assert ledger.calls("all_reduce") == expected_calls, \
                f"{what}: {ledger.calls('all_reduce')} all-reduces, expected {expected_calls} ({ledger.summary()})"
            bitmap = 4 * len(trainable) if find_unused else 0
            assert ledger.bytes("all_reduce") == grad_bytes + bitmap, \
                f"{what}: {ledger.bytes('all_reduce')} B all-reduced, expected {grad_bytes + bitmap}"
            if calls_when_first_ready and n_buckets > 1:
                # The last gradient of backward: earlier buckets must already be in flight.
                assert calls_when_first_ready[-1] >= 1, \
                    f"{what}: no all-reduce launched before backward ended (no overlap)"
        moved = max(max_abs_diff(p, p0) for p, p0 in zip(trainable, initial))
        assert moved > 1e-3, f"rank {rank}, {impl}, {n_buckets} bucket(s): weights never changed (max move {moved:.1e})"
        assert_ranks_identical(model, step=STEPS)


def _worker_ddp_kinds(rank, world_size, impl, kinds, n_buckets_list, find_unused=False):
    for kind in kinds:  # several cases in one world: starting worlds is the slow part
        _worker_ddp(rank, world_size, impl, kind, n_buckets_list, find_unused and kind != "tied_frozen")


@pytest.mark.exercise("3.10-3.11 DDP overlap per parameter")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_overlap_matches_single_process_and_torch_ddp(world_size):
    run_distributed(_worker_ddp_kinds, world_size, "overlap", ["mlp", "tied_frozen"], [1])


@pytest.mark.exercise("3.12-3.14 DDP buckets")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_bucketed_matches_single_process_and_torch_ddp(world_size):
    run_distributed(_worker_ddp, world_size, "bucketed", "mlp", sorted(BUCKET_CAPS))


@pytest.mark.exercise("3.12-3.14 DDP buckets")
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_bucketed_tied_frozen_unused_matches_torch_ddp(world_size):
    # tied + frozen; a parameter no rank uses; a branch only even ranks use.
    run_distributed(_worker_ddp_kinds, world_size, "bucketed", ["tied_frozen", "tied_frozen_unused", "branchy"],
                    [1, 6], find_unused=True)


def _worker_unused_error(rank, world_size):
    ddp = load(PHASE, "ddp_bucketed").DDPBucketed(_make("tied_frozen_unused", 0), bucket_size_mb=0.0)
    x, y = _batch("tied_frozen", 0)
    _loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="unused.weight"):
        ddp.finish_gradient_synchronization()


@pytest.mark.exercise("3.12-3.14 DDP buckets")
def test_ddp_bucketed_unused_without_flag_raises_like_torch_ddp():
    run_distributed(_worker_unused_error, 1)


@pytest.mark.exercise("3.12-3.14 DDP buckets")
def test_bucket_assignment_matches_hand_computed_partition():
    assign = load(PHASE, "ddp_bucketed").assign_buckets
    params = list(_make("mlp", 0).parameters())[::-1]
    sizes = {1: [6], 2: [4, 2], 3: [3, 2, 1], 6: [1] * 6}
    for n, cap in BUCKET_CAPS.items():
        got = [len(b) for b in assign(params, cap)]
        assert got == sizes[n], f"cap {cap / MB:.0f} B: bucket lengths {got}, expected {sizes[n]}"
    got = [len(b) for b in assign(params, 100.0, first_bucket_mb=344 * MB)]
    assert got == [3, 3], f"a 344 B first bucket, then 100 MiB: bucket lengths {got}, expected [3, 3]"
    mixed = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert [len(b) for b in assign(mixed, 100.0)] == [1, 1], "a bucket must not mix dtypes"


def _worker_no_sync(rank, world_size, impl):
    micro = 2
    baseline = _make("mlp", 0)
    model = _make("mlp", rank)
    ddp = _wrap(impl, model, BUCKET_CAPS[3], False)
    base_opt, opt = _adamw(baseline), _adamw(model)
    for step in range(STEPS):
        x, y = _batch("mlp", step)
        _baseline_step(baseline, base_opt, "mlp", x, y, world_size, micro_batches=micro)
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        opt.zero_grad(set_to_none=True)
        ledger = CommLedger()
        with ledger:
            with ddp.no_sync():
                (_loss(ddp(shard(xs, 0, micro)), shard(ys, 0, micro)) / micro).backward()
            assert ledger.calls("all_reduce") == 0, f"rank {rank}, step {step}: no_sync must not communicate"
            (_loss(ddp(shard(xs, 1, micro)), shard(ys, 1, micro)) / micro).backward()
            ddp.finish_gradient_synchronization()
        opt.step()
        assert_models_close(model, baseline, rank=rank, step=f"{step} ({impl}, no_sync accumulation)", **TOL)


@pytest.mark.exercise("3.10-3.11 DDP overlap per parameter")
def test_ddp_overlap_no_sync_accumulation_matches_single_process():
    run_distributed(_worker_no_sync, 2, "overlap")


@pytest.mark.exercise("3.12-3.14 DDP buckets")
def test_ddp_bucketed_no_sync_accumulation_matches_single_process():
    run_distributed(_worker_no_sync, 2, "bucketed")


# --------------------------------------------------------------------------- 3.15-3.19 ZeRO
def _padded(sharded_state: dict) -> int:
    return sum(b["padded"] for b in sharded_state["layout"])


def _zero(stage: int, model: nn.Module, **kw):
    args = dict(lr=0.01, weight_decay=0.1)
    if stage == 3:
        return load(PHASE, "fsdp").FullyShardedDataParallel(model, torch.optim.AdamW, **kw, **args)
    # 400 B buckets: several buckets, so the per-bucket bookkeeping is exercised.
    return load(PHASE, "zero").ZeroOptimizer(model, torch.optim.AdamW, stage=stage, bucket_size_mb=400 / 2**20,
                                             **kw, **args)


def _check_memory(zo, model: nn.Module, stage: int, rank: int, world_size: int, elem: int, what: str) -> None:
    """At rest: params/grads/optimizer state are the textbook fractions of the padded Psi."""
    # Independent of the wrapper's own accounting: no full gradient is kept (stage 2, 3),
    # and no full parameter keeps memory behind it (stage 3).
    for name, p in model.named_parameters():
        if p.requires_grad and stage >= 2:
            assert p.grad is None, f"{what}: {name} still holds a full gradient at rest"
        if p.requires_grad and stage == 3:
            assert p.untyped_storage().size() == 0, f"{what}: {name} is still gathered at rest"
    psi = _padded(zo.sharded_state_dict()) * elem  # padding: < W elements per bucket
    expected = {"params": psi // world_size if stage == 3 else psi,
                "grads": psi if stage == 1 else psi // world_size,
                "optimizer": 2 * psi // world_size}  # AdamW: exp_avg + exp_avg_sq (K = 2 in fp64)
    got = zo.memory_bytes()
    assert got == expected, f"{what}: per-rank bytes {got}, expected {expected}"
    everyone = [None] * world_size
    dist.all_gather_object(everyone, got["optimizer"])
    assert max(everyone) <= 1.01 * min(everyone), f"{what}: optimizer state per rank {everyone} not balanced"


def _worker_zero(rank, world_size, stage):
    for kind in ("mlp", "tied_frozen"):  # several cases in one world: starting worlds is the slow part
        _check_zero(rank, world_size, stage, kind)


def _check_zero_resume(rank, world_size, stage, kind, zo, model):
    """ZeRO-1/2: a fresh optimizer loaded from the sharded state takes bitwise the same next step."""
    restored_model = _make(kind, 7)
    restored = _zero(stage, restored_model)
    restored_model.load_state_dict(model.state_dict())  # in place: the params stay views of the buckets
    restored.load_sharded_state_dict(zo.sharded_state_dict())
    x, y = _batch(kind, 9)
    for m, opt in ((model, zo), (restored_model, restored)):
        opt.zero_grad()
        _loss(m(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()
    # Same parameters, optimizer state and data: no tolerance.
    assert_models_close(restored_model, model, rank=rank, step=f"ZeRO-{stage} resumed", rtol=0, atol=0)


def _check_zero(rank, world_size, stage, kind):
    baseline = _make(kind, 0)
    base_opt = _adamw(baseline)
    model = _make(kind, rank)  # different on purpose: construction must broadcast rank 0's
    zo = _zero(stage, model)
    forward = zo if stage == 3 else model
    builtin = builtin_opt = None
    if stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        builtin = nn.parallel.DistributedDataParallel(_make(kind, 0))
        builtin_opt = ZeroRedundancyOptimizer([p for p in builtin.parameters() if p.requires_grad],
                                              optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    elem = 8
    for step in range(STEPS):
        what = f"rank {rank}, ZeRO-{stage}, {kind}, step {step}"
        x, y = _batch(kind, step)
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        _baseline_step(baseline, base_opt, kind, x, y, world_size)
        zo.zero_grad()
        ledger = CommLedger()
        with ledger:
            _loss(forward(xs), ys).backward()
            zo.step()
        if stage == 3:
            full = zo.full_state_dict()
            for name, expected in baseline.state_dict().items():
                assert_tensors_close(full[name], expected, f"{what}, gathered {name}", **TOL)
        else:
            assert_models_close(model, baseline, rank=rank, step=what, **TOL)
        if builtin is not None:
            builtin_opt.zero_grad()
            _loss(builtin(xs), ys).backward()
            builtin_opt.step()
            # Same averaged gradients, same elementwise AdamW: only summation order differs.
            assert_models_close(model, builtin.module, rank=rank, step=f"{what} vs ZeroRedundancyOptimizer", **TOL)
        _check_memory(zo, model, stage, rank, world_size, elem, what)
        if stage == 3:
            psi_pad = _padded(zo.sharded_state_dict()) * elem
            units = len(zo.sharded_state_dict()["layout"])
            ag, rs = ledger.summary().get("all_gather_single", {}), ledger.summary().get("reduce_scatter_single", {})
            # Forward and backward each gather every unit once; every unit reduce-scatters once.
            assert ag == {"calls": 2 * units, "bytes": 2 * psi_pad // world_size}, f"{what}: all-gathers {ag}"
            assert rs == {"calls": units, "bytes": psi_pad}, f"{what}: reduce-scatters {rs}"
            if world_size > 1:
                # Bytes each rank puts on the wire in a ring: an all-gather sends (W-1) chunks, a
                # reduce-scatter (W-1)/W of its input, DDP's all-reduce 2 (W-1)/W of the gradients.
                psi = sum(p.numel() for p in baseline.parameters() if p.requires_grad) * elem
                ours = (world_size - 1) * ag["bytes"] + (world_size - 1) / world_size * rs["bytes"]
                ddp = 2 * (world_size - 1) / world_size * psi
                assert abs(ours / ddp - 1.5 * psi_pad / psi) < 1e-12 and psi_pad / psi < 1.05, \
                    f"{what}: ZeRO-3 / DDP bytes {ours / ddp:.4f}, expected 1.5 (x padding {psi_pad / psi:.4f})"
    if stage < 3:
        _check_zero_resume(rank, world_size, stage, kind, zo, model)


@pytest.mark.exercise("3.15 ZeRO-1")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero1_matches_single_process_and_zero_redundancy_optimizer(world_size):
    run_distributed(_worker_zero, world_size, 1)


@pytest.mark.exercise("3.16 ZeRO-2")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero2_matches_single_process(world_size):
    run_distributed(_worker_zero, world_size, 2)


@pytest.mark.exercise("3.17-3.18 ZeRO-3")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero3_matches_single_process(world_size):
    run_distributed(_worker_zero, world_size, 3)


def _worker_zero3_gpt(rank, world_size):
    from distlab.models import GPTConfig, TinyGPT
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    baseline = seeded(TinyGPT, 0, cfg).double()
    base_opt = _adamw(baseline)
    fsdp = _zero(3, seeded(TinyGPT, rank, cfg).double())
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(16, (GLOBAL_BATCH, 8), generator=g)
        y = torch.roll(x, -1, dims=1)
        base_opt.zero_grad()
        baseline(x, y)[1].backward()
        base_opt.step()
        fsdp.zero_grad()
        fsdp(shard(x, rank, world_size), shard(y, rank, world_size))[1].backward()
        fsdp.step()
        full = fsdp.full_state_dict()
        for name, expected in baseline.state_dict().items():
            assert_tensors_close(full[name], expected, f"rank {rank}, ZeRO-3 TinyGPT, step {step}, {name}", **TOL)


@pytest.mark.exercise("3.17-3.18 ZeRO-3")
def test_zero3_tinygpt_units_match_single_process():
    run_distributed(_worker_zero3_gpt, 2)


def _worker_zero3_bf16(rank, world_size):
    baseline = seeded(ToyMLP, 0, 6, 10, 3)  # fp32 master weights
    base_opt = _adamw(baseline)
    fsdp = _zero(3, seeded(ToyMLP, rank, 6, 10, 3), compute_dtype=torch.bfloat16)
    for step in range(STEPS):
        x, y = _batch("mlp", step)
        x = x.float()
        # Baseline: each shard's forward/backward in bf16, gradients summed in fp32, / W.
        base_opt.zero_grad()
        grads = [torch.zeros_like(p) for p in baseline.parameters()]
        for r in range(world_size):
            low = copy.deepcopy(baseline).to(torch.bfloat16)
            _loss(low(shard(x, r, world_size).bfloat16()).float(), shard(y, r, world_size)).backward()
            for g, p in zip(grads, low.parameters()):
                g += p.grad.float()
        for g, p in zip(grads, baseline.parameters()):
            p.grad = g / world_size
        base_opt.step()
        fsdp.zero_grad()
        _loss(fsdp(shard(x, rank, world_size)).float(), shard(y, rank, world_size)).backward()
        fsdp.step()
        full = fsdp.full_state_dict()
        assert all(p.dtype == torch.bfloat16 for p in fsdp.module.parameters()), "gathered params must be bf16"
        for name, expected in baseline.state_dict().items():
            # Identical bf16 shard computations; the fp32 sum over ranks may be reordered (~1e-7),
            # which AdamW's normalised update turns into ~1e-6 at most.
            assert_tensors_close(full[name], expected, f"rank {rank}, ZeRO-3 bf16, step {step}, {name}",
                                 rtol=1e-5, atol=1e-5)
        mem = fsdp.memory_bytes()
        assert mem["grads"] == mem["params"], f"rank {rank}: gradient chunks must stay fp32 like the master chunks"


@pytest.mark.exercise("3.17-3.18 ZeRO-3")
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero3_bf16_compute_matches_single_process_mixed_precision(world_size):
    run_distributed(_worker_zero3_bf16, world_size)


def _worker_zero3_checkpoint(rank, world_size):
    fsdp = _zero(3, _make("tied_frozen", 0))
    for step in range(2):
        x, y = _batch("tied_frozen", step)
        fsdp.zero_grad()
        _loss(fsdp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        fsdp.step()
    full, sharded = fsdp.full_state_dict(), fsdp.sharded_state_dict()
    restored = _zero(3, _make("tied_frozen", 7))  # other weights: the loads must overwrite them
    restored.load_full_state_dict(full)
    restored.load_sharded_state_dict(sharded)
    for name, t in restored.full_state_dict().items():
        assert torch.equal(t, full[name]), f"rank {rank}: {name} differs after load_full_state_dict"
    for model in (fsdp, restored):
        x, y = _batch("tied_frozen", 5)
        model.zero_grad()
        _loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        model.step()
    after, expected = restored.full_state_dict(), fsdp.full_state_dict()
    for name in expected:
        # Same chunks, same optimizer state, same data: bitwise the same step.
        assert torch.equal(after[name], expected[name]), f"rank {rank}: {name} differs one step after restoring"


@pytest.mark.exercise("3.19 ZeRO-3 state dicts")
@pytest.mark.parametrize("world_size", [1, 3])
def test_zero3_state_dict_round_trip_matches_uninterrupted_training(world_size):
    run_distributed(_worker_zero3_checkpoint, world_size)


def _worker_bad_config(rank, world_size):
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        _zero(0, _make("mlp", 0))
    model = _make("mlp", 0)
    with pytest.raises(ValueError, match="the root is always a unit"):
        load(PHASE, "fsdp").FullyShardedDataParallel(model, torch.optim.AdamW, units=[model])
    seq = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)).double()
    with pytest.raises(ValueError, match="contains 1 other unit"):
        load(PHASE, "fsdp").FullyShardedDataParallel(seq, torch.optim.AdamW, units=[seq[0], seq[0][0]])


@pytest.mark.exercise("3.15-3.19 ZeRO configuration")
@pytest.mark.scaffold
def test_zero_rejects_bad_configuration():
    run_distributed(_worker_bad_config, 1)
