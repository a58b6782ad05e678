"""Drop-in for torch users: one ordinary PyTorch training loop, torch's wrappers vs the course's.

``_train`` is the loop a torch user writes: an optimizer over ``model.parameters()``, an LR
scheduler, gradient accumulation with ``no_sync()`` (or nanoGPT's ``require_backward_grad_sync``),
``zero_grad(set_to_none=True)``, train/eval, ``state_dict()`` saved with ``torch.save`` and loaded
after a restart into fresh objects. It never calls a course-only method (no
``finish_gradient_synchronization()``). Each contender runs it at world size 2 under
``run_distributed``; the ranks return their final state and eval losses, and the parent compares
them with torch's built-in twin: ``torch.equal`` where the sums happen in the same order.

At W=2 a mean over ranks is bitwise the same however it is taken: (a + b) / 2 == a/2 + b/2 in
IEEE arithmetic (halving is exact, an addition of two terms commutes), so the course's DDP
(divide, then sum) and torch's (sum of pre-scaled gradients) agree to the bit.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import load
from distlab.launch import run_distributed
from distlab.models import seeded
from distlab.testing import shard

PHASE = "phase3_multi_node"
WORLD_SIZE = 2
STEPS, RESTART_AT, MICRO = 4, 2, 2   # 2 steps, save, restart into fresh objects, 2 more steps
GLOBAL_BATCH = 16                    # 8 per rank, two micro-batches of 4


class Net(nn.Module):
    """A tiny classifier with a BatchNorm: buffers that differ per rank until DDP broadcasts them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(3, (GLOBAL_BATCH,), generator=g)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, steps: range, rank: int,
           world_size: int, accumulation: str) -> list[float]:
    """Ordinary PyTorch data-parallel training; the eval loss after every other step."""
    evals = []
    for step in steps:
        model.train()
        x, y = _batch(step)
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for m in range(MICRO):
            last = m == MICRO - 1
            if accumulation == "flag":  # nanoGPT: toggle the flag instead of entering no_sync()
                model.require_backward_grad_sync = last
                skip = contextlib.nullcontext()
            else:
                skip = contextlib.nullcontext() if last else model.no_sync()
            with skip:
                loss = F.cross_entropy(model(shard(xs, m, MICRO)), shard(ys, m, MICRO)) / MICRO
                loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 2 == 0:  # not after the last step: which forwards broadcast buffers shows in the end state
            model.eval()
            with torch.no_grad():
                x, y = _batch(1000)
                evals.append(F.cross_entropy(model(x), y).item())
    return evals


def _build(contender: str, seed: int):
    model = seeded(Net, seed)  # a different seed per rank and per life: the wrapper or the load must fix it
    if contender == "torch_ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    elif contender == "course_overlap":
        wrapped = load(PHASE, "ddp_overlap").DDPIndividualParameters(model)
    elif contender == "course_bucketed":  # ~1 KB buckets: several all-reduces per backward
        wrapped = load(PHASE, "ddp_bucketed").DDPBucketed(model, bucket_size_mb=1000 / 2**20,
                                                          first_bucket_mb=200 / 2**20)
    else:
        raise ValueError(contender)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return wrapped, optimizer, scheduler


def _worker_ddp(rank: int, world_size: int, contenders: list[str], tmp: str) -> dict:
    results = {}
    for contender in contenders:
        path = Path(tmp) / f"{contender}-rank{rank}.pt"
        model, optimizer, scheduler = _build(contender, seed=rank)
        evals = _train(model, optimizer, scheduler, range(RESTART_AT), rank, world_size, "no_sync")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, path)
        dist.barrier()
        del model, optimizer, scheduler  # the restart: fresh objects, another initialisation
        model, optimizer, scheduler = _build(contender, seed=10 + rank)
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        evals += _train(model, optimizer, scheduler, range(RESTART_AT, STEPS), rank, world_size, "flag")
        results[contender] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                              "evals": evals}
    return results


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert got["state"].keys() == expected["state"].keys(), f"{what}: state_dict keys differ"
    for name, t in expected["state"].items():
        diff = (got["state"][name].double() - t.double()).abs().max().item()
        assert torch.equal(got["state"][name], t), f"{what}, {name}: max abs diff {diff:.3e} (expected bitwise equal)"
    assert got["evals"] == expected["evals"], f"{what}: eval losses {got['evals']} vs {expected['evals']}"


@pytest.mark.exercise("3.12-3.14 DDP buckets")
def test_course_ddp_in_a_torch_training_loop_matches_torch_ddp(tmp_path):
    # Both course wrappers in one world: starting worlds is the slow part.
    ranks = run_distributed(_worker_ddp, WORLD_SIZE, ["torch_ddp", "course_overlap", "course_bucketed"],
                            str(tmp_path), timeout_s=120)
    for rank, results in enumerate(ranks):  # rank by rank: BatchNorm's running stats differ between ranks
        for contender in ("course_overlap", "course_bucketed"):
            _assert_same(results[contender], results["torch_ddp"], f"rank {rank}, {contender} vs torch DDP")
    for name, t in ranks[0]["torch_ddp"]["state"].items():  # and the replicas agree on the parameters
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(ranks[1]["torch_ddp"]["state"][name], t), f"torch DDP's replicas differ at {name}"
