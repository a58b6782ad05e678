"""Host synchronisations: every call in a training step that makes the CPU wait for the GPU.

A CUDA op returns as soon as it is queued; the CPU runs ahead and keeps the GPU fed. A
call that needs a value the GPU has not produced yet stops the CPU until the queue has
drained (a device-to-host synchronisation): then the GPU idles while Python prepares the
next kernels. One per step costs little; one per parameter, per micro-batch or per
attention block costs more than the kernels it waits for.

``HostSyncMeter`` counts them on any device: it counts the calls that WOULD wait on CUDA,
also on CPU tensors (where nothing waits), so a CPU test holds a strategy to its GPU budget::

    with HostSyncMeter() as meter:
        train_step(...)
    meter.check(budget=1, steps=1, what="loss scaler")   # raises, naming each sync's line

Counted (the ``op`` of each record):

| op | calls | why the CPU waits on CUDA |
|---|---|---|
| item | ``.item()``, ``bool(t)``, ``if t:``, ``int(t)``, ``float(t)``, f"{t:.3f}" | a Python number needs the value |
| tolist | ``.tolist()`` | Python numbers again |
| to host | ``.cpu()``, ``.to("cpu")``, a copy from a device to the CPU | the copy is read when it returns |
| blocking copy to device | ``.to(device)`` from the CPU without ``non_blocking=True`` (real devices only) | torch waits for the stream after a pageable copy |
| nonzero, masked_select, unique, repeat_interleave, bincount, boolean mask index | ``x[mask]``, ``torch.where(c)``, ``repeat_interleave`` without ``output_size`` | the output's size depends on the values |
| equal, allclose | ``torch.equal``, ``torch.allclose`` | a Python bool |
| cuda.synchronize, Event.synchronize, Stream.synchronize, accelerator.synchronize, barrier | explicit waits (``dist.barrier`` waits for the device on NCCL; ``distlab.metrics.sync_device``, the clock sync of the bench's timers, counts as cuda.synchronize on any device) | |

Not counted: ``.numpy()`` (it refuses device tensors: host data, such as positions or sizes
that live on the CPU in a GPU run too, is read that way), ``non_blocking`` copies, NCCL's
``work.wait()`` (it makes the stream wait, not the CPU), and a ``.to(device)`` on a CPU run
(a no-op there; a GPU run's blocking copies are counted where they happen). Each record
names where: the innermost frames outside torch and this module, "file:line in function".
Also not seen: a ``from torch.cuda import synchronize`` made before the meter started.
Guide: phase2_advanced/guidelines.md#mixed-precision (the loss scaler's one sync per step).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from distlab import metrics

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
_REPO = os.path.dirname(os.path.dirname(_HERE)) + os.sep

aten = torch.ops.aten
# aten ops whose output (or return value) the CPU must see before it can go on.
_VALUE_OPS: dict[Any, str] = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim_consecutive.default: "unique",
    aten.bincount.default: "bincount",
    aten.equal.default: "equal",
    aten.allclose.default: "allclose",
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEX = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}

_tls = threading.local()  # .inside: a counted Python-level call is running (its own ops are not counted again)


@dataclass(frozen=True)
class HostSync:
    """One synchronisation: the op and where it was called (innermost frame first)."""

    op: str
    where: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.op} at {' <- '.join(self.where) or '?'}"


def _where(depth: int) -> tuple[str, ...]:
    """The ``depth`` innermost frames outside torch and this module, as "file:line in function":
    the first such frame, then only this repository's (not pytest's or the launcher's callers)."""
    frames, f = [], sys._getframe(1)
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename
        path = os.path.abspath(name)
        if not (path.startswith(_TORCH_DIR) or path == _HERE or name.startswith("<")) and \
                (not frames or (path.startswith(_REPO) and "site-packages" not in path)):
            shown = path[len(_REPO):] if path.startswith(_REPO) else path
            frames.append(f"{shown}:{f.f_lineno} in {f.f_code.co_name}")
        f = f.f_back
    return tuple(frames)


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the host as a string ("cpu"): that spelling
    only ever means "bring it to the CPU" (``.to(device)`` on a CPU run is a no-op)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and _is_cpu(target)


