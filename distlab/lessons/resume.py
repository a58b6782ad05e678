"""The bench around ``CheckpointManager``: one run per directory, rank files of one run, resume from one that *loads*.

**One writer per directory.** A run takes its checkpoint directory before it restores or saves
(``take_directory``): rank 0 of the manager's group holds an exclusive ``flock`` on a lock file
beside the directory (``<dir>.lock``; beside, so the directory holds nothing but checkpoints) with
its pid, host and run id written in it, and tells every rank. A second run is refused on every rank
with an error naming the holder. The kernel releases a ``flock`` when its holder dies, however it
dies, so a killed run never blocks its restart (on NFS: when the server sees the client is gone).
The managers of one process share its one lock (a test, or a restart in the same process).

**Rank files of one run and one step.** Every rank file carries ``WRITTEN_BY``: the run's id, the
step and the rank. ``torn`` compares it with ``meta.pt``; reading it (``written_by``) costs the
pickle only, not the tensors' bytes.

**Resume from the newest checkpoint that loads, and every rank from the same one.** A checkpoint can
verify (its checksum matches) and still be unusable: a forged file that ``torch.load(weights_only=True)``
refuses, another model's checkpoint (a size mismatch in ``load_state_dict``), one written by a world
size the loader cannot reshard. ``restore`` tries the checkpoints a manager yields, newest first, and
moves on after a failure with one warning; only a run with nothing loadable starts fresh, and says so.
The ranks agree on every try, so a failure on one rank (its own file refused) moves all of them.

Used by ``CheckpointManager`` (phase4_production/checkpoint.py); see
phase4_production/guidelines.md#crash-safe-checkpoints. Tests: tests/test_checkpoint_fallback.py,
tests/test_checkpoint_runs.py.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import time
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

# What loading a checkpoint that does not fit raises: CheckpointError (a ValueError), a missing
# key, a ValueError of a loader, load_state_dict's RuntimeError. Anything else is a bug: it propagates.
LOAD_ERRORS = (KeyError, ValueError, RuntimeError)

WRITTEN_BY = "_written_by"  # the key of every rank file's {"run", "step", "rank"}


class CheckpointDirectoryError(RuntimeError):
    """This run cannot take its checkpoint directory: another run holds it, or its lock file cannot be made."""


# --------------------------------------------------------------------------- one writer per directory
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


# --------------------------------------------------------------------------- rank files of one run and step
class Window(io.RawIOBase):
    """The file ``f`` from byte ``start`` on: ``torch.load`` reads a payload stored behind a header."""

    def __init__(self, f: Any, start: int) -> None:
        self.f, self.start = f, start
        f.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self.f.readinto(buffer)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        return self.f.seek(self.start + pos if whence == io.SEEK_SET else pos, whence) - self.start

    def tell(self) -> int:
        return self.f.tell() - self.start


def written_by(path: Path, start: int) -> Any:
    """The ``WRITTEN_BY`` entry of the checkpoint file ``path`` (payload from byte ``start``), None if it has none.

    Unpickled with ``weights_only`` onto the meta device: the tensors' bytes are never read.
    Raises: OSError (unreadable); what ``torch.load`` raises for a payload it refuses.
    """
    with open(path, "rb") as f:
        state = torch.load(Window(f, start), map_location="meta", weights_only=True)
    return state.get(WRITTEN_BY) if isinstance(state, dict) else None


def untorn(checkpoints: Iterable[Any], start: int, warn: bool = True) -> Iterator[Any]:
    """The ``checkpoints`` (verified ones, newest first) whose every rank file carries their ``meta.pt``'s
    run, step and its own rank; a torn one is skipped with one warning (if ``warn``) naming the file.
    Cost: the pickle of each rank file (payload from byte ``start``), not its tensors' bytes."""
    for found in checkpoints:
        problem = None
        for r in range(found.world_size):
            path = found.path / f"rank{r}.pt"
            try:
                problem = torn(found.meta, r, written_by(path, start))
            except Exception as exc:  # unreadable, or refused by weights_only: nothing to resume from
                text = " ".join(str(exc).split())
                why = re.search(r"WeightsUnpickler error: (.*?)(?= Please use|$)", text)
                problem = f"cannot read its run id: {type(exc).__name__}: {why[1] if why else text}"
            if problem:
                problem = f"{path}: {problem}"
                break
        if problem is None:
            yield found
        elif warn:
            warnings.warn(f"skipping checkpoint {found.path.name}: {problem}; falling back to an older one",
                          stacklevel=3)


