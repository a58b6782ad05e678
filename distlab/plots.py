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
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_timeline(events: Iterable[tuple], path: str | Path, title: str = "pipeline timeline") -> Path:
    """A Gantt chart: events are ``(lane, start_s, end_s, kind, label)``; one row per lane (stage/rank).

    ``kind`` picks the colour ("F" forward, "B" backward, "comm", "wait", "opt", ...).
    """
    colours = {"F": "tab:blue", "B": "tab:orange", "comm": "tab:green", "wait": "lightgrey",
               "opt": "tab:purple", "data": "tab:olive"}
    events = list(events)
    lanes = sorted({e[0] for e in events})
    t0 = min((e[1] for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 1.5))
    for lane, start, end, kind, label in events:
        y = lanes.index(lane)
        ax.barh(y, end - start, left=start - t0, color=colours.get(kind, "tab:gray"), edgecolor="black",
                linewidth=0.4)
        if label:
            ax.text(start - t0 + (end - start) / 2, y, str(label), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), [str(lane) for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
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


def plot_bars(values: Mapping[str, float], path: str | Path, ylabel: str, title: str = "") -> Path:
    """One bar per name (bytes per step, peak memory, ...)."""
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(values) + 2), 4))
    ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)
