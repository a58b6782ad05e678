"""What a checkpoint directory holds that is the course's, and what a resume must match.

**Starting over deletes only the course's own entries.** ``CheckpointManager`` writes, in its
directory, nothing but step directories::

    step_00000012/                       a published step: meta.pt, rank0.pt, rank1.pt, ...
    step_00000012.tmp/                   a step being staged (a crash can leave it)
    step_00000012.replaced-1a2b3c4d/     a step moved aside by a save of the same step
    step_00000012.other-run-1a2b3c4d/    (the same, for another run's step: kept, never deleted by a save)

and, inside a step directory, the temporary files of an atomic write (``.rank0.pt.tmp4242``). Its lock
lives beside the directory (``<dir>.lock``), held by the run, never deleted. ``course_entries`` lists
those entries and refuses a directory that holds anything else (a file, a folder of another name, a
step directory with a stranger inside, a symbolic link of any name), naming what is there; nothing is
deleted then. ``remove`` deletes the listed files one by one and then their (now empty) directories with
``rmdir``, which fails rather than delete something that appeared in between: no ``rmtree``, and no
symbolic link is ever followed out of the directory.

**A resume fits or is refused.** A run describes itself with a few plain values (``config``: the model,
the strategy, the optimizer, the world size where the strategy cannot reshard); the checkpoint's
``meta.pt`` keeps the values of the run that wrote it. ``differences`` names every value both sides
give and that differs, in one line.

Used by ``distlab/lessons/resume.py`` (``RunDirectory.start_over``, ``restore``). Tests:
tests/test_checkpoint_fresh.py.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_TOP = re.compile(r"step_[0-9]{8,}(\.tmp|\.(replaced|other-run)-[0-9a-f]{8})?")
_FILE = re.compile(r"(meta|rank[0-9]+)\.pt|\.(meta|rank[0-9]+)\.pt\.tmp[0-9]+")
_SHOWN = 5  # entries named in a refusal; the rest are counted


class ForeignEntriesError(ValueError):
    """A checkpoint directory holds entries the course did not write: starting over there is refused."""


def _kind(entry: os.DirEntry) -> str:
    if entry.is_symlink():
        return f"{entry.name} (a symbolic link)"
    return entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "")


def course_entries(directory: str | Path) -> list[Path]:
    """The entries of ``directory`` that the course wrote, each directory after its files; [] if it does not exist.

    Raises:
        ForeignEntriesError: ``directory`` holds anything else (named, up to five, then counted);
            nothing is deleted.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    ours: list[Path] = []
    others: list[str] = []
    with os.scandir(directory) as entries:
        top = sorted(entries, key=lambda e: e.name)
    for entry in top:
        if not (entry.is_dir(follow_symlinks=False) and _TOP.fullmatch(entry.name)):
            others.append(_kind(entry))
            continue
        with os.scandir(entry.path) as inside:
            files = sorted(inside, key=lambda e: e.name)
        strays = [f for f in files if not (f.is_file(follow_symlinks=False) and _FILE.fullmatch(f.name))]
        if strays:
            others += [f"{entry.name}/{_kind(f)}" for f in strays]
        else:
            ours += [Path(f.path) for f in files] + [Path(entry.path)]
    if others:
        shown = ", ".join(others[:_SHOWN]) + (f" and {len(others) - _SHOWN} more" if len(others) > _SHOWN else "")
        raise ForeignEntriesError(
            f"starting over (--fresh) is refused: {directory} holds {len(others)} "
            f"entr{'y' if len(others) == 1 else 'ies'} this course did not write ({shown}); nothing was deleted. "
            "Give the run a checkpoint directory of its own (it holds only step_* directories), or move those out")
    return ours


def remove(entries: list[Path]) -> int:
    """Delete ``entries`` (``course_entries``' list: files, then their directory); return how many went.

    ``os.unlink`` for files and ``os.rmdir`` for directories: a directory that is not empty (something
    appeared after it was listed) raises ``OSError`` instead of losing what appeared.
    """
    for path in entries:
        if path.is_dir() and not path.is_symlink():
            os.rmdir(path)
        else:
            os.unlink(path)
    return len(entries)


def differences(saved: dict | None, wanted: dict | None) -> str:
    """The values that differ between a checkpoint's run (``saved``) and this one (``wanted``), in one
    line ("model vit_tiny, this run resnet18; strategy ddp, this run zero-2"); "" when they fit.

    A key only one side gives is not compared (a checkpoint written before it was recorded).
    """
    if not saved or not wanted:
        return ""
    return "; ".join(f"{key} {saved[key]}, this run {wanted[key]}" for key in wanted
                     if key in saved and saved[key] != wanted[key])