def torn(meta: dict, rank: int, who: Any) -> str | None:
    """What is wrong with rank file ``rank`` whose ``WRITTEN_BY`` is ``who``, in the checkpoint ``meta``
    describes; None when it is this checkpoint's (or the checkpoint predates run ids)."""
    if "run" not in meta:
        return None
    expected = {"run": meta["run"], "step": meta["step"], "rank": rank}
    if who == expected:
        return None
    this = f"this checkpoint is step {meta['step']} of run {meta['run'][:8]}"
    if not isinstance(who, dict) or not {"run", "step", "rank"} <= set(who):
        return f"it carries no run id, but {this}: a torn checkpoint"
    return (f"it was written by run {str(who['run'])[:8]} at step {who['step']} as rank {who['rank']}, "
            f"but {this}: a torn checkpoint (two runs, or two steps, wrote this directory)")


# --------------------------------------------------------------------------- the manager's bench
def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable: without it a power loss can forget the new name."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunDirectory:
    """A checkpoint directory as one run writes it: the bench under ``CheckpointManager``.

    * **Held**: ``_hold`` (in ``restore`` and the first ``save``) takes the directory for this run
      (``take_directory``) until ``close()``, the end of a ``with`` block, or the process's exit.
    * **Lineage**: a run's own id, or, once it resumes, the lineage of the checkpoint it resumed from
      (``_adopt``). Pruning counts and deletes only checkpoints of this lineage up to the step last
      saved (``_mine``): another experiment's, and checkpoints this run could not load, are never
      counted (they would push out the ones it can load) and never deleted (they are not its data).
    * **All or nothing**: a step that fails on one rank fails on all (``_together``), and a step
      directory that is not this lineage's is moved aside, never deleted (``_publish``).
    """

    def __init__(self, directory: str | Path, group: dist.ProcessGroup | None = None) -> None:
        self.directory, self.group = Path(directory), group
        self._run: str | None = None  # this run's id, once it holds the directory
        self._lineage: str | None = None
        self._last_step = -1
        self._release: Callable[[], Any] = lambda: None

    def close(self) -> None:
        """Let the directory go: another run may take it (also done when this object is collected)."""
        self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hold(self) -> None:
        """Collective (the first time): take the directory for a new run, or raise on every rank."""
        if self._run is None:
            key, self._run = take_directory(self.directory, self.group)
            self._lineage = self._run
            if key is not None:
                self._release = weakref.finalize(self, release, key)

    def _adopt(self, found: Any) -> Any:
        """``found`` (the checkpoint resumed from, or None): this run carries on its lineage."""
        if found is not None and found.meta.get("lineage"):
            self._lineage = found.meta["lineage"]
        return found

    def _mine(self, found: Any) -> bool:
        """Whether pruning may count and delete ``found`` (see the class docstring)."""
        return found.meta.get("lineage") == self._lineage and found.step <= self._last_step

    def _stamped(self, state: dict, step: int, rank: int) -> dict:
        """``state`` with ``WRITTEN_BY``: what makes a rank file of two runs or steps detectable."""
        if not isinstance(state, dict) or WRITTEN_BY in state:
            raise TypeError(f"save takes a dict without the key {WRITTEN_BY!r} (it stores the run's id, the step "
                            f"and the rank there), got {type(state).__name__}")
        self._last_step = step
        return {**state, WRITTEN_BY: {"run": self._run, "step": step, "rank": rank}}

    def _save_step(self, step: int, state: dict, final: Path, write: Callable[[Any, Path], None],
                   meta_of: Callable[[Path], dict]) -> Path:
        """The protocol of ``CheckpointManager.save``: every rank ``write``s its stamped ``state`` into
        ``final``'s staging directory; once all are in, rank 0 writes ``meta.pt``, publishes, fsyncs the
        directory and prunes (``self._prune``). A failure on any rank raises on every rank. Collective."""
        self._hold()
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        staging = final.with_name(final.name + ".tmp")
        state, error = self._stamped(state, step, rank), None  # the run's id, the step and the rank added
        try:
            staging.mkdir(parents=True, exist_ok=True)
            write(state, staging / f"rank{rank}.pt")
        except Exception as exc:  # every rank hears of it, and raises: no hang
            error = exc
        self._together(step, error, staging, "write its file")  # every rank's file is in the staging directory
        if rank == 0:
            try:
                write({"step": step, "world_size": world_size, "run": self._run, "lineage": self._lineage},
                      staging / "meta.pt")
                self._publish(staging, final, meta_of)  # replaces only its own
                fsync_dir(self.directory)
                self._prune()
            except Exception as exc:
                error = exc
        self._together(step, error, staging, "publish it")  # nobody touches the next step before this one is out
        return final

    def _together(self, step: int, error: Exception | None, staging: Path, what: str) -> None:
        """Raise on every rank of the group if ``error`` is set on any (its own error where it failed), after
        rank 0 removed ``staging``. Collective; one all-reduce of W + 2 integers."""
        failed, lo, hi = agree(step, error is not None, self.group)
        if lo != hi:
            raise RuntimeError(f"{self.directory}: ranks saved different steps ({lo} to {hi}): every rank of the "
                               "group must call save with the same step")
        if not failed:
            return
        if (dist.get_rank(self.group) if dist.is_initialized() else 0) == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(f"rank(s) {', '.join(map(str, failed))} could not {what} for step {step} in "
                           f"{self.directory} (see their error): nothing was published, nothing saved before is lost")

    def _publish(self, staging: Path, final: Path, meta_of: Callable[[Path], dict]) -> None:
        """Rename ``staging`` to ``final``. A ``final`` already there (the same step saved again) is moved
        aside first; deleted afterwards if it is this lineage's, kept (with a warning) if not."""
        aside = None
        if final.exists():
            try:
                mine = meta_of(final).get("lineage") == self._lineage
            except ValueError:  # a CheckpointError: unreadable, so nothing says it is this run's
                mine = False
            aside = final.with_name(f"{final.name}.{'replaced' if mine else 'other-run'}-{uuid.uuid4().hex[:8]}")
            os.replace(final, aside)
        os.replace(staging, final)
        if aside is not None and mine:
            shutil.rmtree(aside, ignore_errors=True)
        elif aside is not None:
            warnings.warn(f"{final} held a checkpoint that is not this run's: moved to {aside.name}, not deleted",
                          stacklevel=3)


