"""Phase 5: sharded checkpoints saved at W ranks and loaded at W' (2->1, 2->3, 4->2).

A world of W ranks trains an FSDP2 model (uneven shards: 7 and 5 rows do not divide by
2, 3 or 4), saves model + AdamW state + the loader position with the course's format
and with ``torch.distributed.checkpoint``, and rank 0 keeps the *unsharded* state
(every DTensor's ``full_tensor()``). A second world of W' ranks, sharing the tmp dir,
loads both into a differently initialised model and must reproduce that state bit for
bit (a copy reorders no sum: ``torch.equal``).
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distlab import load
from distlab.comm import CommLedger
from distlab.spawn import run_distributed
from distlab.models import seeded
from distlab.testing import assert_at_most, assert_equal, assert_tensors_close, max_abs_diff, shard

from property_checks_p5 import LoadLog

PHASE = "phase5_large_models"
LOADER = {"epoch": 1, "position": 24}  # the data loader's place: must come back with the weights


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


def _build(seed: int):
    model = seeded(_Net, seed)
    for unit in (model.a, model.b, model):
        fully_shard(unit)  # FSDP2 on the world: every parameter and its Adam state Shard(0)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _train(model, opt, rank, world_size, steps, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 6, generator=g), torch.randn(12, 5, generator=g)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()


def _state(model, opt) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "loader": dict(LOADER)}


def _unsharded(state: dict, lesson) -> dict:
    """Every tensor whole (collective for DTensors), every plain value as is, by flat key."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone()) if torch.is_tensor(v) else v
            for k, v in lesson.flatten(state).items()}


