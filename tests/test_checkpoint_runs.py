"""One run per checkpoint directory, and nothing a run did not write is ever lost to it.

The bench of ``CheckpointManager`` (distlab/lessons/resume.py; given code, not graded). Each test is a probe
that once lost data, made deterministic:

* another experiment's *newer* checkpoints (they verify, but do not load) were counted by keep-N
  pruning, and deleted every checkpoint of the new run: pruning counts this run's lineage only;
* a second run writing the same directory was not refused, and a step could end up with rank files
  of two runs that passed verification: the directory is locked, and every rank file carries the
  run's id, the step and the rank, so a torn step fails verification;
* a checkpoint the process may not read crashed the resume with a bare PermissionError: it is
  skipped like a corrupted one; a full disk leaves no partial file and names the path, on every rank.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import socket
import stat
import subprocess
import sys
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
REPO = Path(__file__).resolve().parent.parent


def _state(step: int, rank: int) -> dict:
    return {"step": step, "rank": rank, "w": torch.full((3,), float(step * 10 + rank))}


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught]


# --------------------------------------------------------------------------- pruning
def _worker_foreign_newer(rank, world_size, directory, other):
    torch.set_num_threads(1)
    import demos.fault_tolerance as ft

    cfg = ft.RunConfig(steps=8, ckpt_every=2, keep=3, ckpt_dir=directory)
    ft.train(rank, world_size, cfg)  # from step 0: saves steps 2, 4, 6, 8
    if rank == 0:  # then another experiment's newer steps land in the directory
        for step in Path(other).iterdir():
            shutil.copytree(step, Path(directory) / step.name)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one "cannot resume" per foreign step: tests/test_checkpoint_fallback.py
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ft.train(rank, world_size, replace(cfg, steps=12))  # the restart: from step 8, saves 10 and 12
    return out.getvalue()


def test_pruning_never_counts_nor_deletes_another_experiments_newer_checkpoints(tmp_path):
    """Another experiment (another model) left steps 14, 16, 18 in the directory after the harness run
    saved 2-8. Its restart skips them (they verify, but do not load), resumes from 8 and saves 10 and 12
    with keep=3: it keeps its own 8, 10, 12 and leaves the others byte for byte; counting them kept 0
    of its own."""
    ckpt = load(PHASE, "checkpoint")
    directory, other = tmp_path / "ckpt", tmp_path / "other"
    with ckpt.CheckpointManager(other) as manager:  # closed: the lock is free for the run
        for step in (14, 16, 18):
            manager.save(step, {"model": {"weight": torch.zeros(7)}})
    foreign = {p.relative_to(other): p.read_bytes() for p in other.rglob("*.pt")}
    printed = run_distributed(_worker_foreign_newer, 2, str(directory), str(other), timeout_s=120)[0]
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["step_00000008", "step_00000010", "step_00000012", "step_00000014", "step_00000016",
                     "step_00000018"], f"expected this run's 8, 10, 12 and the other run's 14, 16, 18: {names}"
    assert {path: (directory / path).read_bytes() for path in foreign} == foreign, "the other experiment's files changed"
    assert f"resumed from {directory / 'step_00000008'} (step 8" in printed, f"the restart did not resume: {printed}"


def test_pruning_keeps_the_step_it_saved_when_a_newer_one_of_its_lineage_does_not_load(tmp_path):
    """A restart that could not load its own step 4 resumes from step 2 and saves step 3 with keep=1:
    step 3 (the newest that loads) is kept, step 4 is left to look at, step 2 is pruned."""
    ckpt = load(PHASE, "checkpoint")
    with ckpt.CheckpointManager(tmp_path, keep=2) as first:
        first.save(2, _state(2, 0))
        first.save(4, _state(4, 0))

    def refuse_4(found):  # e.g. a weights_only refusal, or a reshard the loader cannot do
        if found.step == 4:
            raise ValueError("step 4 does not load")
        found.load(0)

    with warnings.catch_warnings(record=True), ckpt.CheckpointManager(tmp_path, keep=1) as restart:
        warnings.simplefilter("always")
        assert restart.restore(refuse_4).step == 2
        restart.save(3, _state(3, 0))
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    assert names == ["step_00000003", "step_00000004"], f"keep=1 after resuming from 2 and saving 3 left {names}"


# --------------------------------------------------------------------------- one writer
_HOLDER = "import sys; from distlab.lessons import resume; resume.hold(sys.argv[1], 'a' * 32); print('held', flush=True); " \
          "sys.stdin.read()"


def _worker_refused(rank, world_size, directory):
    ckpt = load(PHASE, "checkpoint")
    said = []
    for attempt in (lambda m: m.restore(lambda c: None), lambda m: m.save(2, _state(2, rank))):
        try:
            attempt(ckpt.CheckpointManager(directory))
            said.append(None)
        except resume.CheckpointDirectoryError as exc:
            said.append(str(exc))
    return said


def test_a_second_run_is_refused_on_every_rank_naming_the_holder_until_it_dies(tmp_path):
    ckpt = load(PHASE, "checkpoint")
    directory = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert holder.stdout.readline() == "held\n", "the holder process did not take the lock"
        said = run_distributed(_worker_refused, 2, str(directory), timeout_s=60)
    finally:
        holder.kill()  # SIGKILL: no cleanup; the kernel releases its flock
        holder.wait()
    who = f"pid {holder.pid} on host {socket.gethostname()}"
    for rank, messages in enumerate(said):
        for what, message in zip(("restore", "save"), messages):
            assert message is not None and message == said[0][0] and who in message \
                and "another checkpoint directory" in message, \
                f"rank {rank}, {what}: expected the same refusal on every rank naming {who}, got {message}"
    assert not directory.exists(), f"a refused run wrote into {directory}: {list(directory.iterdir())}"
    with ckpt.CheckpointManager(directory) as manager:  # its holder is dead: the lock is free
        manager.save(2, _state(2, 0))
    assert f'"pid": {os.getpid()}' in resume.lock_path(directory).read_text()


# --------------------------------------------------------------------------- torn steps, full disks
def _worker_torn_and_full(rank, world_size, root):
    ckpt = load(PHASE, "checkpoint")
    root = Path(root)
    with ckpt.CheckpointManager(root / "a") as a, ckpt.CheckpointManager(root / "b") as b:
        a.save(2, _state(2, rank))
        a.save(4, _state(4, rank))
        b.save(4, _state(40, rank))
    if rank == 0:  # step 4's rank-1 file from another run at the same step, or from the same run's step 2
        shutil.copytree(root / "a", root / "other step")
        shutil.copy(root / "b" / "step_00000004" / "rank1.pt", root / "a" / "step_00000004" / "rank1.pt")
        shutil.copy(root / "a" / "step_00000002" / "rank1.pt", root / "other step" / "step_00000004" / "rank1.pt")
    dist.barrier()
    for case, why in (("a", "written by run"), ("other step", "at step 2 as rank 1")):
        manager = ckpt.CheckpointManager(root / case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert manager.latest().step == 2, f"rank {rank}, {case}: a torn step 4 must fail verification"
            loaded = []
            found = manager.restore(lambda c: loaded.append(c.load(rank)))
        said = _messages(caught)
        assert found.step == 2 and torch.equal(loaded[-1]["w"], _state(2, rank)["w"]), \
            f"rank {rank}, {case}: resumed from {found}"
        assert len(said) == 2 and all(m.startswith("skipping checkpoint step_00000004") and "step_00000004/rank1.pt"
                                      in m and why in m and "torn" in m for m in said), \
            f"rank {rank}, {case}: expected one warning per look naming step 4's rank1.pt as torn: {said}"
        manager.close()
    with pytest.raises(ckpt.CheckpointError, match="rank1.pt: it was written by run .* torn"):
        ckpt.Checkpoint(4, 2, root / "a" / "step_00000004").load(1)  # a file torn after it was verified

    # Rank 1's disk is full: both ranks raise (no hang), nothing of step 6 is left, steps 2 and 4 are whole.
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = full if rank == 1 else real_fsync
    try:
        with ckpt.CheckpointManager(root / "b") as manager:
            manager.save(6, _state(6, rank))
        raise AssertionError(f"rank {rank}: a save with rank 1's disk full returned")
    except (OSError, RuntimeError) as exc:
        error = exc
    finally:
        os.fsync = real_fsync
    if rank == 1:
        assert isinstance(error, OSError) and error.errno == errno.ENOSPC and \
            str(root / "b" / "step_00000006.tmp" / "rank1.pt") in str(error), f"rank 1: {error!r}"
    else:
        assert "rank(s) 1 could not write its file for step 6" in str(error), f"rank 0: {error!r}"
    dist.barrier()
    left = sorted(p.relative_to(root / "b").as_posix() for p in (root / "b").rglob("*"))
    assert left == ["step_00000004", "step_00000004/meta.pt", "step_00000004/rank0.pt", "step_00000004/rank1.pt"], \
        f"rank {rank}: a failed save of step 6 left {left}"


def test_torn_checkpoints_fail_verification_and_a_full_disk_fails_every_rank(tmp_path):
    run_distributed(_worker_torn_and_full, 2, str(tmp_path), timeout_s=60)


def test_save_file_on_a_full_disk_names_the_path_and_leaves_the_previous_file(tmp_path, monkeypatch):
    ckpt = load(PHASE, "checkpoint")
    path = tmp_path / "rank0.pt"
    ckpt.save_file(_state(2, 0), path)

    def full(fd):  # where a full disk often surfaces: the data is flushed at fsync
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"No space left on device: cannot write checkpoint file {path}") as info:
        ckpt.save_file(_state(4, 0), path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.pt"], "a temporary file was left behind"
    assert torch.equal(ckpt.load_file(path)["w"], _state(2, 0)["w"]), "the previous file changed"


# --------------------------------------------------------------------------- unreadable checkpoints
def _deny_like_the_kernel(monkeypatch) -> None:
    """Make opening a mode-000 file, or a path through a mode-000 directory, raise PermissionError.

    Root bypasses permission bits (CAP_DAC_OVERRIDE) and the suite runs as root in containers, so
    there the refusal a non-root process gets from the kernel is faked at ``open``; as any other user
    the kernel's own check is what the test meets.
    """
    if os.geteuid() != 0:
        return
    real_open = io.open

    def denied(file) -> bool:
        path = Path(os.fsdecode(file)).absolute()
        return any(p.exists() and stat.S_IMODE(p.stat().st_mode) == 0 for p in (path, *path.parents))

    def fake_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and denied(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(builtins, "open", fake_open)


@pytest.mark.parametrize("unreadable", ["step directory", "rank file"])
def test_an_unreadable_checkpoint_is_skipped_like_a_corrupted_one(unreadable, tmp_path, monkeypatch):
    ckpt = load(PHASE, "checkpoint")
    with ckpt.CheckpointManager(tmp_path) as manager:
        manager.save(2, _state(2, 0))
        manager.save(4, _state(4, 0))
    newest = tmp_path / "step_00000004"
    target = newest if unreadable == "step directory" else newest / "rank0.pt"
    target.chmod(0)
    _deny_like_the_kernel(monkeypatch)
    try:
        with warnings.catch_warnings(record=True) as caught, ckpt.CheckpointManager(tmp_path) as manager:
            warnings.simplefilter("always")
            loaded = []
            found = manager.restore(lambda c: loaded.append(c.load(0)))
    finally:
        monkeypatch.undo()
        target.chmod(0o755)
    said = _messages(caught)
    assert found.step == 2 and torch.equal(loaded[0]["w"], _state(2, 0)["w"]), f"{unreadable}: resumed from {found}"
    assert len(said) == 1 and "skipping checkpoint step_00000004" in said[0] and "Permission denied" in said[0], \
        f"{unreadable}: expected one warning naming step 4 and the permission error, got {said}"

