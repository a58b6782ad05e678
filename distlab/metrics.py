"""Timers, throughput, memory and rank-aware logging for the demos and benchmarks.

Only rank 0 prints progress (``log0``, ``progress``); every rank may ``log`` with a
``[rank r]`` prefix. Timers synchronise CUDA before reading the clock, so a GPU
step is timed when it has finished, not when it was queued. ``Timeline`` (a pipeline's
spans) records CUDA events instead and reads them once after the step: it never stalls the
step it times, so it can stay on in a training loop.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(msg: str, rank: int | None = None) -> None:
    """Print with a ``[rank r]`` prefix (any rank)."""
    rank = get_rank() if rank is None else rank
    print(f"[rank {rank}] {msg}", flush=True)


def log0(msg: str) -> None:
    """Print on rank 0 only."""
    if get_rank() == 0:
        print(msg, flush=True)


def progress(iterable: Iterable, desc: str = "", total: int | None = None, **kwargs) -> Iterable:
    """A tqdm progress bar on rank 0; the plain iterable elsewhere."""
    if get_rank() != 0:
        return iterable
    from tqdm import tqdm

    kwargs.setdefault("mininterval", 1.0)  # a log file gets a line a second, not one per step
    return tqdm(iterable, desc=desc, total=total, file=sys.stdout, dynamic_ncols=True, **kwargs)


def device_clock(device: torch.device | str | None) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished (see sync_device)."""
    sync_device(device)
    return time.perf_counter()


def sync_device(device: torch.device | str | None) -> None:
    """Wait until the work queued on ``device`` has finished; call it before reading a clock.

    A CUDA op returns once it is queued, so a clock read right after it times the launch,
    not the work. CPU ops (and gloo's synchronous calls) have finished when they return:
    no-op there, and for ``None``.
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1,
                 sync: Callable[[], None] | None = None) -> list[float]:
    """Wall time of ``fn()`` ``repeats`` times after ``warmup`` untimed calls.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read, so queued GPU
    work is timed when it finishes, not when it is launched.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append(time.perf_counter() - start)
    return samples


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


class StepTimer:
    """Accumulate wall time per named section: ``with timer("compute"): ...``."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.times: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        sync_device(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync_device(self.device)
            self.times[name].append(time.perf_counter() - start)

    def total(self, name: str) -> float:
        return sum(self.times.get(name, ()))

    def median(self, name: str) -> float:
        values = self.times.get(name)
        return statistics.median(values) if values else float("nan")

    def summary(self) -> dict[str, float]:
        """Total seconds per section."""
        return {k: sum(v) for k, v in self.times.items()}


class Timeline:
    """Spans ``(lane, start_s, end_s, kind, label)`` of one step, for ``plots.plot_timeline``, with no host sync.

    A mark is the wall clock on the CPU. On CUDA it is an event recorded on the current stream
    (the CPU does not wait): the spans are read once, when ``spans`` is read (one wait, for the
    last event), as the wall clock at the step's first mark plus the GPU time since it. Timing
    a CUDA span with the wall clock instead needs a ``torch.cuda.synchronize`` at each end.
    ``enabled=False``: nothing is recorded and ``spans`` stays empty.
    """

    def __init__(self, device: torch.device | str | None = None, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._spans: list[tuple] = []
        self._pending: list[tuple] = []  # CUDA: spans whose ends are events not read yet
        self._anchor: tuple | None = None  # CUDA: (first event of the step, wall clock when it was queued)

    def mark(self) -> object:
        """A point in time: ``perf_counter()``, a recorded CUDA event, or None when disabled."""
        if not self.enabled:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._anchor is None:
            self._anchor = (event, time.perf_counter())
        return event

    def span(self, start: object, lane: object, kind: str, label: object = "") -> None:
        """Record the span from the mark ``start`` to now."""
        if self.enabled:
            (self._pending if self.cuda else self._spans).append((lane, start, self.mark(), kind, label))

    def clear(self) -> None:
        """Forget the spans (the next mark starts a new step); no sync."""
        self._spans.clear()
        self._pending.clear()
        self._anchor = None

    @property
    def spans(self) -> list[tuple]:
        """The spans in seconds (on CUDA: waits once for the last event, then reads them all)."""
        if self._pending:
            first, wall = self._anchor
            self._pending[-1][2].synchronize()  # events on one stream complete in order
            seconds = lambda e: wall + first.elapsed_time(e) / 1e3  # noqa: E731 (elapsed_time: ms)
            self._spans += [(lane, seconds(s), seconds(e), kind, label) for lane, s, e, kind, label in self._pending]
            self._pending.clear()
        return self._spans


class Throughput:
    """Samples per second over the steps recorded, skipping ``warmup`` steps."""

    def __init__(self, warmup: int = 1) -> None:
        self.warmup = warmup
        self.samples = 0
        self.seconds = 0.0
        self.steps = 0

    def record(self, samples: int, seconds: float) -> None:
        self.steps += 1
        if self.steps > self.warmup:
            self.samples += samples
            self.seconds += seconds

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, process max RSS on CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def nbytes(value: torch.Tensor | Iterable | None) -> int:
    """Bytes held by a tensor, or by every tensor of a (nested) collection; None and a freed storage count 0.

    The bench's one byte counter: the ledger's message sizes (``distlab.comm``), the p2p size headers,
    the sharded wrappers' memory meters and the demos' tables all count with it.
    """
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return 0 if value.untyped_storage().size() == 0 else value.numel() * value.element_size()
    return sum(nbytes(v) for v in value)


def format_bytes(n: float) -> str:
    """``16 B``, ``4 KiB``, ``1.5 MiB``, ``2.25 GiB``: three significant digits in the largest unit that fits."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain-text table with aligned columns (for end-of-run summaries)."""
    if not rows:
        return ""
    columns = columns or list(rows[0])
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, rule, *body])
