"""Pipeline schedules: where the idle time of a step comes from, and our steps beside torch.distributed.pipelining.

The model has balanced stages: every virtual stage is the same ``--layers`` blocks of
Linear(hidden, hidden)+Tanh (stage 0's input requires grad, so its backward does the
same work as the others'; the last stage's loss is a small softmax). Global batch m x
``mb_rows`` rows, SGD, p gloo CPU ranks. Each stage records when it computes (F, B)
and when it waits in recv; after each step the events of all stages are gathered
(one machine: one clock) and the step is *replayed* from them with free communication:

* ideal span: every F takes the mean F time and every B the mean B time on every
  stage; its bubble is the schedule's own, (p-1)/(vm+p-1) (checked: the run fails
  when a schedule's replay misses it, i.e. the schedule is not the textbook one);
* compute-only span: every op takes its own recorded time. Its bubble over
  (p-1)/(vm+p-1) is "bubble without comm / theory": 1.0 on perfectly balanced
  stages, above 1 by what stage imbalance and noise in the op times add;
* measured span: the wall clock from the first forward to the last backward.
  comm efficiency = ideal span / measured span (1 = communication and imbalance cost
  nothing); comm cost = measured span - compute-only span, shown separately;
* stage imbalance = max / mean busy (F + B) time over the stages.

Steps of ours (GPipe, 1F1B) and ``torch.distributed.pipelining``'s ScheduleGPipe /
Schedule1F1B on copies of the same stage modules race on the harness
(benchmarks/harness.py: rotated order, warm-up, parameters checked equal after the
warm-up and the run, slowest rank, 3 launches). Interleaved (v = 2) has no built-in
contender here (torch's needs several stages per rank); its metrics are its own.
With more ranks than cores (p=4 on 2 cores) stages also wait for a core: the
compute-only bubble then says more about the machine than the schedule.

    python -m benchmarks.bench_pipeline [--quick]

writes benchmarks/results/pipeline.json, pipeline_bubble.png and
pipeline_<schedule>_p<p>_m<m>_timeline.png (measured and ideal, idle time by cause).
"""
from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import Contender, format_row, launch, load_of, measure, ratio_row, stat_row
from distlab.metrics import format_table

SCHEDULES = ("gpipe", "1f1b", "interleaved")
BUILTIN = "torch.distributed.pipelining"


