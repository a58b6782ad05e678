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

Every repeat runs every contender for ``--steps`` steps in turn (so a burst of load on
a shared machine hits all of them), between barriers; rank 0's times, medians reported.
Ratios are ours / torch DDP in time per step (below 1: faster) and in throughput.

    python -m benchmarks.bench_ddp [--quick]

writes benchmarks/results/ddp.json and ddp_throughput.png.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import RESULTS, comparison, machine_info, median, write_result
from distlab.launch import run_distributed
from distlab.metrics import format_table

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


def _build(name: str, bucket_mb: float):
    """(module called in forward, parameters' owner, sync after backward)."""
    import torchvision
    from solutions.phase1_data_parallel.trainer import allreduce_gradients, broadcast_parameters
    from solutions.phase3_multi_node.ddp_bucketed import DDPBucketed
    from solutions.phase3_multi_node.ddp_overlap import DDPIndividualParameters

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    if name == "per-param after backward":
        broadcast_parameters(model)
        return model, model, lambda: allreduce_gradients(model)
    if name == "one flat all-reduce after backward":
        broadcast_parameters(model)
        return model, model, lambda: _flat_allreduce(model)
    if name == "ours per-param overlapped":
        ddp = DDPIndividualParameters(model)
        return ddp, model, ddp.finish_gradient_synchronization
    if name == "ours bucketed overlapped":
        ddp = DDPBucketed(model, bucket_size_mb=bucket_mb)
        return ddp, model, ddp.finish_gradient_synchronization
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    return ddp, model, lambda: None


def _worker(rank, world_size, batch, steps, repeats, bucket_mb):
    setups = {name: _build(name, bucket_mb) for name in CONTENDERS}
    optims = {name: torch.optim.SGD(owner.parameters(), lr=0.01, momentum=0.9)
              for name, (_, owner, _) in setups.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(10, (batch,), generator=g)

    def train(name: str, n: int) -> None:
        fwd, _, sync = setups[name]
        for _ in range(n):
            optims[name].zero_grad(set_to_none=True)
            F.cross_entropy(fwd(x), y).backward()
            sync()
            optims[name].step()

    for name in CONTENDERS:  # warm-up: allocator, first-call paths, torch DDP's bucket rebuild
        train(name, 2)
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(repeats):
        for name in CONTENDERS:
            dist.barrier()
            start = time.perf_counter()
            train(name, steps)
            dist.barrier()
            samples[name].append((time.perf_counter() - start) / steps)
    return samples


def run(quick: bool = False, bucket_mb: float = BUCKET_MB) -> dict:
    world_size, batch = 2, 32
    steps, repeats = (2, 3) if quick else (3, 7)
    samples = run_distributed(_worker, world_size, batch, steps, repeats, bucket_mb, backend="gloo", timeout_s=1800)[0]
    result = {"name": "ddp", "machine": machine_info(), "world_size": world_size,
              "model": "torchvision resnet18(num_classes=10), 3x32x32", "batch_per_rank": batch,
              "bucket_mb": bucket_mb, "steps_per_repeat": steps, "repeats": repeats,
              "note": "gloo CPU ranks on one machine; it may be shared with other jobs, so every repeat "
                      "interleaves all contenders and medians are reported",
              "median_step_s": {n: median(s) for n, s in samples.items()}, "samples_s": samples,
              "comparisons": {}}
    torch_t = result["median_step_s"]["torch DDP"]
    rows = []
    for name in CONTENDERS:
        t = result["median_step_s"][name]
        if name != "torch DDP":
            result["comparisons"][f"{name} vs torch DDP (step time)"] = comparison(
                samples[name], samples["torch DDP"], world_size, f"resnet18, batch {batch}/rank")
        rows.append({"contender": name, "step ms": f"{t * 1e3:.0f}",
                     "samples/s": f"{world_size * batch / t:.1f}",
                     "throughput vs torch DDP": f"{torch_t / t:.2f}x"})
    result["throughput_ratio_vs_torch_ddp"] = {n: torch_t / result["median_step_s"][n] for n in CONTENDERS}
    result["table"] = rows
    from distlab.plots import plot_bars

    RESULTS.mkdir(parents=True, exist_ok=True)
    png = plot_bars({n: world_size * batch / result["median_step_s"][n] for n in CONTENDERS},
                    RESULTS / "ddp_throughput.png", "samples / s",
                    f"ResNet-18 3x32x32, W={world_size} gloo CPU ranks ({machine_info()['cores']} cores)")
    result["plot"] = str(png.relative_to(RESULTS.parent.parent))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="bucket size of ours and torch's")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, bucket_mb=args.bucket_mb)
    path = write_result("ddp", result)
    print(format_table(result["table"]))
    print(f"medians of {result['repeats']} repeats x {result['steps_per_repeat']} steps; "
          f"throughput ratio above 1: faster than torch DDP")
    print(f"wrote {path} and {RESULTS / 'ddp_throughput.png'}")


if __name__ == "__main__":
    main()
