# Generated from solutions/phase4_production/monitoring.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Monitoring and profiling: where each rank's step goes, and which rank holds the others back.

Each rank times four sections of every step: **data** (fetching the batch), **compute**
(forward + backward), **comm** (waiting for the gradient all-reduce) and **optimizer**,
and records loss, gradient norm, samples/s and memory. Every ``interval`` steps the
per-rank summaries are gathered to rank 0 (``gather_to_rank0``: one small
``dist.gather``), which names the **stragglers** and writes one JSON line per rank
(``metrics.jsonl``), a CSV, and TensorBoard scalars when tensorboard is installed.

Why not compare step times? In synchronous data parallelism every rank's step takes
as long as the slowest rank's: the others wait for it inside the all-reduce. A slow
rank shows up as large *busy* time (data + compute + optimizer) while the others show
large *comm* time. So a straggler is a rank whose median busy time exceeds
``factor`` x the median over ranks (``find_stragglers``).

Timers read an injectable ``clock`` (tests pass a fake one, so a "slow rank" is a
deterministic fact, not a race). ``profile`` wraps ``torch.profiler`` and writes one
Chrome/Perfetto trace per rank (open at https://ui.perfetto.dev).
Cost: one gather of 9 floats per rank every ``interval`` steps.
See phase4_production/guidelines.md#monitoring-and-profiling.

Run: ``RUN_MODE=monitoring ./entrypoint.sh`` (rank 1 made 4x slower: it is named).
"""
from __future__ import annotations

import csv
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from distlab.metrics import peak_memory_bytes, sync_device
from distlab.lessons.sync import group_root
from distlab.todo import todo

SECTIONS = ("data", "compute", "comm", "optimizer")
FIELDS = ("data_s", "compute_s", "comm_s", "optimizer_s", "busy_s", "step_s", "samples_per_s", "loss", "grad_norm",
          "memory_mb")


@dataclass(frozen=True)
class RankSummary:
    """Medians over one interval of one rank's steps (seconds), and the last loss/grad norm."""

    rank: int
    step: int
    data_s: float
    compute_s: float
    comm_s: float
    optimizer_s: float
    busy_s: float  # data + compute + optimizer: the work this rank does itself
    step_s: float
    samples_per_s: float
    loss: float
    grad_norm: float
    memory_mb: float


@dataclass(frozen=True)
class Report:
    """What rank 0 learns every interval: every rank's summary and the stragglers' ranks."""

    step: int
    ranks: list[RankSummary]
    stragglers: list[int]


# --------------------------------------------------------------------------- the lesson
def gather_to_rank0(values: list[float], group: dist.ProcessGroup | None = None,
                    device: torch.device | str | None = None) -> list[list[float]] | None:
    """Collect every rank's list of floats (same length everywhere) on group rank 0.

    ``device`` is where the values travel: the rank's device (NCCL moves CUDA tensors only;
    None: the CPU).

    Equivalent to: ``dist.gather_object``, without pickling: one float64 tensor per rank.
    Collective: every rank of ``group`` must call it with the same number of values.
    Cost: len(values) x 8 bytes per rank, received by rank 0.
    Returns:
        On rank 0, ``[values of rank 0, values of rank 1, ...]``; None elsewhere.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None  # noqa: F841 (gathered: for TODO 4.11)
    # --- TODO 4.11: gather metrics to rank 0 ---
    # Goal: group rank 0 returns every rank's values as lists, in group rank order; the others
    # return None. One collective, len(values) x 8 bytes per rank, no pickling; every rank of
    # `group` calls it. Mind that a destination is named by its GLOBAL rank.
    raise todo("4.11 gather metrics to rank 0", "guidelines.md#monitoring-and-profiling")
    # --- end TODO 4.11 ---


def find_stragglers(busy_s: list[float], factor: float = 1.5) -> list[int]:
    """Ranks whose busy time exceeds ``factor`` x the median over ranks, in rank order.

    The median, not the mean: one very slow rank must not raise the bar it is measured against.
    """
    if factor <= 1:
        raise ValueError(f"factor must be > 1 (a rank is slow when it takes factor x the median), got {factor}")
    # --- TODO 4.12: straggler detection ---
    # Goal: the ranks (indices of `busy_s`, in order) whose busy time is strictly greater than
    # `factor` times the median busy time over all ranks.
    raise todo("4.12 straggler detection", "guidelines.md#stragglers")
    # --- end TODO 4.12 ---


# --------------------------------------------------------------------------- the monitor
def grad_norm(model: torch.nn.Module) -> float:
    """The global L2 norm of the gradients (after the all-reduce every rank has the same)."""
    norms = [p.grad.detach().double().norm() for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else 0.0


class Monitor:
    """Per-rank step timing with rank-0 aggregation, straggler detection and metric files.

    Args:
        rank, world_size: this rank in ``group``.
        out_dir: where rank 0 writes metrics.jsonl / metrics.csv / tensorboard/ (None: nowhere).
        interval: gather and report every ``interval`` steps (a collective: every rank calls ``end_step``).
        straggler_factor: see ``find_stragglers``.
        clock: seconds as a float; ``time.perf_counter`` unless a test injects a fake one.
        device: the rank's device: synchronised before each clock read on CUDA, and the one the
            summaries travel on (None: the CPU).
    """

    def __init__(self, rank: int, world_size: int, out_dir: str | Path | None = None, interval: int = 10,
                 straggler_factor: float = 1.5, clock: Callable[[], float] = time.perf_counter,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self.factor, self.clock, self.device, self.group = straggler_factor, clock, device, group
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []  # the steps of the current interval
        self.events: list[list[tuple]] = []  # per step: (lane, start, end, kind, label) for plot_timeline
        self._step_events: list[tuple] = []
        self.reports: list[Report] = []
        self._tb = None
        if rank == 0 and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "metrics.jsonl").write_text("")
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: only if tensorboard is installed
                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except ImportError:
                pass

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time one section of the current step: ``with monitor.section("compute"): ...``."""
        if name not in SECTIONS:
            raise ValueError(f"section must be one of {SECTIONS}, got {name!r}")
        sync_device(self.device)  # on CUDA, time the work, not its queueing
        start = self.clock()
        try:
            yield
        finally:
            sync_device(self.device)
            end = self.clock()
            self.current[name] = self.current.get(name, 0.0) + end - start
            kind = {"compute": "F", "comm": "comm", "optimizer": "opt", "data": "data"}[name]
            self._step_events.append((f"rank {self.rank}", start, end, kind, ""))

    def end_step(self, step: int, samples: int, loss: float, grad_norm: float) -> Report | None:
        """Close the step; every ``interval`` steps gather to rank 0 and return its Report there.

        Collective: every rank must call it every step (it gathers on interval boundaries).
        """
        record = {f"{s}_s": self.current.get(s, 0.0) for s in SECTIONS}
        record["busy_s"] = record["data_s"] + record["compute_s"] + record["optimizer_s"]
        record["step_s"] = sum(self.current.get(s, 0.0) for s in SECTIONS)
        record.update(samples=samples, loss=float(loss), grad_norm=float(grad_norm))
        self.steps.append(record)
        self.events.append(self._step_events)
        self.current, self._step_events = {}, []
        if (step + 1) % self.interval:
            return None
        summary = self._summarise(step)
        self.steps = []
        gathered = gather_to_rank0([getattr(summary, f) for f in FIELDS], self.group, self.device)
        if gathered is None:
            return None
        ranks = [RankSummary(rank=r, step=step, **dict(zip(FIELDS, values))) for r, values in enumerate(gathered)]
        report = Report(step=step, ranks=ranks, stragglers=find_stragglers([s.busy_s for s in ranks], self.factor))
        self.reports.append(report)
        self._write(report)
        return report

    def _summarise(self, step: int) -> RankSummary:
        med = {f: statistics.median(s[f] for s in self.steps) for f in ("data_s", "compute_s", "comm_s",
                                                                        "optimizer_s", "busy_s", "step_s")}
        seconds = sum(s["step_s"] for s in self.steps)
        samples = sum(s["samples"] for s in self.steps)
        last = self.steps[-1]
        return RankSummary(rank=self.rank, step=step, **med,
                           samples_per_s=samples / seconds if seconds > 0 else float("nan"),
                           loss=last["loss"], grad_norm=last["grad_norm"],
                           memory_mb=peak_memory_bytes(self.device) / 2 ** 20)

    def _write(self, report: Report) -> None:
        if self.out_dir is None:
            return
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            for s in report.ranks:
                f.write(json.dumps({**asdict(s), "straggler": s.rank in report.stragglers}) + "\n")
        rows = [json.loads(line) for line in (self.out_dir / "metrics.jsonl").read_text().splitlines()]
        with open(self.out_dir / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        if self._tb is not None:
            for s in report.ranks:
                for f in FIELDS:
                    self._tb.add_scalar(f"{f}/rank{s.rank}", getattr(s, f), report.step)
            self._tb.flush()

    def gather_events(self, last_steps: int = 3) -> list[tuple] | None:
        """Every rank's timeline events of its ``last_steps`` steps, on rank 0 (for ``plot_timeline``).

        Collective: every rank must call it. Clocks of different processes share
        ``time.perf_counter``'s origin only on one machine; across machines, compare shapes.
        """
        out = [None] * self.world_size if self.rank == 0 else None
        mine = [e for step in self.events[-last_steps:] for e in step]
        dist.gather_object(mine, out, dst=group_root(self.group), group=self.group)
        return [e for events in out for e in events] if out is not None else None


class _NoProfiler:
    def __enter__(self) -> "_NoProfiler":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        pass


def profile(out_dir: str | Path, rank: int, enabled: bool = True, wait: int = 1, warmup: int = 1, active: int = 3):
    """A ``torch.profiler`` context (call ``.step()`` each step) writing ``trace_rank{rank}.json``.

    The trace opens in Perfetto (https://ui.perfetto.dev) or chrome://tracing; with
    ``enabled=False`` it is a no-op context with a ``step()`` that does nothing.
    """
    if not enabled:
        return _NoProfiler()
    from torch.profiler import ProfilerActivity, schedule
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return torch.profiler.profile(
        activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(Path(out_dir) / f"trace_rank{rank}.json")))
