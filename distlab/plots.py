"""Plots that say more than a table: loss curves, pipeline timelines, bandwidth curves, bars.

matplotlib with the Agg backend (no display needed); every function writes a PNG
and returns its path. Figures of several panels are laid out first as ``Panel``s (title,
axis labels, series) and then drawn, one axes per panel: tests read the layout, and the
drawn figure (``figure_of``) has exactly those axes, lines and bars.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


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


@dataclass
class Panel:
    """One axes: ``series`` maps a label to its values (a line: one value per step; bars: one value each)."""

    title: str
    ylabel: str
    series: dict[str, list[float]] = field(default_factory=dict)
    kind: str = "line"  # "line" or "bars"
    xlabel: str = "step"
    yscale: str = "linear"  # "symlog": differences from a baseline, from 0 up across decades
    linthresh: float = 1.0  # symlog's linear range around 0: below the smallest difference shown
    unit: str | None = None  # bars: "bytes" scales the axis to KiB/MiB/GiB and writes each value on its bar


def loss_panels(groups: Mapping[str, Mapping[str, Sequence[float]]]) -> list[Panel]:
    """Per model (a column): its losses, and each run's difference from its single-process run.

    Args:
        groups: model -> {run name: losses per step}; the first run of each model is its single-process
            baseline. Different models never share an axes: their losses are not comparable.
    Runs that agree to 1e-6 lie under one line at the scale of a loss curve; the difference panel
    (symlog: 0, then every decade up) tells them apart, and shows which run left the baseline when.
    """
    panels = []
    for model, runs in groups.items():
        (base_name, base), *others = runs.items()
        panels.append(Panel(_wrap(f"{model}: loss"), "loss", {n: list(v) for n, v in runs.items()}))
        diffs = {n: [a - b for a, b in zip(v, base)] for n, v in others}
        tiny = [abs(d) for v in diffs.values() for d in v if d != 0]
        # the linear range ends a decade below the smallest difference, so every non-zero one sits on a log decade
        linthresh = 10.0 ** (math.floor(math.log10(min(tiny))) - 1) if tiny else 1e-8
        panels.append(Panel(_wrap(f"{model}: loss - {base_name}"), f"loss - {base_name}", diffs, yscale="symlog",
                            linthresh=linthresh))
    return panels


def bar_panels(groups: Mapping[str, Mapping[str, float]], ylabel: str, unit: str | None = None) -> list[Panel]:
    """One bar panel per model: bars side by side only where they measure the same model."""
    return [Panel(_wrap(model, 30), ylabel, {n: [float(v)] for n, v in values.items()}, kind="bars", xlabel="", unit=unit)
            for model, values in groups.items()]


def _wrap(title: str, width: int = 48) -> str:
    """A panel title on lines of ``width`` characters: three columns of long titles do not run into each other."""
    return "\n".join(textwrap.wrap(title, width))


def figure_of(panels: Sequence[Panel], title: str = "", ncols: int | None = None, rows_of: int = 1):
    """The matplotlib figure of ``panels``: one axes each, in panel order, column by column in groups of
    ``rows_of`` (``loss_panels``: 2, the loss above its difference). Returns the figure (not saved)."""
    ncols = ncols or max(1, math.ceil(len(panels) / rows_of))
    nrows = math.ceil(len(panels) / ncols)
    widths = [max(3, max((len(p.series) for p in panels[c * rows_of:(c + 1) * rows_of]), default=1))
              if panels and panels[0].kind == "bars" else 1 for c in range(ncols)]
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, gridspec_kw={"width_ratios": widths},
                             figsize=(max(6.0, 4.2 * ncols if panels[0].kind == "line" else 0.7 * sum(widths) + 2),
                                      3.2 * nrows + 0.8))
    for i, panel in enumerate(panels):
        ax = axes[i % rows_of + (i // (rows_of * ncols)) * rows_of][(i // rows_of) % ncols]
        _draw_panel(ax, panel)
    for ax in axes.flat[len(panels):]:
        if not ax.has_data():
            ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig


def _draw_panel(ax, panel: Panel) -> None:
    if panel.kind == "bars":
        names, values = list(panel.series), [v[0] for v in panel.series.values()]
        labels = None
        ylabel = panel.ylabel
        if panel.unit == "bytes":
            from distlab.metrics import format_bytes

            scale, suffix = next(((2 ** p, s) for p, s in ((30, "GiB"), (20, "MiB"), (10, "KiB"))
                                  if max(values, default=0) >= 2 ** p), (1, "B"))
            labels = [format_bytes(v) for v in values]
            values = [v / scale for v in values]
            ylabel = f"{ylabel} ({suffix})"
        bars = ax.bar(names, values, color="tab:blue")
        if labels:
            ax.bar_label(bars, labels=labels, fontsize=7)
        ax.tick_params(axis="x", rotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.set_ylabel(ylabel)
    else:
        styles = curve_styles(len(panel.series) + (panel.yscale == "symlog"))[panel.yscale == "symlog":]
        for i, ((name, ys), (colour, style)) in enumerate(zip(panel.series.items(), styles)):
            ax.plot(range(1, len(ys) + 1), ys, label=name, color=colour, linestyle=style,
                    linewidth=2.2 if i == 0 and panel.yscale != "symlog" else 1.2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        if panel.yscale == "symlog":
            ax.set_yscale("symlog", linthresh=panel.linthresh)
            ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_ylabel(panel.ylabel)
        if panel.series:
            ax.legend(fontsize=6)
    ax.set_xlabel(panel.xlabel)
    ax.set_title(panel.title, fontsize=9)


def plot_panels(panels: Sequence[Panel], path: str | Path, title: str = "", rows_of: int = 1) -> Path:
    """Draw ``panels`` (``figure_of``) and write the PNG."""
    return _save(figure_of(panels, title, rows_of=rows_of), path)


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
