"""Pipeline parallelism: an MLP on digits cut into one stage per rank, GPipe, 1F1B or interleaved 1F1B.

Each rank keeps its stage (or, interleaved, its v chunks) of one seeded MLP (the same
model, p x --layers-per-stage hidden blocks, for every schedule: their losses compare) and trains
with the schedule of ``phase2_advanced/pipeline.py`` (exercises 2.12-2.14). The summary
shows the final loss, the measured bubble (median over the steps) beside the theory
(p-1)/(v*m+p-1), the peak number of micro-batches in flight on every stage and the
bytes rank 0 sends per step; a Gantt chart of the last step goes to
``runs/pipeline_<schedule>_timeline.png``.

    RUN_MODE=pipeline_gpipe ./entrypoint.sh                       # 2 stages; NPROC=4 for 4
    RUN_MODE=pipeline_1f1b ./entrypoint.sh --microbatches 16
    RUN_MODE=pipeline_interleaved ./entrypoint.sh --chunks 2
    IMPL=templates RUN_MODE=pipeline_1f1b ./entrypoint.sh         # the same with your template
    python -m demos.pipeline --schedule gpipe                     # 1 stage, no torchrun

The schedule is ``--schedule``, else the RUN_MODE's suffix, else 1F1B.
See phase2_advanced/guidelines_model_parallel.md#pipeline-parallelism.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from demos.sizes import at_least, multiple_of, positive
from distlab import trace
from distlab.comm import CommLedger
from distlab.data import digits
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, median, progress
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    schedules = sorted(load("phase2_advanced", "pipeline").SCHEDULES)
    default = os.environ.get("RUN_MODE", "pipeline_1f1b").removeprefix("pipeline_")
    parser = argparse.ArgumentParser(description="Pipeline-parallel MLP on digits: GPipe, 1F1B or interleaved.")
    parser.add_argument("--schedule", choices=schedules, default=default if default in schedules else "1f1b")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="default: 8 (at least one per stage; interleaved: a multiple of the stages)")
    parser.add_argument("--batch", type=int, default=None, help="default: 16 per micro-batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers-per-stage", type=int, default=None,
                        help="hidden blocks per rank, whatever the schedule (default: 2, or --chunks)")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank (interleaved only)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per epoch (default: all of the training split, 1437 // --batch)")
    parser.add_argument("--out-dir", default="runs")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """World-size defaults (see demos/sizes.py): micro-batches, batch and layers that fit ``world_size`` stages."""
    p, interleaved = world_size, args.schedule == "interleaved"
    positive(args, "--chunks", "--hidden", "--epochs")
    if args.steps is not None:
        positive(args, "--steps")
    v = args.chunks if interleaved else 1
    if args.layers_per_stage is not None:  # interleaved: every chunk of a rank gets the same number of blocks
        at_least(args.layers_per_stage, v, "--layers-per-stage", f" (hidden blocks per stage, {v} chunk(s))")
    args.layers_per_stage = multiple_of(args.layers_per_stage, 2, v, "--layers-per-stage", "--chunks")
    if args.microbatches is not None:
        at_least(args.microbatches, p, "--microbatches", f" with {p} stages, or the pipeline never fills")
    args.microbatches = multiple_of(args.microbatches, max(8, p), p if interleaved else 1, "--microbatches",
                                    "the number of stages")
    args.batch = multiple_of(args.batch, 16 * args.microbatches, args.microbatches, "--batch", "--microbatches")
    return args


def build_chunks(pp, schedule: str, rank: int, num_stages: int, chunks: int, in_features: int, hidden: int,
                 num_classes: int, layers_per_stage: int) -> list[nn.Module]:
    """This rank's pieces of one seeded MLP of ``num_stages * layers_per_stage`` hidden blocks.

    The same model for every schedule, so their losses compare: GPipe and 1F1B cut it into
    one stage per rank; interleaved cuts it into ``num_stages * chunks`` virtual stages of
    ``layers_per_stage / chunks`` blocks, and chunk c of this rank is virtual stage c*p + rank.
    """
    v = chunks if schedule == "interleaved" else 1
    return [pp.build_stage_module(c * num_stages + rank, num_stages * v, in_features, hidden, num_classes,
                                  layers_per_stage // v) for c in range(v)]


def main(argv: list[str] | None = None) -> None:
    pp = load("phase2_advanced", "pipeline")
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        p, m = env.world_size, args.microbatches
        x_all, y_all = digits("train", flatten=True).tensors
        v = args.chunks if args.schedule == "interleaved" else 1
        chunks = [c.to(env.device) for c in build_chunks(pp, args.schedule, env.rank, p, args.chunks, x_all.shape[1],
                                                         args.hidden, 10, args.layers_per_stage)]
        stage = pp.PipelineStage(chunks if v > 1 else chunks[0], (args.batch // m, args.hidden), device=env.device)
        opt = torch.optim.SGD([q for c in chunks for q in c.parameters()], lr=0.05, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        if args.batch > x_all.shape[0]:
            raise ValueError(f"--batch {args.batch} is larger than the {x_all.shape[0]} training images: "
                             f"use --batch {x_all.shape[0] // m * m}")
        steps = min(x_all.shape[0] // args.batch, args.steps or x_all.shape[0])
        log0(f"pipeline ({args.schedule}): {p} stages, {m} micro-batches of {args.batch // m}, "
             f"{steps} steps/epoch")
        ledger, loss, bubbles = CommLedger(), None, []
        for epoch in range(args.epochs):
            perm = torch.randperm(x_all.shape[0], generator=torch.Generator().manual_seed(epoch))
            for i in progress(range(steps), desc=f"epoch {epoch}"):
                idx = perm[i * args.batch:(i + 1) * args.batch]
                dist.barrier()  # a common start, so the timeline shows the bubble, not skew
                with ledger:
                    loss = pp.train_step(stage, opt, args.schedule, x_all[idx].to(env.device),
                                         y_all[idx].to(env.device), loss_fn, m)
                sent_step = ledger.sent_bytes()
                ledger.reset()
                events = [None] * p
                dist.all_gather_object(events, stage.events)
                bubbles.append(pp.measured_bubble([e for evs in events for e in evs], p))
                # --trace: this stage's forwards, backwards and idle time (the bubble, by cause) as spans
                trace.add_spans(trace.schedule_spans([e for evs in events for e in evs], stage.stage_id))
        all_events = [e for evs in events for e in evs]  # the last step's, from every stage
        peaks = [None] * p
        dist.all_gather_object(peaks, stage.peak_in_flight)
        last_loss = [loss]
        dist.broadcast_object_list(last_loss, src=p - 1)  # the loss lives on the last stage
        if env.is_main:
            from distlab.plots import plot_timeline  # matplotlib: rank 0 only, when it draws

            path = plot_timeline(all_events, os.path.join(args.out_dir, f"pipeline_{args.schedule}_timeline.png"),
                                 title=f"{args.schedule}: {p} stages x {v} chunks, {m} micro-batches (last step)")
            print("\n" + format_table([{
                "schedule": args.schedule, "stages": p, "micro-batches": m, "final loss": f"{last_loss[0]:.4f}",
                "bubble (measured, median)": f"{median(bubbles):.1%}",
                "bubble (theory)": f"{pp.theoretical_bubble(p, m, v):.1%}",
                "peak in flight per stage": peaks, "p2p sent/step (rank 0)": format_bytes(sent_step)}]))
            print(f"timeline: {path}")
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
