# Generated from solutions/phase5_large_models/sharded_checkpoint.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Sharded checkpoints that load at another world size: one file per rank plus an index.

A ZeRO-3/FSDP2 model at W ranks holds 1/W of every parameter and of its optimizer
state. Gathering everything to rank 0 to save it costs Psi bytes of traffic and Psi of
rank-0 memory; instead every rank writes its own pieces, and a metadata file records,
for every tensor, its global shape and which rank wrote which box (offsets, sizes):

    ckpt/rank0.pt   {"model/a.weight": rows 0-3, "optim/state/a.weight/exp_avg": rows 0-3, ...}
    ckpt/rank1.pt   {"model/a.weight": rows 4-6, ...}
    ckpt/metadata.pt {"tensors": {key: {global_shape, dtype, pieces: [(rank, offsets, sizes)]}},
                      "objects": {key: value}}   # step counters, param_groups, loader position

Loading at W' is *resharding*: each rank asks for its new box of every tensor, finds the
saved boxes that overlap it, reads only those files and copies each intersection. The
same idea is ``torch.distributed.checkpoint`` (DCP): ``dcp.save`` writes ``__0_0.distcp``...
and ``.metadata``; ``dcp.load`` plans reads of overlapping chunks. ``get_state_dict`` /
``set_state_dict`` turn a model and its optimizer into such a dict of DTensors and back.

Async save: copy the local pieces (the snapshot; training may then change the weights),
agree on the index (the only collective), and write the files on a background thread
while the next steps run; ``wait()`` joins it and barriers, after which the checkpoint
is complete on every rank.

Cost: no tensor communication (one all_gather_object of the index, one barrier); each
rank writes ~1/W of the state; a load reads the pieces that overlap its new shard.
See phase5_large_models/guidelines_mesh.md#sharded-checkpoints.
Run: ``NPROC=4 RUN_MODE=sharded_checkpoint ./entrypoint.sh`` (demos/sharded_checkpoint.py).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from distlab.todo import todo

METADATA = "metadata.pt"
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a piece in its global tensor


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level, keys joined by "/" (``{"optim": {"state": ...}}`` -> "optim/state/...")."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def unflatten(flat: dict[str, Any], like: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The inverse of ``flatten``, shaped like ``like`` (whose keys may be ints)."""
    return {key: unflatten(flat, value, f"{prefix}{key}/") if isinstance(value, dict) and value
            else flat[f"{prefix}{key}"] for key, value in like.items()}