# --------------------------------------------------------------------------- resume
def restore(manager: Any, apply: Callable[[Any], Any], group: dist.ProcessGroup | None = None) -> Any | None:
    """Call ``apply`` on the newest checkpoint of ``manager`` it accepts; return that checkpoint, or None.

    Args:
        manager: yields good checkpoints newest first (``checkpoints()``), lists its step
            directories (``_published()``) and has a ``directory``.
        apply: loads a checkpoint into *freshly built* training state; raises one of
            ``LOAD_ERRORS`` when it cannot (it must leave nothing half-loaded behind).

    A failed checkpoint costs one warning per rank naming the directory and the reason (a rank
    that did not fail itself names the ranks that did). When none is left: one warning that
    the run starts fresh, unless the directory held no checkpoint at all.

    Collective: every rank of ``group`` calls it; one all-reduce of W + 2 integers per checkpoint
    tried. Ranks that see different checkpoints get a ``RuntimeError``, not a hang.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    candidates = iter(manager.checkpoints())
    while True:
        found, error = next(candidates, None), None
        if found is not None:
            try:
                apply(found)
            except NotImplementedError:  # a learner's unfinished TODO (a RuntimeError): say so, not "cannot load"
                raise
            except LOAD_ERRORS as exc:
                error = exc
        step = found.step if found is not None else -1
        failed, lo, hi = agree(step, error is not None, group)
        if lo != hi:
            raise RuntimeError(f"{manager.directory}: ranks would resume from different steps ({lo} to {hi}; -1 is "
                               "none): every rank must see the same checkpoint directory")
        if found is None:
            if manager._published():
                warnings.warn(f"no loadable checkpoint in {manager.directory} (every one was skipped): "
                              "starting fresh from step 0", stacklevel=3)
            return None
        if not failed:
            return found
        reason = (" ".join(f"{type(error).__name__}: {error}".split()) if error is not None
                  else f"rank(s) {', '.join(map(str, failed))} could not load it")
        warnings.warn(f"cannot resume from {found.path}: {reason}; falling back to an older checkpoint",
                      stacklevel=3)


def agree(step: int, failed: bool, group: dist.ProcessGroup | None = None) -> tuple[list[int], int, int]:
    """The ranks of ``group`` for which something failed, and the lowest and highest ``step`` given: the
    same answer on every rank. Collective: every rank of ``group``; one all-reduce of W + 2 integers."""
    if not dist.is_initialized():
        return ([0] if failed else []), step, step
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    votes = torch.zeros(world_size + 2, dtype=torch.int64)
    votes[rank], votes[-2], votes[-1] = int(failed), step, -step
    if "nccl" in dist.get_backend(group):  # NCCL reduces device tensors only (also "cpu:gloo,cuda:nccl")
        votes = votes.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    votes = votes.cpu()
    return [r for r in range(world_size) if votes[r]], -int(votes[-1]), int(votes[-2])
