"""Nothing lost: starting over deletes only the course's checkpoints, and a resume that does not fit is refused.

``--fresh`` (demos/fault_tolerance.py, demos/imagenet.py) goes through ``RunDirectory.start_over``
(distlab/lessons/resume.py, ckpt_entries.py): the directory's lock first, then the course's own
``step_*`` entries only. A directory that holds anything else (a checkout, a folder of runs, a link
out of it) is refused with one line naming what is there, and nothing is deleted. A resume whose newest
checkpoint was written with other settings, or whose checkpoints all fail to load, is refused with one
line, every file left as it was; the run that wrote them resumes afterwards. A directory deleted during
a run is reported at the next save, not recreated.

The baseline of "nothing lost" is the tree itself: every path, file content and link target before,
compared with after (``_snapshot``).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlab import load
from distlab.lessons import ckpt_entries, resume
from distlab.procs import kill_process_tree, marked_environ
from distlab.spawn import run_distributed

PHASE = "phase4_production"
REPO = Path(__file__).resolve().parents[1]


def _snapshot(root: Path) -> dict[str, object]:
    """Every path under ``root``: a link's target, a file's bytes, or "dir" (links are not followed)."""
    tree = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            tree[key] = ("link", os.readlink(path))
        elif path.is_dir():
            tree[key] = "dir"
        else:
            tree[key] = path.read_bytes()
    return tree


def _saved(directory: Path, steps=(2, 4), config: dict | None = None) -> None:
    """A run of one process that saved ``steps`` in ``directory`` (and let it go)."""
    ckpt = load(PHASE, "checkpoint")
    with ckpt.CheckpointManager(directory, config=config) as manager:
        for step in steps:
            manager.save(step, {"w": torch.full((3,), float(step)), "step": step})


def _checkout(root: Path) -> Path:
    """A folder as a user's checkout looks: history, sources, uncommitted notes, and checkpoints."""
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "README.md").write_text("mine\n")
    (root / "notes.txt").write_text("uncommitted\n")
    _saved(root)
    return root


# --------------------------------------------------------------------------- --fresh
def test_starting_over_in_a_folder_with_anything_else_is_refused_and_deletes_nothing(tmp_path):
    checkout = _checkout(tmp_path / "checkout")
    before = _snapshot(checkout)
    manager = load(PHASE, "checkpoint").CheckpointManager(checkout)
    with pytest.raises(ckpt_entries.ForeignEntriesError) as refused:
        manager.start_over()
    message = str(refused.value)
    assert "\n" not in message and "3 entries this course did not write (.git/, README.md, notes.txt)" in message \
        and "nothing was deleted" in message, message
    assert _snapshot(checkout) == before, "a refused --fresh changed the folder"


def test_starting_over_never_follows_a_link_out_of_the_directory(tmp_path):
    outside = tmp_path / "elsewhere"
    _saved(outside)  # course-shaped entries: only the link makes them reachable
    for case in ("a step that is a link", "a file in a step that is a link"):
        directory = tmp_path / case.replace(" ", "_")
        _saved(directory)
        if case == "a step that is a link":
            (directory / "step_00000008").symlink_to(outside / "step_00000004", target_is_directory=True)
        else:
            (directory / "step_00000002" / "rank1.pt").symlink_to(outside / "step_00000004" / "rank0.pt")
        before, there = _snapshot(directory), _snapshot(outside)
        with pytest.raises(ckpt_entries.ForeignEntriesError, match="a symbolic link"):
            load(PHASE, "checkpoint").CheckpointManager(directory).start_over()
        assert _snapshot(directory) == before and _snapshot(outside) == there, f"{case}: something was deleted"


