"""Hand-made all-reduces (Phase 3) against gloo's, and against the loopback bound of the same run.

For W = 2 and 4 ranks and messages from 1 KiB (latency-bound: a few microseconds of
work, the rest is per-message cost) to 256 MiB (bandwidth-bound), on the harness
(benchmarks/harness.py: rotated order, warm-up, every result checked against
``dist.all_reduce``'s, slowest rank per repeat, 3 launches):

* ``ring_allreduce`` (step by step), ``ring_allreduce_pipelined`` (slices streamed
  through the ring), ``halving_doubling_allreduce``, and ``dist.all_reduce``;
* the loopback bound: the ring's own traffic and nothing else, 2(W-1) two-way
  exchanges of N/W bytes between neighbours (send right, receive left at once), into
  buffers allocated once. What the transport needs to move the bytes an all-reduce
  must move: no adds, no allocation. (W=2, 64 MiB: two 32 MiB exchanges.)

Ratios: time of ours / time of ``dist.all_reduce`` (below 1: ours faster), and time /
the loopback bound (1 = as fast as moving the bytes allows; above 1: what the adds,
copies and per-message costs add). Bus bandwidth (nccl-tests' definition, comparable
across W): bytes / t * 2(W-1)/W. On GPU ranks (NCCL, cuda tensors) the same races run.

    python -m benchmarks.bench_collectives [--quick]

writes benchmarks/results/collectives.json and collectives_busbw.png.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import Contender, format_row, launch, load_of, measure, ratio_row
from distlab import p2p
from distlab.metrics import format_bytes, format_table

KiB, MiB = 1 << 10, 1 << 20
SIZES = [KiB * 4 ** k for k in range(10)]  # 1 KiB ... 256 MiB
QUICK_SIZES = [4 * KiB, 1 * MiB]
TABLE_SIZES = [KiB, 16 * MiB, 256 * MiB]  # the rows of the summary: latency-bound, then bandwidth-bound
BUILTIN, BOUND = "dist.all_reduce", "loopback bound"
RATIOS = [("ring pipelined", BUILTIN), ("ring", BUILTIN), ("halving-doubling", BUILTIN),
          ("ring pipelined", BOUND), ("ring", BOUND), (BUILTIN, BOUND)]


def _inner(nbytes: int) -> int:
    """Calls per timed window: enough latency-bound calls to outlast the scheduler's noise. The
    in-place result grows W-fold per call (exactly, in binary, for W = 2 and 4): W^31 stays finite."""
    return max(1, min(32, 256 * KiB // nbytes))


def _repeats(nbytes: int, quick: bool) -> int:
    if quick:
        return 4
    return 15 if nbytes <= MiB else 9 if nbytes <= 16 * MiB else 7


def _loopback_exchange(send: torch.Tensor, recv: torch.Tensor, steps: int) -> None:
    """``steps`` times: send ``send`` to the right neighbour while receiving ``recv`` from the left."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for _ in range(steps):  # the pair in one launch, as the ring posts it (NCCL-safe: distlab.p2p)
        p2p.send_recv(send, right, recv, left)


