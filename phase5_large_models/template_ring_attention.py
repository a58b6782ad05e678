# Generated from solutions/phase5_large_models/ring_attention.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Context parallelism: ring attention (Liu et al. 2023), with the zig-zag split that balances causal work.

A sequence too long for one device is split along T: rank r holds the queries, keys and
values of its tokens. Attention needs every query against every (earlier) key, so the
K/V blocks travel around the ring while the queries stay home:

    step 0: rank r attends its queries to its own K/V block      then passes it to r+1
    step i: rank r holds the block of rank r-i (received from r-1) ...
    after W steps every query has seen every block; W-1 transfers, each overlapped with
    the compute of the block in hand (the next transfer is posted before the compute).

Each block gives a partial softmax: an output normalised over that block only and the
log-sum-exp (lse) of its scores. Two partials merge exactly (the online-softmax rule):

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Backward takes the same ring: K/V travel again, and with them the dK/dV accumulator of
each block, to which every rank adds its queries' share; one last hop brings each
accumulator home. Causal masking makes a contiguous split unfair (rank W-1 sees every
block, rank 0 only its own); the zig-zag split gives rank r chunks r and 2W-1-r of 2W,
so every rank does the same work.

Uneven lengths: no padding. ``sequence_layout`` cuts with ``torch.tensor_split``'s rule
(the first chunks one token longer) and every rank knows every rank's positions, so a
receive buffer always has the sender's size and the causal mask comes from positions.
Positions are host data (CPU tensors, read with numpy): which rows and columns of a block
are visible is known without asking the GPU, so the ring has no host sync (a ``nonzero`` on
device positions would stop the CPU twice per block, forward and backward).

Cost per rank (c = B*H*D elements per token; T_j = tokens of rank j): forward sends the
K/V of W-1 blocks, 2c(T - T_{r+1}); backward the same again plus the W dK/dV
accumulators, 2cT (accumulated in float32, or the input dtype if wider).
See phase5_large_models/guidelines_context.md#ring-attention.
Run: ``NPROC=4 RUN_MODE=context_parallel ./entrypoint.sh``.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from distlab.todo import todo

LAYOUTS = ("contiguous", "zigzag")


def sequence_layout(seq_len: int, world_size: int, kind: str = "zigzag") -> list[torch.Tensor]:
    """The global token positions each rank holds, in the order it holds them.

    contiguous: rank r holds the r-th of W consecutive chunks; zigzag: the sequence is cut
    into 2W chunks and rank r holds chunks r and 2W-1-r. Chunk sizes follow
    ``torch.tensor_split`` (the first ``seq_len % parts`` chunks are one token longer).
    """
    if kind not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {kind!r}")
    parts = 2 * world_size if kind == "zigzag" else world_size
    if seq_len < parts:
        raise ValueError(f"sequence length {seq_len} is shorter than the {parts} chunks of a {kind} split "
                         f"over {world_size} ranks: every chunk needs at least one token")
    if kind == "contiguous":
        return list(torch.arange(seq_len).tensor_split(world_size))
    # --- TODO 5.1: zig-zag split ---
    # Goal: cut positions 0..seq_len-1 into 2W chunks (tensor_split's sizes); rank r holds chunk r
    # followed by chunk 2W-1-r (one early, one late chunk: equal causal work on every rank).
    # Return a list of W position tensors.
    raise todo("5.1 zig-zag split", "guidelines_context.md#the-zig-zag-split")
    # --- end TODO 5.1 ---


# --------------------------------------------------------------------------- one block (given)
def _visible(pos_q: torch.Tensor, pos_k: torch.Tensor, device: torch.device) -> tuple | None:
    """Rows (queries) that see at least one key of the block, columns (keys) seen by at least one
    query, and the causal mask between them (True: masked), on ``device``; None if no row sees any.

    Computed on the host from the positions (CPU tensors, as ``sequence_layout`` makes them; numpy
    refuses device tensors): no host sync, and the copies to ``device`` do not wait.
    """
    pq, pk = (p.numpy() if p.device.type == "cpu" else p.cpu().numpy() for p in (pos_q, pos_k))
    rows, cols = np.flatnonzero(pq >= pk.min()), np.flatnonzero(pk <= pq.max())
    if rows.size == 0:
        return None
    masked = pq[rows, None] < pk[None, cols]
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (rows, cols, masked))


