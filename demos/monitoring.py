"""Per-rank step timing, straggler detection and profiling on a data-parallel MLP.

Each rank trains the same MLP on its share of digits batches; one rank (``--slow-rank``)
really computes ``--slow-factor`` times more (it repeats its forward and backward), so
the timers measure a genuine delay. Phase 4's ``Monitor`` gathers every rank's step
breakdown to rank 0 every ``--interval`` steps, names the straggler, and writes
metrics.jsonl, metrics.csv and a timeline of the last steps of every rank
(``--profile``: torch.profiler traces too, for https://ui.perfetto.dev).

    RUN_MODE=monitoring ./entrypoint.sh                         # rank 1 made 4x slower: it is named
    IMPL=templates RUN_MODE=monitoring ./entrypoint.sh          # your monitoring (template_monitoring.py)
    RUN_MODE=monitoring ./entrypoint.sh --profile --out-dir runs/monitoring

See phase4_production/guidelines.md#monitoring-and-profiling.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn

from demos.sizes import at_least, positive
from distlab.loader import load
from distlab.todo import run_demo

PHASE = "phase4_production"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Per-rank step timing, straggler detection and profiling.")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--slow-rank", type=int, default=1,
                        help="this rank does --slow-factor x the compute (-1: none)")
    parser.add_argument("--slow-factor", type=int, default=4)
    # With 2 ranks the median is the mean of both: a rank r times slower than the other
    # is 2r/(1+r) times the median, so 1.3 names a rank about 2x slower.
    parser.add_argument("--straggler-factor", type=float, default=1.3)
    parser.add_argument("--out-dir", default="runs/monitoring")
    parser.add_argument("--profile", action="store_true", help="write torch.profiler traces per rank")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Each rank takes --global-batch // world_size samples; --slow-rank may name no rank (then none is slow)."""
    positive(args, "--steps", "--interval", "--slow-factor")
    at_least(args.global_batch, world_size, "--global-batch", f" (every one of the {world_size} ranks needs a sample)")
    return args


def main(argv: list[str] | None = None) -> None:
    from distlab.data import digits
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_table, log0, progress
    from distlab.plots import plot_timeline
    from distlab.lessons.sync import allreduce_gradients

    args = build_parser().parse_args(argv)
    mon = load(PHASE, "monitoring")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        train = digits("train", flatten=True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        model = model.to(env.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        monitor = mon.Monitor(env.rank, env.world_size, args.out_dir, interval=args.interval,
                              straggler_factor=args.straggler_factor, device=env.device)
        per_rank = args.global_batch // env.world_size
        # The slow rank really computes more (repeats its forward/backward): a delay the timers measure.
        repeats = args.slow_factor if env.rank == args.slow_rank else 1
        plan = mon.gather_to_rank0([float(repeats)], device=env.device)  # one small gather: rank 0 learns who is slowed
        if plan is not None:
            log0("compute repeats per rank: " + ", ".join(f"rank {r}: {int(v[0])}x" for r, v in enumerate(plan)))
        x_all, y_all = train.tensors
        with mon.profile(Path(args.out_dir) / "traces", env.rank, enabled=args.profile) as prof:
            for step in progress(range(args.steps), desc="monitoring"):
                with monitor.section("data"):
                    idx = torch.randint(len(y_all), (args.global_batch,), generator=torch.Generator().manual_seed(step))
                    idx = idx[env.rank * per_rank:(env.rank + 1) * per_rank]
                    x, y = x_all[idx].to(env.device), y_all[idx].to(env.device)
                with monitor.section("compute"):
                    for _ in range(repeats):
                        optimizer.zero_grad(set_to_none=True)
                        loss = nn.functional.cross_entropy(model(x), y)
                        loss.backward()
                with monitor.section("comm"):
                    allreduce_gradients(model.parameters())
                with monitor.section("optimizer"):
                    optimizer.step()
                report = monitor.end_step(step, per_rank, loss.item(), mon.grad_norm(model))
                if report is not None and report.stragglers:
                    log0(f"\nstep {step}: straggler(s) {report.stragglers}: busy "
                         + ", ".join(f"rank {s.rank} {s.busy_s * 1e3:.2f} ms" for s in report.ranks))
                prof.step()
        events = monitor.gather_events()
        if env.is_main:
            last = monitor.reports[-1]
            log0("\n" + format_table([{"rank": s.rank, "data ms": f"{s.data_s * 1e3:.2f}",
                                       "compute ms": f"{s.compute_s * 1e3:.2f}", "comm ms": f"{s.comm_s * 1e3:.2f}",
                                       "optim ms": f"{s.optimizer_s * 1e3:.2f}", "samples/s": f"{s.samples_per_s:.0f}",
                                       "loss": f"{s.loss:.3f}", "grad norm": f"{s.grad_norm:.3f}",
                                       "straggler": "YES" if s.rank in last.stragglers else ""} for s in last.ranks]))
            path = plot_timeline(events, Path(args.out_dir) / "timeline.png", title="last 3 steps per rank")
            log0(f"wrote {args.out_dir}/metrics.jsonl, metrics.csv, {path}"
                 + (f", traces in {args.out_dir}/traces" if args.profile else ""))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