def _worker_save(rank, world_size, tmp, asynchronous):
    lesson = load(PHASE, "sharded_checkpoint")
    model, opt = _build(seed=0)
    _train(model, opt, rank, world_size, steps=2)
    state = _state(model, opt)
    reference = _unsharded(state, lesson)
    if rank == 0:
        torch.save(reference, Path(tmp) / "reference.pt")
    if not asynchronous:
        ledger = CommLedger()
        with ledger:
            lesson.save_sharded(state, Path(tmp) / "ours")
        # Sharded: no tensor is gathered or reduced, only the index is exchanged.
        moved = {op for op in ("all_reduce", "all_gather", "all_gather_into_tensor", "gather", "broadcast", "send")
                 if ledger.calls(op)}
        assert_equal(sorted(moved), [], f"rank {rank}: save_sharded communicated tensors: {ledger.summary()}")
        written = sum(v.numel() for v in torch.load(Path(tmp) / "ours" / f"rank{rank}.pt").values())
        # At most a torch.chunk share (ceil(rows/W) rows) of each sharded tensor; the
        # replicated scalars (Adam's step) only on rank 0.
        tensors = [v for v in reference.values() if torch.is_tensor(v)]
        bound = sum(-(-v.shape[0] // world_size) * v[0].numel() if v.dim() else int(rank == 0) for v in tensors)
        if world_size > 1:
            assert bound < sum(v.numel() for v in tensors), f"test setup: the bound {bound} is the whole state"
            assert_at_most(written, bound, f"rank {rank}: wrote {written} elements, expected at most {bound} "
                                           f"(1/{world_size} of the state)")
        dcp.save(state, checkpoint_id=str(Path(tmp) / "dcp"))  # torch's twin, same state
        return
    gate = threading.Event()

    def gated_write(obj, path):  # the disk is slow: nothing is written until the test says so
        gate.wait(timeout=30)
        lesson.write_file(obj, path)

    # The test's own copy of this rank's local pieces at the save (DTensor.to_local, not the lesson's code).
    at_save = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in lesson.flatten(state).items() if torch.is_tensor(v)}
    handle = lesson.async_save_sharded(state, Path(tmp) / "ours", write=gated_write)
    _train(model, opt, rank, world_size, steps=2, first=2)  # the next steps run while it saves
    pending = not handle.done()
    gate.set()
    handle.wait()
    assert pending, f"rank {rank}: the save had finished before the training steps were over (not async)"
    # Written after two more steps, yet a snapshot: bitwise the values at the save (a copy reorders no sum).
    for key, piece in torch.load(Path(tmp) / "ours" / f"rank{rank}.pt", weights_only=True).items():
        if not torch.equal(piece, at_save[key]):
            raise AssertionError(f"rank {rank}: rank{rank}.pt holds {key} as it was after the later steps "
                                 f"(max abs diff {max_abs_diff(piece, at_save[key]):.3e} from the save's): the "
                                 "pieces are views of the live tensors; copy them (.detach().clone()) when saving")
    after = _unsharded(_state(model, opt), lesson)
    assert max_abs_diff(after["model/a.weight"], reference["model/a.weight"]) > 1e-4, \
        f"rank {rank}: the steps after the save did not change the weights, the test proves nothing"


def _worker_load(rank, world_size, tmp, formats):
    lesson = load(PHASE, "sharded_checkpoint")
    reference = torch.load(Path(tmp) / "reference.pt", weights_only=True)
    for fmt in formats:
        model, opt = _build(seed=1)  # other weights: everything must come from the checkpoint
        _train(model, opt, rank, world_size, steps=1, first=50)  # and other optimizer state
        state = _state(model, opt)
        state["loader"] = {"epoch": 0, "position": 0}
        if fmt == "dcp":
            dcp.load(state, checkpoint_id=str(Path(tmp) / "dcp"))
        else:
            with LoadLog() as log:
                state = lesson.load_sharded(state, Path(tmp) / "ours")
            # A rank file may be far larger than this rank's box: mapped, only the pages it copies are read.
            assert_equal(bool(log.loads), True, f"rank {rank}: load_sharded read no rank file with torch.load(path)")
            assert_equal(log.not_mapped(), [], f"rank {rank}: load_sharded read {log.not_mapped()} whole into "
                                               "memory; open each rank file with torch.load(..., mmap=True)")
            names = [name for name, _ in log.loads]
            again = sorted({n for n in names if names.count(n) > 1})
            assert_equal(again, [], f"rank {rank}: load_sharded opened {again} more than once; keep them in `files`")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = _unsharded(_state(model, opt), lesson)
        assert_equal(state["loader"], LOADER, f"rank {rank}, {fmt}: loader position {state['loader']}, saved {LOADER}")
        assert_equal(sorted(got), sorted(reference), f"rank {rank}, {fmt}: keys {sorted(got)} != {sorted(reference)}")
        for key, want in reference.items():
            if torch.is_tensor(want):
                assert_tensors_close(got[key], want, f"rank {rank} of {world_size}, {fmt}: {key} differs from the "
                                     "unsharded state", rtol=0, atol=0, baseline=False)


@pytest.mark.exercise("5.11-5.12")
@pytest.mark.parametrize("saved_at,loaded_at", [(2, 1), (2, 3), (4, 2)])
def test_sharded_checkpoint_reshards_bit_exact_like_dcp(saved_at, loaded_at, tmp_path):
    run_distributed(_worker_save, saved_at, str(tmp_path), False)
    run_distributed(_worker_load, loaded_at, str(tmp_path), ["ours", "dcp"])


@pytest.mark.exercise("5.13")
def test_async_save_overlaps_steps_and_keeps_the_snapshot(tmp_path):
    run_distributed(_worker_save, 2, str(tmp_path), True)
    run_distributed(_worker_load, 3, str(tmp_path), ["ours"])


def _worker_async_failure(rank, world_size, tmp):
    """Rank 1's file cannot be written (a directory holds its name): its wait() must raise the error."""
    lesson = load(PHASE, "sharded_checkpoint")
    model, opt = _build(seed=0)
    _train(model, opt, rank, world_size, steps=1)
    directory = Path(tmp) / "failing"
    if rank == 1:
        (directory / "rank1.pt").mkdir(parents=True)  # os.replace(file, directory) fails: IsADirectoryError
    dist.barrier()  # the obstacle is in place before anyone saves
    handle = lesson.async_save_sharded(_state(model, opt), directory)
    raised = None
    try:
        handle.wait()
    except OSError as exc:
        raised = exc
        dist.barrier()  # the ranks whose writes succeeded wait in wait()'s barrier: release them
    assert_equal(raised is not None, rank == 1, (
        f"rank {rank}: wait() raised {raised!r}" if raised is not None else
        f"rank {rank}: the write of rank1.pt failed on the writer thread but wait() returned: the error was "
        "lost; record the thread's exception in `errors` (wait() re-raises it)"))


@pytest.mark.exercise("5.13")
def test_async_save_failure_on_one_rank_surfaces_in_its_wait(tmp_path):
    run_distributed(_worker_async_failure, 2, str(tmp_path))
