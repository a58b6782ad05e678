"""Run every benchmark side by side with PyTorch's built-ins; write the summary and the README section.

    python -m benchmarks.run              # everything (minutes)
    python -m benchmarks.run --quick      # smaller sizes, fewer repeats (README left alone)
    python -m benchmarks.run --only collectives ddp
    python -m benchmarks.run --render-readme   # only rewrite the tables from the summary

Each ``benchmarks/bench_<topic>.py`` measures ours and the built-in in the same run
(see benchmarks/common.py) and writes benchmarks/results/<topic>.json and PNGs.
This script collects their comparisons into benchmarks/results/summary.json (name ->
median ratio with its spread: IQR, min-max and the median of each launch, what the
ratio means, the machine, world size, size and the load average around the run) and
summary.md, and renders the whole table into benchmarks/README.md and its headline rows into
the README's "What it costs": ratios, not absolute times, because only ratios carry over
between machines. Benchmarks on
benchmarks/harness.py check every contender's result against the built-in's: a
difference fails the topic, the command exits 1 and README is left as it was.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import ContenderMismatch, format_row

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"  # the headline rows (HEADLINES)
BENCH_README = Path(__file__).resolve().parent / "README.md"  # every row
BEGIN, END = "<!-- costs:begin -->", "<!-- costs:end -->"
# One row per lesson a learner asks "what does it cost?" about; the rest is in benchmarks/README.md.
HEADLINES = [
    "collectives/ring / dist.all_reduce, W=4, 256.0 MiB",
    "collectives/ring / loopback bound, W=4, 256.0 MiB",
    "hierarchical/flat ring (3.3) / hierarchical (3.6), 4 MiB",
    "hierarchical/flat ring (3.3) / hierarchical (3.6), 4 MiB: measured / model",
    "ddp/ours bucketed overlapped / torch DDP (step time)",
    "compression/topk bytes/step vs fp32 all-reduce",
    "pipeline/1f1b p=4 m=16: step time ours / built-in",
    "zero/ZeRO-1 W=4 process peak: ours ZeRO-1 / torch ZeroRedundancyOptimizer",
    "zero/ZeRO-3 W=4 process peak: ours ZeRO-3 / torch FSDP2 (fully_shard)",
    "zero/ZeRO-3 W=4 step time: ours ZeRO-3 / torch FSDP2 (fully_shard)",
]


def topics() -> list[str]:
    return sorted(m.name.removeprefix("bench_") for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                  if m.name.startswith("bench_"))


def summarise(results: dict[str, dict]) -> dict:
    summary = {"machine": machine_info(), "comparisons": {}}
    for topic, result in results.items():
        for name, c in result.get("comparisons", {}).items():
            summary["comparisons"][f"{topic}/{name}"] = {
                "ratio": c["ratio"], "metric": c.get("metric", "time"), "world_size": c.get("world_size"),
                "size": c.get("size"), "machine": result.get("machine", summary["machine"]),
                "spread": c.get("spread"), "launch_medians": c.get("launch_medians"),
                "meaning": c.get("meaning") or f"{c.get('metric', 'time')}: ours / built-in",
                "load": c.get("load")}
    return summary


def _load(c: dict) -> str:
    load = c.get("load")
    if not load:
        return "-"
    busy = " (busy)" if max(load["before_max"], load["after_max"]) > (load.get("cores") or 1) else ""
    return f"{load['before_max']:.1f} / {load['after_max']:.1f}{busy}"


def _cells(c: dict) -> tuple[str, str, str]:
    s = c.get("spread")
    if not s:
        return f"{c['ratio']:.2f}", "one measurement", "-"
    launches = " ".join(f"{m:.2f}" for m in c.get("launch_medians") or [])
    return f"{c['ratio']:.2f}", f"{s['q1']:.2f}-{s['q3']:.2f} (range {s['min']:.2f}-{s['max']:.2f})", launches


def _header(summary: dict) -> str:
    m = summary["machine"]
    where = m.get("gpu") or f"{m.get('cores')} CPU cores"
    return (f"Measured by `python -m benchmarks.run` on {where} (torch {m.get('torch')}). "
            "Each row says what its ratio means. Ratio: the median over every repeat of every launch "
            "(ours and the built-in paired within a repeat, contenders in rotated order); IQR and range "
            "over the same repeats; then the median of each launch (fresh processes). Load: the highest "
            "1-minute load average before / after a launch (busy: above the core count, so the "
            "machine was shared and the spread is wider).")


def _rows(comparisons: dict) -> list[str]:
    lines = ["| comparison | ratio | IQR (range) | per launch | meaning | W | size | load |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in comparisons.items():
        ratio, iqr, launches = _cells(c)
        lines.append(f"| {name} | {ratio} | {iqr} | {launches} | {c.get('meaning', '')} | {c['world_size']} "
                     f"| {c['size']} | {_load(c)} |")
    return lines


def markdown(summary: dict, images: str = "results/") -> str:
    """Every comparison, and the plots (``images``: their folder as seen from the page)."""
    lines = [_header(summary), "", *_rows(dict(sorted(summary["comparisons"].items())))]
    pngs = sorted(p.name for p in RESULTS.glob("*.png"))
    if pngs:
        lines += ["", " ".join(f"![{p}]({images}{p})" for p in pngs)]
    return "\n".join(lines)


def headlines(summary: dict) -> str:
    """The HEADLINES rows that the summary has, and where the rest is."""
    rows = {name: summary["comparisons"][name] for name in HEADLINES if name in summary["comparisons"]}
    return "\n".join([_header(summary), "", *_rows(rows), "",
                      f"All {len(summary['comparisons'])} comparisons, the plots and how each benchmark runs: "
                      "[benchmarks/README.md](benchmarks/README.md)."])


def _replace_section(path: Path, body: str, title: str) -> None:
    text = path.read_text() if path.exists() else f"# {title}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def render_readme(summary: dict) -> None:
    """Every row into benchmarks/README.md, the headline rows into the README's "What it costs"."""
    _replace_section(BENCH_README, markdown(summary), "Benchmarks")
    if BEGIN not in README.read_text():
        README.write_text(README.read_text() + "\n## What it costs\n")
    _replace_section(README, headlines(summary), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    parser.add_argument("--only", nargs="*", default=None, help=f"topics among {topics()}")
    parser.add_argument("--render-readme", action="store_true",
                        help="only re-render the tables (README.md, benchmarks/README.md) from summary.json")
    args = parser.parse_args(argv)
    if args.render_readme:
        render_readme(json.loads((RESULTS / "summary.json").read_text()))
        return 0
    results, failed = {}, []
    for topic in args.only or topics():
        print(f"== benchmark: {topic} ==", flush=True)
        start = time.perf_counter()
        try:
            results[topic] = importlib.import_module(f"benchmarks.bench_{topic}").run(quick=args.quick)
            write_result(topic, results[topic])
        except Exception as exc:
            traceback.print_exc()
            if isinstance(exc, ContenderMismatch) or "ContenderMismatch" in str(exc):
                print(f"RESULT MISMATCH in {topic}: a contender computed something else than the built-in; "
                      "its timings are not reported", file=sys.stderr)
            failed.append(topic)
            continue
        for name, c in results[topic].get("comparisons", {}).items():
            print(f"   {name:<60} {format_row(c)}\n      {c.get('meaning') or 'ours / built-in'}; "
                  f"W={c.get('world_size')}, {c.get('size')}; load {_load(c)}")
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.only:  # merge with earlier topics' results so the summary stays whole
        for path in RESULTS.glob("*.json"):
            if path.stem not in results and path.stem != "summary" and path.stem in topics():
                results[path.stem] = json.loads(path.read_text())
    summary = summarise(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2))
    (RESULTS / "summary.md").write_text(markdown(summary, images="") + "\n")
    if failed:  # README keeps its last complete table
        print(f"FAILED: {failed}; wrote {RESULTS / 'summary.json'} and summary.md, README left as it was",
              file=sys.stderr)
        return 1
    if args.quick:  # a quick run's numbers never replace the README's
        print(f"wrote {RESULTS / 'summary.json'} and summary.md (--quick: README left as it was)")
        return 0
    render_readme(summary)
    print(f"wrote {RESULTS / 'summary.json'}, summary.md, benchmarks/README.md and README's 'What it costs'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
