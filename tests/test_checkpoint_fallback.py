"""Checkpoints never lose the last good state: a checkpoint that does not load is skipped, never fatal.

The resume path of the fault-tolerance harness (demos/fault_tolerance.py, RUN_MODE=fault_tolerance)
and ``CheckpointManager.restore`` (given code, not an exercise: these tests are not graded). Each
case saves a few checkpoints, damages the newest the way it happens in practice, and resumes:

* a forged header (the checksum recomputed over a pickle that would run code): refused by
  ``weights_only``, never run, and the previous checkpoint taken;
* another model's checkpoint (shape mismatch), a checkpoint of another world size that the
  loader cannot reshard: the previous checkpoint taken;
* nothing loadable: refused on every rank (``ResumeRefused``), every file left as it was, never a silent
  start from step 0 over them; ``--fresh`` starts over (tests/test_checkpoint_fresh.py); a stale resume
  (``--steps`` below the checkpoint): an error that says what to change; a checkpoint "directory" that is
  a file: an error naming it.

The baseline is an uninterrupted run of the same harness in the same world: a resume from the
previous checkpoint must reproduce it bitwise (same world size, kernels and order of sums), and
every skipped checkpoint must cost exactly one warning per rank, naming the directory and the reason.
"""
from __future__ import annotations

import hashlib
import io
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import load
from distlab.lessons import resume
from distlab.spawn import run_distributed

PHASE = "phase4_production"


