"""Checkpoints that survive crashes: atomic, checksummed, verified, complete enough to resume exactly.

A job that runs for days will be killed: a node dies, the scheduler preempts it, a
rank runs out of memory, often *while a checkpoint is being written*. Three rules
make a checkpoint trustworthy:

1. **Atomic.** Write to a temporary file in the same directory, flush it to disk
   (``fsync``), rename it over the final name (``os.replace`` is atomic on POSIX),
   then fsync the directory so the rename itself is durable. A reader sees the old
   file or the new one, never half of one.
2. **Verified.** The file starts with a header: a magic line, the payload's length
   and its SHA-256. Loading recomputes both and refuses a truncated or corrupted
   file with ``CheckpointError``; the manager then falls back to the previous good
   checkpoint instead of crashing or, worse, training on garbage. Integrity, not a signature.
3. **Safe to load.** ``torch.load(..., weights_only=True)``: only tensors and plain
   containers are unpickled, never code from a file whose checksum someone recomputed.

And *complete*: model, optimizer, LR scheduler, the sampler's position, the step, and every
random generator a step draws from (torch CPU and CUDA, numpy, Python's ``random``).

On disk: ``ckpt/step_00000010/rank0.pt rank1.pt ... meta.pt``, staged as ``step_00000010.tmp/`` and
renamed once every rank's file is in. ``restore`` resumes from the newest checkpoint that verifies and
*loads*; a run holds its directory, stamps its rank files and prunes only its own (``distlab/lessons/resume.py``).

Cost: two all-reduces of W + 2 integers per save; disk: each rank's state. See guidelines.md#crash-safe-checkpoints.
"""
from __future__ import annotations

import hashlib
import io
import os
import random
import re
import shutil
import struct
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from distlab.lessons import resume

MAGIC = b"DISTLAB-CKPT-1\n"
_HEADER = struct.Struct("<Q32s")  # payload length, SHA-256 of the payload
HEADER_BYTES = len(MAGIC) + _HEADER.size
_STEP_DIR = re.compile(r"step_[0-9]{8,}")  # a published step: not step_N.tmp (staging), not step_N.other-run-*


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupted, or not a checkpoint at all."""


# --------------------------------------------------------------------------- files
def save_file(obj: Any, path: str | Path) -> None:
    """Write ``obj`` (tensors and plain containers) to ``path`` atomically, with a checksum.

    Equivalent to: ``torch.save(obj, path)``, except that a crash at any moment
    leaves either the previous file or the complete new one.
    Collective: no (each rank writes its own files).
    Cost: |obj| bytes written once, one fsync of the file and one of the directory.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # same directory: rename stays atomic
    try:
        # ### BEGIN SOLUTION 4.1: atomic checksummed save [guidelines.md#crash-safe-checkpoints]
        # Goal: `path` holds MAGIC, then the packed (payload length, SHA-256 of the payload) header,
        # then the payload (``obj`` as torch.save writes it). At every instant a reader finds the
        # previous complete file or the new complete one, never half of one, and an object that
        # cannot be saved leaves the disk untouched. Write through `tmp`; on return it is gone.
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = buffer.getvalue()
        header = MAGIC + _HEADER.pack(len(payload), hashlib.sha256(payload).digest())
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
        resume.fsync_dir(path.parent)
        # ### END SOLUTION 4.1
    except OSError as exc:  # disk full (ENOSPC), quota, I/O error: name the file; what was saved stays
        why = (f"{exc.strerror or exc}: cannot write checkpoint file {path} (no partial file is left; what "
               "was saved before is untouched): free space there, or give another directory")
        raise (OSError(exc.errno, why) if exc.errno else OSError(why)) from exc
    finally:
        tmp.unlink(missing_ok=True)  # gone after a failed write too (after a rename there is nothing left)


