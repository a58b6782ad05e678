"""The capstone trainer runs every strategy and resumes exactly from its checkpoints.

The capstone is the demo of RUN_MODE=imagenet (demos/imagenet.py). Its own ``main()``
runs in ranks started by run_distributed (init_from_env adopts the launcher's process
group), on tiny settings: a small ViT on 8x8 digits for six steps. The lesson modules
it uses come through ``distlab.loader.load``, as do the checkpoints read here.
tests/test_deployment.py checks the cluster manifests' commands against its parser.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from distlab.launch import run_distributed
from distlab.loader import load

TINY = ["--model", "vit_tiny", "--image-size", "8", "--global-batch", "16", "--max-steps", "6",
        "--warmup-steps", "2", "--lr", "0.05"]


def _worker_capstone(rank, world_size, args):
    from demos import imagenet

    return imagenet.main(TINY + args)


def _final_model(directory: Path) -> dict:
    ckpt = load("phase4_production", "checkpoint").CheckpointManager(directory).latest()
    assert ckpt is not None and ckpt.step == 6, f"no final checkpoint at step 6 in {directory}"
    return ckpt.load(0)["engine"]["model"]


@pytest.mark.parametrize("strategy", ["ddp", "ours", "zero1", "zero2", "zero3", "fsdp"])
def test_capstone_trains_and_checkpoints_with_each_strategy(strategy, tmp_path):
    # torch's FSDP2 saves through torch.distributed.checkpoint, not this script's checkpoints
    saves = strategy != "fsdp"
    args = ["--strategy", strategy.rstrip("123")] + (["--checkpoint-dir", str(tmp_path)] if saves else [])
    if strategy.startswith("zero"):
        args += ["--zero-stage", strategy[-1]]
    results = run_distributed(_worker_capstone, 2, args, timeout_s=120)
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in results)
    if saves:
        assert load("phase4_production", "checkpoint").CheckpointManager(tmp_path).latest().step == 6


def test_capstone_resume_is_bit_identical_and_elastic(tmp_path):
    """Uninterrupted 6 steps == stop at step 4 and resume; resuming on 1 rank instead of 2 is close."""
    straight, resumed, elastic = tmp_path / "straight", tmp_path / "resumed", tmp_path / "elastic"
    run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(straight)], timeout_s=120)
    assert run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(resumed), "--stop-at-step", "4"],
                           timeout_s=120)[0] == {"stopped_at": 4}
    run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(resumed)], timeout_s=120)
    a, b = _final_model(straight), _final_model(resumed)
    for name in a:  # same world size, same order of every sum: bitwise
        assert torch.equal(a[name], b[name]), f"parameter {name} differs after resume"
    run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(elastic), "--stop-at-step", "4"], timeout_s=120)
    run_distributed(_worker_capstone, 1, ["--checkpoint-dir", str(elastic)], timeout_s=120)
    c = _final_model(elastic)
    for name in a:  # 1 rank sums the global batch in another order than 2: float32 rounding only
        torch.testing.assert_close(c[name], a[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _worker_eval_and_units(rank, world_size):
    """evaluate() on an uneven split (no hang, exact count); ZeRO-3 on the ViT gathers one block at a time."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from demos import imagenet
    FSDP = load("phase3_multi_node", "fsdp").FullyShardedDataParallel
    torch.manual_seed(0)
    model = imagenet.build_model("vit_tiny", 10, 8)
    reference = copy.deepcopy(model)
    fsdp = FSDP(model)
    # 11 images over 3 ranks in batches of 3: shards of 4, 4, 3 images, so 2, 2 and 1 batches; each
    # forward is a collective (ZeRO-3 gathers), so unequal batch counts would hang.
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(11, 3, 8, 8, generator=g), torch.randint(10, (11,), generator=g))
    accuracy = imagenet.evaluate(fsdp, data, torch.device("cpu"), rank, world_size, batch_size=3)
    with torch.no_grad():
        expected = (reference.eval()(data.tensors[0]).argmax(1) == data.tensors[1]).double().mean().item()
    assert accuracy == expected, f"rank {rank}: accuracy {accuracy} != {expected} on 11 images"
    units = [type(u.module).__name__ for u in fsdp.units]
    assert units.count("EncoderBlock") == 4, f"ViT units {units}: expected one per encoder layer"
    fsdp.memory.reset()
    fsdp.max_gathered = 0
    F.cross_entropy(fsdp(data.tensors[0][:4]), data.tensors[1][:4]).backward()
    block = max(u.full.numel() * u.full.element_size() for u in fsdp.units if u.module is not model)
    root = next(u.full.numel() * u.full.element_size() for u in fsdp.units if u.module is model)
    shards = sum(u.shard.numel() * u.shard.element_size() for u in fsdp.units)
    # The root (class token, position embedding) + the unit in backward + one prefetched.
    assert fsdp.max_gathered <= 3 and fsdp.memory.peak["params"] <= shards + root + 2 * block, \
        f"rank {rank}: {fsdp.max_gathered} units gathered, params peak {fsdp.memory.peak['params']} B " \
        f"> shards {shards} + root {root} + 2 x block {block}"


def test_capstone_evaluate_is_exact_and_vit_zero3_gathers_one_block_at_a_time():
    run_distributed(_worker_eval_and_units, 3, timeout_s=120)
