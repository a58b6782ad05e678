"""Phase 5: expert parallelism (exercises 5.5-5.8) against a single-process mixture of experts.

Every rank rebuilds every rank's tokens and the whole layer (all E experts), computes the
single-process MoE on the concatenated tokens with a deliberately naive reference (a
Python loop over (slot, token) pairs in the global priority order), runs the
expert-parallel layer on its own tokens, and compares outputs, the load-balancing loss,
gradients, tokens per expert and the bytes of every collective. The code under test
comes from ``load(...)``: the solutions by default, the templates with ``--impl templates``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab import load
from distlab.comm import ALL_GATHER_SINGLE, CommLedger
from distlab.spawn import run_distributed
from distlab.testing import assert_equal, assert_tensors_close

PHASE = "phase5_large_models"
WORLD_SIZES = [1, 2, 3, 4]
D, H, E, K = 6, 5, 12, 2          # E = 12 divides by 1, 2, 3 and 4
TOKENS = [7, 3, 0, 9]              # tokens on ranks 0..3: uneven, and a rank with none at W >= 3
CAPACITY_FACTORS = [0.5, 6.0]      # 0.5: many drops; E / K = 6: C = N, nothing can drop
COEF = 0.01
# float64: the distributed layer sums the same terms in another order (index_add, the
# all-reduce of the router's gradient shares): ~1e-16 per op; 1e-10 still catches a
# missing gate, a pair counted twice or a gradient sent to the wrong rank (all O(1e-2+)).
TOL = dict(rtol=1e-10, atol=1e-10)


def _reference_keep(choices: list[list[int]], num_experts: int, capacity: int):
    """GShard priority, spelled out: slot 0 of every token (global order), then slot 1, ...;
    a pair is kept while its expert has accepted fewer than ``capacity``."""
    filled = [0] * num_experts
    keep = [[False] * len(c) for c in choices]
    for s in range(len(choices[0]) if choices else 0):
        for t, c in enumerate(choices):
            if filled[c[s]] < capacity:
                keep[t][s] = True
                filled[c[s]] += 1
    return keep, filled


def _reference_moe(x, router_w, w1, w2, top_k, capacity_factor, coef):
    """Single-process MoE on all N tokens: output, Switch's L_aux, keep, kept pairs per expert."""
    n, num_experts = x.shape[0], w1.shape[0]
    probs = (x @ router_w.T).softmax(dim=-1)
    gates, idx = probs.topk(top_k, dim=-1)
    capacity = math.ceil(capacity_factor * top_k * n / num_experts)
    keep, filled = _reference_keep(idx.tolist(), num_experts, capacity)
    rows = []
    for t in range(n):
        y = x.new_zeros(x.shape[1])
        for s in range(top_k):
            if keep[t][s]:
                e = int(idx[t, s])
                y = y + gates[t, s] * (torch.relu(x[t] @ w1[e]) @ w2[e])
        rows.append(y)
    out = torch.stack(rows)
    f = torch.bincount(idx.reshape(-1), minlength=num_experts).to(x.dtype) / (top_k * n)  # Switch eq. 4
    aux = coef * num_experts * (f * probs.mean(dim=0)).sum()
    return out, aux, torch.tensor(keep), filled


# --------------------------------------------------------------------------- 5.5 all-to-all
def _splits(world_size: int) -> list[list[int]]:
    """S[i][j]: rows rank i sends to rank j; uneven, with zeros (including to itself)."""
    return [[(3 * i + 2 * j + 1) % 4 for j in range(world_size)] for i in range(world_size)]