def verify_file(path: str | Path) -> bytes:
    """Return the payload of the checkpoint file at ``path`` after checking its header.

    Raises:
        CheckpointError: missing file, wrong magic, truncated payload, or checksum mismatch,
            with the path and what is wrong in the message.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file is missing") from None
    except OSError as exc:  # permission denied, I/O error: as unusable as a corrupted file, so fall back too
        raise CheckpointError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    # ### BEGIN SOLUTION 4.2a: verified load (header and checksum) [guidelines.md#crash-safe-checkpoints]
    # Goal: return the payload only if `data` is a whole, intact checkpoint (the format of 4.1);
    # otherwise raise CheckpointError naming `path` and, in words the caller can match, what is
    # wrong: "not a distlab checkpoint", "truncated" (header or payload short), or "checksum".
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a distlab checkpoint (bad magic header)")
    if len(data) < HEADER_BYTES:
        raise CheckpointError(f"{path}: truncated: {len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
    length, digest = _HEADER.unpack_from(data, len(MAGIC))
    payload = data[HEADER_BYTES:]
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated: payload has {len(payload)} of {length} bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file is corrupted")
    return payload
    # ### END SOLUTION 4.2a


def load_file(path: str | Path, map_location: str | torch.device | None = None) -> Any:
    """Load a file written by ``save_file``: checksum verified, then unpickled with ``weights_only``.

    Raises:
        CheckpointError: see ``verify_file``; or weights_only refused the payload (a checksum is no signature).
    """
    # ### BEGIN SOLUTION 4.2b: verified load (weights_only) [guidelines.md#crash-safe-checkpoints]
    # Goal: the object `save_file` wrote, on `map_location`, from a verified payload only; and a
    # file is data, never code: anything but tensors, numbers, strings and plain containers
    # must be refused when unpickled, not built, with a CheckpointError naming `path` and "weights_only".
    payload = verify_file(path)
    try:  # tensors, numbers, strings and containers only: any other object is refused, not built
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as exc:  # UnpicklingError (refused), or a payload torch cannot decode
        why = re.search(r"WeightsUnpickler error: (.*?)(?= Please use|$)", " ".join(str(exc).split()))
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): {why[1] if why else exc!r}") from exc
    # ### END SOLUTION 4.2b


# --------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict:
    """Every random generator a training step may draw from, as weights_only-loadable values.

    torch CPU, every CUDA device (if CUDA is initialised), numpy's global generator
    (its key array as a tensor: ndarrays are not weights_only-loadable) and Python's ``random``.
    """
    import numpy as np

    # ### BEGIN SOLUTION 4.3a: RNG state (capture) [guidelines.md#what-a-checkpoint-must-hold]
    # Goal: a dict from which `restore_rng_state` makes every generator continue exactly where
    # it is now: torch CPU, Python's random, numpy's global generator (all of its state, the
    # cached Gaussian included), and CUDA's when it is initialised. It must survive
    # ``torch.load(weights_only=True)``: tensors and plain Python values only, no ndarrays.
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
    # ### END SOLUTION 4.3a


def restore_rng_state(state: dict) -> None:
    """Undo ``capture_rng_state``: every generator continues exactly where it was captured."""
    import numpy as np

    # ### BEGIN SOLUTION 4.3b: RNG state (restore) [guidelines.md#what-a-checkpoint-must-hold]
    # Goal: the inverse of `capture_rng_state`: afterwards every generator draws the same
    # numbers as it would have right after the capture.
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    # ### END SOLUTION 4.3b


# --------------------------------------------------------------------------- manager
@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory: the step it holds and how many ranks wrote it."""

    step: int
    world_size: int
    path: Path

    @cached_property
    def meta(self) -> dict:
        """``meta.pt``: the step, the world size, and the ``run`` that wrote it and its ``lineage``."""
        return load_file(self.path / "meta.pt")

    def load(self, rank: int, map_location: str | torch.device | None = None) -> Any:
        """The state that rank ``rank`` of the saving job wrote (``load_file``; CheckpointError if none,
        or if the file is another run's or step's)."""
        if not 0 <= rank < self.world_size:
            raise CheckpointError(f"{self.path} was written by {self.world_size} ranks: it has no file for "
                                  f"rank {rank} (resume with {self.world_size} ranks, or reshard)")
        state = load_file(self.path / f"rank{rank}.pt", map_location)
        who = state.pop(resume.WRITTEN_BY, None) if isinstance(state, dict) else None
        if problem := resume.torn(self.meta, rank, who):
            raise CheckpointError(f"{self.path / f'rank{rank}.pt'}: {problem}")
        return state


