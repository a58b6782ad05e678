"""Collectives at scale, by simulation: the course's schedules as discrete events on a described cluster.

A laptop runs 2-4 ranks; learners plan for thousands. This module replays the lessons'
collective schedules (``distlab.netsim_schedules``: the ring of 3.1-3.3, halving-doubling
3.5, hierarchical 3.6, all-to-all) message by message over a ``Topology``: nodes of G
ranks, an alpha-beta link inside a node and another between nodes, optionally an
oversubscribed fabric. It is not a closed formula per algorithm: the times come out of
the events, so placement, uneven chunks, contention and waiting show up by themselves.

The event rules (every message of a step is handled at once, vectorized over ranks):

* a rank runs the lesson's loop: its step k+1 starts when its step k's sends and receives
  are done (``ring_exchange`` / ``exchange`` are blocking grouped launches);
* a message starts when both ends are ready (gloo and NCCL send only into a posted receive:
  the receiver's "ready" notice), and lands ``alpha + bytes x beta`` later; a reduced message
  then costs ``gamma x bytes`` of adds on the receiver; empty messages are skipped (as in p2p);
* links: inside a node each rank has its own link (NVLink, loopback), shared by the messages
  it sends (receives) in one step; between nodes a node has one link to the fabric
  (``inter_beta``: all its NICs together; NCCL spreads one ring over every NIC with channels),
  shared by the node's concurrent inter-node messages, each way; with oversubscription s the
  fabric carries at most M / s node links' worth, shared by every inter-node message of the
  step (placement is worst case: every flow crosses the oversubscribed layer).
  Messages of one step are taken to overlap in time (they do in these lock-step schedules).

The planner's entry point is ``collective_seconds(op, nbytes, ranks, topology)``.
See phase5_large_models/guidelines.md#collectives-at-scale-by-simulation.

    python -m distlab.netsim --op all_reduce --bytes 1e9 --ranks 1024      # every algorithm, fastest first
    python -m distlab.netsim_report --calibrate                             # against this repo's measurements
    python -m distlab.netsim_report --plot scale.png                        # the lesson's figure
"""
from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from distlab import netsim_schedules as sched

ALGORITHMS = {
    "all_reduce": ("ring", "halving_doubling", "hierarchical", "hierarchical_2d"),
    "reduce_scatter": ("ring", "halving"),
    "all_gather": ("ring", "doubling"),
    "all_to_all": ("pairwise",),
}


