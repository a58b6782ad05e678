"""Plots that say more than a table: loss curves, pipeline timelines, bandwidth curves, bars.

matplotlib with the Agg backend (no display needed); every function writes a PNG
and returns its path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_curves(curves: Mapping[str, Sequence[float]], path: str | Path,
                     title: str = "training loss") -> Path:
    """One line per run: ``{"single process": [...], "ddp": [...]}``."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    # Colour alone repeats after 10 series: every series gets its own colour/line-style pair,
    # and the first (the baseline) is drawn thick and black, so no run can be mistaken for it.
    for i, ((name, losses), (colour, style)) in enumerate(zip(curves.items(), curve_styles(len(curves)))):
        ax.plot(range(1, len(losses) + 1), losses, label=name, color=colour, linestyle=style,
                linewidth=2.2 if i == 0 else 1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def curve_styles(n: int) -> list[tuple[str, str]]:
    """(colour, line style) of the first ``n`` series of ``plot_loss_curves``: distinct pairs."""
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    return [("black", "-")] + [(colours[i % len(colours)], styles[(i // len(colours)) % len(styles)])
                               for i in range(n - 1)]


TIMELINE_KINDS = {  # kind -> (colour, legend entry)
    "F": ("tab:blue", "F: forward (micro-batch[.chunk])"), "B": ("tab:orange", "B: backward (micro-batch[.chunk])"),
    "comm": ("tab:green", "communication"), "wait": ("lightgrey", "idle: waiting in recv"),
    "idle": ("white", "idle: no op (sends, bookkeeping; in a replay: the schedule's bubble)"),
    "opt": ("tab:purple", "optimizer"), "data": ("tab:olive", "data")}


def idle_events(events: list[tuple], t_end: float) -> list[tuple]:
    """"idle" events wherever a lane has no event, from the events' first start to ``t_end``."""
    t0 = min(e[1] for e in events)
    gaps = []
    for lane in {e[0] for e in events}:
        cursor = t0
        for _, start, end, _, _ in sorted((e for e in events if e[0] == lane), key=lambda e: e[1]):
            if start > cursor:
                gaps.append((lane, cursor, start, "idle", ""))
            cursor = max(cursor, end)
        if t_end > cursor:
            gaps.append((lane, cursor, t_end, "idle", ""))
    return gaps


def plot_timeline(events: Iterable[tuple], path: str | Path, title: str = "pipeline timeline",
                  idle_gaps: bool = False) -> Path:
    """A Gantt chart: events are ``(lane, start_s, end_s, kind, label)``; one row per lane (stage/rank).

    ``kind`` picks the colour and the legend entry ("F" forward, "B" backward, "wait" idle in
    recv, "comm", "opt", ...); ``label`` (the micro-batch) is written on the bar. ``idle_gaps``
    draws the time a lane has no event at all as "idle", so idle time shows by cause.
    """
    events = list(events)
    if idle_gaps and events:
        events += idle_events(events, max(e[2] for e in events))
    lanes = sorted({e[0] for e in events}, key=str)
    t0 = min((e[1] for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 2.0))
    seen = []
    for lane, start, end, kind, label in events:
        y = lanes.index(lane)
        colour, _ = TIMELINE_KINDS.get(kind, ("tab:gray", kind))
        ax.barh(y, end - start, left=start - t0, color=colour, edgecolor="black", linewidth=0.4,
                hatch="//" if kind == "idle" else None)
        if kind not in seen:
            seen.append(kind)
        if label != "" and label is not None:
            ax.text(start - t0 + (end - start) / 2, y, str(label), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), [str(lane) for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=TIMELINE_KINDS.get(k, ("tab:gray", k))[0], edgecolor="black",
                     hatch="//" if k == "idle" else None, label=TIMELINE_KINDS.get(k, ("", k))[1]) for k in seen]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(lanes) < 4 else -0.12),
              ncol=min(3, max(1, len(handles))))
    return _save(fig, path)


def plot_bandwidth(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path,
                   title: str = "bus bandwidth", ylabel: str = "GB/s") -> Path:
    """Lines of (message bytes, bandwidth) per implementation, log-x."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_bars(values: Mapping[str, float], path: str | Path, ylabel: str, title: str = "",
              unit: str | None = None) -> Path:
    """One bar per name (bytes per step, peak memory, ...).

    ``unit="bytes"`` scales the axis to the KiB/MiB/GiB that fits the largest bar and writes
    each bar's value on it, in the same units as the tables (``distlab.metrics.format_bytes``).
    """
    names, heights = list(values), list(values.values())
    if unit == "bytes":
        from distlab.metrics import format_bytes

        scale, suffix = next(((2 ** p, s) for p, s in ((30, "GiB"), (20, "MiB"), (10, "KiB"))
                              if max(heights, default=0) >= 2 ** p), (1, "B"))
        labels = [format_bytes(h) for h in heights]
        heights = [h / scale for h in heights]
        ylabel = f"{ylabel} ({suffix})"
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(values) + 2), 4.5))
    bars = ax.bar(names, heights, color="tab:blue")
    if unit == "bytes":
        ax.bar_label(bars, labels=labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=35)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    return _save(fig, path)
