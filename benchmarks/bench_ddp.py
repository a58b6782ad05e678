"""Data-parallel training step: our DDP wrappers against torch's DDP, side by side.

ResNet-18 (torchvision, num_classes=10) on 3x32x32 inputs, W=2 CPU ranks (gloo over
loopback), SGD, batch per rank ``--batch``. One step = zero_grad, forward, backward,
gradient synchronisation, optimizer step. Contenders:

* per-param after backward: Phase 1's ``allreduce_gradients`` (one all-reduce per
  parameter, once backward has finished);
* one flat all-reduce after backward: every gradient copied into one buffer, one call;
* ours per-param overlapped: ``DDPIndividualParameters`` (hooks, async);
* ours bucketed overlapped: ``DDPBucketed`` (25 MiB buckets, torch's default);
* torch DDP: ``torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)``.

Like for like: every contender keeps BatchNorm's running statistics in step the way
torch DDP does (rank 0's buffers broadcast before every forward: our wrappers do it
themselves, the two after-backward baselines call ``broadcast_tensors`` on the
buffers), and after the warm-up and after the last repeat every contender's
parameters and buffers are checked against torch DDP's (each trained the same steps
on the same data from the same seed), or the run fails. On the harness
(benchmarks/harness.py): contenders in rotated order per repeat, the slowest rank's
time, 3 launches. Ratios: step time of ours / torch DDP (below 1: faster).
``--quick`` trains distlab's TinyCNN (BatchNorm too) instead: seconds, for the tests.

    python -m benchmarks.bench_ddp [--quick]

writes benchmarks/results/ddp.json and ddp_throughput.png.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import Contender, format_row, launch, load_of, measure, ratio_row
from distlab.metrics import format_table
from distlab.lessons.sync import broadcast_tensors

BUCKET_MB = 25.0
CONTENDERS = ["per-param after backward", "one flat all-reduce after backward", "ours per-param overlapped",
              "ours bucketed overlapped", "torch DDP"]


def _flat_allreduce(model: nn.Module) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class _BuffersFromRank0(nn.Module):
    """What torch DDP does before every forward: rank 0's buffers (BatchNorm statistics) everywhere."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        broadcast_tensors(list(self.module.buffers()))
        return self.module(x)


def _model(quick: bool) -> nn.Module:
    torch.manual_seed(0)
    if quick:
        from distlab.models import TinyCNN
        return TinyCNN(num_classes=10, in_channels=3)
    import torchvision
    return torchvision.models.resnet18(num_classes=10)


def _build(name: str, bucket_mb: float, quick: bool = False):
    """(module called in forward, parameters' owner, sync after backward)."""
    from solutions.phase1_data_parallel.trainer import allreduce_gradients, broadcast_parameters
    from solutions.phase3_multi_node.ddp_bucketed import DDPBucketed
    from solutions.phase3_multi_node.ddp_overlap import DDPIndividualParameters

    model = _model(quick)
    if name == "per-param after backward":
        broadcast_parameters(model)
        return _BuffersFromRank0(model), model, lambda: allreduce_gradients(model)
    if name == "one flat all-reduce after backward":
        broadcast_parameters(model)
        return _BuffersFromRank0(model), model, lambda: _flat_allreduce(model)
    if name == "ours per-param overlapped":
        ddp = DDPIndividualParameters(model)
        return ddp, model, ddp.finish_gradient_synchronization
    if name == "ours bucketed overlapped":
        ddp = DDPBucketed(model, bucket_size_mb=bucket_mb)
        return ddp, model, ddp.finish_gradient_synchronization
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    return ddp, model, lambda: None


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in itertools.chain(model.parameters(), model.buffers())]


def _check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    # The same gradients summed in other groupings (per parameter, one flat buffer, buckets) and
    # averaged before (torch) or after (ours) the sum: float32 rounding, carried by momentum over
    # the steps; buffers (BatchNorm statistics, num_batches_tracked) come from the same forwards.
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"tensor {i} (params, then buffers): {m}")