def _worker_all_to_all(rank, world_size):
    prim = load(PHASE, "moe_primitives")
    S = _splits(world_size)
    inputs = [torch.randn(sum(S[i]), 3, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
              for i in range(world_size)]
    upstream = [torch.randn(sum(S[i][j] for i in range(world_size)), 3, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(100 + j)) for j in range(world_size)]
    x = inputs[rank].clone().requires_grad_()
    in_splits = S[rank]
    out_splits = [S[i][rank] for i in range(world_size)]
    ledger = CommLedger()
    with ledger:
        out = prim.all_to_all_single(x.new_empty(sum(out_splits), 3), x * 1, out_splits, in_splits)
        out.backward(upstream[rank])
    # Expected: block `rank` of every source, in source order; a pure copy, so bitwise.
    expected = torch.cat([inputs[i].split(S[i])[rank] for i in range(world_size)])
    assert_tensors_close(out, expected, f"rank {rank}: all-to-all output", rtol=0, atol=0)
    # d out_j / d x_rank: block j of my input became block `rank` of rank j's output.
    expected_grad = torch.cat([upstream[j].split([S[i][j] for i in range(world_size)])[rank]
                               for j in range(world_size)])
    assert_tensors_close(x.grad, expected_grad, f"rank {rank}: gradient of the all-to-all input", rtol=0, atol=0)
    sizes = [r.nbytes for r in ledger.records]
    assert_equal(([r.op for r in ledger.records], sizes), (["all_to_all_single"] * 2, [x.nbytes, out.nbytes]),
                 f"rank {rank}: expected one all-to-all of {x.nbytes} B forward and {out.nbytes} B backward, "
                 f"got {ledger.summary()}")


@pytest.mark.exercise("5.5")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_uneven_matches_hand_computed_blocks_and_transpose(world_size):
    run_distributed(_worker_all_to_all, world_size)


# --------------------------------------------------------------------------- 5.6 capacity
@pytest.mark.exercise("5.6")
def test_capacity_keep_matches_global_priority_loop():
    moe = load(PHASE, "moe")
    for world_size in WORLD_SIZES:  # no communication: the ranks are simulated in one process
        tokens = TOKENS[:world_size]
        g = torch.Generator().manual_seed(world_size)
        # Few experts and a skewed router: queues overflow at every capacity below.
        choices = [torch.randn(n, 4, generator=g).add(torch.tensor([1.5, 0.5, 0.0, -1.0])).topk(K, dim=-1).indices
                   for n in tokens]
        all_counts = torch.stack([torch.stack([torch.bincount(c[:, s], minlength=4) for s in range(K)])
                                  for c in choices])
        for capacity in (0, 1, 3, sum(tokens)):
            expected, _ = _reference_keep(torch.cat(choices).tolist(), 4, capacity)
            got = torch.cat([moe.capacity_keep(c, all_counts, r, capacity) for r, c in enumerate(choices)])
            assert_tensors_close(got, torch.tensor(expected, dtype=torch.bool),
                                 f"W={world_size} tokens {tokens} capacity {capacity}: keep {got.int().tolist()} "
                                 f"!= expected {torch.tensor(expected).int().tolist()} (priority: slot, then rank, "
                                 "then token)", rtol=0, atol=0)  # a dtype other than bool fails too


# --------------------------------------------------------------------------- 5.6-5.8 the layer
def _worker_moe(rank, world_size, device="cpu"):  # tests/test_gpu.py: "cuda" on NCCL
    moe = load(PHASE, "moe")
    tokens = TOKENS[:world_size]
    mine = slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    per_rank = E // world_size
    my_experts = slice(rank * per_rank, (rank + 1) * per_rank)
    for cf in CAPACITY_FACTORS:
        what = f"rank {rank} of {world_size}, capacity factor {cf}"
        torch.manual_seed(0)  # every rank: the same router, experts, tokens and upstream gradient
        router = nn.Linear(D, E, bias=False).double().to(device)
        experts = moe.Experts(E, D, H).double().to(device)
        x_all = torch.randn(sum(tokens), D, dtype=torch.float64).to(device)
        upstream = torch.randn(sum(tokens), D, dtype=torch.float64).to(device)
        # single process, every token
        ref_x = x_all.clone().requires_grad_()
        ref_params = [router.weight.detach().clone().requires_grad_(), experts.w1.detach().clone().requires_grad_(),
                      experts.w2.detach().clone().requires_grad_()]
        ref_out, ref_aux, ref_keep, ref_filled = _reference_moe(ref_x, *ref_params, K, cf, COEF)
        ((ref_out * upstream).sum() + ref_aux).backward()
        # expert parallel: my tokens, my experts
        layer = moe.ExpertParallelMoE(copy.deepcopy(router), experts, top_k=K, capacity_factor=cf, aux_loss_coef=COEF)
        assert_equal(layer.experts.w1.shape[0], per_rank, f"{what}: holds {layer.experts.w1.shape[0]} experts, not E/W")
        x = x_all[mine].clone().requires_grad_()
        ledger = CommLedger()
        with ledger:
            out, aux = layer(x)
            ((out * upstream[mine]).sum() + aux).backward()
        assert_tensors_close(out, ref_out[mine], f"{what}: MoE output", **TOL)
        aux_total = aux.detach().clone()
        dist.all_reduce(aux_total)  # the shares sum to Switch's L_aux
        assert_tensors_close(aux_total, ref_aux.detach(), f"{what}: sum of the load-balancing shares", **TOL)
        assert_tensors_close(x.grad, ref_x.grad[mine], f"{what}: gradient of the tokens", **TOL)
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # replicated: each rank holds its tokens' share
        assert_tensors_close(router_grad, ref_params[0].grad, f"{what}: router gradient (summed over ranks)", **TOL)
        for name, ref in zip(("w1", "w2"), ref_params[1:]):
            assert_tensors_close(getattr(layer.experts, name).grad, ref.grad[my_experts],
                                 f"{what}: gradient of experts.{name} (experts {my_experts.start}..{my_experts.stop - 1})", **TOL)
        # Tokens per expert and drops, against the reference's queue.
        stats = layer.stats
        kept_here = int(ref_keep[mine].sum())
        received = sum(ref_filled[my_experts])
        assert_equal(stats.tokens_per_expert.tolist(), ref_filled[my_experts],
                     f"{what}: tokens per expert {stats.tokens_per_expert.tolist()} != {ref_filled[my_experts]}")
        assert_equal(stats.dropped, K * tokens[rank] - kept_here,
                     f"{what}: dropped {stats.dropped}, expected {K * tokens[rank] - kept_here}")
        if cf == CAPACITY_FACTORS[-1]:
            assert_equal(bool(ref_keep.all()), True, "capacity C = N must keep every pair")
        else:
            assert_equal(bool(ref_keep.all()), False, f"{what}: the test meant to drop pairs but nothing dropped")
        # Bytes: counts all-gather (k*E int64), counts all-to-all (E int64), then the tokens:
        # dispatch sends my kept pairs, combine sends what my experts received; backward swaps.
        row = D * 8
        expected = [(ALL_GATHER_SINGLE, K * E * 8), ("all_to_all_single", E * 8),
                    ("all_to_all_single", kept_here * row), ("all_to_all_single", received * row),
                    ("all_to_all_single", kept_here * row), ("all_to_all_single", received * row)]
        got = [(r.op, r.nbytes) for r in ledger.records]
        assert_equal(got, expected, f"{what}: collectives {got}, expected {expected} "
                                    f"({kept_here} pairs sent, {received} received, {row} B per row)")


@pytest.mark.exercise("5.6-5.8")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_expert_parallel_moe_matches_single_process(world_size):
    run_distributed(_worker_moe, world_size)


# --------------------------------------------------------------------------- given code
@pytest.mark.scaffold
def test_experts_not_divisible_by_world_size_is_a_clear_error():
    moe = load(PHASE, "moe")
    assert moe.experts_per_rank(12, 4) == 3
    with pytest.raises(ValueError, match=r"num_experts 6 is not divisible by expert-parallel size.* 4 \(6 = 1 \* 4 \+ 2\)"):
        moe.experts_per_rank(6, 4)


@pytest.mark.scaffold
def test_load_balancing_shares_sum_to_switch_formula():
    moe = load(PHASE, "moe")
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(10, 4, generator=g, dtype=torch.float64).softmax(-1)
    idx = probs.topk(K, dim=-1).indices
    f = torch.bincount(idx.reshape(-1), minlength=4).double() / (K * 10)
    expected = COEF * 4 * (f * probs.mean(0)).sum()  # Fedus et al. 2021, eq. 4
    parts = [slice(0, 3), slice(3, 3), slice(3, 10)]
    all_counts = torch.stack([torch.stack([torch.bincount(idx[p, s], minlength=4) for s in range(K)]) for p in parts])
    shares = sum(moe.load_balancing_loss(probs[p], all_counts, 10, COEF) for p in parts)
    assert_tensors_close(shares, expected, "sum of 3 ranks' shares", rtol=1e-12, atol=0)
    uniform = torch.full((8, 4), 0.25, dtype=torch.float64)
    balanced = torch.full((1, K, 4), 4)  # 8 tokens x 2 choices spread evenly
    assert_tensors_close(moe.load_balancing_loss(uniform, balanced, 8, COEF), torch.tensor(COEF, dtype=torch.float64),
                         "perfectly balanced router", rtol=1e-12, atol=0)