def test_starting_over_removes_only_the_course_entries_and_keeps_the_directory(tmp_path):
    directory = tmp_path / "ckpt"
    _saved(directory, steps=(2, 4, 6))
    (directory / "step_00000008.tmp").mkdir()  # a save that died: staging and the temporary file of a write
    (directory / "step_00000008.tmp" / ".rank0.pt.tmp4242").write_bytes(b"half")
    shutil.copytree(directory / "step_00000002", directory / "step_00000002.other-run-0123abcd")
    ckpt = load(PHASE, "checkpoint")
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.start_over() == 14  # 3 steps of 2 files + their 3 directories, staging 1 + 1, moved 2 + 1
        assert list(directory.iterdir()) == [], f"left {sorted(p.name for p in directory.iterdir())}"
        assert manager.restore(lambda c: None) is None  # nothing to resume: the run starts at step 0
    assert resume.lock_path(directory).exists(), "the lock beside the directory is the run's, not deleted"


_HOLDER = "import sys; from distlab.lessons import resume; resume.hold(sys.argv[1], 'a' * 32); print('held', flush=True); " \
          "sys.stdin.read()"


def test_starting_over_takes_the_lock_first_so_a_running_run_loses_nothing(tmp_path):
    directory = tmp_path / "ckpt"
    _saved(directory)
    before = _snapshot(directory)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert holder.stdout.readline() == "held\n", "the holder process did not take the lock"
        with pytest.raises(resume.CheckpointDirectoryError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            load(PHASE, "checkpoint").CheckpointManager(directory).start_over()
    finally:
        holder.kill()
        holder.wait()
    assert _snapshot(directory) == before, "--fresh deleted a running run's checkpoints before it was refused"


def test_fault_tolerance_fresh_on_a_checkout_is_one_line_and_the_checkout_is_whole(tmp_path):
    """The reported case: ``RUN_MODE=fault_tolerance ./entrypoint.sh --ckpt-dir . --steps 4 --fresh``
    (entrypoint.sh runs in the checkout: ``.`` is the checkout) emptied it, .git included."""
    checkout = _checkout(tmp_path / "checkout")
    before = _snapshot(checkout)
    marker = os.urandom(8).hex()
    proc = subprocess.Popen([str(REPO / "entrypoint.sh"), "--ckpt-dir", str(checkout), "--steps", "4", "--fresh"],
                            cwd=REPO, env={**marked_environ(marker), "RUN_MODE": "fault_tolerance", "NPROC": "2",
                                           "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_process_tree(proc.pid, marker)
        proc.wait()
    assert proc.returncode == 1 and output.count("starting over (--fresh) is refused") == 1 \
        and "Traceback" not in output, output
    assert _snapshot(checkout) == before, "--fresh changed the checkout"


# --------------------------------------------------------------------------- resumes that do not fit
def test_a_resume_with_other_settings_is_refused_naming_them_and_touches_nothing(tmp_path):
    ckpt = load(PHASE, "checkpoint")
    directory = tmp_path / "ckpt"
    written = {"model": "vit_tiny", "strategy": "ddp or ours", "optimizer": "SGD"}
    _saved(directory, config=written)
    before = _snapshot(directory)
    other = {**written, "model": "resnet18", "strategy": "zero-2"}
    loaded = []
    with ckpt.CheckpointManager(directory, config=other) as manager:
        with pytest.raises(resume.ResumeRefused) as refused:
            manager.restore(loaded.append)
        with pytest.raises(resume.ResumeRefused):  # and no save of this run replaces them either
            manager.restore(loaded.append)
    message = str(refused.value)
    assert "model vit_tiny, this run resnet18; strategy ddp or ours, this run zero-2" in message \
        and "step_00000004" in message and "--fresh" in message and "\n" not in message, message
    assert loaded == [] and _snapshot(directory) == before, "a refused resume loaded or changed a checkpoint"
    with ckpt.CheckpointManager(directory, config=written) as manager:  # the run that wrote them carries on
        assert manager.restore(loaded.append).step == 4 and [c.step for c in loaded] == [4]


def test_a_directory_where_nothing_loads_is_refused_not_restarted_over(tmp_path):
    ckpt = load(PHASE, "checkpoint")
    directory = tmp_path / "ckpt"
    _saved(directory)
    before = _snapshot(directory)

    def refuse(found):
        raise KeyError("zero")  # what another strategy's loader raised in the reported case

    with ckpt.CheckpointManager(directory) as manager, pytest.warns(UserWarning, match="falling back"):
        with pytest.raises(resume.ResumeRefused, match=r"none of the 2 checkpoint\(s\) .* loads into this run "
                                                       r"\(step_00000004: KeyError: 'zero'; step_00000002: "):
            manager.restore(refuse)
    assert _snapshot(directory) == before, "a refused resume changed the directory"


def test_a_directory_deleted_during_the_run_is_reported_not_recreated(tmp_path):
    ckpt = load(PHASE, "checkpoint")
    directory = tmp_path / "ckpt"
    with ckpt.CheckpointManager(directory) as manager:
        manager.save(2, {"step": 2})
        shutil.rmtree(directory)  # an operator's cleanup, or a wrong --ckpt-dir of another job
        with pytest.raises(resume.CheckpointDirectoryError,
                           match=r"was deleted while this run used it \(last saved: step 2\); it is not recreated"):
            manager.save(4, {"step": 4})
    assert not directory.exists(), "the deleted directory was recreated"


def _worker_capstone_mismatch(rank, world_size, directory):
    from demos import imagenet

    tiny = ["--image-size", "8", "--global-batch", "8", "--max-steps", "2", "--checkpoint-every", "2",
            "--checkpoint-dir", directory]
    imagenet.main(["--model", "vit_tiny", *tiny])
    said = []
    for change in (["--model", "vit_tiny", "--strategy", "zero"], ["--model", "resnet18"]):
        try:
            imagenet.main([*change, *tiny, "--max-steps", "4"])
            said.append(None)
        except resume.ResumeRefused as exc:
            said.append(str(exc))
    return said


def test_capstone_resumed_with_another_strategy_or_model_is_refused(tmp_path):
    """The reported case: a ``--model vit_tiny`` checkpoint resumed with ``--strategy zero`` warned
    ``KeyError: 'zero'``, moved the checkpoint aside as another run's and trained from step 0."""
    directory = tmp_path / "ckpt"
    said = run_distributed(_worker_capstone_mismatch, 2, str(directory), timeout_s=180)
    for rank, (zero, resnet) in enumerate(said):
        assert zero is not None and "strategy ddp or ours, this run zero-1" in zero, f"rank {rank}: {zero}"
        assert resnet is not None and "model vit_tiny, this run resnet18" in resnet, f"rank {rank}: {resnet}"
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000002"], "a refused resume left or moved files"


# --------------------------------------------------------------------------- other folders a run cleans
def test_a_checks_trace_folder_loses_only_the_traces_raw_files(tmp_path):
    """``python -m distlab check ID --trace DIR`` clears the raw files of its previous worlds; ``DIR/raw``
    may be a folder of the user's (it removed the whole of it)."""
    from distlab.trace import RAW, clear_raw

    raw, outside = tmp_path / "trace" / RAW, tmp_path / "outside.rank0.json"
    raw.mkdir(parents=True)
    outside.write_text("{}")
    for name in ("w1.rank0.json", "w1.rank1.json"):
        (raw / name).write_text("{}")
    (raw / "notes.txt").write_text("mine")
    (raw / "photos").mkdir()
    (raw / "photos" / "a.rank0.json").write_text("{}")
    (raw / "link.rank2.json").symlink_to(outside)
    assert clear_raw(tmp_path / "trace") == 2
    assert sorted(p.name for p in raw.iterdir()) == ["link.rank2.json", "notes.txt", "photos"]
    assert (raw / "photos" / "a.rank0.json").exists() and outside.read_text() == "{}"
