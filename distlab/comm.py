"""CommLedger: count the calls and bytes of every collective and point-to-point op, per rank.

Communication is measured, not assumed: a test wraps the code under test in a
ledger and asserts the textbook volume (a ring all-reduce sends 2(W-1)/W of the
tensor per rank, bucketed DDP issues one all-reduce per bucket, ...).

    ledger = CommLedger()
    with ledger:
        my_allreduce(t)
    assert ledger.sent_bytes() == 2 * (W - 1) * t.nbytes // W

While the ledger is active it observes the public functions of ``torch.distributed``
(``dist.all_reduce``, ``dist.isend``, ``dist.batch_isend_irecv``, ...) through
``distlab.intercept``: code must call them through the module (``dist.send``, or
``dist.distributed_c10d.send``), as all code in this course does; a function imported
by name before (``from torch.distributed import send``) is torch's own, not seen.
Internal calls inside torch (all_gather_object's own all_gather) are not counted.

What "bytes" means per op (``Record.nbytes``): the size of the buffer this rank
contributes: the tensor for all_reduce/broadcast/reduce/send, the received buffer
for recv, the input for all_gather(_into_tensor), gather, reduce_scatter(_tensor)
and all_to_all(_single), the output chunk for scatter. ``sent_bytes()`` and
``received_bytes()`` count point-to-point traffic exactly; for the built-in
collectives the algorithm (and so the wire volume) is the backend's choice.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab import intercept
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
    return intercept.torch_function(op)  # torch's own function under the interception wrappers


# ``dist.P2POp`` while intercepted (distlab.intercept): takes torch's isend/irecv or any wrapper of them.
_LedgerP2POp = intercept.P2POp


class CommLedger:
    """Records this rank's communication while active (``with ledger: ...``)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._subscription: intercept.Subscription | None = None

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

    # --- observing (distlab.intercept) -------------------------------------
    def __enter__(self) -> "CommLedger":
        if self._subscription is not None:
            raise RuntimeError("this CommLedger is already active")
        self._subscription = intercept.subscribe("ledger", self._observe)
        return self

    def __exit__(self, *exc) -> None:
        if self._subscription is not None:
            self._subscription.cancel()
            self._subscription = None

    def _record(self, op, nbytes, group, seconds, async_op) -> None:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.records.append(Record(op, nbytes, size, seconds, async_op))

    def _observe(self, call: intercept.Call):
        """One intercepted call: a batch counts each P2POp (as isend/irecv), before it runs; another op
        its payload, after it returns (a call that raises is not counted)."""
        if call.op == "batch_isend_irecv":
            for kind, p in call.p2p_ops():
                self._record(kind, nbytes(p.tensor), p.group, 0.0, True)
            yield
            return
        if call.op not in _PAYLOAD_ARG:
            return
        arg = _PAYLOAD_ARG[call.op]
        payload = call.arguments.get(arg) if arg else None
        async_op = call.async_op
        seconds = 0.0  # an async call is not timed: it waits elsewhere
        if not async_op:
            device = _device_of(payload)
            sync_device(device)  # on CUDA, time the op itself, not the queue ahead of it
            start = time.perf_counter()
        yield
        if not async_op:
            sync_device(device)  # a CUDA collective returns once it is queued
            seconds = time.perf_counter() - start
        self._record(call.op, nbytes(payload), call.group, seconds, async_op)
