"""The simulator held against this repository's measurements, and the phase 5 lesson's figure.

``calibration()``: the simulator's predictions for benchmarks/results/hierarchical.json (flat ring /
hierarchical over 40 Mbit/s shaped links between two containers, links measured in each launch)
and benchmarks/results/netsim.json (the ring on loopback, W = 2-4), beside the measured spread.
``plot(path)``: the three panels of phase5_large_models/guidelines.md#collectives-at-scale-by-simulation.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from distlab.metrics import format_bytes
from distlab.netsim import Topology, collective_seconds, simulate

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
MiB, GiB = 1 << 20, 1 << 30


# --------------------------------------------------------------------------- calibration
def hierarchical_bench(results: dict) -> list[dict]:
    """Flat ring (3.3) / hierarchical (3.6) per size: predicted from each launch's measured links."""
    rows = []
    g = results["ranks_per_node"]
    w = results["nodes"] * g
    for nbytes in results["sizes"]:
        ratios, ring_s, hier_s = [], [], []
        for run in results["runs"]:
            links = run["result"]["links"]
            # one container = one node; its eth0 (the tbf) is the node's link, shared by its ranks
            topo = Topology(g, links["intra"]["alpha"], links["intra"]["beta"], links["inter"]["alpha"],
                            links["inter"]["beta"])
            ring = simulate("all_reduce", nbytes, w, topo, "ring", element_size=4).seconds
            hier = simulate("all_reduce", nbytes, w, topo, "hierarchical", element_size=4).seconds
            ratios.append(ring / hier)
            ring_s.append(ring)
            hier_s.append(hier)
        row = results["comparisons"][f"flat ring (3.3) / hierarchical (3.6), {nbytes / MiB:g} MiB"]
        rows.append({"case": f"flat ring / hierarchical, {w} ranks on {results['nodes']} nodes, "
                             f"{results['rate_mbit']:g} Mbit/s, {nbytes / MiB:g} MiB",
                     "predicted": statistics.median(ratios), "measured": row["spread"]})
        for name, sims, key in (("flat ring (3.3)", ring_s, "ours"), ("hierarchical (3.6)", hier_s, "builtin")):
            rows.append({"case": f"  {name} seconds, {nbytes / MiB:g} MiB", "predicted": statistics.median(sims),
                         "measured": {"median": row[key]}})
    return rows


def loopback_bench(results: dict) -> list[dict]:
    """The lesson's ring on loopback (benchmarks/bench_netsim.py): predicted and measured seconds."""
    return [{"case": f"{name.split(':')[0]} on loopback, seconds", "predicted": row["predicted_s"]["median"],
             "measured": row["measured_s"]} for name, row in results["comparisons"].items()]


def calibration(results_dir: Path = RESULTS) -> list[dict]:
    rows = []
    for name, fn in (("hierarchical.json", hierarchical_bench), ("netsim.json", loopback_bench)):
        path = results_dir / name
        if path.exists():
            rows += fn(json.loads(path.read_text()))
    return rows


def print_calibration() -> None:
    print(f"{'case':<72} {'predicted':>10} {'measured median [IQR; range]':>36}")
    for r in calibration():
        m = r["measured"]
        spread = (f" [{m['q1']:.3g}-{m['q3']:.3g}; {m['min']:.3g}-{m['max']:.3g}]" if "q1" in m else "")
        verdict = ("" if "q1" not in m else "  in IQR" if m["q1"] <= r["predicted"] <= m["q3"]
                   else "  in range" if m["min"] <= r["predicted"] <= m["max"] else "  OUTSIDE")
        print(f"{r['case']:<72} {r['predicted']:>10.3g} {m['median']:>10.3g}{spread}{verdict}")


# --------------------------------------------------------------------------- the lesson's figure
# Illustrative A100 cluster (the Megatron-LM paper's: NVLink inside a node, 8 x 200 Gb/s InfiniBand
# per node); latencies of the order NCCL's tuning model charges per step (a few us on NVLink, ~10 us
# across the network). Not a fit: change them and the shape of every panel stays.
CLUSTER = Topology(ranks_per_node=8, intra_alpha=3e-6, intra_beta=1 / 300e9, inter_alpha=10e-6,
                   inter_beta=1 / 200e9)


def _latency_share(nbytes: int, ranks: int, topo: Topology) -> float:
    """Share of the ring all-reduce's time that is per-message latency: the run with free bandwidth / the run."""
    free = replace(topo, intra_beta=0.0, inter_beta=0.0)
    return (simulate("all_reduce", nbytes, ranks, free, "ring").seconds
            / simulate("all_reduce", nbytes, ranks, topo, "ring").seconds)