class HostSyncMeter(TorchDispatchMode):
    """Count device-to-host synchronisations while the ``with`` block runs (see the module docstring).

    Args:
        depth: frames outside torch kept per record (the first one is the line to fix).
    Attributes:
        records: one ``HostSync`` per synchronisation, in order.
    Meters nest (each counts everything inside it); backward on autograd's threads is
    counted too (they inherit the mode).
    """

    _active: list["HostSyncMeter"] = []
    _originals: dict[tuple[Any, str], tuple[Callable, bool]] = {}  # (real, defined on owner itself)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # True wraps __torch_dispatch__ in torch._dynamo.disable: 2-3 s of import in every rank

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.depth = depth
        self.records: list[HostSync] = []

    # ----------------------------------------------------------------- results
    def __len__(self) -> int:
        return len(self.records)

    def counts(self) -> dict[str, int]:
        """Synchronisations per op."""
        return dict(collections.Counter(r.op for r in self.records))

    def report(self, limit: int = 8) -> str:
        """One line per distinct (op, place), most frequent first."""
        lines = collections.Counter(str(r) for r in self.records).most_common()
        text = [f"{n} x {line}" for line, n in lines[:limit]]
        if len(lines) > limit:
            text.append(f"... and {len(lines) - limit} more places")
        return "\n".join(text) or "none"

    def check(self, budget: float, steps: int = 1, what: str = "") -> None:
        """Raise ``AssertionError`` when the syncs per step exceed ``budget``, naming each one's line."""
        per_step = len(self.records) / steps
        if per_step > budget:
            raise AssertionError(f"{what + ': ' if what else ''}{per_step:g} host syncs per step "
                                 f"({len(self.records)} in {steps} steps), budget {budget:g}:\n{self.report()}")

    # ----------------------------------------------------------------- counting
    def _record(self, op: str) -> None:
        self.records.append(HostSync(op, _where(self.depth)))

    def _mine(self) -> bool:
        """Whether this thread runs inside this meter (the mode is on its stack; popped while it dispatches)."""
        return any(m is self for m in _get_current_dispatch_mode_stack())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_tls, "inside", False):
            op = self._sync_of(func, args, kwargs)
            if op:
                self._record(op)
        return func(*args, **kwargs)

    @staticmethod
    def _sync_of(func, args: tuple, kwargs: dict) -> str | None:
        if func in _VALUE_OPS:
            return _VALUE_OPS[func]
        if func in _REPEAT_INTERLEAVE:
            return None if kwargs.get("output_size") is not None else "repeat_interleave"
        if func in _INDEX:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                return "boolean mask index"
            return None
        non_blocking = kwargs.get("non_blocking", False)
        if func is aten._to_copy.default:
            src, dst = args[0].device, kwargs.get("device")
        elif func is aten.copy_.default:  # copy_(self, src, non_blocking): it may come positionally
            src, dst = args[1].device, args[0].device
            non_blocking = non_blocking or (len(args) > 2 and bool(args[2]))
        else:
            return None
        if dst is None or src == torch.device(dst) or non_blocking:
            return None
        if torch.device(dst).type == "cpu":
            return "to host" if src.type != "meta" else None
        return "blocking copy to device" if src.type == "cpu" else None

    # ----------------------------------------------------------------- Python-level calls
    @classmethod
    def _python_level(cls) -> list[tuple[Any, str, str, Callable[..., bool]]]:
        """(owner, attribute, op, when(*args, **kwargs)) of the calls the dispatcher does not see."""
        always = lambda *a, **k: True  # noqa: E731
        calls = [(torch.Tensor, "tolist", "tolist", always),
                 (torch.Tensor, "cpu", "to host", always),
                 (torch.Tensor, "to", "to host", lambda self, *a, **k: _to_host(a, k)),
                 (torch.cuda, "synchronize", "cuda.synchronize", always),
                 (torch.cuda.Event, "synchronize", "Event.synchronize", always),
                 (torch.cuda.Stream, "synchronize", "Stream.synchronize", always),
                 (dist, "barrier", "barrier", always),
                 # the bench's clock sync: a no-op on the CPU, torch.cuda.synchronize on CUDA
                 (metrics, "sync_device", "cuda.synchronize", lambda device: device is not None)]
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
            calls.append((torch.accelerator, "synchronize", "accelerator.synchronize", always))
        return calls

    @classmethod
    def _patch(cls) -> None:
        for owner, name, op, when in cls._python_level():
            real = getattr(owner, name)
            cls._originals[owner, name] = real, name in vars(owner)

            def counted(*args, _real=real, _op=op, _when=when, **kwargs):
                if not getattr(_tls, "inside", False) and _when(*args, **kwargs):
                    for meter in cls._active:
                        if meter._mine():
                            meter._record(_op)
                    _tls.inside = True
                    try:
                        return _real(*args, **kwargs)
                    finally:
                        _tls.inside = False
                return _real(*args, **kwargs)
            setattr(owner, name, counted)

    @classmethod
    def _unpatch(cls) -> None:
        for (owner, name), (real, own) in cls._originals.items():
            if own:
                setattr(owner, name, real)
            else:
                delattr(owner, name)  # inherited (torch.Tensor's C methods): uncover it again
        cls._originals.clear()

    def __enter__(self) -> "HostSyncMeter":
        if not HostSyncMeter._active:
            HostSyncMeter._patch()
        HostSyncMeter._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            HostSyncMeter._active.remove(self)
            if not HostSyncMeter._active:
                HostSyncMeter._unpatch()
