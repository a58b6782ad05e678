"""Phase 5's property checks: what an exercise teaches beyond its numbers, seen from inside a rank.

* :class:`OverlapLog` records, in order, every point-to-point transfer posted (``dist.batch_isend_irecv``,
  ``dist.isend``, ``dist.irecv``), every ``wait()`` on their works, and every call of a compute function
  of the lesson (ring attention's ``block_attention``), and says whether the K/V block computed on at
  step i+1 was posted before step i's compute and waited after it (the ring's overlap).
* :class:`LoadLog` records every ``torch.load`` of a checkpoint's rank file and whether it was
  memory-mapped.
* :func:`fsdp_units` names the modules ``fully_shard`` made into FSDP2 units.

Used inside a rank worker (tests/test_phase5_*.py); the CommLedger stays the one that counts bytes.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from distlab.comm import CommLedger


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Work:
    """A posted transfer's work: ``wait()`` is logged (first wait only matters), the rest delegated."""

    def __init__(self, work, log: "OverlapLog", transfer: int) -> None:
        self._work, self._log, self._transfer = work, log, transfer

    def wait(self, *args, **kwargs):
        self._log.events.append(("wait", self._transfer))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class OverlapLog:
    """``with OverlapLog(module, ["block_attention"]) as log: ...``: the order of posts, waits and compute.

    Events: ``("post", transfer id, {storages received into})``, ``("wait", transfer id)``,
    ``("compute", function name, storage of its K argument)``. ``dist.P2POp`` keeps working with the
    wrapped ``isend``/``irecv`` (a CommLedger underneath unwraps them for torch's own check).
    """

    def __init__(self, module, compute: list[str], key_arg: int = 1) -> None:
        self.module, self.compute, self.key_arg = module, compute, key_arg
        self.events: list[tuple] = []
        self._ledger = CommLedger()
        self._saved: dict[tuple[object, str], object] = {}

    # --- recording ---------------------------------------------------------------------------
    def _post(self, works, receives) -> int:
        transfer = sum(1 for e in self.events if e[0] == "post")
        self.events.append(("post", transfer, {_storage(t) for t in receives}))
        return transfer

    def _patch(self, owner, name, wrapper) -> None:
        self._saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, wrapper)

    def __enter__(self) -> "OverlapLog":
        self._ledger.__enter__()  # its P2POp unwraps our isend/irecv below (they carry __wrapped_by_ledger__)
        batch, isend, irecv = dist.batch_isend_irecv, dist.isend, dist.irecv

        @functools.wraps(batch)
        def batch_wrapper(ops):
            recvs = [op.tensor for op in ops if "recv" in getattr(op.op, "__name__", "")]
            works = batch(ops)
            transfer = self._post(works, recvs)
            return [_Work(w, self, transfer) for w in works]

        def single(original, receiving):
            @functools.wraps(original)
            def wrapper(tensor, *args, **kwargs):
                work = original(tensor, *args, **kwargs)
                return _Work(work, self, self._post([work], [tensor] if receiving else []))
            wrapper.__wrapped_by_ledger__ = original
            return wrapper

        self._patch(dist, "batch_isend_irecv", batch_wrapper)
        self._patch(dist, "isend", single(isend, False))
        self._patch(dist, "irecv", single(irecv, True))
        for name in self.compute:
            original = getattr(self.module, name)

            def compute(*args, _original=original, _name=name, **kwargs):
                self.events.append(("compute", _name, _storage(args[self.key_arg])))
                return _original(*args, **kwargs)
            self._patch(self.module, name, compute)
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in reversed(self._saved.items()):
            setattr(owner, name, original)
        self._saved.clear()
        self._ledger.__exit__(*exc)

    # --- the property ------------------------------------------------------------------------
    def mark(self, label: str) -> None:
        """Start a new pass (``forward``, ``backward``): overlap is judged within a pass."""
        self.events.append(("pass", label))

    def overlap_violations(self) -> list[str]:
        """One line per step whose K/V block was not in flight across the previous step's compute.

        For each pass and each compute i >= 1: the transfer that received the K/V it computes on
        (by storage: the receive buffer or a view of it) must be posted before compute i-1 and
        first waited after compute i-1. Empty when every step overlapped (and with one rank).
        """
        problems, label, computes = [], "?", []
        passes: list[tuple[str, list[int]]] = []
        for i, e in enumerate(self.events):
            if e[0] == "pass":
                passes.append((label, computes))
                label, computes = e[1], []
            elif e[0] == "compute":
                computes.append(i)
        passes.append((label, computes))
        for label, computes in passes:
            for step in range(1, len(computes)):
                here, before = computes[step], computes[step - 1]
                key = self.events[here][2]
                posts = [i for i in range(here) if self.events[i][0] == "post" and key in self.events[i][2]]
                if not posts:
                    problems.append(f"{label} step {step}: computed on K/V that no transfer received into "
                                    f"(receive into the buffer you compute on)")
                    continue
                post = posts[-1]
                transfer = self.events[post][1]
                waits = [i for i, e in enumerate(self.events) if e == ("wait", transfer)]
                if post > before:
                    problems.append(f"{label} step {step}: its K/V transfer was posted after step {step - 1}'s "
                                    f"compute (post it before computing on the block in hand)")
                elif not waits or waits[0] < before:
                    problems.append(f"{label} step {step}: its K/V transfer was waited before step {step - 1}'s "
                                    f"compute (wait after computing, so the transfer overlaps it)")
        return problems


_RANK_FILE = re.compile(r"rank\d+\.pt")


class LoadLog:
    """``with LoadLog() as log: load_sharded(...)``: every ``torch.load`` of a rank file, and its mmap."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, bool]] = []  # (file name, memory-mapped)
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "LoadLog":
        original = torch.load

        @functools.wraps(original)
        def load(f, *args, **kwargs):
            name = Path(os.fspath(f)).name if isinstance(f, (str, os.PathLike)) else Path(getattr(f, "name", "?")).name
            if _RANK_FILE.fullmatch(name):
                self.loads.append((name, bool(kwargs.get("mmap"))))
            return original(f, *args, **kwargs)

        for owner in (torch, torch.serialization):
            self._saved.append((owner, "load", owner.load))
            owner.load = load
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)

    def not_mapped(self) -> list[str]:
        return sorted({name for name, mapped in self.loads if not mapped})


def fsdp_units(model: nn.Module) -> list[str]:
    """The qualified names of the modules that are FSDP2 units (``fully_shard`` applied), root as ""."""
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


class explain_wrong_group:
    """Context manager: torch's "Number of tensor splits not equal to group size" (a collective called without
    ``group=`` inside a subgroup, so on the world) re-raised as one line that names the fix."""

    def __init__(self, group: dist.ProcessGroup, what: str) -> None:
        self.group, self.what = group, what

    def __enter__(self) -> "explain_wrong_group":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if not isinstance(exc, RuntimeError) or "not equal to group size" not in str(exc):
            return False
        size = dist.get_world_size(self.group)
        raise AssertionError(f"{self.what}: {exc}: a collective ran on the world ({dist.get_world_size()} ranks) "
                             f"instead of the {size}-rank group: pass group=group to it") from exc
