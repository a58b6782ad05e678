"""Pipeline schedules: our GPipe / 1F1B / interleaved steps beside torch.distributed.pipelining, and their bubble.

An MLP of ``2p`` Linear(hidden, hidden)+Tanh blocks split over p ranks (gloo, CPU),
global batch m x ``--microbatch`` rows, SGD. For each schedule and each m, every
repeat runs a few steps between barriers; each stage records when it computes
(forward, backward) and the bubble of a step is 1 - busy / (p x makespan), from
the events of all stages (one machine: one clock). Two kinds of comparisons:

* "<schedule> step p=.. m=..": our step time / ``torch.distributed.pipelining``'s
  ScheduleGPipe or Schedule1F1B on the same stage modules and batch, run alternately
  in the same repeat (so a burst of load hits both);
* "<schedule> bubble p=.. m=..": the measured bubble / the theoretical (p-1)/(v*m+p-1)
  of a perfectly balanced pipeline with free communication: a ratio above 1 is what
  send/recv latency and uneven stages add (interleaved: v = 2 chunks per rank).
With more ranks than cores (p=4 on a 2-core machine) the stages also wait for a
core, and the measured bubble says more about the machine than the schedule.

    python -m benchmarks.bench_pipeline [--quick]

writes benchmarks/results/pipeline.json and pipeline_bubble.png, pipeline_<schedule>_timeline.png.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.common import RESULTS, comparison, median, write_result
from distlab.launch import run_distributed
from distlab.metrics import format_table


def _torch_step(schedule, rank: int, p: int, x, y) -> None:
    if rank == 0:
        schedule.step(x)
    elif rank == p - 1:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()


def _worker(rank, world_size, schedule, microbatches, hidden, mb_rows, steps):
    from torch.distributed import pipelining

    from solutions.phase2_advanced.pipeline import PipelineStage, build_stage_module, measured_bubble, train_step

    p, v = world_size, 2 if schedule == "interleaved" else 1
    chunks = [build_stage_module(c * p + rank, p * v, hidden, hidden, 10, layers_per_stage=2 // v)
              for c in range(v)]
    stage = PipelineStage(chunks if v > 1 else chunks[0], (mb_rows, hidden))
    opt = torch.optim.SGD([q for c in chunks for q in c.parameters()], lr=0.01)
    builtin = None
    if v == 1:  # the built-in on the same layers (its own copy, so both train the same way)
        tstage = pipelining.PipelineStage(build_stage_module(rank, p, hidden, hidden, 10, layers_per_stage=2),
                                          stage_index=rank, num_stages=p, device=torch.device("cpu"))
        cls = pipelining.ScheduleGPipe if schedule == "gpipe" else pipelining.Schedule1F1B
        builtin = cls(tstage, n_microbatches=microbatches, loss_fn=nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(microbatches * mb_rows, hidden, generator=g)
    y = torch.randint(10, (microbatches * mb_rows,), generator=g)
    bubbles, times, builtin_times, events = [], [], [], None
    for step in range(steps + 1):  # the first step warms up (allocations, connections, shapes)
        dist.barrier()
        start = time.perf_counter()
        train_step(stage, opt, schedule, x, y, nn.functional.cross_entropy, microbatches)
        dist.barrier()  # timed like the built-in: until the last stage is done
        elapsed = time.perf_counter() - start
        gathered = [None] * world_size
        dist.all_gather_object(gathered, stage.events)
        events = [e for evs in gathered for e in evs]
        if builtin is not None:
            dist.barrier()
            start = time.perf_counter()
            _torch_step(builtin, rank, p, x, y)
            dist.barrier()  # the step ends when the last stage is done
            if step:
                builtin_times.append(time.perf_counter() - start)
        if step:
            bubbles.append(measured_bubble(events, world_size))
            times.append(elapsed)
    if rank:
        return None
    return {"bubbles": bubbles, "times": times, "builtin_times": builtin_times, "events": events}


def run(quick: bool = False) -> dict:
    from distlab.plots import plot_bars, plot_timeline
    from solutions.phase2_advanced.pipeline import theoretical_bubble

    stages = [2] if quick else [2, 4]
    hidden, mb_rows, steps = (512, 16, 3) if quick else (1024, 32, 5)
    comparisons, raw, rows = {}, {}, []
    for p in stages:
        for m in ([p, 4 * p] if quick else [p, 2 * p, 4 * p, 8 * p]):
            for schedule in ("gpipe", "1f1b", "interleaved"):
                out = run_distributed(_worker, p, schedule, m, hidden, mb_rows, steps, backend="gloo", timeout_s=300)[0]
                theory = theoretical_bubble(p, m, 2 if schedule == "interleaved" else 1)
                key = f"{schedule} bubble p={p} m={m}"
                comparisons[key] = comparison(out["bubbles"], theory, world_size=p, size=f"m={m}",
                                              metric="bubble_fraction (measured / theory)", unit="fraction")
                raw[key] = {"bubbles": out["bubbles"], "step_s": out["times"], "builtin_step_s": out["builtin_times"]}
                builtin_ms = "-"
                if out["builtin_times"]:
                    comparisons[f"{schedule} step p={p} m={m}"] = comparison(
                        out["times"], out["builtin_times"], world_size=p, size=f"m={m}, {mb_rows}x{hidden}")
                    builtin_ms = f"{1e3 * median(out['builtin_times']):.1f}"
                rows.append({"schedule": schedule, "stages": p, "micro-batches": m,
                             "bubble measured": f"{median(out['bubbles']):.1%}", "bubble theory": f"{theory:.1%}",
                             "step ms (ours)": f"{1e3 * median(out['times']):.1f}",
                             "step ms (torch.distributed.pipelining)": builtin_ms})
                if m == 2 * p or (quick and m == p):
                    plot_timeline(out["events"], RESULTS / f"pipeline_{schedule}_p{p}_m{m}_timeline.png",
                                  title=f"{schedule}: {p} stages, {m} micro-batches (grey: waiting in recv)")
    plot_bars({k.replace(" bubble", ""): c["ours"] for k, c in comparisons.items() if " bubble " in k},
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
