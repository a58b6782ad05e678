"""Run every benchmark side by side with PyTorch's built-ins; write the summary and the README section.

    python -m benchmarks.run              # everything (minutes)
    python -m benchmarks.run --quick      # smaller sizes, fewer repeats
    python -m benchmarks.run --only collectives ddp
    python -m benchmarks.run --render-readme   # only rewrite README's "What it costs" from the summary

Each ``benchmarks/bench_<topic>.py`` measures ours and the built-in in the same run
(see benchmarks/common.py) and writes benchmarks/results/<topic>.json and PNGs.
This script collects their comparisons into benchmarks/results/summary.json (name ->
median ratio, with the machine, world size and size it was measured at) and
summary.md, and renders the README's "What it costs" section from them: ratios, not
absolute times, because only ratios carry over between machines.
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

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- costs:begin -->", "<!-- costs:end -->"


def topics() -> list[str]:
    return sorted(m.name.removeprefix("bench_") for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                  if m.name.startswith("bench_"))


def summarise(results: dict[str, dict]) -> dict:
    summary = {"machine": machine_info(), "comparisons": {}}
    for topic, result in results.items():
        for name, c in result.get("comparisons", {}).items():
            summary["comparisons"][f"{topic}/{name}"] = {
                "ratio": c["ratio"], "metric": c.get("metric", "time"), "world_size": c.get("world_size"),
                "size": c.get("size"), "machine": result.get("machine", summary["machine"])}
    return summary


def markdown(summary: dict) -> str:
    m = summary["machine"]
    where = m.get("gpu") or f"{m.get('cores')} CPU cores"
    lines = [f"Measured by `python -m benchmarks.run` on {where} (torch {m.get('torch')}). "
             "Ratio = ours / PyTorch's built-in, medians of repeated runs in the same process: "
             "below 1 is faster (or fewer bytes) than the built-in.", "",
             "| comparison | metric | ratio | world size | size |", "|---|---|---|---|---|"]
    for name, c in sorted(summary["comparisons"].items()):
        lines.append(f"| {name} | {c['metric']} | {c['ratio']:.2f} | {c['world_size']} | {c['size']} |")
    pngs = sorted(p.name for p in RESULTS.glob("*.png"))
    if pngs:
        lines += ["", " ".join(f"![{p}](benchmarks/results/{p})" for p in pngs)]
    return "\n".join(lines)


def render_readme(summary: dict) -> None:
    text = README.read_text()
    if BEGIN not in text:
        text += f"\n## What it costs\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    README.write_text(f"{head}{BEGIN}\n{markdown(summary)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    parser.add_argument("--only", nargs="*", default=None, help=f"topics among {topics()}")
    parser.add_argument("--render-readme", action="store_true", help="only re-render README from summary.json")
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
        except Exception:
            traceback.print_exc()
            failed.append(topic)
            continue
        for name, c in results[topic].get("comparisons", {}).items():
            print(f"   {name:<50} ratio {c['ratio']:.2f} ({c.get('metric', 'time')}, W={c.get('world_size')}, "
                  f"{c.get('size')})")
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.only:  # merge with earlier topics' results so the summary stays whole
        for path in RESULTS.glob("*.json"):
            if path.stem not in results and path.stem != "summary" and path.stem in topics():
                results[path.stem] = json.loads(path.read_text())
    summary = summarise(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2))
    (RESULTS / "summary.md").write_text(markdown(summary) + "\n")
    render_readme(summary)
    print(f"wrote {RESULTS / 'summary.json'}, summary.md and README's 'What it costs'")
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