class _InputRequiresGrad(nn.Module):
    """Stage 0's input as a leaf that requires grad: its backward then computes dL/d(input)
    like every other stage's, so the stages cost the same."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.requires_grad else x.detach().requires_grad_()


def balanced_stage(virtual_stage: int, hidden: int, layers: int) -> nn.Sequential:
    """Virtual stage ``virtual_stage``: ``layers`` blocks of Linear(hidden, hidden)+Tanh, seeded by its index."""
    torch.manual_seed(1000 + virtual_stage)
    blocks = [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)]
    return nn.Sequential(_InputRequiresGrad(), *blocks) if virtual_stage == 0 else nn.Sequential(*blocks)


# --------------------------------------------------------------------------- replay
def _op(event: tuple, num_stages: int) -> tuple[str, int, int]:
    """(kind, virtual stage, micro-batch) of an F/B event labelled ``mb`` or ``"mb.chunk"``."""
    lane, _, _, kind, label = event
    mb, _, chunk = str(label).partition(".")
    return kind, int(chunk or 0) * num_stages + lane, int(mb)


def replay(events: list[tuple], num_stages: int, num_chunks: int = 1, equal_costs: bool = False) -> list[tuple]:
    """Replay each stage's recorded F/B order with free communication; returns the replayed events.

    An op starts when its stage is free and its input exists: F(vs, i) after F(vs-1, i);
    B(vs, i) after B(vs+1, i), or after F(vs, i) on the last virtual stage. Durations are
    each op's recorded one, or with ``equal_costs`` the mean F and mean B over all stages.
    """
    ops = [e for e in events if e[3] in ("F", "B")]
    mean = {k: statistics.fmean(e[2] - e[1] for e in ops if e[3] == k) for k in ("F", "B")}
    last = num_stages * num_chunks - 1
    queues = {s: sorted((e for e in ops if e[0] == s), key=lambda e: e[1]) for s in range(num_stages)}
    free = dict.fromkeys(queues, 0.0)
    done: dict[tuple[str, int, int], float] = {}
    out = []
    while any(queues.values()):
        progressed = False
        for s, queue in queues.items():
            while queue:
                kind, vs, mb = _op(queue[0], num_stages)
                dep = ("F", vs - 1, mb) if kind == "F" else ("B", vs + 1, mb) if vs < last else ("F", vs, mb)
                if kind == "F" and vs == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                e = queue.pop(0)
                start = max(free[s], ready)
                end = start + (mean[kind] if equal_costs else e[2] - e[1])
                done[kind, vs, mb], free[s] = end, end
                out.append((s, start, end, kind, e[4]))
                progressed = True
        if not progressed:
            raise ValueError("the recorded order cannot be replayed: an op waits on one that never runs")
    return out


def _span(events: list[tuple]) -> float:
    ops = [e for e in events if e[3] in ("F", "B")]
    return max(e[2] for e in ops) - min(e[1] for e in ops)


def step_metrics(events: list[tuple], p: int, v: int, m: int) -> dict:
    """Every metric of one step from all stages' events (see the module docstring)."""
    from solutions.phase2_advanced.pipeline import measured_bubble, theoretical_bubble

    theory = theoretical_bubble(p, m, v)
    ideal, compute = replay(events, p, v, equal_costs=True), replay(events, p, v)
    busy = [sum(e[2] - e[1] for e in events if e[0] == s and e[3] in ("F", "B")) for s in range(p)]
    measured_span, compute_span, ideal_span = _span(events), _span(compute), _span(ideal)
    ideal_bubble = measured_bubble(ideal, p)
    if abs(ideal_bubble - theory) > 1e-6:  # the float sums of equal durations; anything else is the schedule
        raise AssertionError(f"the schedule replayed with equal stage costs has bubble {ideal_bubble:.6f}, "
                             f"not (p-1)/(vm+p-1) = {theory:.6f} (p={p}, v={v}, m={m})")
    return {"theory": theory, "ideal bubble": ideal_bubble, "compute-only bubble": measured_bubble(compute, p),
            "measured bubble": measured_bubble(events, p), "imbalance": max(busy) / statistics.fmean(busy),
            "comm efficiency": ideal_span / measured_span, "comm cost s": measured_span - compute_span,
            "measured span s": measured_span, "ideal span s": ideal_span, "compute-only span s": compute_span}


# --------------------------------------------------------------------------- the race
def _torch_step(schedule, rank: int, p: int, x, y) -> None:
    if rank == 0:
        schedule.step(x)
    elif rank == p - 1:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()


def _params(modules) -> list[torch.Tensor]:
    return [q.detach().clone() for mod in modules for q in mod.parameters()]


def _check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    # The same micro-batch gradients accumulated in the same order; the built-in scales them by
    # 1/m after accumulating, ours divides each loss by m first: float32 rounding only.
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda msg: f"parameter {i} of this stage: {msg}")