def block_attention(q, k, v, pos_q, pos_k, scale: float):
    """Causal attention of queries ``q`` (B, H, Tq, D) over one K/V block (B, H, Tk, D).

    Returns ``(out, lse, work)``: the output normalised over this block only, the
    log-sum-exp of each query's scores (-inf, with out 0, for a query that sees no key of
    the block) and the scores computed per (batch, head): fully masked rows and columns
    are skipped, which is where causal work saves (and where a contiguous split loses balance).
    """
    out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))
    visible = _visible(pos_q, pos_k, q.device)
    if visible is None:
        return out, lse, 0
    rows, cols, masked = visible
    ks, vs = k.index_select(2, cols), v.index_select(2, cols)
    s = (q.index_select(2, rows) @ ks.transpose(-1, -2)) * scale
    s = s.masked_fill(masked, float("-inf"))
    lse_b = torch.logsumexp(s, dim=-1)
    out.index_copy_(2, rows, torch.exp(s - lse_b[..., None]) @ vs)
    lse.index_copy_(2, rows, lse_b)
    return out, lse, rows.numel() * cols.numel()


def block_attention_backward(q, k, v, dout, lse, delta, pos_q, pos_k, scale: float):
    """This block's share of dQ, and its dK, dV, given each query's FINAL ``lse`` (over all
    blocks) and ``delta = (dout * out).sum(-1)``, as in FlashAttention's backward."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    visible = _visible(pos_q, pos_k, q.device)
    if visible is None:
        return dq, dk, dv
    rows, cols, masked = visible
    qs, ks, vs, do = q.index_select(2, rows), k.index_select(2, cols), v.index_select(2, cols), dout.index_select(2, rows)
    s = (qs @ ks.transpose(-1, -2)) * scale
    s = s.masked_fill(masked, float("-inf"))
    p = torch.exp(s - lse.index_select(2, rows)[..., None])  # probabilities under the whole row's softmax
    ds = p * (do @ vs.transpose(-1, -2) - delta.index_select(2, rows)[..., None])
    dq.index_copy_(2, rows, ds @ ks * scale)
    dk.index_copy_(2, cols, ds.transpose(-1, -2) @ qs * scale)
    dv.index_copy_(2, cols, p.transpose(-1, -2) @ do)
    return dq, dk, dv


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's partial softmax into the running one: returns the new ``(out, lse)``.

    Equivalent to: softmax attention over the union of the keys both partials saw.
    ``lse`` is finite (the running partial includes the query's own key); ``block_lse`` may
    be -inf (a query that saw no key of the block), which must leave the row unchanged.
    """
    # --- TODO 5.2: online-softmax merge ---
    # Goal: each partial is a softmax-weighted average normalised by its own exp(lse); rescale
    # both to the common normaliser exp(new lse) and add. Work in log space (no exp of a raw lse).
    # Shapes: out (B, H, T, D), lse (B, H, T).
    raise todo("5.2 online-softmax merge", "guidelines_context.md#merging-partial-softmaxes")
    # --- end TODO 5.2 ---


