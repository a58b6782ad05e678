"""Pipeline bubble: measured idle share of GPipe and 1F1B steps beside the theory (p-1)/(m+p-1).

An MLP of ``2p`` Linear(hidden, hidden)+Tanh blocks split over p ranks (gloo, CPU),
global batch m x ``--microbatch`` rows, SGD. For each schedule and each m, every
repeat runs a few steps between barriers; each stage records when it computes
(forward, backward) and the bubble of a step is 1 - busy / (p x makespan), from
the events of all stages (one machine: one clock). The comparison's "builtin" is the
theoretical bubble of a perfectly balanced pipeline with free communication, so a
ratio above 1 is what send/recv latency and uneven stages add.
With more ranks than cores (p=4 on a 2-core machine) the stages also wait for a
core, and the measured bubble says more about the machine than the schedule.

    python -m benchmarks.bench_pipeline [--quick]

writes benchmarks/results/pipeline.json and pipeline_bubble.png, pipeline_<schedule>_timeline.png.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.common import RESULTS, comparison, median, write_result
from distlab.launch import run_distributed
from distlab.metrics import format_table


def _worker(rank, world_size, schedule, microbatches, hidden, mb_rows, steps):
    from solutions.phase2_advanced.pipeline import PipelineStage, build_stage_module, measured_bubble, train_step

    module = build_stage_module(rank, world_size, hidden, hidden, 10, layers_per_stage=2)
    stage = PipelineStage(module, (mb_rows, hidden))
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(microbatches * mb_rows, hidden, generator=g)
    y = torch.randint(10, (microbatches * mb_rows,), generator=g)
    bubbles, times, events = [], [], None
    for step in range(steps + 1):  # the first step warms up (allocations, connections)
        dist.barrier()
        train_step(stage, opt, schedule, x, y, nn.functional.cross_entropy, microbatches)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, stage.events)
        events = [e for evs in gathered for e in evs]
        if step:
            bubbles.append(measured_bubble(events, world_size))
            times.append(max(e[2] for e in events) - min(e[1] for e in events))
    return {"bubbles": bubbles, "times": times, "events": events} if rank == 0 else None


def run(quick: bool = False) -> dict:
    from distlab.plots import plot_bars, plot_timeline
    from solutions.phase2_advanced.pipeline import theoretical_bubble

    stages = [2] if quick else [2, 4]
    hidden, mb_rows, steps = (512, 16, 3) if quick else (1024, 32, 5)
    comparisons, raw, rows = {}, {}, []
    for p in stages:
        for m in ([p, 4 * p] if quick else [p, 2 * p, 4 * p, 8 * p]):
            for schedule in ("gpipe", "1f1b"):
                out = run_distributed(_worker, p, schedule, m, hidden, mb_rows, steps, timeout_s=300)[0]
                theory = theoretical_bubble(p, m)
                key = f"{schedule} bubble p={p} m={m}"
                comparisons[key] = comparison(out["bubbles"], theory, world_size=p, size=f"m={m}",
                                              metric="bubble_fraction (measured / theory)", unit="fraction")
                raw[key] = {"bubbles": out["bubbles"], "step_s": out["times"]}
                rows.append({"schedule": schedule, "stages": p, "micro-batches": m,
                             "bubble measured": f"{median(out['bubbles']):.1%}", "bubble theory": f"{theory:.1%}",
                             "step ms": f"{1e3 * median(out['times']):.1f}"})
                if m == 2 * p or (quick and m == p):
                    plot_timeline(out["events"], RESULTS / f"pipeline_{schedule}_p{p}_m{m}_timeline.png",
                                  title=f"{schedule}: {p} stages, {m} micro-batches (grey: waiting in recv)")
    plot_bars({k.replace(" bubble", ""): c["ours"] for k, c in comparisons.items()},
              RESULTS / "pipeline_bubble.png", ylabel="measured bubble fraction", title="pipeline bubble")
    print(format_table(rows))
    result = {"comparisons": comparisons, "raw": raw, "hidden": hidden, "microbatch_rows": mb_rows}
    write_result("pipeline", result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
