"""A cluster described once (peak FLOP/s, links), and what a collective costs on it.

The planner's time model (distlab/plan_time.py) needs two things from the hardware: how
fast a GPU multiplies matrices, and how long a collective over some of its GPUs takes.
Both live here so that every number about the machine is written, with its source, once.

Collective times use the alpha-beta model of the course's ring (phase 3,
guidelines.md#ring-all-reduce): a ring all-reduce over W ranks takes 2(W-1) steps,
each paying a latency alpha and moving 1/W of the buffer at the link's bandwidth, so

    all-reduce:  2 (W-1) alpha + 2 (W-1)/W * nbytes / bandwidth
    all-gather, reduce-scatter: half of that; send: alpha + nbytes / bandwidth

and across nodes the hierarchical form (reduce-scatter inside the node over NVLink, an
all-reduce of 1/g of the buffer across nodes, one per NIC, all-gather inside the node).
distlab/netsim.py (issue 34, part 2) runs the same schedules as discrete events; where it is
present, ``collective_seconds`` (the one function the planner calls) asks it instead, so the
planner's times come from the simulator; the closed form stays as ``alpha_beta_seconds``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Link:
    """One direction of one GPU's share of a link: ``alpha`` seconds per message, ``bandwidth`` bytes/s."""

    alpha: float
    bandwidth: float


@dataclass(frozen=True)
class Hardware:
    """A GPU and how its nodes are wired. ``matmul_efficiency``: the one fraction of peak that
    the model's FLOPs run at (everything else in a step is counted as a separate term)."""

    name: str
    peak_flops: float          # dense 16-bit tensor-core FLOP/s per GPU
    matmul_efficiency: float   # achieved / peak for the step's FLOPs (one value for every model)
    memory_bytes: float        # per GPU
    memory_bandwidth: float    # HBM bytes/s: what element-wise kernels (LayerNorm, softmax, GELU, dropout) run at
    gpus_per_node: int
    intra: Link                # NVLink, per GPU and direction
    inter: Link                # one NIC, per direction
    nics_per_node: int

    def __post_init__(self) -> None:
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency {self.matmul_efficiency} is not in (0, 1]")
        if self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise ValueError(f"gpus_per_node {self.gpus_per_node} and nics_per_node {self.nics_per_node} "
                             f"must be at least 1")

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    @property
    def inter_per_gpu(self) -> float:
        """Bytes/s across nodes per GPU when every GPU of a node sends at once (they share the NICs)."""
        return self.inter.bandwidth * self.nics_per_node / self.gpus_per_node


