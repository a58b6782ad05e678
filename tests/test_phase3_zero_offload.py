"""ZeRO-Offload (optimizer on the CPU) and the DeepSpeed-style config (distlab/lessons/zero_config.py).

Offload: at W = 2, stages 1 and 2 with two micro-batches per step, the offloaded
ZeroOptimizer takes bitwise the steps of the one without offload (the same AdamW
arithmetic on copies) and matches the single process; the optimizer's parameters and
state live where ``offload_device`` says, apart from the model's buckets; each step moves
my gradient chunks there once and the updated chunks back once (watched with a dispatch
mode recording every ``copy_``, not with the optimizer's own counters). On this CPU-only
machine the offload device and the model's device are both the CPU; ``"meta"`` shows the
argument is honoured. The config: a valid file maps to ZeroOptimizer's and FSDP's real
arguments, bad batch arithmetic and unknown keys are refused with the stated messages,
and both demos take ``--deepspeed-config``.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from distlab import load
from distlab.spawn import run_distributed
from distlab.models import ToyMLP, seeded
from distlab.testing import assert_equal, assert_models_close, shard
from distlab.lessons.zero_config import load_zero_config, parse_zero_config

PHASE = "phase3_multi_node"
REPO = Path(__file__).resolve().parent.parent
GLOBAL_BATCH, STEPS, MICRO = 8, 3, 2
# float64: the single process sums the global batch in another order; 1e-10 still catches a
# missing 1/W or a gradient lost between the devices.
TOL = dict(rtol=1e-10, atol=1e-10)
ADAMW = dict(lr=0.01, weight_decay=0.1)


class _Copies(TorchDispatchMode):
    """Every ``aten.copy_`` while active: (source storage, destination storage, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.seen.append((src.untyped_storage().data_ptr(), dst.untyped_storage().data_ptr(),
                              dst.numel() * dst.element_size()))
        return func(*args, **(kwargs or {}))


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(3, (GLOBAL_BATCH,), generator=g)


def _check_offload(rank, world_size, stage):
    zero = load(PHASE, "zero").ZeroOptimizer
    baseline = seeded(ToyMLP, 0, 6, 10, 3).double()
    base_opt = torch.optim.AdamW(baseline.parameters(), **ADAMW)
    # Seeded by rank: construction must broadcast rank 0's values before the copies are offloaded.
    plain_model, model = seeded(ToyMLP, rank, 6, 10, 3).double(), seeded(ToyMLP, rank, 6, 10, 3).double()
    # 400 B buckets: several buckets, so every chunk's copies are counted.
    kw = dict(stage=stage, bucket_size_mb=400 / 2**20, **ADAMW)
    plain = zero(plain_model.parameters(), torch.optim.AdamW, **kw)
    zo = zero(model.parameters(), torch.optim.AdamW, offload_device="cpu", **kw)
    buckets = _storages(b.flat for b in zo.buckets)
    chunk_bytes = sum(b.flat.numel() // world_size * b.flat.element_size() for b in zo.buckets)
    for step in range(STEPS):
        what = f"rank {rank}, ZeRO-{stage} offload, step {step}"
        base_opt.zero_grad()
        for m, opt in ((plain_model, plain), (model, zo)):
            opt.zero_grad()
        for micro in range(MICRO):  # accumulate: the gradients still move once, at step()
            x, y = _batch(step, micro)
            (F.cross_entropy(baseline(x), y) / MICRO).backward()
            for m in (plain_model, model):
                (F.cross_entropy(m(shard(x, rank, world_size)), shard(y, rank, world_size)) / MICRO).backward()
        base_opt.step()
        plain.step()
        device_grads = _storages([*getattr(zo, "grad_flats", []), *(s.grad for s in zo.shards)])
        with _Copies() as copies:
            zo.step()
        masters = [p for g in zo.param_groups for p in g["params"]]
        offloaded = _storages([*masters, *(p.grad for p in masters)])
        to_offload = [n for src, dst, n in copies.seen if src in device_grads and dst in offloaded]
        back = [n for src, dst, n in copies.seen if src in offloaded and dst in buckets]
        # Expected from the wrapper's own buckets: baseline=False.
        assert_equal((len(to_offload), sum(to_offload)), (len(zo.buckets), chunk_bytes),
                     f"{what}: gradient copies to the offload device {to_offload}, expected one per bucket, "
                     f"{chunk_bytes} B", baseline=False)
        assert_equal((len(back), sum(back)), (len(zo.buckets), chunk_bytes),
                     f"{what}: parameter copies back {back}, expected one per bucket, {chunk_bytes} B", baseline=False)
        # The same AdamW on the same values, only on a copy: bitwise.
        assert_models_close(model, plain_model, rank=rank, step=f"{what} vs no offload", rtol=0, atol=0,
                            baseline=False)
        assert_models_close(model, baseline, rank=rank, step=f"{what} vs single process", **TOL)
    for p in masters:
        assert_equal(p.device, torch.device("cpu"), f"rank {rank}: the optimizer's parameter is on {p.device}")
    state = [v for s in zo.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    msg = f"rank {rank}: AdamW state devices {[v.device for v in state]}"
    assert_equal(len(state), 2 * len(masters), msg, baseline=False)  # two moments per optimizer parameter
    assert all(v.device == torch.device("cpu") for v in state), msg
    assert not (_storages(masters) | _storages(state)) & buckets, f"rank {rank}: offloaded tensors alias the buckets"
    assert _storages(p for g in plain.param_groups for p in g["params"]) <= _storages(b.flat for b in plain.buckets), \
        "without offload the optimizer steps on the buckets themselves (the check above means something)"
    # At rest: nothing of the optimizer's on the model's device; copy + gradient + 2 AdamW moments offloaded.
    mem = zo.memory_bytes()
    assert_equal((mem["optimizer"], mem["offloaded"]), (0, 4 * chunk_bytes),
                 f"rank {rank}, ZeRO-{stage} offload: memory_bytes() {mem}, expected optimizer 0 B, "
                 f"offloaded {4 * chunk_bytes} B", baseline=False)  # chunk_bytes: the wrapper's own buckets
    # Resume: a fresh offloaded optimizer loaded from the sharded state steps bitwise the same.
    restored_model = seeded(ToyMLP, 5, 6, 10, 3).double()
    restored = zero(restored_model.parameters(), torch.optim.AdamW, offload_device="cpu", **kw)
    restored_model.load_state_dict(model.state_dict())
    restored.load_sharded_state_dict(zo.sharded_state_dict())
    x, y = _batch(9, 0)
    for m, opt in ((model, zo), (restored_model, restored)):
        opt.zero_grad()
        F.cross_entropy(m(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()
    assert_models_close(restored_model, model, rank=rank, step=f"ZeRO-{stage} offload resumed", rtol=0, atol=0,
                        baseline=False)


def _worker_offload(rank, world_size, config_path):
    for stage in (1, 2):
        _check_offload(rank, world_size, stage)
    # The argument is honoured, not assumed to be "cpu": the optimizer's copies go where asked.
    meta = load(PHASE, "zero").ZeroOptimizer(seeded(ToyMLP, 0, 6, 10, 3).parameters(), torch.optim.AdamW,
                                             stage=2, offload_device="meta", **ADAMW)
    devices = {p.device.type for g in meta.param_groups for p in g["params"]}
    assert_equal(devices, {"meta"}, f"rank {rank}: offload_device='meta' put the optimizer's copies on {devices}")
    from demos import zero as zero_demo
    zero_mod, fsdp_mod = load(PHASE, "zero"), load(PHASE, "fsdp")
    real_zero, real_fsdp, made = zero_mod.ZeroOptimizer, fsdp_mod.FullyShardedDataParallel, []

    class _Built(Exception):
        pass

    def record(*args, **kwargs):
        made.append(real_zero(*args, **kwargs))
        return made[-1]

    def refuse(*args, **kwargs):  # stop the stage-3 run at construction: only its arguments matter
        raise _Built(kwargs)

    zero_mod.ZeroOptimizer, fsdp_mod.FullyShardedDataParallel = record, refuse
    try:
        zero_demo.main(["--deepspeed-config", config_path, "--steps", "1"])  # stage 2, offload, 2 micro-batches
        with pytest.raises(_Built) as built:
            zero_demo.main(["--deepspeed-config", str(REPO / "configs" / "zero3.json")])
    finally:
        zero_mod.ZeroOptimizer, fsdp_mod.FullyShardedDataParallel = real_zero, real_fsdp
    (zo,) = made
    assert_equal((zo.offload, zo.stage, len(zo.overlap.history)), (torch.device("cpu"), 2, 2),
                 f"rank {rank}: demo's ZeroOptimizer offload {zo.offload}, stage {zo.stage}, "
                 f"{len(zo.overlap.history)} backwards")
    kw = built.value.args[0]
    assert_equal((kw["compute_dtype"], kw["max_in_flight"]), (torch.bfloat16, 2), f"rank {rank}: demo's FSDP got {kw}")
    from demos import imagenet  # the capstone's engine gets the config's optimizer and offload
    cfg, ds = imagenet.apply_deepspeed_config(imagenet.Config(
        deepspeed_config=str(REPO / "configs" / "zero2_offload.json")), world_size)
    engine = imagenet.Engine(cfg, torch.nn.Linear(4, 2), torch.device("cpu"), ds)  # any model: no torchvision import
    got = (engine.zero.stage, engine.zero.offload, type(engine.zero.optimizer), engine.optimizer.param_groups[0]["lr"])
    # The class as a bool: a class is not plain data (the records travel as weights_only torch.save).
    assert_equal((*got[:2], got[2] is torch.optim.AdamW, got[3]), (2, torch.device("cpu"), True, 0.003),
                 f"rank {rank}: capstone's ZeroOptimizer {got}")


@pytest.mark.exercise("3.15-3.18")
def test_zero_offload_matches_no_offload_and_single_process(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 65536}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    run_distributed(_worker_offload, 2, str(path), timeout_s=120)


# --------------------------------------------------------------------------- the config
def test_zero_config_maps_to_zero_optimizer_and_fsdp_arguments():
    ds = load_zero_config(REPO / "configs" / "zero2_offload.json", world_size=4)
    assert (ds.stage, ds.offload_device, ds.dtype) == (2, "cpu", "float32")
    assert (ds.train_batch_size, ds.micro_batch_size, ds.gradient_accumulation_steps) == (64, 16, 1)
    assert ds.optimizer_class is torch.optim.AdamW and ds.optimizer_kwargs["betas"] == (0.9, 0.999)
    assert ds.zero_kwargs() == {"stage": 2, "offload_device": "cpu", "max_in_flight": 2, "bucket_size_mb": 0.25}
    zero = load(PHASE, "zero", impl="solutions").ZeroOptimizer
    fsdp = load(PHASE, "fsdp", impl="solutions").FullyShardedDataParallel
    # The mapped names are the wrappers' real keyword arguments (bind raises on any other).
    inspect.signature(zero).bind([], torch.optim.AdamW, **ds.zero_kwargs(), **ds.optimizer_kwargs)
    ds3 = load_zero_config(REPO / "configs" / "zero3.json", world_size=2)
    assert (ds3.stage, ds3.dtype, ds3.offload_device) == (3, "bfloat16", None)
    inspect.signature(fsdp).bind(torch.nn.Linear(1, 1), **ds3.fsdp_kwargs())
    # The rest of DeepSpeed's batch rule, and its "Adam" (AdamW unless adam_w_mode is false).
    two = parse_zero_config({"train_batch_size": 24, "gradient_accumulation_steps": 3,
                             "zero_optimization": {"stage": 1, "overlap_comm": False},
                             "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, world_size=2)
    assert (two.micro_batch_size, two.zero_kwargs()["max_in_flight"], two.optimizer_class) == (4, 1, torch.optim.AdamW)
    every = parse_zero_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 2}, world_size=2)  # 16 = 4 x 2 x 2
    assert (every.train_batch_size, every.stage, every.optimizer_class) == (16, 0, None)
    l2 = parse_zero_config({"train_micro_batch_size_per_gpu": 3,
                            "optimizer": {"type": "adam", "params": {"adam_w_mode": False}}}, world_size=2)
    assert (l2.train_batch_size, l2.gradient_accumulation_steps, l2.optimizer_class) == (6, 1, torch.optim.Adam)


@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size 30 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size 4 = 32"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 x world size 4"),
    ({"gradient_accumulation_steps": 2}, "set train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": "auto"}, "train_batch_size must be a number (int), got 'auto'"),
    ({"train_batch_size": 8, "steps_per_print": 10},
     "unsupported key(s) steps_per_print; supported here: train_batch_size, train_micro_batch_size_per_gpu, "
     "gradient_accumulation_steps, zero_optimization, bf16, fp16, optimizer"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 2, "contiguous_gradients": True}},
     "unsupported key(s) zero_optimization.contiguous_gradients; supported here: zero_optimization.stage, "
     "zero_optimization.offload_optimizer, zero_optimization.reduce_bucket_size, zero_optimization.overlap_comm"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer.device \"cpu\" needs stage 1 or 2 (got 3)"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.device 'nvme': supported \"cpu\" or \"none\""),
    ({"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ({"train_batch_size": 8, "optimizer": {"type": "Lamb"}}, "supported Adam, AdamW, SGD"),
    ({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "torch_adam": True}}},
     "unsupported key(s) optimizer.params.torch_adam; supported here: optimizer.params.lr"),
])
def test_zero_config_refuses_bad_files_with_the_stated_message(tmp_path, config, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_zero_config(path, world_size=4)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_capstone_takes_the_deepspeed_config(tmp_path):
    from demos import imagenet

    args = imagenet.build_parser().parse_args(["--deepspeed-config", str(REPO / "configs" / "zero2_offload.json")])
    cfg, ds = imagenet.apply_deepspeed_config(imagenet.Config(**vars(args)), world_size=2)
    assert (cfg.strategy, cfg.zero_stage, cfg.offload_optimizer, cfg.global_batch, cfg.bucket_mb, cfg.amp) == \
        ("zero", 2, "cpu", 32, 0.25, "none") and ds.optimizer_class is torch.optim.AdamW
    cfg3, _ = imagenet.apply_deepspeed_config(imagenet.Config(deepspeed_config=str(REPO / "configs" / "zero3.json")), 2)
    assert (cfg3.strategy, cfg3.zero_stage, cfg3.amp) == ("zero", 3, "bf16")
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps({"train_batch_size": 32,
                                "zero_optimization": {"stage": 0, "reduce_bucket_size": 2**21}}))
    ddp, _ = imagenet.apply_deepspeed_config(imagenet.Config(deepspeed_config=str(path)), 2)
    assert (ddp.strategy, ddp.bucket_mb, ddp.global_batch) == ("ddp", 2.0, 32)
    path = tmp_path / "accum.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}))
    with pytest.raises(ValueError, match="gradient_accumulation_steps 2: the capstone takes one step per global batch"):
        imagenet.apply_deepspeed_config(imagenet.Config(deepspeed_config=str(path)), 2)