@dataclass(frozen=True)
class Topology:
    """A cluster: nodes of ``ranks_per_node`` consecutive ranks; alpha in seconds, beta in seconds per byte.

    ``intra_*``: one rank's link inside its node. ``inter_*``: one node's link to the fabric, all its
    NICs together (8 x 200 Gb/s InfiniBand per node: beta = 1 / 200e9). ``oversubscription`` s >= 1:
    the fabric carries M/s node links' worth at once. ``gamma``: seconds per byte to add a received
    chunk into one's own (the reduce in reduce-scatter; negligible on GPUs, not on a busy CPU).
    ``intra_concurrency``: how many transfers a node carries at full speed at once (NVSwitch: all of
    them, inf; loopback: its CPU cores, which copy the bytes, so os.cpu_count()); more share it.
    """

    ranks_per_node: int = 8
    intra_alpha: float = 3e-6
    intra_beta: float = 1 / 300e9
    inter_alpha: float = 10e-6
    inter_beta: float = 1 / 200e9
    oversubscription: float = 1.0
    gamma: float = 0.0
    intra_concurrency: float = math.inf

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for name in ("intra_alpha", "intra_beta", "inter_alpha", "inter_beta", "gamma"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.intra_concurrency <= 0:
            raise ValueError(f"intra_concurrency must be > 0, got {self.intra_concurrency}")
        if self.oversubscription < 1:
            raise ValueError(f"oversubscription must be >= 1 (1: full bisection), got {self.oversubscription}")

    @classmethod
    def from_gbs(cls, ranks_per_node: int, intra_gbs: float, inter_gbs_per_rank: float, intra_us: float = 3.0,
                 inter_us: float = 10.0, oversubscription: float = 1.0) -> Topology:
        """From per-GPU figures, as ``distlab.plan``'s flags give them (GB/s per direction, latency in us)."""
        return cls(ranks_per_node, intra_us * 1e-6, 1 / (intra_gbs * 1e9), inter_us * 1e-6,
                   1 / (inter_gbs_per_rank * ranks_per_node * 1e9), oversubscription)

    def for_group(self, stride: int) -> Topology:
        """The topology one group of a mesh axis sees: members ``stride`` ranks apart, and all ``stride``
        such groups running the same collective at once (tp fastest: dp's stride is tp x cp x ...).

        Each node then holds G / stride members of the group (one, if stride >= G) and shares its
        fabric link with min(stride, G) groups: each gets that fraction of it.
        """
        g = self.ranks_per_node
        if stride < 1 or (stride < g and g % stride) or (stride > g and stride % g):
            raise ValueError(f"stride {stride} must divide or be a multiple of ranks_per_node {g}")
        return replace(self, ranks_per_node=max(1, g // stride), inter_beta=self.inter_beta * min(stride, g))


@dataclass(frozen=True)
class Result:
    """One simulated collective: the last rank's finish time, and what each rank sent and received."""

    op: str
    algorithm: str
    seconds: float
    sent: np.ndarray  # bytes per rank
    received: np.ndarray
    messages: int
    steps: int
    finish: np.ndarray  # seconds, per rank


class Sim:
    """The event engine: per-rank clocks, advanced one schedule step (a set of messages) at a time."""

    def __init__(self, ranks: int, topology: Topology) -> None:
        self.ranks, self.topo = ranks, topology
        self.ready = np.zeros(ranks)
        self.node = np.arange(ranks) // topology.ranks_per_node
        self.num_nodes = -(-ranks // topology.ranks_per_node)
        self.messages = self.steps = 0
        self._links: dict[object, tuple] = {}  # pattern key -> (alpha, beta, unique, identity, src, dst)
        self._bytes: dict[object, np.ndarray] = {}  # pattern key -> bytes so far, per message slot

    def _link(self, src: np.ndarray, dst: np.ndarray) -> tuple:
        """Per-message alpha and beta of one step's pattern, its link shared among that step's messages."""
        t, node = self.topo, self.node
        inter = node[src] != node[dst]
        # inside a node: the sender's and the receiver's own links, split among their messages this step
        out_n, in_n = np.bincount(src, minlength=self.ranks), np.bincount(dst, minlength=self.ranks)
        intra_share = np.maximum(out_n[src], in_n[dst])
        if math.isfinite(t.intra_concurrency):  # and the node's copy engines (cores) among all its transfers
            per_node = np.bincount(node[src][~inter], minlength=self.num_nodes) / t.intra_concurrency
            intra_share = np.maximum(intra_share, per_node[node[src]])
        # between nodes: each node's link, each way, split among its crossing messages; the fabric's M/s links
        ns, nd = node[src][inter], node[dst][inter]
        egress, ingress = np.bincount(ns, minlength=self.num_nodes), np.bincount(nd, minlength=self.num_nodes)
        fabric = t.oversubscription * inter.sum() / self.num_nodes
        inter_share = np.maximum(np.maximum(egress[node[src]], ingress[node[dst]]), fabric)
        alpha = np.where(inter, t.inter_alpha, t.intra_alpha)
        beta = np.where(inter, t.inter_beta * inter_share, t.intra_beta * intra_share)
        identity = len(src) == self.ranks and bool((src == np.arange(self.ranks)).all())
        ring = identity and bool((dst == np.roll(src, -1)).all())  # one ring over all ranks: slices, no gathers
        unique = out_n.max() <= 1 and in_n.max() <= 1
        return alpha, beta, unique, "ring" if ring else "identity" if identity else None, src, dst

    def step(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray | int, reduce: bool, key: object) -> None:
        """Every message ``src[i] -> dst[i]`` of ``nbytes[i]`` (or all of ``nbytes``), at once; ``reduce``:
        the receiver adds it in. ``key`` names the (src, dst) pattern: its links are worked out once."""
        if len(src) == 0:
            return
        if key not in self._links:
            self._links[key] = self._link(src, dst)
            self._bytes[key] = np.zeros(len(src), dtype=np.int64)
        alpha, beta, unique, shape, src, dst = self._links[key]
        self.steps += 1
        if np.ndim(nbytes) == 0 and nbytes <= 0:
            return  # p2p skips empty tensors: no message, no alpha
        ready = self.ready
        r_src = ready if shape else ready[src]
        r_dst = np.concatenate((ready[1:], ready[:1])) if shape == "ring" else ready[dst]
        land = np.maximum(r_src, r_dst)  # a send goes into a posted receive: both ends ready, then the wire
        land += alpha
        land += nbytes * beta
        done = land + self.topo.gamma * nbytes if reduce and self.topo.gamma else land
        if np.ndim(nbytes) and not nbytes.all():  # an empty message changes nobody's clock
            live = nbytes > 0
            land, done = np.where(live, land, r_src), np.where(live, done, r_dst)
            self.messages += int(np.count_nonzero(live))
        else:
            self.messages += len(src) if np.ndim(nbytes) == 0 else len(nbytes)
        if unique:  # the lessons' patterns: at most one send and one receive per rank and step
            if shape:
                np.maximum(ready, land, out=ready)
            else:
                ready[src] = np.maximum(r_src, land)
            if shape == "ring":  # rank i + 1 receives message i
                np.maximum(ready[1:], done[:-1], out=ready[1:])
                ready[0] = max(ready[0], done[-1])
            else:
                ready[dst] = np.maximum(ready[dst], done)
        else:
            np.maximum.at(ready, src, land)
            np.maximum.at(ready, dst, done)
        self._bytes[key] += nbytes  # per message slot; spread to ranks once, in ``ledger``

    def ledger(self) -> tuple[np.ndarray, np.ndarray]:
        """Bytes each rank sent and received, over every step so far."""
        sent, received = np.zeros(self.ranks, dtype=np.int64), np.zeros(self.ranks, dtype=np.int64)
        for key, nbytes in self._bytes.items():
            _, _, _, _, src, dst = self._links[key]
            np.add.at(sent, src, nbytes)
            np.add.at(received, dst, nbytes)
        return sent, received


def applicable(op: str, algorithm: str, ranks: int, topology: Topology) -> str | None:
    """None if ``algorithm`` can run ``op`` on ``ranks`` ranks of ``topology``, else why not."""
    if op not in ALGORITHMS:
        return f"op must be one of {sorted(ALGORITHMS)}, got {op!r}"
    if algorithm not in ALGORITHMS[op]:
        return f"{op} algorithms are {ALGORITHMS[op]}, got {algorithm!r}"
    if algorithm in ("halving", "doubling") and ranks & (ranks - 1):
        return f"{algorithm} needs a power-of-two world (the lesson folds extra ranks for all-reduce only), got {ranks}"
    if algorithm == "hierarchical_2d" and ranks % topology.ranks_per_node:
        return f"hierarchical_2d needs whole nodes: {ranks} ranks % {topology.ranks_per_node} per node != 0"
    return None


def simulate(op: str, nbytes: int, ranks: int, topology: Topology, algorithm: str = "ring",
             element_size: int = 1) -> Result:
    """Run one collective's schedule as events.

    Args:
        op: "all_reduce", "reduce_scatter", "all_gather" or "all_to_all".
        nbytes: the whole tensor: what each rank all-reduces; what reduce-scatter starts from and
            all-gather ends with on every rank (each rank's share is its chunk); each rank's
            all-to-all input (W blocks, one per destination).
        ranks: world size, >= 1; ranks are placed in consecutive blocks of ``ranks_per_node``.
        element_size: bytes per element: chunks are cut in elements (tensor_split's rule), so a
            ledger of a real run with that dtype matches byte for byte.
    """
    why = applicable(op, algorithm, ranks, topology)
    if why:
        raise ValueError(why)
    if ranks < 1 or nbytes < 0 or nbytes % element_size:
        raise ValueError(f"need ranks >= 1 and nbytes a multiple of element_size: ranks {ranks}, "
                         f"nbytes {nbytes} = {nbytes // max(element_size, 1)} x {element_size} + "
                         f"{nbytes % max(element_size, 1)}")
    sim, numel, g = Sim(ranks, topology), nbytes // element_size, topology.ranks_per_node
    if ranks > 1:
        rings, chunks = sched._one_ring(ranks, numel, element_size)
        if (op, algorithm) == ("all_reduce", "ring"):
            sched.ring_all_reduce(sim, rings, chunks)
        elif (op, algorithm) == ("reduce_scatter", "ring"):
            sched.ring_reduce_scatter(sim, rings, chunks)
        elif (op, algorithm) == ("all_gather", "ring"):
            sched.ring_all_gather(sim, rings, chunks)
        elif algorithm in ("halving_doubling", "halving", "doubling"):
            sched.halving_doubling(sim, numel, element_size, {"halving_doubling": "both"}.get(algorithm, algorithm))
        elif algorithm == "hierarchical":
            sched.hierarchical(sim, numel, element_size, g)
        elif algorithm == "hierarchical_2d":
            sched.hierarchical_2d(sim, numel, element_size, g)
        else:
            sched.pairwise_all_to_all(sim, numel, element_size)
    sent, received = sim.ledger()
    return Result(op, algorithm, float(sim.ready.max()), sent, received, sim.messages, sim.steps, sim.ready)


@functools.lru_cache(maxsize=4096)
def _seconds(op: str, nbytes: int, ranks: int, topology: Topology, algorithm: str) -> float:
    return simulate(op, nbytes, ranks, topology, algorithm).seconds


def best_algorithm(op: str, nbytes: int, ranks: int, topology: Topology) -> tuple[str, float]:
    """The fastest applicable algorithm in simulation and its seconds (NCCL picks by its own cost model;
    this picks with hindsight, so it is a lower bound on what a tuned library gets from these schedules)."""
    if op not in ALGORITHMS:
        raise ValueError(f"op must be one of {sorted(ALGORITHMS)}, got {op!r}")
    times = {a: _seconds(op, int(nbytes), ranks, topology, a) for a in ALGORITHMS[op]
             if applicable(op, a, ranks, topology) is None}
    name = min(times, key=times.get)
    return name, times[name]


def collective_seconds(op: str, nbytes: int, ranks: int, topology: Topology, algorithm: str | None = None) -> float:
    """Seconds one ``op`` of ``nbytes`` takes on ``ranks`` ranks of ``topology`` (the last rank's finish).

    ``algorithm`` None: the fastest applicable one (``best_algorithm``). ``nbytes`` as in ``simulate``
    (the whole tensor; for all-to-all each rank's input). For one group of a mesh axis whose members
    are ``stride`` ranks apart, pass ``topology.for_group(stride)``. Results are cached.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if algorithm is None:
        return best_algorithm(op, nbytes, ranks, topology)[1]
    why = applicable(op, algorithm, ranks, topology)
    if why:
        raise ValueError(why)
    return _seconds(op, int(nbytes), ranks, topology, algorithm)


def alpha_beta_seconds(op: str, algorithm: str, nbytes: float, ranks: int, alpha: float, beta: float) -> float:
    """The textbook closed form on one flat link (allreduce_algorithms' docstring): a check on the events."""
    w, log = ranks, math.log2(ranks)
    return {("all_reduce", "ring"): 2 * (w - 1) * (alpha + nbytes / w * beta),
            ("all_reduce", "halving_doubling"): 2 * log * alpha + 2 * (w - 1) / w * nbytes * beta,
            ("reduce_scatter", "ring"): (w - 1) * (alpha + nbytes / w * beta),
            ("all_gather", "ring"): (w - 1) * (alpha + nbytes / w * beta),
            ("all_to_all", "pairwise"): (w - 1) * (alpha + nbytes / w * beta)}[(op, algorithm)]


# --------------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    d = Topology()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--op", default="all_reduce", choices=sorted(ALGORITHMS), help="the collective")
    ap.add_argument("--bytes", type=float, default=2 ** 30, help="the whole tensor (see simulate)")
    ap.add_argument("--ranks", type=int, default=1024, help="world size, in node blocks")
    ap.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node, help="G, GPUs per node")
    ap.add_argument("--intra-gbs", type=float, default=round(1e-9 / d.intra_beta, 6),
                    help="GB/s, one rank inside a node")
    ap.add_argument("--inter-gbs", type=float, default=round(1e-9 / d.inter_beta, 6),
                    help="GB/s, one node's fabric link")
    ap.add_argument("--intra-us", type=float, default=round(d.intra_alpha * 1e6, 6), help="per message inside a node")
    ap.add_argument("--inter-us", type=float, default=round(d.inter_alpha * 1e6, 6), help="per message between nodes")
    ap.add_argument("--oversubscription", type=float, default=1.0, help="fabric: M/s node links' worth at once")
    return ap  # the calibration and the lesson's figure: python -m distlab.netsim_report


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    topo = Topology(args.ranks_per_node, args.intra_us / 1e6, 1 / (args.intra_gbs * 1e9), args.inter_us / 1e6,
                    1 / (args.inter_gbs * 1e9), args.oversubscription)
    rows = []
    for algo in ALGORITHMS[args.op]:
        why = applicable(args.op, algo, args.ranks, topo)
        rows.append((algo, simulate(args.op, int(args.bytes), args.ranks, topo, algo) if why is None else why))
    rows.sort(key=lambda r: r[1].seconds if isinstance(r[1], Result) else math.inf)
    print(f"{args.op} of {args.bytes:.3g} B on {args.ranks} ranks ({args.ranks_per_node} per node): {topo}")
    for algo, r in rows:
        if isinstance(r, Result):
            print(f"  {algo:<18} {r.seconds * 1e3:10.3f} ms  {r.steps:6d} steps  "
                  f"max sent/rank {r.sent.max() / 1e6:10.3f} MB")
        else:
            print(f"  {algo:<18} n/a: {r}")


if __name__ == "__main__":
    main()