# --------------------------------------------------------------------------- the ring
def _ring_shift(send: torch.Tensor, recv: torch.Tensor, group) -> list:
    """Post ``send`` to the next rank and ``recv`` from the previous one as ONE batch (NCCL-safe:
    grouped opposite ops, no tags, sizes known on both ends); wait on the returned works before
    reading ``recv`` or writing ``send``. One rank: a local copy."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        recv.copy_(send)
        return []
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world_size),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world_size)])


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, group, stats):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)  # noqa: F841 (rank, world_size: for TODO 5.3a)
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in >= fp32
        scale = q.shape[-1] ** -0.5
        B, H, _, D = q.shape
        qa = q.to(acc)  # noqa: F841 (qa: for TODO 5.3a)
        kv = torch.stack([k, v])  # one message per step: (2, B, H, T_src, D), in the input dtype  # noqa: F841 (kv: for TODO 5.3a)
        out = lse = None
        # --- TODO 5.3a: ring attention forward ---
        # Goal: out (B, H, T_r, D) and lse (B, H, T_r) of this rank's queries over ALL W blocks.
        # At step i this rank holds the K/V block of rank src = (rank - i) % W, at positions
        # layout[src]. Post the transfer of the block in hand to the next rank (receiving the
        # previous rank's) BEFORE computing on it, so the transfer overlaps the compute; W-1
        # transfers in all. Start with your own block (every query sees its own key: a finite
        # lse), then merge each block with merge_partials. Add each block's work to
        # stats["score_elements"] when stats is not None.
        raise todo("5.3a ring attention forward", "guidelines_context.md#ring-attention")
        # --- end TODO 5.3a ---
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.scale = layout, group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale = ctx.layout, ctx.group, ctx.scale  # noqa: F841 (layout, scale: for TODO 5.3b)
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)  # noqa: F841 (rank, world_size: for TODO 5.3b)
        B, H, _, D = q.shape
        acc = out.dtype
        qa, do = q.to(acc), dout.to(acc)
        delta = (do * out).sum(-1)  # rowsum(dO * O): the softmax backward's correction term  # noqa: F841 (delta: for TODO 5.3b)
        kv = torch.stack([k, v])  # noqa: F841 (kv: for TODO 5.3b)
        dq = torch.zeros_like(qa)
        dkv = None
        # --- TODO 5.3b: ring attention backward ---
        # Goal: dq (B, H, T_r, D) and dkv = stack([dK, dV]) of THIS rank's own K/V block, in `acc`.
        # The K/V blocks travel as in forward. Each block's dK/dV accumulator travels with it:
        # add this rank's share (block_attention_backward) and pass the accumulator to the next
        # rank, which holds that block at the next step; after W steps one last hop brings each
        # accumulator home (W accumulator transfers, W-1 K/V transfers).
        raise todo("5.3b ring attention backward", "guidelines_context.md#the-backward-ring")
        # --- end TODO 5.3b ---
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[torch.Tensor],
                   group: dist.ProcessGroup | None = None, stats: dict | None = None) -> torch.Tensor:
    """Causal self-attention of this rank's tokens over the whole sequence; K/V go round the ring.

    Args:
        q, k, v: (B, H, T_r, D), this rank's tokens, at global positions ``layout[rank]`` in that order.
        layout: every rank's positions (``sequence_layout(T, W, kind)``: CPU tensors), the same list on every rank.
        group: the context-parallel group (None: WORLD).
        stats: optional dict; ``stats["score_elements"]`` grows by the attention scores this
            rank computed per (batch, head) in forward: its share of the causal work.

    Returns: (B, H, T_r, D), this rank's rows of the attention output.
    Equivalent to: ``F.scaled_dot_product_attention(Q, K, V, is_causal=True)[:, :, layout[rank]]``
    on the whole sequence (and its gradients for the rows and columns this rank holds).
    Collective: every rank of ``group`` calls it, forward and backward, with the same layout.
    Cost per rank (c = B*H*D elements per token): forward 2c(T - T_{r+1}) sent (K/V of W-1
    blocks); backward the same plus 2cT of dK/dV accumulators (float32 or wider).
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(layout) != world_size:
        raise ValueError(f"layout has {len(layout)} ranks' positions, the group has {world_size} ranks")
    if not (q.shape == k.shape == v.shape) or q.dim() != 4 or q.shape[2] != layout[rank].numel():
        raise ValueError(f"q, k, v must be (B, H, T_r, D) with T_r = {layout[rank].numel()} tokens "
                         f"(layout[{rank}]); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return _RingAttention.apply(q, k, v, layout, group, stats)
