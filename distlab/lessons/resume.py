"""The bench around ``CheckpointManager``: one run per directory, rank files of one run, resume from one that *loads*.

**One writer per directory.** A run takes its checkpoint directory before it restores, saves or starts
over: a ``flock`` beside the directory, named in the refusal of a second run (``distlab/lessons/dir_lock.py``,
whose names this module re-exports).

**Rank files of one run and one step.** Every rank file carries ``WRITTEN_BY``: the run's id, the
step and the rank. ``torn`` compares it with ``meta.pt``; reading it (``written_by``) costs the
pickle only, not the tensors' bytes.

**Resume from the newest checkpoint that loads, and every rank from the same one.** A checkpoint can
verify (its checksum matches) and still be unusable: a forged file that ``torch.load(weights_only=True)``
refuses, another model's checkpoint (a size mismatch in ``load_state_dict``), one written by a world
size the loader cannot reshard. ``restore`` tries the checkpoints a manager yields, newest first, and
moves on after a failure with one warning. The ranks agree on every try, so a failure on one rank (its
own file refused) moves all of them.

**A resume that does not fit is refused, never silently restarted.** A run that describes itself
(``config``: model, strategy, optimizer, ...) keeps that in every ``meta.pt``; a newest checkpoint written
by other settings is refused with one line naming what differs (``ResumeRefused``), and so is a
directory whose checkpoints all fail to load: nothing in the directory is touched, and the run does not
start from step 0 over them. Starting over is explicit: ``start_over`` (the demos' ``--fresh``) takes
the directory's lock first, then deletes the course's own entries only (``distlab/lessons/ckpt_entries.py``).
A directory deleted while the run uses it is reported at the next save, not recreated.

Used by ``CheckpointManager`` (phase4_production/checkpoint.py); see
phase4_production/guidelines.md#crash-safe-checkpoints. Tests: tests/test_checkpoint_fallback.py,
tests/test_checkpoint_runs.py.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from distlab.lessons import ckpt_entries
from distlab.lessons.dir_lock import CheckpointDirectoryError, hold, lock_path, release, take_directory  # noqa: F401

# What loading a checkpoint that does not fit raises: CheckpointError (a ValueError), a missing
# key, a ValueError of a loader, load_state_dict's RuntimeError. Anything else is a bug: it propagates.
LOAD_ERRORS = (KeyError, ValueError, RuntimeError)

WRITTEN_BY = "_written_by"  # the key of every rank file's {"run", "step", "rank"}


class ResumeRefused(ValueError):
    """The checkpoints of a directory do not fit this run: resume with their settings, or start over explicitly."""


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

    def __init__(self, directory: str | Path, group: dist.ProcessGroup | None = None,
                 config: dict | None = None) -> None:
        self.directory, self.group = Path(directory), group
        self.config = dict(config) if config else None  # plain values a resume must match (meta.pt keeps them)
        self._run: str | None = None  # this run's id, once it holds the directory
        self._lineage: str | None = None
        self._last_step = -1
        self._saved = -1  # the last step published (for the message of a directory deleted mid-run)
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
            self.directory.mkdir(parents=True, exist_ok=True)  # from now on, its absence means it was deleted

    def start_over(self) -> int:
        """Delete the course's checkpoints in the directory (the demos' ``--fresh``); return how many entries went.

        The directory is taken for this run first (another run holding it: ``CheckpointDirectoryError``
        on every rank, before anything is deleted); then rank 0 deletes only what the course wrote
        (``ckpt_entries.course_entries``). A directory that holds anything else is refused on every rank
        (``ckpt_entries.ForeignEntriesError``, naming what is there) and nothing is deleted.
        Collective: every rank of ``group``; one all-reduce of W + 2 integers.
        """
        self._hold()
        removed, error = 0, None
        if (dist.get_rank(self.group) if dist.is_initialized() else 0) == 0:
            try:
                removed = ckpt_entries.remove(ckpt_entries.course_entries(self.directory))
            except (ckpt_entries.ForeignEntriesError, OSError) as exc:
                error = exc
        if agree(-1, error is not None, self.group)[0]:
            raise error if error is not None else ckpt_entries.ForeignEntriesError(
                f"rank 0 could not start over in {self.directory} (see its error): nothing else was deleted")
        return removed

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
            if not self.directory.is_dir():  # _hold made it: gone means deleted under the run
                raise CheckpointDirectoryError(
                    f"checkpoint directory {self.directory} was deleted while this run used it (last saved: "
                    f"{'step ' + str(self._saved) if self._saved >= 0 else 'nothing yet'}); it is not recreated: "
                    "find out what deleted it, then resume from a copy, or start over explicitly")
            staging.mkdir(exist_ok=True)
            write(state, staging / f"rank{rank}.pt")
        except Exception as exc:  # every rank hears of it, and raises: no hang
            error = exc
        self._together(step, error, staging, "write its file")  # every rank's file is in the staging directory
        if rank == 0:
            try:
                meta = {"step": step, "world_size": world_size, "run": self._run, "lineage": self._lineage}
                write({**meta, "config": self.config} if self.config else meta, staging / "meta.pt")
                self._publish(staging, final, meta_of)  # replaces only its own
                fsync_dir(self.directory)
                self._prune()
            except Exception as exc:
                error = exc
        self._together(step, error, staging, "publish it")  # nobody touches the next step before this one is out
        self._saved = step
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
    that did not fail itself names the ranks that did), and the one before is tried.

    Raises:
        ResumeRefused: on every rank, with nothing in the directory touched: the newest checkpoint was
            written by other settings (``manager.config`` against its ``meta.pt``'s, named in one line),
            or the directory holds checkpoints and none of them loads.

    Collective: every rank of ``group`` calls it; one all-reduce of W + 2 integers per checkpoint
    tried (two for the newest). Ranks that see different checkpoints get a ``RuntimeError``, not a hang.
    """
    candidates, newest, reasons = iter(manager.checkpoints()), True, []
    while True:
        found, error = next(candidates, None), None
        if found is not None and newest:  # the directory's run is its newest checkpoint's: its settings must fit
            saved = (getattr(found, "meta", None) or {}).get("config")  # (a bare manager's checkpoints have none)
            newest, differs = False, ckpt_entries.differences(saved, getattr(manager, "config", None))
            if agree(found.step, bool(differs), group)[0]:
                raise ResumeRefused(
                    f"{found.path} was written by another run's settings ({differs or 'on another rank'}): it is "
                    "left as it is; resume with that run's settings, or start over explicitly (--fresh) or in "
                    "another checkpoint directory")
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
            if published := manager._published():
                said = "; ".join(reasons) or "every one failed to verify, see the warnings above"
                raise ResumeRefused(
                    f"none of the {len(published)} checkpoint(s) in {manager.directory} loads into this run "
                    f"({said}): they are left as they are and the run does not start from step 0 over them; "
                    "resume with the settings that wrote them, or start over explicitly (--fresh) or in "
                    "another checkpoint directory")
            return None
        if not failed:
            return found
        reason = (" ".join(f"{type(error).__name__}: {error}".split()) if error is not None
                  else f"rank(s) {', '.join(map(str, failed))} could not load it")
        reasons.append(f"{found.path.name}: {reason[:200]}")
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
