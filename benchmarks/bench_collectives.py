"""Hand-made collectives (Phase 3) against gloo's built-ins, side by side in one run.

For W = 2 and 4 CPU ranks (gloo over loopback) and message sizes up to 64 MiB:

* all-reduce: ``ring_allreduce`` (step by step), ``ring_allreduce_pipelined``
  (slices streamed through the ring), ``halving_doubling_allreduce``, and
  ``dist.all_reduce``;
* reduce-scatter: ``ring_reduce_scatter`` against ``dist.reduce_scatter``.

Every repeat runs every contender once, in turn (so a burst of load on a shared
machine hits all of them), between barriers; we keep rank 0's times and report
medians. Bus bandwidth, the figure comparable across W (nccl-tests' definition):
all-reduce busbw = bytes / t * 2(W-1)/W; reduce-scatter busbw = bytes / t * (W-1)/W.

    python -m benchmarks.bench_collectives [--quick]

writes benchmarks/results/collectives.json and collectives_busbw.png.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, comparison, machine_info, median, write_result
from distlab.launch import run_distributed
from distlab.metrics import format_bytes, format_table

MiB = 1 << 20


def _contenders(world_size: int):
    from solutions.phase3_multi_node import allreduce_algorithms as algos
    from solutions.phase3_multi_node import ring_allreduce as ring

    def gloo_reduce_scatter(t):
        out = torch.empty(t.numel() // world_size, dtype=t.dtype, device=t.device)
        dist.reduce_scatter(out, list(t.chunk(world_size)))
        return out

    allreduce = {"ring": ring.ring_allreduce, "ring pipelined": ring.ring_allreduce_pipelined,
                 "halving-doubling": algos.halving_doubling_allreduce,
                 "dist.all_reduce": lambda t: dist.all_reduce(t)}
    reduce_scatter = {"ring reduce-scatter": ring.ring_reduce_scatter,
                      "dist.reduce_scatter": gloo_reduce_scatter}
    return allreduce, reduce_scatter


def _worker(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    torch.set_num_threads(1)  # the adds are memory-bound; leave the cores to gloo's I/O threads
    # With a GPU per rank run_distributed picks NCCL: the same comparison on cuda tensors.
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    allreduce, reduce_scatter = _contenders(world_size)
    contenders = {**allreduce, **reduce_scatter}
    samples = {name: {} for name in contenders}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)).to(device)
        expected = x.clone()
        dist.all_reduce(expected)
        for name, fn in allreduce.items():  # never report the speed of a wrong answer
            y = x.clone()
            fn(y)
            torch.testing.assert_close(y, expected, msg=lambda m: f"{name}, {nbytes} B: {m}")  # float32 rounding
        for name in contenders:
            samples[name][nbytes] = []
        work = x.clone()
        for rep in range(repeats + 1):  # the first round warms up connections and allocators
            for name, fn in contenders.items():
                work.copy_(x)  # the same input every time (in-place results would grow)
                sync()
                dist.barrier()
                start = time.perf_counter()
                fn(work)
                sync()
                dist.barrier()
                if rep:
                    samples[name][nbytes].append(time.perf_counter() - start)
    return {"backend": dist.get_backend(), "samples": samples}


def run(quick: bool = False) -> dict:
    sizes = [1 * MiB, 16 * MiB] if quick else [256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    repeats = 5 if quick else 9
    result = {"name": "collectives", "machine": machine_info(), "repeats": repeats,
              "note": "CPU ranks on one machine over loopback (gloo); the machine may be shared, "
                      "so every repeat interleaves all contenders and medians are reported",
              "comparisons": {}, "busbw_GBps": {}, "median_s": {}}
    series: dict[str, list[tuple[float, float]]] = {}
    rows = []
    for world_size in (2, 4):
        out = run_distributed(_worker, world_size, sizes, repeats, timeout_s=600)[0]
        result["backend"], samples = out["backend"], out["samples"]
        factor_ar, factor_rs = 2 * (world_size - 1) / world_size, (world_size - 1) / world_size
        for name, by_size in samples.items():
            factor = factor_rs if "reduce" in name and "scatter" in name else factor_ar
            for nbytes, times in by_size.items():
                t = median(times)
                busbw = nbytes / t * factor / 1e9
                key = f"{name} W={world_size} {format_bytes(nbytes)}"
                result["median_s"][key] = t
                result["busbw_GBps"][key] = busbw
                series.setdefault(f"{name} (W={world_size})", []).append((nbytes, busbw))
        for nbytes in sizes:
            if nbytes < 16 * MiB:
                continue
            size = format_bytes(nbytes)
            for ours, builtin in (("ring pipelined", "dist.all_reduce"), ("ring", "dist.all_reduce"),
                                  ("halving-doubling", "dist.all_reduce"),
                                  ("ring reduce-scatter", "dist.reduce_scatter")):
                c = comparison(samples[ours][nbytes], samples[builtin][nbytes], world_size, size)
                result["comparisons"][f"{ours} vs {builtin}, W={world_size}, {size}"] = c
                rows.append({"comparison": f"{ours} / {builtin}", "W": world_size, "size": size,
                             "ours ms": f"{c['ours'] * 1e3:.1f}", "built-in ms": f"{c['builtin'] * 1e3:.1f}",
                             "ratio": f"{c['ratio']:.2f}",
                             "ours busbw GB/s": f"{result['busbw_GBps'][f'{ours} W={world_size} {size}']:.2f}",
                             "built-in busbw GB/s": f"{result['busbw_GBps'][f'{builtin} W={world_size} {size}']:.2f}"})
    from distlab.plots import plot_bandwidth

    RESULTS.mkdir(parents=True, exist_ok=True)
    png = plot_bandwidth(series, RESULTS / "collectives_busbw.png",
                         title=f"bus bandwidth, {result['backend']} ranks ({machine_info().get('gpu') or str(machine_info()['cores']) + ' cores'})")
    result["plot"] = str(png.relative_to(RESULTS.parent.parent))
    result["table"] = rows
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, 5 repeats (about a minute)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    path = write_result("collectives", result)
    print(format_table(result["table"]))
    print(f"ratio = ours / built-in time (below 1: ours is faster); medians of {result['repeats']} repeats")
    print(f"wrote {path} and {RESULTS / 'collectives_busbw.png'}")


if __name__ == "__main__":
    main()