class CheckpointManager(resume.RunDirectory):
    """One directory of step checkpoints: collective ``save``, ``latest`` good one, newest ``keep`` kept.

    Args:
        directory: where the ``step_XXXXXXXX/`` directories live (shared by all ranks).
        keep: how many of this run's complete checkpoints to keep (its older ones are deleted after a save).
        group: the ranks that save together (None = WORLD).
        config: what a resume must match (model, strategy, ...), kept in meta.pt; other values are refused.

    The run holds the directory from its ``restore`` or first ``save`` until ``close()``, its exit or the
    end of ``with CheckpointManager(...) as manager:`` (``distlab.lessons.resume.RunDirectory``).
    """

    def __init__(self, directory: str | Path, keep: int = 3, group: dist.ProcessGroup | None = None,
                 config: dict | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}: the newest checkpoint is always kept")
        super().__init__(directory, group, config)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file: name another directory")
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def save(self, step: int, state: dict) -> Path:
        """Every rank writes its ``state``; rank 0 then publishes the step atomically and prunes. The first
        save (or ``restore``) takes the directory for this run; if a rank cannot write, every rank raises.

        Collective: every rank of ``group`` must call it with the same ``step``.
        Cost: two all-reduces of W + 2 integers (and one broadcast the first time); |state| bytes per rank.
        """
        return self._save_step(step, state, self.step_dir(step), save_file,
                               lambda path: Checkpoint(step, 0, path).meta)  # distlab/lessons/resume.py

    def _published(self) -> list[Path]:
        """The complete step directories (not staging ``*.tmp`` ones, nor ones moved aside), oldest first."""
        return sorted(p for p in self.directory.glob("step_*") if _STEP_DIR.fullmatch(p.name) and p.is_dir())

    def _prune(self) -> None:
        """Delete this run's good checkpoints older than its newest ``keep`` good ones; bad ones and
        another run's are left alone (never counted). Cost: rank 0 reads back every published checkpoint."""
        # ### BEGIN SOLUTION 4.4a: checkpoint manager (prune) [guidelines.md#crash-safe-checkpoints]
        # Goal: keep the newest `self.keep` checkpoints that verify (`self.checkpoints`, quietly) and are
        # this run's (`self._mine`), delete this run's older ones. Count nothing else: newer bad ones, or
        # another run's, must not push this run's good ones out, and another run's are never deleted.
        mine = sorted(c.path for c in self.checkpoints(warn=False) if self._mine(c))  # oldest first
        for old in mine[:-self.keep]:  # zero-padded names: sorting names sorts steps
            shutil.rmtree(old, ignore_errors=True)
        # ### END SOLUTION 4.4a

    def checkpoints(self, warn: bool = True) -> Iterator[Checkpoint]:
        """Every checkpoint whose every file verifies and was written by one run at one step, newest first:
        a torn one (``resume.untorn``) is skipped like a corrupted one. Collective: no."""
        return resume.untorn(self._verified(warn), HEADER_BYTES, warn)

    def _verified(self, warn: bool = True) -> Iterator[Checkpoint]:
        """Every checkpoint whose every file verifies, newest first.

        A directory whose ``meta.pt`` does not load or one of whose ``rank*.pt`` does not verify is
        skipped with one warning (if ``warn``) naming the file and what is wrong.
        """
        # ### BEGIN SOLUTION 4.4b: checkpoint manager (verified checkpoints) [guidelines.md#crash-safe-checkpoints]
        # Goal: newest first over `self._published()`, yield a `Checkpoint` per directory whose meta.pt
        # ({"step", "world_size"}) and rank files verify; skip a bad one with a warning (if `warn`).
        for path in reversed(self._published()):
            try:
                meta = load_file(path / "meta.pt")
                for r in range(meta["world_size"]):
                    verify_file(path / f"rank{r}.pt")
            except CheckpointError as exc:
                if warn:
                    warnings.warn(f"skipping checkpoint {path.name}: {exc}; falling back to an older one",
                                  stacklevel=2)
                continue
            yield Checkpoint(step=int(meta["step"]), world_size=int(meta["world_size"]), path=path)
        # ### END SOLUTION 4.4b

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose every file verifies (see ``checkpoints``); None when there is none."""
        return next(iter(self.checkpoints()), None)

    def restore(self, apply: Callable[[Checkpoint], Any], group: dist.ProcessGroup | None = None) -> Checkpoint | None:
        """Resume from the newest good checkpoint that ``apply`` loads (else the one before, with a warning); None:
        there is none. ``ResumeRefused``: another ``config``, or none loads. Collective (``distlab.lessons.resume``)."""
        self._hold()
        return self._adopt(resume.restore(self, apply, group))
