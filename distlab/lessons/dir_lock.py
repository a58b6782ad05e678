"""One run per checkpoint directory: a ``flock`` beside it, named in the refusal of a second run.

Rank 0 of the manager's group holds an exclusive ``flock`` on a lock file beside the directory
(``<dir>.lock``; beside, so the directory holds nothing but checkpoints) with its pid, host and run id
written in it, and tells every rank (``take_directory``). A second run is refused on every rank with an
error naming the holder. The kernel releases a ``flock`` when its holder dies, however it dies, so a
killed run never blocks its restart (on NFS: when the server sees the client is gone). The managers of
one process share its one lock (a test, or a restart in the same process).

Used by ``distlab/lessons/resume.py`` (``RunDirectory``), which re-exports these names.
Tests: tests/test_checkpoint_runs.py.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist


class CheckpointDirectoryError(RuntimeError):
    """This run cannot take its checkpoint directory: another run holds it, or its lock file cannot be made."""


_HELD: dict[str, list[int]] = {}  # lock file -> [its fd, how many managers of this process hold it]


def lock_path(directory: str | Path) -> Path:
    """``<dir>.lock`` beside the directory (symbolic links resolved: two names of one directory share it)."""
    directory = Path(directory).resolve()
    return directory.with_name(directory.name + ".lock")


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text())
        return f"pid {who['pid']} on host {who['host']} (run {who['run'][:8]}, since {who['since']})"
    except (OSError, ValueError, KeyError, TypeError):  # written a moment after it was locked
        return "a process that has not yet written its pid"


def hold(directory: str | Path, run: str) -> str:
    """Lock ``directory`` for this process; return the key to ``release`` it with.

    Raises:
        CheckpointDirectoryError: another process holds it (naming its pid and host), or the lock
            file cannot be created.
    """
    import fcntl  # POSIX: flock is released by the kernel when its holder dies

    path = lock_path(directory)
    key = str(path)
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CheckpointDirectoryError(
            f"cannot lock checkpoint directory {directory}: cannot create {path}: {exc.strerror or exc}; the "
            "lock lives beside the directory: choose a checkpoint directory inside a folder this run can "
            "write") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointDirectoryError(
            f"checkpoint directory {directory} is in use by another run: {_holder(path)} holds {path}. Two runs "
            "writing one directory overwrite and tear each other's checkpoints: give this run another checkpoint "
            "directory, or stop the other run first (the lock is released when its holder exits or dies)") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": run,
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    _HELD[key] = [fd, 1]
    return key


def release(key: str) -> None:
    """Undo one ``hold``; the last one closes the file, which releases the lock."""
    held = _HELD.get(key)
    if held is not None:
        held[1] -= 1
        if held[1] == 0:
            os.close(_HELD.pop(key)[0])


def take_directory(directory: str | Path, group: dist.ProcessGroup | None = None) -> tuple[str | None, str]:
    """Rank 0 of ``group`` locks ``directory`` for a new run; every rank gets the run's id, or the same error.

    Returns ``(key, run)``: the key to ``release`` on rank 0 (None elsewhere) and the run's id.
    Collective: every rank of ``group``; one broadcast of a short string.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    key, refused, run = None, "", uuid.uuid4().hex
    if rank == 0:
        try:
            key = hold(directory, run)
        except CheckpointDirectoryError as exc:
            refused = str(exc)
    if dist.is_initialized() and dist.get_world_size(group) > 1:  # the other ranks never write before rank 0 holds it
        box = [(refused, run)]
        dist.broadcast_object_list(box, group_src=0, group=group)
        refused, run = box[0]
    if refused:
        raise CheckpointDirectoryError(refused)
    return key, run
