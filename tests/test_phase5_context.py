"""Phase 5 (context parallelism): ring attention, the zig-zag split, Ulysses.

Every worker builds the whole sequence itself (same seed on every rank), runs torch's
``F.scaled_dot_product_attention(..., is_causal=True)`` on it as the single-process
baseline, then runs the distributed attention on its own tokens and compares its rows
of the output and of dQ, dK, dV. Bytes per rank come from the CommLedger and are
asserted against the formulas of the guideline; the causal work per rank is measured
by the ring itself (attention scores computed) and asserted against its formula.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import load
from distlab.comm import CommLedger
from distlab.spawn import run_distributed
from distlab.testing import assert_equal, assert_tensors_close, explain_group_errors

from property_checks_p5 import OverlapLog, explain_wrong_group

PHASE = "phase5_large_models"
WORLD_SIZES = [1, 2, 3, 4]
B, H, D = 2, 2, 8
EVEN_T, UNEVEN_T = 24, 13  # 24 divides into 2W chunks for W = 1, 2, 3, 4; 13 divides by none of 2..8
# float64 throughout: the blockwise softmax reorders sums and exps (~1e-16 relative each);
# 1e-10 still catches a block merged twice or missed (O(1e-1)), a wrong mask or a stale block.
TOL = dict(rtol=1e-10, atol=1e-10)


def _layout(seq_len: int, world_size: int, kind: str) -> list[torch.Tensor]:
    """The tests' own construction of the split (independent of the learner's 5.1)."""
    if kind == "contiguous":
        return list(torch.arange(seq_len).tensor_split(world_size))
    chunks = torch.arange(seq_len).tensor_split(2 * world_size)
    return [torch.cat([chunks[r], chunks[-1 - r]]) for r in range(world_size)]


def _whole(seq_len: int, heads: int = H, batch: int = B, dim: int = D):
    """Q, K, V, dO of the whole sequence: the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seq_len)
    return [torch.randn(batch, heads, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4)]


def _baseline(q, k, v, dout):
    """Single process: torch's causal attention on the whole sequence, output and gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _compare_rows(what, pos, out, grads, ref):
    assert_tensors_close(out, ref[0][:, :, pos], f"{what}: output", **TOL)
    for name, g, r in zip(("dQ", "dK", "dV"), grads, ref[1:]):
        assert_tensors_close(g, r[:, :, pos], f"{what}: {name}", **TOL)


# --------------------------------------------------------------------------- 5.1 zig-zag split
@pytest.mark.exercise("5.1")
def test_zigzag_layout_matches_the_definition():
    ring = load(PHASE, "ring_attention")
    # 10 tokens, 4 chunks of tensor_split sizes 3, 3, 2, 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    got = [p.tolist() for p in ring.sequence_layout(10, 2, "zigzag")]
    assert_equal(got, [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]], f"zigzag layout of 10 tokens on 2 ranks: {got}")
    for seq_len, world_size in ((24, 3), (13, 4), (8, 4), (9, 1)):
        got = ring.sequence_layout(seq_len, world_size, "zigzag")
        want = _layout(seq_len, world_size, "zigzag")
        assert_equal([p.tolist() for p in got], [p.tolist() for p in want],
                     f"zigzag layout of {seq_len} tokens on {world_size} ranks: {[p.tolist() for p in got]}")
    with pytest.raises(ValueError, match=r"sequence length 7 is shorter than the 8 chunks"):
        ring.sequence_layout(7, 4, "zigzag")


# --------------------------------------------------------------------------- 5.2 merge
@pytest.mark.exercise("5.2")
def test_merged_block_partials_match_softmax_over_all_keys():
    ring = load(PHASE, "ring_attention")
    q, k, v, _ = _whole(9)
    q = q[:, :, 2:7]
    pos_q, pos_k = torch.arange(2, 7), torch.arange(9)
    scale = D ** -0.5
    # Blocks of keys [0, 3), [3, 6), [6, 9): queries 2..6 see some of the second and third block
    # and none of it for the earliest queries (lse -inf there: the merge must leave those rows alone).
    out = lse = None
    for cols in (slice(0, 3), slice(3, 6), slice(6, 9)):
        block_out, block_lse, _ = ring.block_attention(q, k[:, :, cols], v[:, :, cols], pos_q, pos_k[cols], scale)
        out, lse = (block_out, block_lse) if out is None else ring.merge_partials(out, lse, block_out, block_lse)
    mask = pos_q[:, None] >= pos_k[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_tensors_close(out, want, "merged output of 3 key blocks vs softmax over all keys", **TOL)
    assert_tensors_close(lse, torch.logsumexp((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")), -1),
                         "merged log-sum-exp", **TOL)


def _large_scores(seq_len: int, scale: float) -> list[torch.Tensor]:
    """Q, K, V (float64) whose scores are ~ +100 on even query rows and ~ -100 on odd ones (+- a few):
    every key shares a component of 10 along dim 0, each query has +-100 / (10 scale) there."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64) for _ in range(3))
    sign = 1 - 2 * (torch.arange(seq_len) % 2)
    q[..., 0] = sign * 100 / (10 * scale)
    k[..., 0] = 10 + 0.1 * torch.randn(B, H, seq_len, generator=g, dtype=torch.float64)
    return [q, k, v]


