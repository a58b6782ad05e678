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
| repr | ``print(t)``, ``str(t)``, ``repr(t)``, f"{t}", ``logging.info("loss %s", t)`` (when the record is emitted) | the text needs the values (torch formats them with the meter switched off: counted at the call) |
| to host | ``.cpu()``, ``.to("cpu")``, ``.to(torch.device("cpu"))``, ``.to(device=cpu)``, ``host_buffer.copy_(t)``, a copy from a device to the CPU | the copy is read when it returns |
| linalg info check | ``torch.linalg.inv``, ``cholesky``, ``solve`` ... (not their ``_ex`` forms) | the error check reads LAPACK's ``info`` on the host |
| blocking copy to device | ``.to(device)`` from the CPU without ``non_blocking=True`` (real devices only) | torch waits for the stream after a pageable copy |
| nonzero, masked_select, unique, repeat_interleave, bincount, boolean mask index | ``x[mask]``, ``torch.where(c)``, ``repeat_interleave`` without ``output_size`` | the output's size depends on the values |
| equal, allclose | ``torch.equal``, ``torch.allclose`` | a Python bool |
| cuda.synchronize, Event.synchronize, Stream.synchronize, accelerator.synchronize, barrier | explicit waits (``dist.barrier`` waits for the device on NCCL; ``distlab.metrics.sync_device``, the clock sync of the bench's timers, counts as cuda.synchronize on any device) | |

On a CPU run host and device are one, so a CPU target is told apart by its spelling on the
caller's line: "cpu" as a string; a ``torch.device`` written with cpu, host or pinned in the
``.to(...)`` call (``torch.device("cpu")``, ``device=cpu``, ``host_device``); a ``copy_`` into a
tensor so named (``host_buffer.copy_(t)``, ``self.cpu_grads[i].copy_(g)``). Any other
``.to(device)`` or ``copy_`` is the run's device (a no-op or a device copy; a GPU run's blocking
copies from the host are counted where they happen). The line is the unit: ``a.to(device);
b.to(cpu)`` on one line counts both.

Not counted: ``.numpy()`` (it refuses device tensors: host data, such as positions or sizes
that live on the CPU in a GPU run too, is read that way), ``non_blocking`` copies, NCCL's
``work.wait()`` (it makes the stream wait, not the CPU), and torch.optim's ``.item()`` of a
non-capturable Adam(W)'s ``step`` (one per parameter per step: torch keeps it on the CPU in a
GPU run too; a ``capturable`` or ``fused`` one never reads it). Each record names where: the
innermost frames outside torch, logging and this module, "file:line in function".
Not seen: a ``from torch.cuda import synchronize`` made before the meter started, and a sync
inside an op's C++ kernel, below the dispatcher, where torch does not expose it as an op of its
own: e.g. ``torch.histc`` on CUDA with ``min == max`` (reads the tensor's range), ``linalg.eig``
on CUDA (computed on the host); ``linalg.inv``'s check is an op, ``_linalg_check_errors``: counted.
Guide: phase2_advanced/guidelines.md#mixed-precision (the loss scaler's one sync per step).
"""
from __future__ import annotations

import collections
import linecache
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from distlab import metrics

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LOGGING_DIR = os.path.dirname(os.path.abspath(logging.__file__)) + os.sep  # a record formats its tensors there
_OPTIMIZER_PY = os.path.join(_TORCH_DIR, "optim", "optimizer.py")
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
    aten._linalg_check_errors.default: "linalg info check",
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


def _outside(f) -> bool:
    """Whether frame ``f`` is the caller's: not torch's, logging's or this module's."""
    name = f.f_code.co_filename
    path = os.path.abspath(name)
    return not (path.startswith((_TORCH_DIR, _LOGGING_DIR)) or path == _HERE or name.startswith("<"))


def _where(depth: int) -> tuple[str, ...]:
    """The ``depth`` innermost frames outside torch, logging and this module, as "file:line in function":
    the first such frame, then only this repository's (not pytest's or the launcher's callers)."""
    frames, f = [], sys._getframe(1)
    while f is not None and len(frames) < depth:
        path = os.path.abspath(f.f_code.co_filename)
        if _outside(f) and (not frames or (path.startswith(_REPO) and "site-packages" not in path)):
            shown = path[len(_REPO):] if path.startswith(_REPO) else path
            frames.append(f"{shown}:{f.f_lineno} in {f.f_code.co_name}")
        f = f.f_back
    return tuple(frames)


_HOST_WORD = re.compile(r"cpu|host|pinned", re.IGNORECASE)


def _spelled_as_host(pattern: re.Pattern) -> bool:
    """Whether the caller's line names the host where ``pattern`` matches (its group 1): on a CPU run
    host and device are one, and only the spelling tells ``x.to(device)`` (a no-op on the run's device)
    from ``x.to(torch.device("cpu"))``, ``x.to(device=cpu)`` or ``host_buffer.copy_(x)``."""
    f = sys._getframe(1)
    while f is not None and not _outside(f):
        f = f.f_back
    line = linecache.getline(f.f_code.co_filename, f.f_lineno) if f is not None else ""
    return any(_HOST_WORD.search(m.group(1)) for m in pattern.finditer(line))


_TO_ARGS = re.compile(r"\.to\(([^()]*(?:\([^()]*\)[^()]*)*)\)")  # .to(...) with one level of nested calls
_COPY_INTO = re.compile(r"([\w.\[\]]+)\.copy_\(")  # the tensor copied into: host_buffer.copy_(t)


def _host_step_count(args: tuple) -> bool:
    """Whether an ``item`` is torch.optim's ``_get_value`` of a step count on the CPU: a non-capturable
    Adam(W) keeps ``step`` there in a GPU run too (one ``.item()`` per parameter per step, never a wait)."""
    if not (args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"):
        return False
    f = sys._getframe(2)
    for _ in range(6):  # the dispatcher's frames, then _get_value (torch.compile's wrappers may sit between)
        if f is None:
            return False
        if f.f_code.co_name == "_get_value" and os.path.abspath(f.f_code.co_filename) == _OPTIMIZER_PY:
            return True
        f = f.f_back
    return False


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` brings a tensor to the host: "cpu" as a string, or a CPU
    ``torch.device`` spelled as the host in the call (``.to(device)`` on a CPU run is a no-op)."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str):
        return _is_cpu(target)
    return isinstance(target, torch.device) and target.type == "cpu" and _spelled_as_host(_TO_ARGS)


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
            return None if func is aten._local_scalar_dense.default and _host_step_count(args) else _VALUE_OPS[func]
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
        if non_blocking or dst is None:
            return None
        if src == torch.device(dst):  # a CPU run: into a host buffer (``host_buffer.copy_(t)``) counts
            cpu_copy = func is aten.copy_.default and src.type == "cpu"
            return "to host" if cpu_copy and _spelled_as_host(_COPY_INTO) else None
        if torch.device(dst).type == "cpu":
            return "to host" if src.type != "meta" else None
        return "blocking copy to device" if src.type == "cpu" else None

    # ----------------------------------------------------------------- Python-level calls
    @classmethod
    def _python_level(cls) -> list[tuple[Any, str, str, Callable[..., bool]]]:
        """(owner, attribute, op, when(*args, **kwargs)) of the calls the dispatcher does not see."""
        always = lambda *a, **k: True  # noqa: E731
        calls = [(torch.Tensor, "__repr__", "repr", lambda self, *a, **k: self.device.type != "meta"),
                 (torch.Tensor, "tolist", "tolist", always),
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
