"""Context parallelism, the other way: Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023).

Ring attention keeps the heads together and moves K/V around the ring. Ulysses notices
that attention heads are independent: swap the split. One all-to-all turns
"every head, my T/W tokens" into "my H/W heads, every token"; each rank runs ordinary
(causal) attention on whole sequences for its heads; a second all-to-all turns the
output back:

    (B, H, T/W, D) --all-to-all--> (B, H/W, T, D) --attention--> (B, H/W, T, D) --all-to-all--> (B, H, T/W, D)
      rank r: all heads, tokens r         rank r: heads r, all tokens

Rank r sends head group j of its tokens to rank j and receives its own head group of
every rank's tokens. Backward is the same two all-to-alls, reversed (the gradient of a
permutation is the inverse permutation). The number of heads must divide by W, and W
can never exceed H: that is Ulysses' limit, where ring attention has none.
Uneven lengths: rank r holds T_r tokens (``torch.tensor_split``'s sizes, contiguous), and
the all-to-alls use uneven split sizes.

Cost per rank (c = B*D elements per head and token): forward all-to-alls of
3cH*T_r (Q, K, V together) and c(H/W)T (the output); backward cH*T_r and 3c(H/W)T;
on the wire (W-1)/W of that: 8cHT/W * (W-1)/W for an even split, falling with W,
where ring attention's grows from 4cHT (W=2) towards 6cHT.
See phase5_large_models/guidelines_context.md#ulysses.
Run: ``NPROC=4 RUN_MODE=context_parallel ./entrypoint.sh``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.lessons.sync import check_divisible


def _seq_to_heads(x: torch.Tensor, seq_lens: list[int], group) -> torch.Tensor:
    """(B, H, T_r, D): every head, this rank's tokens -> (B, H/W, T, D): this rank's heads, every token."""
    world_size = len(seq_lens)
    # ### BEGIN SOLUTION 5.4a: all-to-all, sequence-sharded to head-sharded [guidelines_context.md#ulysses]
    # Goal: rank r sends head group j (heads j*H/W .. (j+1)*H/W - 1) of its T_r tokens to rank j,
    # and receives its own head group of every rank's tokens, concatenated along T in rank
    # order (T = sum(seq_lens)). One dist.all_to_all_single on flat buffers, with uneven
    # output split sizes (rank s sends T_s tokens). One rank: nothing to exchange.
    if world_size == 1:
        return x
    B, H, T_r, D = x.shape
    hw = H // world_size
    send = x.reshape(B, world_size, hw, T_r, D).transpose(0, 1).contiguous()  # head group j first: for rank j
    out_sizes = [B * hw * t * D for t in seq_lens]
    recv = x.new_empty(sum(out_sizes))
    dist.all_to_all_single(recv, send.view(-1), output_split_sizes=out_sizes,
                           input_split_sizes=[B * hw * T_r * D] * world_size, group=group)
    return torch.cat([p.view(B, hw, t, D) for p, t in zip(recv.split(out_sizes), seq_lens)], dim=2)
    # ### END SOLUTION 5.4a


def _heads_to_seq(y: torch.Tensor, seq_lens: list[int], group) -> torch.Tensor:
    """(B, H/W, T, D): this rank's heads, every token -> (B, H, T_r, D): every head, this rank's tokens."""
    world_size = len(seq_lens)
    # ### BEGIN SOLUTION 5.4b: all-to-all, head-sharded back to sequence-sharded [guidelines_context.md#ulysses]
    # Goal: the inverse of 5.4a: rank r sends tokens of rank j (seq_lens[j] of them, in order)
    # of its head group to rank j, and receives every head group of its own T_r tokens,
    # placed at heads j*H/W .. in rank order j. One rank: nothing to exchange.
    if world_size == 1:
        return y
    B, hw, _, D = y.shape
    t_r = seq_lens[dist.get_rank(group)]
    send = torch.cat([p.reshape(-1) for p in y.split(seq_lens, dim=2)])  # rank j's tokens, j = 0..W-1
    recv = y.new_empty(world_size * B * hw * t_r * D)
    dist.all_to_all_single(recv, send, output_split_sizes=[B * hw * t_r * D] * world_size,
                           input_split_sizes=[B * hw * t * D for t in seq_lens], group=group)
    return recv.view(world_size, B, hw, t_r, D).transpose(0, 1).reshape(B, world_size * hw, t_r, D)
    # ### END SOLUTION 5.4b


class _AllToAll(torch.autograd.Function):
    """Forward: one of the two all-to-alls; backward: the other one, on the gradient (the
    gradient of a permutation of data is the inverse permutation)."""

    @staticmethod
    def forward(ctx, x, to_heads: bool, seq_lens, group):
        ctx.to_heads, ctx.seq_lens, ctx.group = to_heads, seq_lens, group
        return (_seq_to_heads if to_heads else _heads_to_seq)(x.contiguous(), seq_lens, group)

    @staticmethod
    def backward(ctx, grad):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), ctx.seq_lens, ctx.group), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Causal self-attention of a sequence split contiguously across the ranks, by heads.

    Args:
        q, k, v: (B, H, T_r, D), this rank's contiguous tokens; H divisible by W.
        seq_lens: every rank's token count T_j, in rank order (the same list on every rank);
            rank j holds positions sum(seq_lens[:j]) .. sum(seq_lens[:j+1]) - 1.
        group: the context-parallel group (None: WORLD).

    Returns: (B, H, T_r, D), this rank's rows of the attention output.
    Equivalent to: ``F.scaled_dot_product_attention(Q, K, V, is_causal=True)`` on the whole
    sequence, rows of this rank.
    Collective: every rank of ``group`` calls it, forward and backward.
    Cost per rank: all-to-all payloads of 3BH*T_r*D + B(H/W)T*D elements forward (Q, K, V
    together, then the output), BH*T_r*D + 3B(H/W)T*D backward: 4BD(H*T_r + (H/W)T) in all.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_divisible(q.shape[1], world_size, "number of attention heads", "Ulysses (context-parallel) size")
    if len(seq_lens) != world_size or q.shape[2] != seq_lens[rank]:
        raise ValueError(f"seq_lens {seq_lens} must give the {world_size} ranks' token counts, "
                         f"and rank {rank} holds {q.shape[2]} tokens")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch = q.shape[0]
    qkv = _AllToAll.apply(torch.cat([q, k, v]), True, seq_lens, group)  # one all-to-all for the three
    qh, kh, vh = qkv.split(batch)
    return _AllToAll.apply(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), False, seq_lens, group)
