"""CommLedger: count the calls and bytes of every collective and point-to-point op, per rank.

Communication is measured, not assumed: a test wraps the code under test in a
ledger and asserts the textbook volume (a ring all-reduce sends 2(W-1)/W of the
tensor per rank, bucketed DDP issues one all-reduce per bucket, ...).

    ledger = CommLedger()
    with ledger:
        my_allreduce(t)
    assert ledger.sent_bytes() == 2 * (W - 1) * t.nbytes // W

While the ledger is active, the public functions of ``torch.distributed``
(``dist.all_reduce``, ``dist.isend``, ``dist.batch_isend_irecv``, ...) are replaced
by recording wrappers; code must call them through the module (``dist.send``), as
all code in this course does. Internal calls inside torch (all_gather_object's own
all_gather) are not counted.

What "bytes" means per op (``Record.nbytes``): the size of the buffer this rank
contributes: the tensor for all_reduce/broadcast/reduce/send, the received buffer
for recv, the input for all_gather(_into_tensor), gather, reduce_scatter(_tensor)
and all_to_all(_single), the output chunk for scatter. ``sent_bytes()`` and
``received_bytes()`` count point-to-point traffic exactly; for the built-in
collectives the algorithm (and so the wire volume) is the backend's choice.
"""
from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.metrics import nbytes, sync_device

# op name -> the argument that holds the bytes this rank contributes
_PAYLOAD_ARG = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
    "gather": "tensor", "scatter": "tensor",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input", "reduce_scatter_single": "input",
    "all_gather_single": "input_tensor",
    "all_to_all": "input_tensor_list", "all_to_all_single": "input",
    "send": "tensor", "isend": "tensor", "recv": "tensor", "irecv": "tensor",
    "barrier": None,
}
_SENDS = ("send", "isend")
_RECVS = ("recv", "irecv")


REDUCE_OPS = ("sum", "avg")


def check_reduce_op(op: str, tensor: torch.Tensor) -> None:
    """The hand-made collectives' ``op`` argument: "sum", or "avg" on a floating tensor."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op 'avg' needs a floating-point tensor, got {tensor.dtype}")


# The op names under which the ledger records ``all_gather_single`` / ``reduce_scatter_single`` below on this
# torch: its own *_single (torch >= 2.14), else the older name they call (the GPU image's torch 2.11).
ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False):
    """``dist.reduce_scatter_single`` (torch >= 2.14) or ``dist.reduce_scatter_tensor`` (older).

    ``input`` is W equal chunks end to end; group rank r receives the reduction of chunk r.
    """
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: dist.ProcessGroup | None = None, async_op: bool = False):
    """``dist.all_gather_single`` (torch >= 2.14) or ``dist.all_gather_into_tensor`` (older).

    ``output`` receives the W ranks' ``input`` tensors end to end, in group-rank order.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _device_of(value) -> torch.device | None:
    """The device of the first tensor in ``value`` (a tensor or a list of them), if any."""
    if isinstance(value, torch.Tensor):
        return value.device
    for v in value if isinstance(value, (list, tuple)) else ():
        found = _device_of(v)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Record:
    """One call: which op, how many bytes, in which group (size), how long (sync calls)."""

    op: str
    nbytes: int
    group_size: int
    seconds: float
    async_op: bool


def _unwrap(op):
    while hasattr(op, "__wrapped_by_ledger__"):  # a ledger's wrapper may wrap the hang doctor's
        op = op.__wrapped_by_ledger__
    return op