def _worker(rank, p, configs, hidden, mb_rows, layers, repeats):
    from torch.distributed import pipelining

    from solutions.phase2_advanced.pipeline import PipelineStage, train_step

    torch.set_num_threads(1)  # one core per stage at most; more threads only contend
    g = torch.Generator().manual_seed(0)
    out = {}
    for schedule, m in configs:
        v = 2 if schedule == "interleaved" else 1
        x = torch.randn(m * mb_rows, hidden, generator=g)
        y = torch.randint(hidden, (m * mb_rows,), generator=g)
        chunks = [balanced_stage(c * p + rank, hidden, layers // v) for c in range(v)]
        stage = PipelineStage(chunks if v > 1 else chunks[0], (mb_rows, hidden))
        opt = torch.optim.SGD([q for c in chunks for q in c.parameters()], lr=0.01)
        timelines = []

        def gather(stage=stage, timelines=timelines):
            gathered = [None] * p
            dist.all_gather_object(gathered, stage.events)
            timelines.append([e for evs in gathered for e in evs])

        def ours(stage=stage, opt=opt, schedule=schedule, x=x, y=y, m=m):
            train_step(stage, opt, schedule, x, y, nn.functional.cross_entropy, m)

        contenders = [Contender("ours", run=ours, after=gather, result=lambda chunks=chunks: _params(chunks))]
        if v == 1:  # the built-in on a copy of the same layers, trained the same way
            module = copy.deepcopy(chunks[0])
            tstage = pipelining.PipelineStage(module, stage_index=rank, num_stages=p, device=torch.device("cpu"))
            cls = pipelining.ScheduleGPipe if schedule == "gpipe" else pipelining.Schedule1F1B
            tsched = cls(tstage, n_microbatches=m, loss_fn=nn.functional.cross_entropy)
            topt = torch.optim.SGD(module.parameters(), lr=0.01)

            def builtin(tsched=tsched, topt=topt, x=x, y=y):
                topt.zero_grad(set_to_none=True)
                _torch_step(tsched, rank, p, x, y)
                topt.step()

            contenders.append(Contender(BUILTIN, run=builtin, result=lambda module=module: _params([module])))
        times = measure(contenders, BUILTIN if v == 1 else "ours", repeats=repeats, warmup=1, check=_check)
        metrics = [step_metrics(t, p, v, m) for t in timelines[1:]]  # the timed repeats (the first is warm-up)
        out[f"{schedule} m={m}"] = {"measure": times, "metrics": {k: [s[k] for s in metrics] for k in metrics[0]},
                                    "events": timelines[-1]}
    return out if rank == 0 else None


def _timeline_events(events: list[tuple], p: int, v: int) -> list[tuple]:
    """The measured step and its ideal replay on one time axis from 0, lanes "measured s" and "ideal s",
    each lane's idle time up to the end of its own step drawn as "idle"."""
    from distlab.plots import idle_events

    t0 = min(e[1] for e in events)
    measured = [(f"measured {lane}", s - t0, e - t0, kind, label) for lane, s, e, kind, label in events]
    ideal = [(f"ideal {lane}", s, e, kind, label) for lane, s, e, kind, label in replay(events, p, v, equal_costs=True)]
    return [*measured, *idle_events(measured, max(e[2] for e in measured)),
            *ideal, *idle_events(ideal, max(e[2] for e in ideal))]


def run(quick: bool = False, out_dir: Path | None = None, launches: int = 3) -> dict:
    from distlab.plots import plot_bars, plot_timeline

    out_dir = Path(out_dir or RESULTS)
    stages = [2] if quick else [2, 4]
    hidden, mb_rows, layers, repeats = (128, 8, 2, 3) if quick else (1024, 32, 2, 5)
    result = {"name": "pipeline", "machine": machine_info(), "hidden": hidden, "microbatch_rows": mb_rows,
              "layers_per_stage": layers, "repeats": repeats, "launches": launches, "comparisons": {},
              "all_rows": {}, "load": {}, "note": "balanced stages; bubbles replayed from the recorded ops "
              "(see the module docstring); p=4 on a 2-core machine shares cores between stages"}
    rows = []
    for p in stages:
        configs = [(s, m) for m in ([2 * p] if quick else [p, 4 * p]) for s in SCHEDULES]
        runs = launch(_worker, p, configs, hidden, mb_rows, layers, repeats, launches=launches,
                      backend="gloo", timeout_s=1800)
        result["load"][f"p={p}"] = load = load_of(runs)
        for schedule, m in configs:
            v, key = 2 if schedule == "interleaved" else 1, f"{schedule} m={m}"
            name = f"{schedule} p={p} m={m}"
            per = lambda metric: [r["result"][key]["metrics"][metric] for r in runs]  # noqa: E731
            theory = per("theory")[0][0]
            stat = dict(world_size=p, size=f"m={m}, {mb_rows}x{hidden}, {layers} layers/stage", load=load)
            new = {
                f"{name}: bubble without comm / theory": stat_row(
                    [[b / theory for b in bs] for bs in per("compute-only bubble")], metric="bubble ratio",
                    meaning=f"idle share replayed from the recorded op times with free communication / "
                            f"(p-1)/(vm+p-1) = {theory:.3f} (1: the schedule's bubble exactly)", **stat),
                f"{name}: comm efficiency": stat_row(
                    per("comm efficiency"), metric="span ratio",
                    meaning="ideal span (equal stage costs, free comm) / measured span (1: comm and imbalance "
                            "cost nothing)", **stat),
                f"{name}: stage imbalance": stat_row(
                    per("imbalance"), metric="busy ratio", meaning="max / mean busy (F+B) time over the stages "
                                                                   "(1: balanced)", **stat)}
            extra = {
                f"{name}: measured bubble / theory": stat_row(
                    [[b / theory for b in bs] for bs in per("measured bubble")], metric="bubble ratio",
                    meaning="wall-clock idle share (comm and waits included) / (p-1)/(vm+p-1)", **stat),
                f"{name}: comm cost / measured span": stat_row(
                    [[c / s for c, s in zip(cs, ss)] for cs, ss in zip(per("comm cost s"), per("measured span s"))],
                    metric="fraction", meaning="(measured span - compute-only span) / measured span: the share "
                                               "of the step that communication adds", **stat)}
            if v == 1:
                new[f"{name}: step time ours / built-in"] = ratio_row(
                    runs, "ours", BUILTIN, key=lambda r, key=key: r[key]["measure"], world_size=p, size=stat["size"],
                    meaning=f"step time of ours / {BUILTIN} (below 1: ours faster)")
            result["comparisons"].update(new)
            result["all_rows"].update(new | extra)
            med = lambda metric: statistics.median(v for vs in per(metric) for v in vs)  # noqa: E731
            rows.append({"schedule": schedule, "p": p, "m": m, "theory": f"{theory:.1%}",
                         "bubble w/o comm": f"{med('compute-only bubble'):.1%}",
                         "measured bubble": f"{med('measured bubble'):.1%}",
                         "comm cost ms": f"{1e3 * med('comm cost s'):.2f}",
                         "comm eff.": f"{med('comm efficiency'):.2f}", "imbalance": f"{med('imbalance'):.3f}",
                         "ours / built-in": format_row(new[f"{name}: step time ours / built-in"]) if v == 1 else "-"})
            if m == 2 * p or (not quick and m == p):
                png = plot_timeline(_timeline_events(runs[-1]["result"][key]["events"], p, v),
                                    out_dir / f"pipeline_{schedule}_p{p}_m{m}_timeline.png",
                                    title=f"{schedule}: {p} stages, {m} micro-batches; measured step above, "
                                          "its ideal replay (equal costs, free comm) below")
                result.setdefault("plots", []).append(png.name)
    bars = {k.split(":")[0]: c["ratio"] for k, c in result["comparisons"].items() if "without comm" in k}
    plot_bars(bars, out_dir / "pipeline_bubble.png", ylabel="bubble without comm / (p-1)/(vm+p-1)",
              title="pipeline bubble, replayed from the recorded ops (1 = the schedule's own)")
    result["table"] = rows
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p=2, m=4, small layers (seconds)")
    parser.add_argument("--launches", type=int, default=3, help="fresh process groups (>= 3 for a spread)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, launches=args.launches)
    path = write_result("pipeline", result)
    print(format_table(result["table"]))
    print(f"wrote {path} and the PNGs beside it")


if __name__ == "__main__":
    main()