def _worker(rank: int, world_size: int, sizes: list[int], quick: bool) -> dict:
    from solutions.phase3_multi_node import allreduce_algorithms as algos
    from solutions.phase3_multi_node import ring_allreduce as ring

    torch.set_num_threads(1)  # the adds are memory-bound; leave the cores to gloo's I/O threads
    # With a GPU per rank run_distributed picks NCCL: the same races on cuda tensors.
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    fns = {BUILTIN: dist.all_reduce, "ring": ring.ring_allreduce, "ring pipelined": ring.ring_allreduce_pipelined,
           "halving-doubling": algos.halving_doubling_allreduce}
    out = {"backend": dist.get_backend(), "by_size": {}}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)).to(device)
        contenders, once = [], torch.empty_like(x)
        for name, fn in fns.items():
            buf = torch.empty_like(x)  # each its own, refilled from x before every timed window
            # The result checked is one call on x: a window's `inner` in-place calls multiply the values
            # by W each, and with them the rounding of sums taken in another order (at W=4, 1 KiB the
            # 32nd call's differ from gloo's beyond float32 tolerances, though every call is right).
            contenders.append(Contender(name, run=lambda fn=fn, buf=buf: (fn(buf), buf)[1],
                                        prepare=lambda buf=buf: buf.copy_(x),
                                        result=lambda fn=fn: (once.copy_(x), fn(once), once.clone())[2]))
        per = -(-x.numel() // world_size)  # the largest ring chunk
        send, recv = x[:per], torch.empty(per, dtype=x.dtype, device=device)
        contenders.append(Contender(BOUND, run=lambda: _loopback_exchange(send, recv, 2 * (world_size - 1)),
                                    checked=False))
        # float32 sums in a different order (ring vs gloo's own): assert_close's float32 tolerances.
        out["by_size"][nbytes] = measure(contenders, BUILTIN, repeats=_repeats(nbytes, quick), warmup=1,
                                         device=device, inner=_inner(nbytes))
        del x, contenders, send, recv, once
    return out


def run(quick: bool = False, out_dir: Path | None = None, launches: int = 3) -> dict:
    out_dir = Path(out_dir or RESULTS)
    sizes = QUICK_SIZES if quick else SIZES
    worlds = (2,) if quick else (2, 4)
    result = {"name": "collectives", "machine": machine_info(), "launches": launches, "sizes": sizes,
              "note": "ranks on one machine (gloo over loopback on CPU); every repeat runs every contender in "
                      "rotated order; a repeat's time is the slowest rank's; rows: median and spread over all "
                      "repeats of all launches; load = 1-minute load average around the launches",
              "comparisons": {}, "all_rows": {}, "busbw_GBps": {}}
    series: dict[str, list[tuple[float, float]]] = {}
    rows = []
    for world_size in worlds:
        runs = launch(_worker, world_size, sizes, quick, launches=launches, timeout_s=1800)
        result["backend"] = runs[0]["result"]["backend"]
        factor = 2 * (world_size - 1) / world_size
        for nbytes in sizes:
            size = format_bytes(nbytes)
            pick = lambda r, nbytes=nbytes: r["by_size"][nbytes]  # noqa: E731
            for name in runs[0]["result"]["by_size"][nbytes]["times"]:
                t = statistics.median(v for r in runs for v in pick(r["result"])["times"][name])
                busbw = nbytes / t * factor / 1e9
                result["busbw_GBps"][f"{name} W={world_size} {size}"] = busbw
                series.setdefault(f"{name} (W={world_size})", []).append((nbytes, busbw))
            for ours, base in RATIOS:
                meaning = (f"time of {ours} / {base}" + (" (below 1: ours faster)" if base == BUILTIN else
                           " (1 = moving the ring's bytes is all it costs)"))
                row = ratio_row(runs, ours, base, meaning=meaning, world_size=world_size, size=size, key=pick)
                key = f"{ours} / {base}, W={world_size}, {size}"
                result["all_rows"][key] = row
                if nbytes in TABLE_SIZES or quick:
                    result["comparisons"][key] = row
                rows.append({"ratio": f"{ours} / {base}", "W": world_size, "size": size,
                             "ours ms": f"{row['ours'] * 1e3:.3f}", "base ms": f"{row['builtin'] * 1e3:.3f}",
                             "median [IQR; range; per launch]": format_row(row)})
        result.setdefault("load", {})[f"W={world_size}"] = load_of(runs)
    from distlab.plots import plot_bandwidth

    where = machine_info().get("gpu") or f"{machine_info()['cores']} cores"
    png = plot_bandwidth(series, out_dir / "collectives_busbw.png",
                         title=f"all-reduce bus bandwidth, {result['backend']} ranks ({where}); "
                               "left: latency-bound, right: bandwidth-bound")
    result["plot"] = png.name
    result["table"] = rows
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="W=2, two sizes, 4 repeats, 3 launches (seconds)")
    parser.add_argument("--launches", type=int, default=3, help="fresh process groups (>= 3 for a spread)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, launches=args.launches)
    path = write_result("collectives", result)
    print(format_table(result["table"]))
    print(f"wrote {path} and {RESULTS / 'collectives_busbw.png'}")


if __name__ == "__main__":
    main()
