"""The capstone trainer runs every strategy and resumes exactly from its checkpoints.

The capstone is the demo of RUN_MODE=imagenet (demos/imagenet.py). Its own ``main()``
runs in ranks started by run_distributed (init_from_env adopts the launcher's process
group), on tiny settings: a small ViT on 8x8 digits for six steps. The lesson modules
it uses come through ``distlab.loader.load``, as do the checkpoints read here.
tests/test_deployment.py checks the cluster manifests' commands against its parser.
"""
from __future__ import annotations

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


@pytest.mark.parametrize("strategy", ["ddp", "ours", "zero1", "zero2", "zero3"])
def test_capstone_trains_and_checkpoints_with_each_strategy(strategy, tmp_path):
    args = ["--strategy", strategy.rstrip("123"), "--checkpoint-dir", str(tmp_path)]
    if strategy.startswith("zero"):
        args += ["--zero-stage", strategy[-1]]
    results = run_distributed(_worker_capstone, 2, args, timeout_s=120)
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in results)
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