def zero3_tflops(gpus: int, topo: Topology, params: float = 7.5e9, layers: int = 32, tokens: int = 2048 * 2048,
                 peak: float = 312e12, efficiency: float = 0.5, overlap: bool = True) -> float:
    """Per-GPU TFLOP/s of ZeRO-3 alone on ``gpus`` GPUs at a fixed global batch of ``tokens``.

    Per step and layer: an all-gather of the layer's bf16 parameters before its forward and again
    before its backward, a reduce-scatter of its gradients after (3 collectives of 2 params / L
    bytes, each over all GPUs). Compute 6 x params x tokens / gpus at ``efficiency`` x ``peak``;
    with ``overlap`` the step is the longer of the two (prefetching hides what it can), else their sum.
    """
    layer_bytes = int(2 * params / layers)
    comm = layers * (2 * collective_seconds("all_gather", layer_bytes, gpus, topo)
                     + collective_seconds("reduce_scatter", layer_bytes, gpus, topo))
    flops = 6 * params * tokens / gpus
    compute = flops / (efficiency * peak)
    return flops / (max(compute, comm) if overlap else compute + comm) / 1e12


def plot(path: str | Path, topo: Topology = CLUSTER) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    g = topo.ranks_per_node
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))

    ax, nodes = axes[0], [2 ** k for k in range(1, 10)]  # 16 .. 4096 ranks
    for nbytes, color in ((64 * 1024, "tab:blue"), (16 * MiB, "tab:orange"), (GiB, "tab:green")):
        ring = [simulate("all_reduce", nbytes, m * g, topo, "ring").seconds for m in nodes]
        for algo, style in (("hierarchical_2d", "-"), ("hierarchical", "--")):
            other = [simulate("all_reduce", nbytes, m * g, topo, algo).seconds for m in nodes]
            ax.plot(nodes, [r / o for r, o in zip(ring, other)], style, color=color, marker="o", ms=3,
                    label=f"{format_bytes(nbytes)}, {algo}")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel=f"nodes ({g} GPUs each)", ylabel="flat ring time / hierarchical time",
           title="All-reduce: where hierarchy wins (above 1)")
    ax.legend(fontsize=7)

    ax, sizes = axes[1], [2 ** k for k in range(10, 33, 2)]
    for ranks in (64, 512, 4096):
        ax.plot(sizes, [_latency_share(n, ranks, topo) for n in sizes], marker="o", ms=3, label=f"W = {ranks}")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="all-reduce size (bytes)", ylabel="latency share of the ring's time",
           title="Ring all-reduce: where the 2(W-1) alpha term dominates")
    ax.legend(fontsize=8)

    ax, gpus = axes[2], [2 ** k for k in range(3, 12)]
    for overlap, style in ((True, "-"), (False, "--")):
        ax.plot(gpus, [zero3_tflops(w, topo, overlap=overlap) for w in gpus], style, marker="o", ms=3,
                label=f"ZeRO-3, {'communication overlapped' if overlap else 'no overlap'}")
    ax.axhline(0.5 * 312, color="grey", lw=0.8, label="compute alone (50% of 312 TFLOP/s)")
    ax.set(xscale="log", xlabel="GPUs (global batch fixed: 2048 x 2048 tokens)", ylabel="TFLOP/s per GPU",
           title="ZeRO-3 without model parallelism, 7.5B params", ylim=(0, 180))
    ax.legend(fontsize=8)
    fig.suptitle(f"Simulated ({g} GPUs/node, {1e-9 / topo.intra_beta:g} GB/s per GPU inside, "
                 f"{1e-9 / topo.inter_beta:g} GB/s per node across; alpha {topo.intra_alpha * 1e6:g} / "
                 f"{topo.inter_alpha * 1e6:g} us): python -m distlab.netsim_report --plot", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m distlab.netsim_report --calibrate`` / ``--plot PNG`` (this module imports the simulator,
    which does not import it back)."""
    import argparse

    ap = argparse.ArgumentParser(description="the simulator against this repo's measurements, and the lesson's figure")
    ap.add_argument("--calibrate", action="store_true", help="predictions against benchmarks/results")
    ap.add_argument("--plot", metavar="PNG", help="write the phase 5 lesson's figure")
    args = ap.parse_args(argv)
    if not (args.calibrate or args.plot):
        ap.error("say --calibrate, --plot PNG or both")
    if args.calibrate:
        print_calibration()
    if args.plot:
        print(f"wrote {plot(args.plot)}")


if __name__ == "__main__":
    main()
