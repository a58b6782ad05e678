"""The collective simulator (distlab/netsim.py) against the lesson's ring all-reduce on loopback, W = 2-4.

In each launch, every world first measures what the simulator takes as input: alpha, the time of
one ring step of 4-byte messages with all W ranks stepping at once (``ring_exchange``); beta, a
one-way transfer of PROBE_BYTES between ranks 0 and 1 (bench_hierarchical's ``_measure_link``,
which also records half a 4-byte round trip between the two, ``alpha_pair``); and gamma, the time of the ring's add
(``chunk += incoming``) per byte with every rank adding at once (on 2 cores W = 4 ranks share
them). Then it times ``ring_allreduce`` (3.3) on each size (slowest rank per repeat) and the
simulator predicts that run from that launch's alpha, beta and gamma (one node of W ranks).

Rows: measured / predicted per repeat (1: the simulator is exact), with the spread over repeats
and launches. What it leaves out: on loopback the "link" is gloo's threads copying through the
kernel on the same cores as the adds, so concurrent transfers slow each other down more than
the probe (one transfer alone) shows.

    python -m benchmarks.bench_netsim [--quick]

writes benchmarks/results/netsim.json (2-4 minutes on 2 shared cores).
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from benchmarks.common import machine_info, write_result
from benchmarks.harness import format_row, launch, load_of, spread, stat_row

KiB, MiB = 1 << 10, 1 << 20
WORLD_SIZES = [2, 3, 4]
SIZES, QUICK_SIZES = [64 * KiB, 4 * MiB], [4 * MiB]
PROBE_BYTES = 16 * MiB  # ~10 ms over loopback: long next to a round trip (~0.1 ms)


def _worker(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    from benchmarks.bench_hierarchical import _measure_link, _time_pattern
    from solutions.phase3_multi_node import ring_allreduce as ring

    torch.set_num_threads(1)
    link = _measure_link(0, 1, PROBE_BYTES)
    # alpha: a ring step of 4-byte messages with every rank stepping at once, as in the ring (on a
    # busy machine W runnable ranks wait for a core; two ranks alone, in the pair probe, do not)
    tiny, steps = torch.zeros(1), 16
    ring.ring_exchange(tiny, tiny.clone())
    tiny_steps = _time_pattern(lambda: [ring.ring_exchange(tiny, tiny.clone()) for _ in range(steps)], rounds=7)
    out = {"alpha": statistics.median(tiny_steps) / steps, "alpha_pair": link["alpha"], "beta": link["beta"],
           "by_size": {}}
    for nbytes in sizes:
        chunk = nbytes // 4 // world_size
        a, b = torch.zeros(chunk), torch.ones(chunk)
        adds = _time_pattern(lambda: a.add_(b), rounds=7)  # every rank at once, as in the ring
        x = torch.zeros(nbytes // 4)
        ring.ring_allreduce(x)  # warm-up: connections, the scratch buffers
        times = _time_pattern(lambda: ring.ring_allreduce(x), rounds=repeats)
        out["by_size"][str(nbytes)] = {"gamma": statistics.median(adds) / (chunk * 4), "times": times}
    return out


def _launch(world_size: int, sizes: list[int], repeats: int, launches: int) -> list[dict]:
    runs = launch(_worker, world_size, sizes, repeats, launches=launches, backend="gloo", timeout_s=300)
    return [{**r, "cores": os.cpu_count()} for r in runs]


def predict(run: dict, world_size: int, nbytes: int) -> float:
    """The simulator's seconds for the lesson's ring on one node of ``world_size`` loopback ranks."""
    from distlab.netsim import Topology, simulate

    r = run["result"]
    # On loopback the cores copy the bytes: W concurrent transfers share os.cpu_count() of them.
    topo = Topology(ranks_per_node=world_size, intra_alpha=r["alpha"], intra_beta=r["beta"],
                    gamma=r["by_size"][str(nbytes)]["gamma"], intra_concurrency=run["cores"])
    return simulate("all_reduce", nbytes, world_size, topo, "ring", element_size=4).seconds


def rows(by_world: dict[int, list[dict]], sizes: list[int]) -> dict[str, dict]:
    out = {}
    for world_size, runs in by_world.items():
        for nbytes in sizes:
            predicted = [predict(r, world_size, nbytes) for r in runs]
            measured = [r["result"]["by_size"][str(nbytes)]["times"] for r in runs]
            m = spread([t for ts in measured for t in ts])
            row = stat_row([[t / p for t in ts] for ts, p in zip(measured, predicted)], metric="ratio",
                           world_size=world_size, size=f"{nbytes / MiB:g} MiB, loopback", load=load_of(runs),
                           meaning="ring all-reduce (3.3) measured / the simulator's prediction from the same "
                                   "launch's alpha, beta and gamma (1: exact)",
                           predicted_s=spread(predicted), measured_s=m,
                           within_measured_range=m["min"] <= statistics.median(predicted) <= m["max"])
            out[f"ring W={world_size}, {nbytes / MiB:g} MiB: measured / simulated"] = row
    return out


def run(quick: bool = False, out_dir: Path | None = None, launches: int = 3) -> dict:
    sizes, repeats = (QUICK_SIZES, 5) if quick else (SIZES, 9)
    # No size header per message (the model counts one message) and no strict checking (store round
    # trips per message; pytest's plugin turns it on), in the ranks: what a timed run leaves out.
    quiet = {"DISTLAB_P2P_SIZE_CHECK": "0", "DISTLAB_STRICT_P2P": "0"}
    saved = {k: os.environ.get(k) for k in quiet}
    os.environ.update(quiet)
    try:
        by_world = {w: _launch(w, sizes, repeats, launches) for w in WORLD_SIZES}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    result = {"name": "netsim", "machine": machine_info(), "launches": launches, "repeats": repeats,
              "sizes": sizes, "comparisons": rows(by_world, sizes),
              "runs": {str(w): runs for w, runs in by_world.items()}}
    if out_dir is not None:
        import json

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "netsim.json").write_text(json.dumps(result, indent=2, default=float))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB only, 5 repeats")
    parser.add_argument("--launches", type=int, default=3, help="fresh process groups per world size")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, launches=args.launches)
    path = write_result("netsim", result)
    for name, row in result["comparisons"].items():
        print(f"   {name:<45} {format_row(row)}  predicted {row['predicted_s']['median'] * 1e3:.2f} ms, "
              f"measured {row['measured_s']['median'] * 1e3:.2f} ms "
              f"(range {row['measured_s']['min'] * 1e3:.2f}-{row['measured_s']['max'] * 1e3:.2f})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