# Selene's DGX A100 nodes, as in Narayanan et al. 2021 ("Efficient Large-Scale Language Model
# Training on GPU Clusters Using Megatron-LM", SC21), section 5: 80 GB A100s, 8 per node over
# NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node.
A100 = Hardware(
    name="A100 80GB (Selene DGX A100)",
    peak_flops=312e12,         # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16 tensor core
    # One value for every model and layout, not one per row: the fraction of peak the step's
    # FLOPs run at (the paper reports end-to-end throughput only, 44-52 % of peak, which also
    # pays for the element-wise kernels, the bubble and communication, counted apart here).
    # Stated, then checked: any value from 0.52 to 0.64 keeps every Table 1 row within 15 %.
    matmul_efficiency=0.6,
    memory_bytes=80e9,         # A100 80GB SXM datasheet
    memory_bandwidth=2039e9,   # A100 80GB SXM datasheet: 2,039 GB/s HBM2e
    gpus_per_node=8,
    # NVLink 3: 12 links x 25 GB/s per direction = 300 GB/s per GPU and direction (A100
    # datasheet: 600 GB/s bidirectional); alpha: an assumed few microseconds per ring step
    # (NCCL's intra-node latency is of that order); latency is < 1 % of every Table 1 row.
    intra=Link(alpha=3e-6, bandwidth=300 * GB),
    # HDR InfiniBand: 200 Gb/s = 25 GB/s per NIC and direction, 8 NICs per node (one per GPU).
    inter=Link(alpha=8e-6, bandwidth=25 * GB),
    nics_per_node=8,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _ring(op: str, nbytes: float, ranks: int, link: Link, bandwidth: float) -> float:
    """The flat ring over ``ranks`` ranks on one kind of link (``bandwidth`` per rank)."""
    if ranks == 1:
        return 0.0
    steps = ranks - 1 if op in ("all_gather", "reduce_scatter") else 2 * (ranks - 1)
    return steps * link.alpha + steps / ranks * nbytes / bandwidth


def alpha_beta_seconds(op: str, nbytes: float, ranks: int, hw: Hardware = A100,
                       ranks_per_node: int | None = None) -> float:
    """The closed form of the module docstring (``collective_seconds``' arguments); "send" always uses it."""
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {OPS}")
    g = min(ranks, hw.gpus_per_node) if ranks_per_node is None else ranks_per_node
    if g < 1 or ranks % g or g > hw.gpus_per_node:
        raise ValueError(f"ranks_per_node {g} must divide ranks {ranks} and be at most {hw.gpus_per_node}")
    nodes = ranks // g
    if op == "send":  # one message between two ranks: NVLink when they share a node, else one NIC
        if ranks != 2:
            raise ValueError(f"a send is between 2 ranks, not {ranks}")
        return hw.intra.alpha + nbytes / hw.intra.bandwidth if nodes == 1 else \
            hw.inter.alpha + nbytes / hw.inter_per_gpu
    if nodes == 1:
        return _ring(op, nbytes, g, hw.intra, hw.intra.bandwidth)
    # hierarchical: inside the node 1/g of the buffer per rank, then across nodes on that
    # rank's share of the NICs; all-gather and reduce-scatter are each one half of it
    inside = _ring("reduce_scatter", nbytes, g, hw.intra, hw.intra.bandwidth)
    across = _ring(op, nbytes / g, nodes, hw.inter, hw.inter_per_gpu)
    return across + inside * (1 if op in ("all_gather", "reduce_scatter") else 2)


def collective_seconds(op: str, nbytes: float, ranks: int, hw: Hardware = A100,
                       ranks_per_node: int | None = None) -> float:
    """Seconds for one collective on ``hw``: the one function the planner asks.

    Args:
        op: "all_reduce", "all_gather", "reduce_scatter" (``nbytes``: the full buffer, each
            rank's input for all-reduce, the gathered output for all-gather) or "send" (one
            message between ``ranks`` = 2 ranks; ``ranks_per_node`` 1 puts them on two nodes).
        ranks: the group's size; ``ranks_per_node``: how many of them share a node (default:
            as many as fit, consecutive ranks). The group's other nodes hold as many each, and
            every GPU of a node communicates at once (the other groups of the same axis).
    Cost: distlab.netsim's simulated schedules, the fastest algorithm, when that module is
    there; else (and for "send") ``alpha_beta_seconds``, the ring, hierarchical across nodes.
    """
    if op == "send" or ranks == 1 or _netsim() is None:
        return alpha_beta_seconds(op, nbytes, ranks, hw, ranks_per_node)
    alpha_beta_seconds(op, nbytes, ranks, hw, ranks_per_node)  # the same ValueErrors either way
    g = min(ranks, hw.gpus_per_node) if ranks_per_node is None else ranks_per_node
    sim = _netsim()
    # the group's view: g ranks per node on NVLink, and g GPUs' share of the node's NICs
    topology = sim.Topology(g, hw.intra.alpha, 1 / hw.intra.bandwidth, hw.inter.alpha, 1 / (hw.inter_per_gpu * g))
    return sim.collective_seconds(op, nbytes, ranks, topology)


@functools.lru_cache(maxsize=1)
def _netsim():
    """distlab.netsim (issue 34 part 2) when present; imported on first use (it may import this module)."""
    try:
        from distlab import netsim  # noqa: PLC0415
    except ImportError:
        return None
    return netsim
