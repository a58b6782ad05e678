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
from distlab.comm import CommLedger, all_gather_single
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
            # Both conventions: gradients kept as zeroed tensors (set_to_none=False) expose work left
            # over from the previous step (a handle waited and divided again).
            opt.zero_grad(set_to_none=step % 2 == 0)
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
            if calls_when_first_ready and (impl == "overlap" or n_buckets > 1):
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
def _zero(stage: int, model: nn.Module, **kw):
    args = dict(lr=0.01, weight_decay=0.1)
    if stage == 3:
        return load(PHASE, "fsdp").FullyShardedDataParallel(model, torch.optim.AdamW, **kw, **args)
    # 400 B buckets: several buckets, so the per-bucket bookkeeping is exercised.
    return load(PHASE, "zero").ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                             bucket_size_mb=400 / 2**20, **kw, **args)


def _padded(zo) -> int:
    """Elements this wrapper shards (padding included: < W per bucket or unit)."""
    return sum(u.full.numel() for u in zo.units) if hasattr(zo, "units") else sum(b.flat.numel() for b in zo.buckets)


def _gathered(fsdp) -> dict[str, torch.Tensor]:
    """The test's own all-gather of every unit's chunks (independent of 3.19's full_state_dict)."""
    state = {n: t for n, t in fsdp.module.state_dict().items()}
    for u in fsdp.units:
        flat = torch.empty(u.full.numel(), dtype=u.shard.dtype)
        all_gather_single(flat, u.shard.detach())
        for p, name, start in zip(u.params, u.names, u.offsets):
            state[name] = flat[start:start + p.numel()].view(p.shape)
    for alias, p in fsdp.module.named_parameters(remove_duplicate=False):  # tied weights: every name
        state[alias] = next(state[n] for n, q in fsdp.module.named_parameters() if q is p)
    return state


