"""A fair race: rotated contenders, warm-up, checked results, every rank's clock, spread over launches.

Inside the ranks (``measure``, called by every rank of the group with the same contenders):

* contenders run in a rotated order per repeat (ABBA for two: AB BA BA AB ...; with n
  contenders every one takes every position equally often over 2n repeats), so a burst
  of load, a warm cache or a cold allocator is shared out instead of always hitting the
  same one (a fixed order biased the DDP ratios by 5-10% on this box);
* ``warmup`` untimed rounds first (connections, allocators, first-call paths);
* the ranks are aligned by a barrier *before* the clock starts, never inside the timed
  window; CUDA is synchronised before each clock read on GPU ranks;
* a repeat's time is the slowest rank's (max over ranks): a collective is done when the
  last rank is done;
* every checked contender's result is compared with the reference's (the built-in)
  after the warm-up and after the last repeat, on every rank; any difference raises
  ``ContenderMismatch`` on every rank (so none waits for the others): never report the
  speed of a wrong answer.

Around the ranks (``launch``): the same measurement in ``launches`` (>= 3) fresh process
groups, with the load average (``os.getloadavg``) before and after each, because a
shared machine's load moves between runs and a single launch hides that spread.

Statistics (``ratio_row``, ``stat_row``): ratios are paired per repeat (ours and the
built-in of the same repeat, seconds apart), then summarised as the median with its IQR
and min/max over all repeats of all launches, plus the median of each launch, and a
sentence saying what the ratio means. ``benchmarks.run`` prints and tabulates these rows.

How a benchmark uses it (see bench_collectives.py, bench_ddp.py, bench_pipeline.py)::

    def _worker(rank, world_size, ...):
        ...
        return measure([Contender("torch DDP", run=step_torch, result=lambda: state(torch_model)),
                        Contender("ours", run=step_ours, result=lambda: state(our_model))],
                       reference="torch DDP", repeats=7, warmup=1, check=my_check)

    runs = launch(_worker, 2, ..., launches=3)
    row = ratio_row(runs, "ours", "torch DDP", meaning="step time of ours / torch DDP (below 1: ours faster)",
                    world_size=2, size="resnet18")
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from distlab.spawn import run_distributed


class ContenderMismatch(AssertionError):
    """A contender's result differs from the reference's: its timing would mean nothing."""


@dataclass
class Contender:
    """One way of doing the same thing.

    Args:
        name: shown in tables and used in ``ratio_row``.
        run: the timed call; its return value is the result checked (unless ``result`` is given).
        prepare: untimed, before every ``run`` (reset the input an in-place call overwrote).
        after: untimed, after every ``run`` (collect a timeline); every rank calls it in the same order.
        result: untimed; what to compare with the reference (e.g. the model's state after training).
        checked: False for a bound that computes something else (the loopback exchange).
    """
    name: str
    run: Callable[[], Any]
    prepare: Callable[[], None] | None = None
    after: Callable[[], None] | None = None
    result: Callable[[], Any] | None = None
    checked: bool = True


def rotation(names: list[str], repeat: int) -> list[str]:
    """The order of ``repeat``: rotated by repeat // 2, reversed on odd repeats (ABBA for two)."""
    k = (repeat // 2) % len(names)
    order = names[k:] + names[:k]
    return order if repeat % 2 == 0 else order[::-1]


def _describe_mismatch(check: Callable[[Any, Any], None], got: Any, want: Any) -> str | None:
    try:
        check(got, want)
    except AssertionError as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else "differs"
    return None


def measure(contenders: list[Contender], reference: str, repeats: int, warmup: int = 1,
            check: Callable[[Any, Any], None] = torch.testing.assert_close,
            device: torch.device | None = None, group: dist.ProcessGroup | None = None,
            inner: int = 1) -> dict:
    """Time every contender ``repeats`` times in rotated order; check results against ``reference``'s.

    Args:
        contenders: the same list, in the same order, on every rank.
        reference: the name of the built-in; checked contenders must match its result.
        check: ``check(result, reference_result)`` raises AssertionError on a difference
            (default ``torch.testing.assert_close``: float32 tolerances, for reordered sums).
        device: a cuda device synchronises before each clock read.
        inner: calls of ``run`` per timed window (``prepare`` once before them); the time
            reported is per call. A latency-bound call (~0.1 ms) is shorter than the
            scheduler's noise on a shared machine; 32 of them in one window are not.
    Returns (identical on every rank):
        {"times": {name: [seconds per repeat, max over ranks]}, "orders": [names per timed repeat],
         "repeats": repeats, "warmup": warmup, "inner": inner}
    Raises:
        ContenderMismatch on every rank when a checked contender's result differs.
    Collective: every rank of ``group`` calls it with the same contenders and arguments.
    """
    names = [c.name for c in contenders]
    by_name = {c.name: c for c in contenders}
    if reference not in by_name:
        raise ValueError(f"reference {reference!r} is not among the contenders {names}")
    if repeats < 1 or warmup < 0 or inner < 1:
        raise ValueError(f"repeats and inner must be >= 1 and warmup >= 0, got repeats={repeats}, "
                         f"inner={inner}, warmup={warmup}")
    on_gpu = device is not None and device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    last: dict[str, Any] = {}
    local: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for r in range(warmup + repeats):
        order = rotation(names, r - warmup) if r >= warmup else names  # timed repeats: AB BA BA AB ...
        if r >= warmup:
            orders.append(order)
        for name in order:
            c = by_name[name]
            if c.prepare is not None:
                c.prepare()
            sync()
            dist.barrier(group)  # align the starts; outside the timed window
            start = time.perf_counter()
            for _ in range(inner):
                out = c.run()
            sync()
            elapsed = (time.perf_counter() - start) / inner
            last[name] = out
            if c.after is not None:
                c.after()
            if r >= warmup:
                local[name].append(elapsed)
        if r == warmup - 1 or r == warmup + repeats - 1:
            _check(by_name, last, reference, check, "warm-up" if r < warmup else f"repeat {r - warmup + 1}",
                   device, group)
    # The slowest rank's time per repeat: a collective (or a step) ends when its last rank ends.
    times = torch.tensor([local[n] for n in names], dtype=torch.float64,
                         device=device if on_gpu else None)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    times = times.cpu()
    return {"times": {n: times[i].tolist() for i, n in enumerate(names)}, "orders": orders,
            "repeats": repeats, "warmup": warmup, "inner": inner}


def _check(by_name, last, reference, check, when, device, group) -> None:
    value = lambda c: c.result() if c.result is not None else last[c.name]  # noqa: E731
    want = value(by_name[reference])
    bad = {}
    for name, c in by_name.items():
        if c.checked and name != reference:
            msg = _describe_mismatch(check, value(c), want)
            if msg is not None:
                bad[name] = msg
    # Agree on the verdict first, so that every rank raises (none hangs in the next barrier).
    world_size = dist.get_world_size(group)
    flags = torch.zeros(world_size, device=device if device is not None and device.type == "cuda" else None)
    flags[dist.get_rank(group)] = len(bad)
    dist.all_reduce(flags, group=group)
    if flags.any():
        rank = dist.get_rank(group)
        where = [r for r in range(world_size) if flags[r]]
        detail = "; ".join(f"{n}: {m}" for n, m in bad.items()) or f"this rank matched; ranks {where} did not"
        raise ContenderMismatch(f"after the {when}, a contender's result differs from {reference!r} "
                                f"on rank {rank}: {detail}")


def launch(worker: Callable[..., dict], world_size: int, *args: Any, launches: int = 3,
           backend: str = "auto", timeout_s: float = 600.0, **kwargs: Any) -> list[dict]:
    """Run ``worker`` in ``launches`` fresh process groups; rank 0's return value of each, with the load.

    Returns ``[{"result": rank 0's return, "loadavg_before": (1, 5, 15 min), "loadavg_after": ...}]``.
    """
    if launches < 1:
        raise ValueError(f"launches must be >= 1, got {launches}")
    runs = []
    for _ in range(launches):
        before = os.getloadavg()
        result = run_distributed(worker, world_size, *args, backend=backend, timeout_s=timeout_s, **kwargs)[0]
        runs.append({"result": result, "loadavg_before": before, "loadavg_after": os.getloadavg()})
    return runs


# --------------------------------------------------------------------------- statistics
def spread(values: list[float]) -> dict:
    """Median, quartiles (inclusive method) and range of ``values``."""
    values = sorted(float(v) for v in values)
    if not values:
        raise ValueError("no values to summarise")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": values[0], "max": values[-1],
            "n": len(values)}


def load_of(launch_runs: list[dict]) -> dict:
    """The 1-minute load averages around the launches: the highest before one and after one."""
    return {"before_max": max(r["loadavg_before"][0] for r in launch_runs),
            "after_max": max(r["loadavg_after"][0] for r in launch_runs), "cores": os.cpu_count()}


def stat_row(per_launch: list[list[float]], *, meaning: str, metric: str, world_size: int | None, size: str,
             load: dict | None = None, **extra: Any) -> dict:
    """A summary row from per-repeat values grouped by launch: median, IQR, min/max, each launch's median."""
    pooled = [v for values in per_launch for v in values]
    s = spread(pooled)
    return {"ratio": s["median"], "spread": s, "launch_medians": [statistics.median(v) for v in per_launch],
            "launches": len(per_launch), "meaning": meaning, "metric": metric, "world_size": world_size,
            "size": size, "load": load, **extra}


def ratio_row(launch_runs: list[dict], ours: str, base: str, *, meaning: str, world_size: int | None,
              size: str, key: Callable[[dict], dict] = lambda result: result) -> dict:
    """ours / base, paired per repeat, over every launch; ``key`` picks the ``measure`` output in a launch's result."""
    per_launch, ours_t, base_t = [], [], []
    for run in launch_runs:
        times = key(run["result"])["times"]
        per_launch.append([o / b if b > 0 else math.nan for o, b in zip(times[ours], times[base])])
        ours_t += times[ours]
        base_t += times[base]
    return stat_row(per_launch, meaning=meaning, metric="time", world_size=world_size, size=size,
                    load=load_of(launch_runs), ours=statistics.median(ours_t), builtin=statistics.median(base_t),
                    unit="s")


def format_row(row: dict) -> str:
    """``0.95 [IQR 0.92-0.98, range 0.88-1.02; launches 0.94 0.95 0.97]``."""
    s = row.get("spread")
    if not s:
        return f"{row['ratio']:.2f} (one measurement)"
    launches = " ".join(f"{m:.2f}" for m in row.get("launch_medians", []))
    return (f"{row['ratio']:.2f} [IQR {s['q1']:.2f}-{s['q3']:.2f}, range {s['min']:.2f}-{s['max']:.2f}; "
            f"launches {launches}]")