def _worker(rank, world_size, batch, steps, repeats, bucket_mb, quick):
    torch.set_num_threads(1)  # two ranks share the cores; more threads per rank only contend
    setups = {name: _build(name, bucket_mb, quick) for name in CONTENDERS}
    optims = {name: torch.optim.SGD(owner.parameters(), lr=0.01, momentum=0.9)
              for name, (_, owner, _) in setups.items()}
    g = torch.Generator().manual_seed(rank)
    side = 16 if quick else 32
    x, y = torch.randn(batch, 3, side, side, generator=g), torch.randint(10, (batch,), generator=g)

    def train(name: str) -> None:
        fwd, _, sync = setups[name]
        for _ in range(steps):
            optims[name].zero_grad(set_to_none=True)
            F.cross_entropy(fwd(x), y).backward()
            sync()
            optims[name].step()

    contenders = [Contender(name, run=lambda name=name: train(name), result=lambda name=name: _state(setups[name][1]))
                  for name in CONTENDERS]
    # Warm-up round: allocator, first-call paths, torch DDP's bucket rebuild; results checked then and at the end.
    return measure(contenders, "torch DDP", repeats=repeats, warmup=1, check=_check)


def run(quick: bool = False, bucket_mb: float = BUCKET_MB, out_dir: Path | None = None, launches: int = 3) -> dict:
    out_dir = Path(out_dir or RESULTS)
    world_size, batch = 2, (8 if quick else 32)
    steps, repeats = (1, 4) if quick else (3, 8)
    model = "TinyCNN (BatchNorm), 3x16x16" if quick else "torchvision resnet18(num_classes=10), 3x32x32"
    runs = launch(_worker, world_size, batch, steps, repeats, bucket_mb, quick, launches=launches,
                  backend="gloo", timeout_s=1800)
    step_s = {n: statistics.median(t / steps for r in runs for t in r["result"]["times"][n]) for n in CONTENDERS}
    result = {"name": "ddp", "machine": machine_info(), "world_size": world_size, "model": model,
              "batch_per_rank": batch, "bucket_mb": bucket_mb, "steps_per_repeat": steps, "repeats": repeats,
              "launches": launches, "load": load_of(runs),
              "note": "gloo CPU ranks on one machine (maybe shared); contenders rotated per repeat, the slowest "
                      "rank's time, BatchNorm buffers from rank 0 before every forward in every contender, "
                      "parameters and buffers checked against torch DDP's after warm-up and after the run",
              "median_step_s": step_s, "samples_s": [r["result"]["times"] for r in runs], "comparisons": {}}
    rows = []
    for name in CONTENDERS:
        row = None
        if name != "torch DDP":
            row = ratio_row(runs, name, "torch DDP", world_size=world_size, size=f"{model.split(',')[0]}, batch {batch}/rank",
                            meaning=f"step time of {name} / torch DDP (below 1: faster)")
            result["comparisons"][f"{name} / torch DDP (step time)"] = row
        rows.append({"contender": name, "step ms": f"{step_s[name] * 1e3:.1f}",
                     "samples/s": f"{world_size * batch / step_s[name]:.1f}",
                     "step time / torch DDP: median [IQR; range; per launch]": format_row(row) if row else "1"})
    result["table"] = rows
    from distlab.plots import plot_bars

    png = plot_bars({n: world_size * batch / step_s[n] for n in CONTENDERS}, out_dir / "ddp_throughput.png",
                    "samples / s (median)", f"{model}, W={world_size} gloo CPU ranks ({machine_info()['cores']} cores)")
    result["plot"] = png.name
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="bucket size of ours and torch's")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, bucket_mb=args.bucket_mb)
    path = write_result("ddp", result)
    print(format_table(result["table"]))
    print(f"{result['launches']} launches x {result['repeats']} repeats x {result['steps_per_repeat']} steps; "
          f"load average {result['load']}")
    print(f"wrote {path} and {RESULTS / 'ddp_throughput.png'}")


if __name__ == "__main__":
    main()