@pytest.mark.exercise("5.2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_at_large_logits_matches_float64_softmax(dtype):
    """Scores of +-100: exp(lse) overflows fp32 and bf16 (exp(89) = inf) or underflows (exp(-104) = 0), so
    only a merge that exponentiates differences of log-sum-exps stays finite and accurate."""
    ring = load(PHASE, "ring_attention")
    scale = D ** -0.5
    q, k, v = _large_scores(9, scale)
    q, k, v = (t.to(dtype).double() for t in (q, k, v))  # rounded to dtype: the reference sees the same inputs
    q = q[:, :, 2:7]
    pos_q, pos_k = torch.arange(2, 7), torch.arange(9)
    mask = pos_q[:, None] >= pos_k[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want_lse = torch.logsumexp((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")), -1)
    assert_equal(bool(want_lse[..., 0::2].min() > 90 and want_lse[..., 1::2].max() < -90), True,
                 "test setup: lse must be ~ +-100")
    out = lse = None
    for cols in (slice(0, 3), slice(3, 6), slice(6, 9)):  # queries 2, 3 see no key of the last block: lse -inf
        if dtype == torch.float32:  # the whole block in fp32
            block = ring.block_attention(*(t.float() for t in (q, k[:, :, cols], v[:, :, cols])), pos_q, pos_k[cols], scale)
            block_out, block_lse = block[0], block[1]
        else:  # exact partials, outputs stored in bf16 and log-sum-exps in fp32, as FlashAttention keeps them
            block_out, block_lse, _ = ring.block_attention(q, k[:, :, cols], v[:, :, cols], pos_q, pos_k[cols], scale)
            block_out, block_lse = block_out.bfloat16(), block_lse.float()
        out, lse = (block_out, block_lse) if out is None else ring.merge_partials(out, lse, block_out, block_lse)
    what = f"{str(dtype).removeprefix('torch.')} merge at scores ~ +-100"
    assert_equal(bool(torch.isfinite(out).all() and torch.isfinite(lse).all()), True, (
        f"{what}: the merged output holds inf/nan ({(~torch.isfinite(out)).sum().item()} values): exp of a raw "
        f"log-sum-exp overflows (exp(100) > {torch.finfo(dtype).max:.1e}); exponentiate lse - new_lse only"))
    # fp32: scores of ~100 carry ~1e-5 absolute rounding, so the softmax weights ~1e-5 relative.
    # bf16: each partial output is rounded to 8 bits (2^-9 relative, |v| < 4): ~1e-2 absolute.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    assert_tensors_close(out.double(), want, f"{what}: merged output vs float64 softmax over all keys", **tol)
    # lse ~ 100 in fp32: 2^-24 x 100 ~ 1e-5 per rounding.
    assert_tensors_close(lse.double(), want_lse, f"{what}: merged log-sum-exp", rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- 5.2-5.3 ring attention
def _worker_ring_overlap(rank, world_size):
    ring = load(PHASE, "ring_attention")
    whole = _whole(UNEVEN_T)
    layout = _layout(UNEVEN_T, world_size, "zigzag")
    q, k, v = (t[:, :, layout[rank]].clone().requires_grad_() for t in whole[:3])
    with OverlapLog(ring, ["block_attention", "block_attention_backward"]) as log:
        log.mark("forward")
        out = ring.ring_attention(q, k, v, layout)
        log.mark("backward")
        out.backward(whole[3][:, :, layout[rank]])
    computes = sum(1 for e in log.events if e[0] == "compute")
    assert_equal(computes, 2 * world_size, f"rank {rank} of {world_size}: {computes} block computations "
                 f"(block_attention and block_attention_backward), expected {world_size} forward and "
                 f"{world_size} backward")
    problems = log.overlap_violations()
    assert_equal(problems, [], f"rank {rank} of {world_size}: the K/V transfers do not overlap the compute: "
                 f"{'; '.join(problems)}")


@pytest.mark.exercise("5.2-5.3")
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_attention_posts_each_transfer_before_the_compute_it_overlaps(world_size):
    """The order of calls, not the clock: step i+1's K/V is posted before step i's block is computed
    and waited after it, forward and backward (a ring that waits first is correct and serial)."""
    run_distributed(_worker_ring_overlap, world_size, backend="gloo")


def _expected_ring_bytes(layout, rank: int, elem: int) -> tuple[int, int, int]:
    """(sent forward, sent in all, received in all) by ``rank``. Forward sends the K/V of W-1
    blocks (every block but rank+1's) and receives W-1 (every block but its own); backward
    moves the same K/V again plus the W dK/dV accumulators (the whole sequence's K/V size)."""
    world_size = len(layout)
    if world_size == 1:
        return 0, 0, 0
    seq_len = sum(p.numel() for p in layout)
    per_token = 2 * B * H * D * elem  # K and V
    fwd_sent = per_token * (seq_len - layout[(rank + 1) % world_size].numel())
    fwd_received = per_token * (seq_len - layout[rank].numel())
    return fwd_sent, 2 * fwd_sent + per_token * seq_len, 2 * fwd_received + per_token * seq_len


def _worker_ring(rank, world_size, device="cpu"):  # tests/test_gpu.py: "cuda" on NCCL
    ring = load(PHASE, "ring_attention")
    for seq_len in (EVEN_T, UNEVEN_T):
        whole = [t.to(device) for t in _whole(seq_len)]
        ref = _baseline(*whole)
        work = {}
        for kind in ("contiguous", "zigzag"):
            what = f"rank {rank} of {world_size}, {kind} split of {seq_len} tokens"
            layout = _layout(seq_len, world_size, kind)
            pos = layout[rank]
            q, k, v = (t[:, :, pos].clone().requires_grad_() for t in whole[:3])
            stats = {}
            ledger = CommLedger()
            with ledger:
                out = ring.ring_attention(q, k, v, layout, stats=stats)
                fwd_sent = ledger.sent_bytes()
                out.backward(whole[3][:, :, pos])
            _compare_rows(what, pos, out, (q.grad, k.grad, v.grad), ref)
            got = (fwd_sent, ledger.sent_bytes(), ledger.received_bytes())
            want = _expected_ring_bytes(layout, rank, elem=8)  # float64
            assert_equal(got, want, f"{what}: (sent forward, sent, received) = {got} B, expected {want} B")
            mine = torch.tensor([stats.get("score_elements", 0)])
            every = [torch.zeros_like(mine) for _ in range(world_size)]
            dist.all_gather(every, mine)
            work[kind] = [int(w) for w in every]
        c = seq_len // (2 * world_size)  # chunk size when 2W divides T
        if seq_len % (2 * world_size) == 0:
            # contiguous: rank r computes r full blocks and its diagonal, (r+1)(2c)^2 scores;
            # zig-zag: its diagonal (2c)^2 and half of every other block, 2c*c: the same on every rank.
            want = {"contiguous": [(r + 1) * (2 * c) ** 2 for r in range(world_size)],
                    "zigzag": [(2 * c) ** 2 + (world_size - 1) * 2 * c * c] * world_size}
            assert_equal(work, want,
                         f"T={seq_len}, W={world_size}: attention scores computed per rank {work}, expected {want}")
        elif world_size > 1:  # uneven chunks: zig-zag within one token row/column of balance, contiguous far off
            ratio = {kind: max(w) / min(w) for kind, w in work.items()}
            assert ratio["zigzag"] < ratio["contiguous"], f"T={seq_len}: max/min work per rank {ratio} ({work})"


@pytest.mark.exercise("5.2-5.3")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_attention_matches_single_process_sdpa(world_size):
    run_distributed(_worker_ring, world_size, backend="gloo")


# --------------------------------------------------------------------------- 5.4 Ulysses
U_HEADS = 12  # divisible by 1, 2, 3 and 4


def _worker_ulysses(rank, world_size, device="cpu"):  # tests/test_gpu.py: "cuda" on NCCL
    ul = load(PHASE, "ulysses")
    for seq_len in (EVEN_T, UNEVEN_T):
        what = f"rank {rank} of {world_size}, Ulysses, {seq_len} tokens"
        whole = [t.to(device) for t in _whole(seq_len, heads=U_HEADS, batch=1, dim=4)]
        ref = _baseline(*whole)
        pos = torch.arange(seq_len).tensor_split(world_size)[rank]
        seq_lens = [len(p) for p in torch.arange(seq_len).tensor_split(world_size)]
        q, k, v = (t[:, :, pos].clone().requires_grad_() for t in whole[:3])
        ledger = CommLedger()
        with ledger:
            out = ul.ulysses_attention(q, k, v, seq_lens)
            out.backward(whole[3][:, :, pos])
        _compare_rows(what, pos, out, (q.grad, k.grad, v.grad), ref)
        # Payloads: forward Q, K, V of my tokens (3*H*T_r) and the output of my heads ((H/W)*T);
        # backward dO of my tokens (H*T_r) and dQ, dK, dV of my heads (3*(H/W)*T). float64, B=1, D=4.
        want = 0 if world_size == 1 else 4 * (U_HEADS * len(pos) + U_HEADS // world_size * seq_len) * 4 * 8
        calls = 0 if world_size == 1 else 4
        assert_equal((ledger.calls("all_to_all_single"), ledger.bytes("all_to_all_single")), (calls, want),
                     f"{what}: {ledger.summary()}, expected {calls} all-to-alls of {want} B in all")
    if world_size == 3:
        q = torch.zeros(1, 4, 8, 4)
        with pytest.raises(ValueError, match=r"number of attention heads 4 is not divisible by .* 3 \(4 = 1 \* 3 \+ 1\)"):
            ul.ulysses_attention(q, q, q, [8] * 3)


@pytest.mark.exercise("5.4")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ulysses_attention_matches_single_process_sdpa(world_size):
    run_distributed(_worker_ulysses, world_size, backend="gloo")


def _worker_ulysses_subgroup(rank, world_size):
    """Two Ulysses groups in a world of 4: global ranks [0, 1] and [2, 3]; in the second a global rank
    is not the group rank (rank 2 is rank 0 of its group)."""
    ul = load(PHASE, "ulysses")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    group, members = groups[rank // 2], [[0, 1], [2, 3]][rank // 2]
    group_rank = members.index(rank)
    whole = _whole(UNEVEN_T, heads=U_HEADS, batch=1, dim=4)
    ref = _baseline(*whole)
    parts = torch.arange(UNEVEN_T).tensor_split(2)  # 7 and 6 tokens: uneven split sizes
    pos = parts[group_rank]
    what = f"global rank {rank} (rank {group_rank} of group {members}), Ulysses, {UNEVEN_T} tokens"
    q, k, v = (t[:, :, pos].clone().requires_grad_() for t in whole[:3])
    with explain_group_errors(group, what), explain_wrong_group(group, what):
        out = ul.ulysses_attention(q, k, v, [len(p) for p in parts], group=group)
        out.backward(whole[3][:, :, pos])
    _compare_rows(what, pos, out, (q.grad, k.grad, v.grad), ref)


@pytest.mark.exercise("5.4")
def test_ulysses_on_a_subgroup_matches_single_process_sdpa():
    """Ranks [2, 3] of a world of 4 as their own context-parallel group: group ranks, not global ones."""
    run_distributed(_worker_ulysses_subgroup, 4, backend="gloo")