def local_box(t: torch.Tensor) -> Box:
    """Where this rank's piece sits in the global tensor: a DTensor's shard, or all of a plain tensor."""
    if isinstance(t, DTensor):
        chunk = t.__create_chunk_list__()[0]  # what DCP itself uses: offsets and sizes of the local shard
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return (0,) * t.dim(), tuple(t.shape)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def write_file(obj: Any, path: Path) -> None:
    """``torch.save`` through a temporary name and a rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _plan(state: dict[str, Any], group: dist.ProcessGroup | None) -> tuple[dict[str, torch.Tensor], dict]:
    """Snapshot this rank's pieces and agree on the index (collective). Returns (my pieces, metadata)."""
    flat = flatten(state)
    tensors = {k: v for k, v in flat.items() if torch.is_tensor(v)}
    mine = {k: (local_box(v), str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()}  # noqa: F841 (mine: for TODO 5.11)
    rank = dist.get_rank(group)  # noqa: F841 (rank: for TODO 5.11)
    # --- TODO 5.11: the index of a sharded checkpoint ---
    # Goal: every rank learns every rank's boxes (one collective), and the metadata records for
    # each tensor key its global shape, dtype and pieces [(rank, offsets, sizes)], each box
    # ONCE (a replicated tensor is written by the lowest rank holding it); "objects" holds the
    # non-tensor values. Return (this rank's pieces as independent copies, by key; metadata).
    raise todo("5.11 the index of a sharded checkpoint", "guidelines_mesh.md#sharded-checkpoints")
    # --- end TODO 5.11 ---
    return pieces, meta  # noqa: F821 (pieces, meta: set by TODO 5.11)


def _write(directory: Path, rank: int, pieces: dict[str, torch.Tensor], meta: dict,
           write: Callable[[Any, Path], None]) -> None:
    write(pieces, directory / f"rank{rank}.pt")
    if rank == 0:
        write(meta, directory / METADATA)  # after this rank's own file; wait()/save's barrier covers the rest


def save_sharded(state: dict[str, Any], directory: str | Path, group: dist.ProcessGroup | None = None) -> None:
    """Write ``state`` (nested dicts of DTensors, tensors and plain values) as one file per rank + metadata.

    Equivalent to: ``dcp.save(state, checkpoint_id=directory)``.
    Collective: every rank of ``group`` calls it with the same keys.
    Cost: one all_gather_object of the index and a barrier; ~1/W of the state written per rank.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pieces, meta = _plan(state, group)
    _write(directory, dist.get_rank(group), pieces, meta, write_file)
    dist.barrier(group=group)  # complete: every rank's file and the metadata are in place


def _overlap(a: Box, b: Box) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices of the intersection of boxes a and b, in a's and in b's local coordinates (None if empty)."""
    in_a, in_b = [], []
    for a_off, a_size, b_off, b_size in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(a_off, b_off), min(a_off + a_size, b_off + b_size)
        if lo >= hi:
            return None
        in_a.append(slice(lo - a_off, hi - a_off))
        in_b.append(slice(lo - b_off, hi - b_off))
    return tuple(in_a), tuple(in_b)


@torch.no_grad()
def load_sharded(state: dict[str, Any], directory: str | Path) -> dict[str, Any]:
    """Fill ``state``'s tensors in place from a checkpoint saved at any world size; returns the state
    with the saved plain values (step counters, loader position) put back in.

    ``state`` has this rank's *new* layout (e.g. ``get_state_dict`` of the model at W').
    Equivalent to: ``dcp.load(state, checkpoint_id=directory)``.
    Collective: no (each rank reads what it needs). Cost: reads the saved pieces that
    overlap this rank's boxes, not the whole checkpoint.
    """
    directory = Path(directory)
    meta = torch.load(directory / METADATA, weights_only=True)
    flat, files = flatten(state), {}  # noqa: F841 (files: for TODO 5.12)
    for key, target in flat.items():
        if key not in meta["tensors"] and key not in meta["objects"]:
            raise ValueError(f"{key}: not in the checkpoint at {directory} (it has {len(meta['tensors'])} "
                             f"tensors and {sorted(meta['objects'])})")
        if not torch.is_tensor(target):
            flat[key] = meta["objects"][key]
            continue
        entry = meta["tensors"][key]
        if tuple(entry["global_shape"]) != tuple(target.shape):
            raise ValueError(f"{key}: checkpoint has global shape {tuple(entry['global_shape'])}, "
                             f"the model {tuple(target.shape)}")
        out, box = local_tensor(target), local_box(target)  # noqa: F841 (out, box: for TODO 5.12)
        # --- TODO 5.12: load with resharding ---
        # Goal: every element of this rank's box `box` of tensor `key`, copied into `out` from the
        # saved pieces that overlap it (any world size wrote them: offsets differ), opening each
        # rank file at most once (keep them in `files`); raise ValueError if part of the box is
        # covered by no saved piece.
        raise todo("5.12 load with resharding", "guidelines_mesh.md#sharded-checkpoints")
        # --- end TODO 5.12 ---
    return unflatten(flat, state)


class AsyncSave:
    """A save whose files are being written on a background thread. ``wait()`` on every rank."""

    def __init__(self, thread: threading.Thread, errors: list[BaseException],
                 group: dist.ProcessGroup | None) -> None:
        self._thread, self._errors, self._group = thread, errors, group

    def done(self) -> bool:
        """This rank's files are written (other ranks may still be writing theirs)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Join the writer and barrier: then the checkpoint is complete everywhere (collective)."""
        self._thread.join()
        if self._errors:
            raise self._errors[0]
        dist.barrier(group=self._group)


def async_save_sharded(state: dict[str, Any], directory: str | Path, group: dist.ProcessGroup | None = None,
                       write: Callable[[Any, Path], None] = write_file) -> AsyncSave:
    """``save_sharded`` that returns once the state is copied; the files are written while training goes on.

    ``write(obj, path)`` writes one file (default ``write_file``).
    Equivalent to: ``dcp.async_save(state, checkpoint_id=directory)`` (``.result()`` ~ ``wait()``).
    Collective: every rank calls it, then ``wait()`` before the next save.
    Cost: a copy of the local pieces (memory ~1/W of the state) and the index exchange on
    the calling thread; the disk writes off it.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank, errors = dist.get_rank(group), []  # noqa: F841 (rank, errors: for TODO 5.13)
    # --- TODO 5.13: async save ---
    # Goal: take the snapshot and agree on the index here (the collective stays on this thread:
    # a collective on another thread would race the training's), then start a thread that
    # writes this rank's file (and, on rank 0, the metadata) with `write`, recording any
    # exception in `errors` instead of losing it; return the AsyncSave handle at once.
    raise todo("5.13 async save", "guidelines_mesh.md#async-save")
    # --- end TODO 5.13 ---
