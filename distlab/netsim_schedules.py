"""The course's collective schedules, step by step, as messages for ``distlab.netsim``'s engine.

Each function replays one lesson's loop: which rank sends how many bytes to whom at each
step, with the same chunking (``chunk_bounds``: tensor_split's rule, the first N % W chunks
one element longer) and the same partner order as the code in solutions/phase3_multi_node/:

* ``ring_reduce_scatter`` / ``ring_all_gather``: 3.1 and 3.2 (``ring_allreduce.py``): at step
  s rank r sends chunk (r - s - 1) % W (reduce-scatter) or (r - s) % W (all-gather) to r + 1;
* ``halving_doubling``: 3.5 (``allreduce_algorithms.py``): fold the ranks past the largest
  power of two p, halve at distances p/2 .. 1 (keep the half on your side of the bit), double
  back at distances 1 .. p/2, unfold;
* ``hierarchical``: 3.6: reduce to each node's leader, ring all-reduce among the leaders,
  broadcast inside the node. The lesson calls gloo's ``dist.reduce`` / ``dist.broadcast``
  inside a node, whose inner algorithm is gloo's; here they are binomial trees
  (ceil(log2 G) rounds of the whole tensor), the "tree reduce + broadcast" of the lesson's cost;
* ``hierarchical_2d``: the same three levels built from the ring lessons only (NCCL's and
  Horovod's layout): ring reduce-scatter inside every node, G rings across nodes (one per
  local rank, each all-reducing its 1/G shard), ring all-gather inside every node;
* ``pairwise_all_to_all``: at step s = 1 .. W-1 rank r sends its block for r + s.

Many rings run at once (every node's, or every local rank's): a ring set is an array of
``(rings, members)`` global ranks, and one step moves every ring's messages together.
"""
from __future__ import annotations

import math
from typing import Protocol

import numpy as np


class Engine(Protocol):
    """What a schedule needs from the engine (``distlab.netsim.Sim``)."""

    ranks: int

    def step(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, reduce: bool, key: object) -> None: ...


def chunk_sizes(numel: int, parts: int) -> np.ndarray:
    """Elements per chunk, tensor_split's rule (``ring_allreduce.chunk_bounds``)."""
    base, extra = divmod(numel, parts)
    return base + (np.arange(parts) < extra).astype(np.int64)


# --------------------------------------------------------------------------- rings (3.1-3.3)
def _ring_steps(sim: Engine, rings: np.ndarray, chunks: np.ndarray, offset: int, reduce: bool, tag: str) -> None:
    """W-1 ring steps over every ring of ``rings`` (shape (R, W)); ``chunks`` (R, W) bytes per chunk.

    Step s: member i sends chunk (i - s - offset) % W to member i + 1 (offset 1: reduce-scatter, 0: all-gather).
    """
    r, w = rings.shape
    src, dst = rings.ravel(), np.roll(rings, -1, axis=1).ravel()
    pos, row, key = np.arange(w), np.arange(r)[:, None], (tag, rings.shape, hash(rings.tobytes()))
    uniform = (chunks == chunks.flat[0]).all()  # W divides N: one size for every message, no indexing
    for step in range(w - 1):
        if uniform:
            nbytes = int(chunks.flat[0])
        elif r == 1:  # member i sends chunk i - k: the chunk sizes rolled by k
            nbytes = np.roll(chunks[0], step + offset)
        else:
            nbytes = chunks[row, (pos - step - offset) % w].ravel()
        sim.step(src, dst, nbytes, reduce, key=key)


def ring_reduce_scatter(sim: Engine, rings: np.ndarray, chunks: np.ndarray) -> None:
    """3.1 on every ring at once: afterwards member i holds chunk i reduced. Sends N - n_i bytes per member."""
    _ring_steps(sim, rings, chunks, 1, True, "ring")


def ring_all_gather(sim: Engine, rings: np.ndarray, chunks: np.ndarray) -> None:
    """3.2 on every ring at once: member i starts with chunk i, ends with all. Sends N - n_(i+1) bytes."""
    _ring_steps(sim, rings, chunks, 0, False, "ring")


def ring_all_reduce(sim: Engine, rings: np.ndarray, chunks: np.ndarray) -> None:
    """3.3: reduce-scatter then all-gather, 2(W-1) steps."""
    ring_reduce_scatter(sim, rings, chunks)
    ring_all_gather(sim, rings, chunks)