def _perturbed(kind: str, rank: int) -> nn.Module:
    """Rank 0's model, trainable weights shifted on other ranks: construction must broadcast rank 0's."""
    model = _make(kind, 0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(rank)
    return model


def _check_memory(zo, model: nn.Module, stage: int, rank: int, world_size: int, elem: int, what: str) -> None:
    """At rest: params/grads/optimizer state are the textbook fractions of the padded Psi."""
    # Independent of the wrapper's own accounting: no full gradient is kept (stage 2, 3),
    # and no full parameter keeps memory behind it (stage 3).
    for name, p in model.named_parameters():
        if p.requires_grad and stage >= 2:
            assert p.grad is None, f"{what}: {name} still holds a full gradient at rest"
        if p.requires_grad and stage == 3:
            assert p.untyped_storage().size() == 0, f"{what}: {name} is still gathered at rest"
    psi = _padded(zo) * elem
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
    restored_model = _perturbed(kind, 7)
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
    model = _make(kind, rank) if stage == 3 else _perturbed(kind, rank)  # construction must broadcast rank 0's
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
            full = _gathered(zo)
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
            psi_pad, units = _padded(zo) * elem, len(zo.units)
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
        full = _gathered(fsdp)
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
        full = _gathered(fsdp)
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
    st = load(PHASE, "fsdp_state")
    full, sharded = st.full_state_dict(fsdp), st.sharded_state_dict(fsdp)
    assert full.keys() == _make("tied_frozen", 0).state_dict().keys(), f"rank {rank}: full state dict names"
    for name, t in _gathered(fsdp).items():  # the test's own gather: same chunks, no arithmetic
        assert torch.equal(full[name], t), f"rank {rank}: full_state_dict()[{name!r}] is not the gathered tensor"
    restored = _zero(3, _make("tied_frozen", 7))  # other weights: the loads must overwrite them
    st.load_full_state_dict(restored, full)
    st.load_sharded_state_dict(restored, sharded)
    for name, t in st.full_state_dict(restored).items():
        assert torch.equal(t, full[name]), f"rank {rank}: {name} differs after load_full_state_dict"
    for model in (fsdp, restored):
        x, y = _batch("tied_frozen", 5)
        model.zero_grad()
        _loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        model.step()
    after, expected = st.full_state_dict(restored), st.full_state_dict(fsdp)
    for name in expected:
        # Same chunks, same optimizer state, same data: bitwise the same step.
        assert torch.equal(after[name], expected[name]), f"rank {rank}: {name} differs one step after restoring"


@pytest.mark.exercise("3.19 ZeRO-3 state dicts")
@pytest.mark.parametrize("world_size", [1, 3])
def test_zero3_state_dict_round_trip_matches_uninterrupted_training(world_size):
    run_distributed(_worker_zero3_checkpoint, world_size)


class Deep(nn.Module):
    """Six equal blocks and a head: enough buckets/units that "a few at a time" differs from "all"."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _worker_peaks(rank, world_size):
    """Per stage: 2 steps of 2 micro-batches vs the single process, then the textbook peaks and overlap."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(24, 8, generator=g, dtype=torch.float64), torch.randint(3, (24,), generator=g))
            for _ in range(2)]
    elem, micro = 8, 2
    for stage in (1, 2, 3):
        what = f"rank {rank}, ZeRO-{stage}, Deep, 2 micro-batches"
        baseline = seeded(Deep, 0).double()
        groups = lambda m: [{"params": m.blocks.parameters(), "lr": 0.02}, {"params": m.head.parameters()}]  # noqa: E731
        base_opt = torch.optim.AdamW(groups(baseline) if stage < 3 else baseline.parameters(), lr=0.01,
                                     weight_decay=0.1)
        model = seeded(Deep, 0).double()
        if stage == 3:
            zo = load(PHASE, "fsdp").FullyShardedDataParallel(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        else:  # parameter groups, as for any torch optimizer (stage 3's are per unit: one group)
            zo = load(PHASE, "zero").ZeroOptimizer(groups(model), torch.optim.AdamW, stage=stage,
                                                   bucket_size_mb=400 / 2**20, lr=0.01, weight_decay=0.1)
        # Stage 1/2: the wrapper is a torch Optimizer, so a scheduler drives it like the baseline's.
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s))
                  for o in (base_opt, zo if stage < 3 else zo.optimizer)]
        forward = zo if stage == 3 else model
        for step, (x, y) in enumerate(data):
            _baseline_step(baseline, base_opt, "deep", x, y, world_size, micro_batches=micro)
            if stage == 1:  # the model's own zero_grad drops the flat views: ZeRO-1 must survive it
                model.zero_grad(set_to_none=True)
            else:
                zo.zero_grad(set_to_none=True)
            xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
            for m in range(micro):
                (_loss(forward(shard(xs, m, micro)), shard(ys, m, micro)) / micro).backward()
            zo.step()
            for sch in scheds:
                sch.step()
            if stage == 3:
                for name, expected in baseline.state_dict().items():
                    assert_tensors_close(_gathered(zo)[name], expected, f"{what}, step {step}, {name}", **TOL)
            else:
                assert_models_close(model, baseline, rank=rank, step=f"{what}, step {step}", **TOL)
        peak, shards = zo.memory.peak, _padded(zo) * elem // world_size
        assert peak["optimizer"] == 2 * shards, f"{what}: optimizer state peak {peak['optimizer']} B != 2 x 1/W"
        if stage == 1:  # stage 1 has no hooks: sampled at each step
            continue
        assert zo.memory.samples > 20, f"{what}: the memory meter was sampled {zo.memory.samples} times"
        # Full gradient buffers alive at once: the one filling + the in-flight window (2), beyond my chunks.
        sizes = [b.flat.numel() * elem for b in zo.buckets] if stage == 2 else [u.full.numel() * elem for u in zo.units]
        assert peak["grads"] <= shards + 3 * max(sizes) < shards + sum(sizes), \
            f"{what}: gradient peak {peak['grads']} B > chunks {shards} + 3 x largest {max(sizes)} (all: {sum(sizes)})"
        if stage == 3:  # gathered at once: the unit in backward + one prefetched (no root parameters here)
            assert zo.max_gathered <= 2 and peak["params"] <= shards + 2 * max(sizes), \
                f"{what}: {zo.max_gathered} units gathered at once, parameter peak {peak['params']} B"
        for i, h in enumerate(zo.overlap.history):
            assert h["first_launch_hook"] is not None and h["first_launch_hook"] < h["hooks"], \
                f"{what}, backward {i}: first reduce-scatter at gradient hook {h['first_launch_hook']} of {h['hooks']}"


@pytest.mark.exercise("3.15-3.18 ZeRO accumulation, memory and overlap")
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_accumulation_peaks_and_overlap_match_textbook(world_size):
    run_distributed(_worker_peaks, world_size)


def _worker_bad_config(rank, world_size):
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        _zero(0, _make("mlp", 0))
    zero = load(PHASE, "zero").ZeroOptimizer
    with pytest.raises(ValueError, match="pass model.parameters()"):
        zero(_make("mlp", 0), torch.optim.AdamW)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zero(_make("mlp", 0).requires_grad_(False).parameters(), torch.optim.AdamW)
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
