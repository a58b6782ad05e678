"""Memory and overlap meters for the sharded wrappers (ZeRO-1/2, ZeRO-3/FSDP).

The wrappers call ``MemoryMeter.sample`` at every hook (each gradient arriving,
each unit gathered or freed, each collective launched or finished) with the
bytes they hold at that moment, so the *peak* during backward is recorded, not
only the state at rest. On GPU ``max_memory_allocated`` is reported beside it
(everything the allocator holds, activations included).

``OverlapMeter`` counts gradient hooks and collective launches inside one
backward: ``first_launch_hook`` is the index (1-based) of the gradient hook at
which the first reduce-scatter/all-reduce started; overlap means it is smaller
than ``hooks`` (the number of hooks in the backward), i.e. communication
started while autograd still had gradients to compute.

``LiveTensorBytes`` needs no cooperation from the code it measures: every tensor storage
alive in the process, sampled after every op, so ours and torch's wrappers are measured
by the same rule (benchmarks/bench_zero.py compares their peaks with it).
"""
from __future__ import annotations

import collections
import gc
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.metrics import nbytes  # noqa: F401 (the sharded wrappers take it with their meters)




@dataclass
class MemoryMeter:
    """Peak bytes per category ("params", "grads", "optimizer", ...) and of their sum."""

    peak: dict[str, int] = field(default_factory=dict)
    peak_total: int = 0
    samples: int = 0
    peak_cuda: int = 0

    def sample(self, **held: int) -> None:
        self.samples += 1
        for k, v in held.items():
            self.peak[k] = max(self.peak.get(k, 0), v)
        self.peak_total = max(self.peak_total, sum(held.values()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.peak_cuda = max(self.peak_cuda, torch.cuda.max_memory_allocated())

    def reset(self) -> None:
        self.peak, self.peak_total, self.samples, self.peak_cuda = {}, 0, 0, 0


@dataclass
class OverlapMeter:
    """Per backward: gradient hooks seen, collectives launched, and when the first one launched."""

    hooks: int = 0
    launches: int = 0
    first_launch_hook: int | None = None
    launched_before_end: int = 0    # collectives started before the last gradient hook ran
    history: list[dict[str, int | None]] = field(default_factory=list)

    def hook(self) -> None:
        """A gradient arrived: whatever launched so far started before this (maybe last) hook."""
        self.launched_before_end = self.launches
        self.hooks += 1

    def launch(self) -> None:
        self.launches += 1
        if self.first_launch_hook is None:
            self.first_launch_hook = self.hooks

    def end_backward(self) -> None:
        """Close one backward: record it in ``history`` and start counting the next."""
        self.history.append({"hooks": self.hooks, "launches": self.launches,
                             "first_launch_hook": self.first_launch_hook,
                             "launched_before_end": self.launched_before_end})
        self.hooks, self.launches, self.first_launch_hook, self.launched_before_end = 0, 0, None, 0


# --------------------------------------------------------------------------- one meter for any wrapper
def storages(t: Any) -> list[torch.UntypedStorage]:
    """The storages behind ``t`` (a DTensor: its local shard's), none for meta or fake tensors."""
    if type(t) in (torch.Tensor, nn.Parameter):  # the common case, first: this runs after every op
        return [t.untyped_storage()] if t.device.type != "meta" else []
    if not isinstance(t, torch.Tensor):
        return []
    if hasattr(t, "__tensor_flatten__"):  # DTensor and other wrapper subclasses
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in storages(getattr(t, n))]
    if t.device.type == "meta" or type(t).__name__ == "FakeTensor":
        return []
    return [t.untyped_storage()]


def _tensors(out: Any):
    """The tensors an op returned (a tensor, or a tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage alive in this process while the ``with`` block runs, and their peak.

    At entry, every tensor Python can reach (``gc.get_objects``); inside, every tensor an op
    takes or returns (a TorchDispatchMode: DTensors are seen as their local shards) and every
    ``UntypedStorage.resize_`` (how FSDP2 and ours free and re-allocate gathered parameters);
    each storage counted once (views share it) until it is freed (a weakref callback), at its
    current size. ``restart()`` leaves out what is alive at that moment for good (the input
    batch, a previous contender's last buffers that gloo's thread still holds) and starts a
    new peak. ``now`` and ``peak`` count the rest, sampled after every op and resize; ``at_peak``
    splits the peak with ``roles()`` ({category: storage ids}, called at each new peak), if given.
    Not seen, by any contender: memory inside one op (kernel workspaces) and the backend's own
    buffers (gloo's temporaries); tensors held only by C++ and never passed to an op (none here:
    torch DDP's buckets are its gradients).
    """

    def __init__(self) -> None:
        super().__init__()
        self.roles: Callable[[], dict[str, set[int]]] | None = None  # None: the peak is not split
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes, while it lives
        self._refs: dict[int, weakref.ref] = {}
        self._left_out: set[int] = set()
        # A storage can die on gloo's thread, or in a garbage collection in the middle of this
        # meter's own code: its callback only queues it; the meter's thread counts it at its next look.
        self._dead: collections.deque[int] = collections.deque()
        self._now = self.peak = 0  # bytes alive, not left out; the most of them since the last restart
        self.at_peak: dict[str, int] = {}
        self._peak_where, self._peak_phase = "", ""

    def _bury(self) -> None:
        while self._dead:
            key = self._dead.popleft()
            size = self.sizes.pop(key, 0)
            self._refs.pop(key, None)
            if key in self._left_out:
                self._left_out.discard(key)  # its id may be reused by a new storage
            else:
                self._now -= size

    def _see(self, storage: torch.UntypedStorage) -> None:
        self._bury()  # first: a dead storage's id may be this one's
        key, size = id(storage), storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._dead.append(key))
        self.sizes[key] = size
        if key not in self._left_out:
            self._now += size - (old or 0)

    def _sample(self, where: Any = "") -> None:
        self._bury()
        if self._now > self.peak:
            self.peak, self._peak_where = self._now, where  # an op: named only when the peak is read
            self._peak_phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward or step"
            if self.roles is not None:
                roles = self.roles()
                split = dict.fromkeys([*roles, "other"], 0)
                for key, size in self.sizes.items():
                    if key not in self._left_out:
                        split[next((c for c, keys in roles.items() if key in keys), "other")] += size
                self.at_peak = split

    @property
    def now(self) -> int:
        """Bytes alive now (not left out)."""
        self._bury()
        return self._now

    @property
    def peak_at(self) -> str:
        """The op (or storage resize) that reached the peak, and in which phase."""
        return f"{self._peak_where} ({self._peak_phase})"

    def restart(self, leave_out_alive: bool = False) -> None:
        """A new peak from now on; with ``leave_out_alive``, what is alive now is never counted again."""
        self._bury()
        if leave_out_alive:
            self._left_out, self._now = set(self.sizes), 0
        self.peak = -1
        self._sample("restart")

    def __enter__(self) -> "LiveTensorBytes":
        with warnings.catch_warnings():  # gc also holds torch's deprecated aliases, which warn when inspected
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for t in tensors:
            for s in storages(t):
                self._see(s)
        self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):  # not an op: TorchDispatchMode does not see it
            out = self._resize(storage, size)
            self._see(storage)
            self._sample("UntypedStorage.resize_")
            return out
        torch.UntypedStorage.resize_ = resize_
        self.restart()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):  # in-place ops and ``out=`` return their tensors too
            for s in storages(t):
                self._see(s)
        self._sample(func)
        return out