def _one_ring(ranks: int, numel: int, element_size: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(ranks)[None, :], chunk_sizes(numel, ranks)[None, :] * element_size


# --------------------------------------------------------------------------- halving-doubling (3.5)
def halving_doubling(sim: Engine, numel: int, element_size: int, halves: str = "both") -> None:
    """3.5 over ranks 0..W-1: ``halves`` "both" (all-reduce), "halving" (reduce-scatter), "doubling" (all-gather).

    Only "both" folds a world that is not a power of two (the lesson's rule); the two halves alone
    need W a power of two (checked by the caller).
    """
    w = sim.ranks
    p = 1 << (w.bit_length() - 1)
    nbytes = numel * element_size
    extra = np.arange(p, w)
    if len(extra) and halves == "both":  # extra ranks hand over their whole tensor
        sim.step(extra, extra - p, np.full(len(extra), nbytes), True, key=("fold in", w))
    blocks = chunk_sizes(numel, p) * element_size
    starts = np.concatenate([[0], np.cumsum(blocks)])
    rank = np.arange(p)
    lo, hi = np.zeros(p, dtype=np.int64), np.full(p, p, dtype=np.int64)
    if halves == "doubling":  # all-gather: every rank starts owning its own block
        lo, hi = rank.copy(), rank + 1
    if halves in ("both", "halving"):
        distance = p // 2
        while distance:  # keep the half on my side of bit `distance`, send the other
            mid = (lo + hi) // 2
            upper = (rank & distance) != 0
            give_lo, give_hi = np.where(upper, lo, mid), np.where(upper, mid, hi)
            sim.step(rank, rank ^ distance, starts[give_hi] - starts[give_lo], True, key=("hd", p, distance))
            lo, hi = np.where(upper, mid, lo), np.where(upper, hi, mid)
            distance //= 2
    if halves in ("both", "doubling"):
        distance = 1
        while distance < p:  # swap what I own for my partner's adjacent range
            sim.step(rank, rank ^ distance, starts[hi] - starts[lo], False, key=("hd", p, distance))
            size = hi - lo
            peer_lo = np.where((rank & distance) == 0, lo + size, lo - size)
            lo, hi = np.minimum(lo, peer_lo), np.maximum(hi, peer_lo + size)
            distance *= 2
    if len(extra) and halves == "both":  # and get the answer back
        sim.step(extra - p, extra, np.full(len(extra), nbytes), False, key=("fold out", w))


# --------------------------------------------------------------------------- hierarchical (3.6)
def _nodes(ranks: int, g: int) -> list[np.ndarray]:
    return [np.arange(start, min(start + g, ranks)) for start in range(0, ranks, g)]


def _binomial(sim: Engine, ranks: int, g: int, nbytes: int, reduce: bool) -> None:
    """Binomial tree inside every node at once: reduce (to local rank 0) or broadcast (from it)."""
    local, rank = np.arange(ranks) % g, np.arange(ranks)
    size_of_node = np.minimum(g, ranks - (rank // g) * g)
    rounds = range(math.ceil(math.log2(g))) if g > 1 else range(0)
    for k in (rounds if reduce else reversed(rounds)):
        # reduce: in round k the local ranks at an odd multiple of 2^k hand their sums 2^k down;
        # broadcast: the same pairs, the other way, rounds reversed
        half = 1 << k
        leaf = (local % (2 * half) == half) & (local < size_of_node)
        senders = rank[leaf]
        src, dst = (senders, senders - half) if reduce else (senders - half, senders)
        sim.step(src, dst, np.full(len(src), nbytes), reduce, key=("tree", ranks, g, k, reduce))


def hierarchical(sim: Engine, numel: int, element_size: int, g: int) -> None:
    """3.6: node sums on the leaders (tree), the lesson's ring among the M leaders, broadcast (tree)."""
    w = sim.ranks
    _binomial(sim, w, g, numel * element_size, True)
    leaders = np.arange(0, w, g)[None, :]
    if leaders.shape[1] > 1:
        ring_all_reduce(sim, leaders, chunk_sizes(numel, leaders.shape[1])[None, :] * element_size)
    _binomial(sim, w, g, numel * element_size, False)


def hierarchical_2d(sim: Engine, numel: int, element_size: int, g: int) -> None:
    """Ring reduce-scatter in every node, a ring per local rank across nodes on its shard, ring all-gather.

    Needs whole nodes (W % G == 0, checked by the caller). Inside a node the shards are the tensor
    split G ways; local rank l's cross-node ring all-reduces shard l, split M ways.
    """
    w, m = sim.ranks, sim.ranks // g
    nodes = np.arange(w).reshape(m, g)  # ring per node
    shard = chunk_sizes(numel, g)
    intra_chunks = np.tile(shard * element_size, (m, 1))
    if g > 1:
        ring_reduce_scatter(sim, nodes, intra_chunks)
    if m > 1:
        across = nodes.T.copy()  # ring per local rank: ranks l, l+G, l+2G, ...
        ring_all_reduce(sim, across, np.stack([chunk_sizes(int(n), m) for n in shard]) * element_size)
    if g > 1:
        ring_all_gather(sim, nodes, intra_chunks)


# --------------------------------------------------------------------------- all-to-all
def pairwise_all_to_all(sim: Engine, numel: int, element_size: int) -> None:
    """W-1 steps; at step s rank r sends its block for rank r + s (blocks: ``numel`` split W ways)."""
    w = sim.ranks
    rank, blocks = np.arange(w), chunk_sizes(numel, w) * element_size
    for step in range(1, w):
        dst = (rank + step) % w
        sim.step(rank, dst, blocks[dst], False, key=("a2a", w, step))