class _Opens:
    """Unpickled by a plain ``pickle.load``, this would create the marker file: it must never be."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _forge(path: Path, extra: object) -> None:
    """Rewrite the checkpoint file ``path`` with ``extra`` added to its state and a freshly computed
    header: the checksum matches, so only ``weights_only`` stands between the file and the loader."""
    ckpt = load(PHASE, "checkpoint", impl="solutions")
    state = ckpt.load_file(path)
    state["x"] = extra
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path.write_bytes(ckpt.MAGIC + ckpt._HEADER.pack(len(payload), hashlib.sha256(payload).digest()) + payload)


def _other_model(path: Path) -> None:
    """Replace the model in ``path`` (a rank-0 file) by one of another width, validly checksummed."""
    ckpt = load(PHASE, "checkpoint", impl="solutions")
    state = ckpt.load_file(path)
    state["model"] = {k: torch.zeros(v.shape[0], 7) if v.dim() == 2 else v for k, v in state["model"].items()}
    ckpt.save_file(state, path)


def _train(ft, cfg) -> tuple[dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = ft.train(dist.get_rank(), dist.get_world_size(), cfg)
    return final, [str(w.message) for w in caught if "checkpoint" in str(w.message)]


def _assert_bitwise(final: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        # Same world size, kernels and all-reduce order: a correct resume is bitwise the uninterrupted run.
        assert torch.equal(final[name], value), \
            f"{what}: {name} differs from the uninterrupted run by {(final[name] - value).abs().max().item():.3e}"


def _worker_harness_fallbacks(rank, world_size, root):
    torch.set_num_threads(1)
    import demos.fault_tolerance as ft

    root = Path(root)
    cfg = ft.RunConfig(steps=8, ckpt_dir=str(root / "baseline"))
    expected, _ = _train(ft, cfg)                                   # uninterrupted: steps 0..7
    _train(ft, replace(cfg, steps=6, ckpt_dir=str(root / "saved")))  # checkpoints at steps 2, 4, 6
    cases = {}
    for case in ("forged", "other model", "stale", "nothing loadable"):
        cases[case] = root / case.replace(" ", "_")
        if rank == 0:
            shutil.copytree(root / "saved", cases[case])
    marker = root / "the forged pickle ran"
    if rank == 0:
        _forge(cases["forged"] / "step_00000006" / "rank1.pt", _Opens(str(marker)))
        _other_model(cases["other model"] / "step_00000006" / "rank0.pt")
        bad = cases["nothing loadable"]
        _forge(bad / "step_00000006" / "rank1.pt", _Opens(str(marker)))
        _other_model(bad / "step_00000004" / "rank0.pt")
        meta = bad / "step_00000002" / "meta.pt"
        meta.write_bytes(meta.read_bytes()[:-1] + b"!")  # a flipped last byte: the checksum catches it
    dist.barrier()

    # A forged header: weights_only refuses the file, nothing runs, step 4 is taken.
    final, said = _train(ft, replace(cfg, ckpt_dir=str(cases["forged"])))
    assert not marker.exists(), f"rank {rank}: the forged pickle ran"
    assert len(said) == 1 and "step_00000006/rank1.pt" in said[0] and "Unsupported global" in said[0], \
        f"rank {rank}: expected one warning naming step_00000006/rank1.pt and the refused global, got {said}"
    _assert_bitwise(final, expected, f"rank {rank}, forged header at step 6, resumed from step 4")

    # Another model's checkpoint: the size mismatch names the directory, step 4 is taken.
    final, said = _train(ft, replace(cfg, ckpt_dir=str(cases["other model"])))
    assert len(said) == 1 and "step_00000006" in said[0] and "size mismatch" in said[0], \
        f"rank {rank}: expected one warning naming step_00000006 and the size mismatch, got {said}"
    _assert_bitwise(final, expected, f"rank {rank}, another model's checkpoint at step 6, resumed from step 4")

    # Nothing loadable (refused at 6, another model at 4, corrupted at 2): refused, every file as it was.
    bad = cases["nothing loadable"]
    before = {str(p.relative_to(bad)): p.read_bytes() for p in sorted(bad.rglob("*")) if p.is_file()}
    with warnings.catch_warnings(record=True) as caught, pytest.raises(resume.ResumeRefused) as refused:
        warnings.simplefilter("always")
        ft.train(rank, world_size, replace(cfg, ckpt_dir=str(bad)))
    said = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    assert len(said) == 3 and [s for s in said if "step_00000006" in s and "Unsupported global" in s] \
        and [s for s in said if "step_00000004" in s and "size mismatch" in s] \
        and [s for s in said if "step_00000002" in s and "checksum" in s], \
        f"rank {rank}: expected one warning per bad checkpoint (6, 4, 2); got {said}"
    assert "none of the 3 checkpoint(s)" in str(refused.value) and "--fresh" in str(refused.value), refused.value
    dist.barrier()  # every rank has read the directory
    after = {str(p.relative_to(bad)): p.read_bytes() for p in sorted(bad.rglob("*")) if p.is_file()}
    assert after == before, f"rank {rank}: a refused resume changed {sorted(set(after) ^ set(before))}"
    dist.barrier()  # every rank has compared before the next run starts over
    assert not marker.exists(), f"rank {rank}: the forged pickle ran"
    # Starting over explicitly: the course's entries go, and the run is bitwise the uninterrupted one.
    final, _ = _train(ft, replace(cfg, ckpt_dir=str(bad), fresh=True))
    _assert_bitwise(final, expected, f"rank {rank}, --fresh over checkpoints that do not load")

    # A stale resume: --steps 4 below the checkpoint's step 6 is an error saying what to change.
    with pytest.raises(ValueError, match=r"step_00000006 is at step 6, past --steps 4: pass --steps 6 or more"):
        ft.train(rank, world_size, replace(cfg, steps=4, ckpt_dir=str(cases["stale"])))


def test_harness_resumes_from_the_previous_checkpoint_when_the_newest_does_not_load(tmp_path):
    run_distributed(_worker_harness_fallbacks, 2, str(tmp_path), timeout_s=120)


def _worker_world_size(rank, world_size, directory):
    ckpt = load(PHASE, "checkpoint")
    manager = ckpt.CheckpointManager(directory)
    manager.save(2, {"rank": rank})  # by both ranks
    alone = dist.new_group([0])  # collective: every rank creates it
    if rank == 0:
        ckpt.CheckpointManager(directory, group=alone).save(4, {"rank": 0})  # by rank 0 alone: W=1
    dist.barrier()
    loaded = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = manager.restore(lambda c: loaded.append((c.step, c.load(rank))))  # no resharding: its own file
    said = [str(w.message) for w in caught]
    assert found is not None and found.step == 2 and loaded[-1] == (2, {"rank": rank}), \
        f"rank {rank}: expected both ranks on step 2 with their own file, got {found}, {loaded}"
    assert len(said) == 1 and "step_00000004" in said[0], f"rank {rank}: expected one warning, got {said}"
    why = "written by 1 ranks: it has no file for rank 1" if rank == 1 else "rank(s) 1 could not load it"
    assert why in said[0], f"rank {rank}: the warning must say {why!r}: {said[0]}"


def test_restore_moves_every_rank_past_a_checkpoint_of_another_world_size(tmp_path):
    run_distributed(_worker_world_size, 2, str(tmp_path / "ckpt"))


def test_a_checkpoint_directory_that_is_a_file_is_named(tmp_path):
    ckpt = load(PHASE, "checkpoint")
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint directory {path} is a file"):
        ckpt.CheckpointManager(path)


def test_an_unfinished_todo_in_the_load_path_stops_the_run_instead_of_starting_fresh(tmp_path):
    """A learner's TODO is a NotImplementedError, a RuntimeError like a bad load: it must not read as one."""
    from types import SimpleNamespace

    from distlab.lessons import resume
    from distlab.todo import LearnerTODO, todo

    found = SimpleNamespace(step=4, directory=tmp_path / "step_00000004")
    manager = SimpleNamespace(directory=tmp_path, checkpoints=lambda: iter([found]), _published=lambda: [found])

    def apply(_):
        raise todo("4.3b RNG state (restore)", "guidelines.md#what-a-checkpoint-must-hold")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping ... starting fresh" warning either
        with pytest.raises(LearnerTODO, match="4.3b"):
            resume.restore(manager, apply)
