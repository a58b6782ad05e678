"""What the phase tests use to check the property an exercise teaches, not only its numbers.

``EventLog`` records, in order, on this rank: each asynchronous transfer as it is posted (a
``torch.distributed`` call that returns a ``Work``: isend, irecv, batch_isend_irecv, or a collective
with ``async_op=True``), each ``Work.wait()``, and the compute the test marks (``log.mark(label)``) or,
with ``adds=True``, every in-place or out-of-place addition (TorchFunctionMode). From that order a test
asserts overlap: a transfer posted before the compute and waited after it. A synchronous collective
posts nothing, so compute next to it is never overlapped.

It patches ``torch.distributed`` attributes and ``Work.wait`` while active (restored on exit, LIFO with
a CommLedger or the strict p2p layer); the P2POp handling is the ledger's (distlab/comm.py).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.comm import _LedgerP2POp

POSTING = ("isend", "irecv", "batch_isend_irecv", "all_gather_into_tensor", "all_gather_single", "all_gather",
           "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_reduce", "broadcast",
           "all_to_all_single")
_WORK = dist.Work


def _innermost(work):
    """The torch Work under the strict p2p layer's wrappers (distlab/p2p_strict.py keeps it in ``_work``)."""
    while "_work" in getattr(work, "__dict__", {}):
        work = work.__dict__["_work"]
    return work


class _Adds(TorchFunctionMode):
    def __init__(self, log: "EventLog") -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if "add" in name:  # add, add_, __add__, __iadd__, index_add_, addmm, ...
            self.log.mark(f"add:{name}")
        return func(*args, **(kwargs or {}))


class EventLog:
    """This rank's posts, waits and compute, in the order they happened (``with EventLog() as log``)."""

    def __init__(self, adds: bool = False) -> None:
        self.events: list[tuple[str, str, object]] = []  # (kind, label, work or None)
        self._saved: dict[str, object] = {}
        self._adds = _Adds(self) if adds else None

    def mark(self, label: str) -> None:
        self.events.append(("compute", label, None))

    def __enter__(self) -> "EventLog":
        for name in POSTING:
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        self._saved["P2POp"] = dist.P2POp
        dist.P2POp = _LedgerP2POp  # torch checks `op is isend` against the unwrapped function
        self._saved_wait = _WORK.wait
        log, original_wait = self, _WORK.wait

        def wait(work, *args, **kwargs):
            result = original_wait(work, *args, **kwargs)
            log.events.append(("wait", "", work))
            return result

        _WORK.wait = wait
        if self._adds is not None:
            self._adds.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._adds is not None:
            self._adds.__exit__(*exc)
        _WORK.wait = self._saved_wait
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            for work in result if isinstance(result, list) else [result]:
                if callable(getattr(work, "wait", None)):  # a Work, or the strict p2p layer's wrapper of one
                    self.events.append(("post", name, work))
            return result

        wrapper.__wrapped_by_ledger__ = original  # distlab.comm._unwrap finds torch's own isend through it
        return wrapper

    # --- queries -----------------------------------------------------------
    def computes(self, prefix: str = "", posted: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
        """``(label, transfers in flight)`` for each compute whose label starts with ``prefix``:
        in flight = posted (by one of the ``posted`` calls, any if None) before it and not yet waited
        (a transfer never waited counts)."""
        pending: dict[int, object] = {}
        out = []
        for kind, label, work in self.events:
            if kind == "post" and (posted is None or label in posted):
                pending[id(_innermost(work))] = work
            elif kind == "wait":
                pending.pop(id(_innermost(work)), None)
            elif label.startswith(prefix):
                out.append((label, len(pending)))
        return out

    def posts(self, name: str | None = None) -> int:
        return sum(1 for kind, label, _ in self.events if kind == "post" and name in (None, label))


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class LiveBytes(TorchDispatchMode):
    """The peak of ``held()`` (bytes the test counts from the code's own state), sampled after every
    operation while active, forward and backward: an instant between two samples has no operation."""

    def __init__(self, held) -> None:
        super().__init__()
        self.held, self.peak = held, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.held())
        return out


FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn", "randint")


class DefaultDeviceFactories:
    """Records the torch factory calls made from ``path`` (the code under test's file) without
    ``device=``: such a tensor lands on the default device (the CPU), not the parameters' (a GPU under
    NCCL), whatever the parameters are on. ``*_like`` and ``new_*`` follow their input and are fine.
    Patches module attributes (plain Python), so it sees calls made in autograd hooks too, where
    torch-function modes are not applied."""

    def __init__(self, path: str) -> None:
        self.path, self.calls, self._saved = path, [], {}

    def __enter__(self) -> "DefaultDeviceFactories":
        import sys

        for name in FACTORIES:
            original = self._saved[name] = getattr(torch, name)

            def factory(*args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1)
                if kwargs.get("device") is None and caller.f_code.co_filename == self.path:
                    self.calls.append(f"torch.{_name}(...) at line {caller.f_lineno}")
                return _original(*args, **kwargs)

            setattr(torch, name, factory)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch, name, original)
        self._saved.clear()