class _LedgerP2POp(dist.P2POp):
    """``dist.P2POp`` while a ledger is active: torch checks ``op is isend`` against its own
    (unwrapped) function, so the P2POp stores the original; the batch wrapper counts it."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, _unwrap(op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs) -> None:
        super().__init__(_unwrap(op), *args, **kwargs)


class CommLedger:
    """Records this rank's communication while active (``with ledger: ...``)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._saved: dict[str, object] = {}
        self._in_batch = False

    # --- queries -----------------------------------------------------------
    def calls(self, op: str | None = None) -> int:
        """Number of calls of ``op`` (all ops if None); a batch counts each P2POp."""
        return sum(1 for r in self.records if op is None or r.op == op)

    def bytes(self, op: str | None = None) -> int:
        """Payload bytes of ``op`` (all ops if None)."""
        return sum(r.nbytes for r in self.records if op is None or r.op == op)

    def sent_bytes(self) -> int:
        """Bytes this rank sent point-to-point (send, isend, and isends in batches)."""
        return sum(r.nbytes for r in self.records if r.op in _SENDS)

    def received_bytes(self) -> int:
        """Bytes this rank received point-to-point."""
        return sum(r.nbytes for r in self.records if r.op in _RECVS)

    def wire_bytes(self, op: str | None = None) -> float:
        """Bytes this rank *sends*, counting collectives as bandwidth-optimal (ring) algorithms do.

        With W ranks in the op's group and n its payload (see the module docstring):
        all_reduce 2(W-1)/W n; reduce_scatter and all_to_all (W-1)/W n; all_gather
        (W-1) n (n is this rank's input); broadcast, reduce, gather, scatter n;
        send/isend n; recv/irecv 0 (the sender counts them). Nothing when W = 1.
        This is what makes strategies comparable: ZeRO-2 equals DDP (reduce-scatter +
        all-gather); ZeRO-1 done as all-reduce + all-gather and ZeRO-3 are 1.5x.
        """
        total = 0.0
        for r in self.records:
            if op is not None and r.op != op:
                continue
            w = r.group_size
            if w == 1 or r.op in _RECVS or r.op == "barrier":
                continue
            if r.op == "all_reduce":
                total += 2 * (w - 1) / w * r.nbytes
            elif r.op.startswith("reduce_scatter") or r.op.startswith("all_to_all"):
                total += (w - 1) / w * r.nbytes
            elif r.op.startswith("all_gather"):
                total += (w - 1) * r.nbytes
            else:
                total += r.nbytes
        return total

    def seconds(self, op: str | None = None) -> float:
        """Wall time spent inside synchronous calls (async calls wait elsewhere).

        On CUDA the device is synchronised before and after each timed call, so this is
        the op's own time, not the time to queue it.
        """
        return sum(r.seconds for r in self.records if op is None or r.op == op)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{op: {"calls": n, "bytes": b}}`` for the ops seen."""
        counts = Counter(r.op for r in self.records)
        return {op: {"calls": n, "bytes": self.bytes(op)} for op, n in sorted(counts.items())}

    def reset(self) -> None:
        self.records.clear()

    # --- patching ----------------------------------------------------------
    def __enter__(self) -> "CommLedger":
        if self._saved:
            raise RuntimeError("this CommLedger is already active")
        for op, arg in _PAYLOAD_ARG.items():
            original = getattr(dist, op, None)
            if original is None:  # not in this torch release
                continue
            self._saved[op] = original
            setattr(dist, op, self._wrap(op, arg, original))
        self._saved["batch_isend_irecv"] = dist.batch_isend_irecv
        setattr(dist, "batch_isend_irecv", self._wrap_batch(dist.batch_isend_irecv))
        self._saved["P2POp"] = dist.P2POp
        setattr(dist, "P2POp", _LedgerP2POp)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _record(self, op, nbytes, group, seconds, async_op) -> None:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.records.append(Record(op, nbytes, size, seconds, async_op))

    def _wrap(self, op, arg, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if self._in_batch:  # counted by the batch wrapper
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            payload = bound.arguments.get(arg) if arg else None
            async_op = bool(bound.arguments.get("async_op", op in ("isend", "irecv")))
            if async_op:  # not timed: it waits elsewhere
                result, seconds = original(*args, **kwargs), 0.0
            else:
                device = _device_of(payload)
                sync_device(device)  # on CUDA, time the op itself, not the queue ahead of it
                start = time.perf_counter()
                result = original(*args, **kwargs)
                sync_device(device)  # a CUDA collective returns once it is queued
                seconds = time.perf_counter() - start
            self._record(op, nbytes(payload), bound.arguments.get("group"), seconds, async_op)
            return result

        wrapper.__wrapped_by_ledger__ = original
        return wrapper

    def _wrap_batch(self, original):
        @functools.wraps(original)
        def wrapper(p2p_op_list):
            for p in p2p_op_list:
                name = "isend" if p.op is _unwrap(self._saved["isend"]) else "irecv"
                self._record(name, nbytes(p.tensor), p.group, 0.0, True)
            self._in_batch = True
            try:
                return original(p2p_op_list)
            finally:
                self._in_batch = False

        return wrapper
