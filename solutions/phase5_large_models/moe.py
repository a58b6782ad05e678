"""Expert parallelism: a mixture-of-experts layer whose E experts live on W ranks, E/W each.

Each token is routed to its top-k experts (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch Transformer, Fedus et al. 2021). Expert e lives on rank e // (E/W), so a
token travels to the rank of each of its experts and back, in two all-to-alls:

    rank r:  tokens --router--> top-k experts, gates --capacity--> kept (token, expert) pairs
             sort the kept pairs by expert (= by destination rank)
             exchange counts      all_to_all_single of [E] int64 per rank
             dispatch             all_to_all_single of the token rows   (uneven splits)
             my E/W experts       run on the rows I received
             combine              all_to_all_single of the output rows  (splits swapped)
             out[t] = sum over t's kept slots of gate * expert output   (dropped slots add 0)

Capacity: expert e accepts at most C = ceil(capacity_factor * k * N / E) (token, slot)
pairs, N the tokens of ALL ranks; the rest are dropped (their slot adds nothing; the
residual connection around the layer carries the token). Priority is global and
GShard's: every first choice before any second choice; within a slot, tokens in global
order (rank 0's tokens, then rank 1's, ...). Because the rule is global, the layer at W
ranks equals the single-process layer on the concatenated tokens for every W, dropped
tokens included. (GShard and Megatron apply capacity per rank instead; its single-process
twin is the layer run on each rank's tokens separately.) It needs every rank's routing
counts: one all-gather of k*E int64 per rank, which also gives the global f_e of the
load-balancing loss.

Load-balancing loss (Switch Transformer, eq. 4): L_aux = alpha * E * sum_e f_e * P_e, with
f_e the fraction of the k*N routing choices that picked expert e and P_e the mean router
probability of e. Each rank returns its share, alpha * E * sum_e f_e * (sum of its tokens'
p_e) / N: the W shares sum to L_aux, and each share's gradient is exactly L_aux's gradient
with respect to that rank's router probabilities.

Cost per rank and step: forward sends k*E*8 (count all-gather) + E*8 (count exchange)
+ (kept pairs sent + kept pairs received) * d * bytes per element; backward the two
token all-to-alls again. See phase5_large_models/guidelines_experts.md.
Run: ``RUN_MODE=expert_parallel ./entrypoint.sh`` (demos/expert_parallel.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm import all_gather_single
from distlab.lessons.sync import check_divisible
from solutions.phase5_large_models.moe_primitives import all_to_all_single  # template: from torch.distributed.nn.functional import all_to_all_single  # torch's twin of exercise 5.5


def experts_per_rank(num_experts: int, world_size: int) -> int:
    """E / W, or a ValueError that shows the arithmetic."""
    return check_divisible(num_experts, world_size, "num_experts", "expert-parallel size (world size of `group`)")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * k * N / E): (token, slot) pairs one expert accepts per step."""
    return math.ceil(capacity_factor * top_k * num_tokens / num_experts)


def top_k_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router probabilities ``[N, E]``, gates ``[N, k]`` and experts ``[N, k]`` (best first).

    The gates are the chosen experts' softmax probabilities, not renormalised (Switch
    Transformer; Mixtral renormalises over the k), so the router also learns from the
    main loss when k = 1.
    """
    probs = logits.softmax(dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    return probs, gates, experts


def load_balancing_loss(probs: torch.Tensor, all_counts: torch.Tensor, num_tokens: int, coef: float) -> torch.Tensor:
    """This rank's share of Switch's L_aux = coef * E * sum_e f_e * P_e (shares sum over ranks to L_aux).

    ``all_counts[r, s, e]``: how many of rank r's tokens chose expert e as their s-th choice.
    """
    num_experts = probs.shape[-1]
    f = all_counts.sum(dim=(0, 1)).to(probs.dtype) / max(int(all_counts.sum()), 1)  # of the k*N choices
    return coef * num_experts * (f * probs.sum(dim=0)).sum() / max(num_tokens, 1)


def capacity_keep(experts: torch.Tensor, all_counts: torch.Tensor, rank: int, capacity: int) -> torch.Tensor:
    """Which of this rank's (token, slot) pairs fit in their expert's capacity, under global priority.

    Args:
        experts: ``[N_r, k]`` int64, this rank's routing choices (slot 0 = first choice).
        all_counts: ``[W, k, E]`` int64, every rank's routing counts (``all_counts[rank]``
            counts ``experts``).
        rank: this rank's index in ``all_counts``.
        capacity: C, pairs each expert accepts.

    Returns ``keep [N_r, k]`` bool. Equivalent to: walking the W ranks' pairs slot by slot
    (every slot-0 pair of every rank before any slot-1 pair), ranks in order, tokens in
    order, and keeping a pair while its expert has accepted fewer than C. No communication.
    """
    num_experts = all_counts.shape[2]
    # ### BEGIN SOLUTION 5.6: capacity and token dropping [guidelines_experts.md#capacity-and-dropping]
    # Goal: a pair's position in its expert's queue = the pairs for that expert that come earlier
    # in the global order (earlier slots of every rank, then this slot of earlier ranks, then
    # this slot of earlier tokens here); keep it iff position < capacity. Vectorised, no loop
    # over tokens: counts of earlier ranks and slots are sums over `all_counts`.
    per_slot = all_counts.sum(dim=0)                                       # [k, E], all ranks
    before = per_slot.cumsum(dim=0) - per_slot + all_counts[:rank].sum(dim=0)  # earlier slots; earlier ranks
    one_hot = F.one_hot(experts, num_experts)                              # [N_r, k, E]
    earlier_here = one_hot.cumsum(dim=0) - one_hot                         # earlier tokens, same slot
    position = (before.unsqueeze(0) + earlier_here).gather(2, experts.unsqueeze(2)).squeeze(2)
    return position < capacity
    # ### END SOLUTION 5.6


class Experts(nn.Module):
    """``num_experts`` two-layer ReLU feed-forward networks, stacked: w1 ``[E, d, h]``, w2 ``[E, h, d]``."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, d_model, d_hidden) * d_model ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, d_hidden, d_model) * d_hidden ** -0.5)

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def shard(self, first: int, count: int) -> Experts:
        """A new Experts holding copies of experts ``first .. first + count - 1``."""
        part = Experts(count, self.w1.shape[1], self.w1.shape[2]).to(self.w1.device, self.w1.dtype)
        with torch.no_grad():
            part.w1.copy_(self.w1[first:first + count])
            part.w2.copy_(self.w2[first:first + count])
        return part

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows in blocks: ``counts[i, j]`` rows for local expert j, blocks ordered (i, j) row-major."""
        num_local = self.num_experts
        sizes = counts.reshape(-1).tolist()
        blocks = rows.split(sizes)
        # One small matmul pair per (source rank, expert) block; production code permutes the
        # rows expert-major first and runs one grouped GEMM.
        outs = [torch.relu(b @ self.w1[i % num_local]) @ self.w2[i % num_local] for i, b in enumerate(blocks)]
        return torch.cat(outs) if outs else rows


@dataclass
class MoEStats:
    """What the last forward routed (for tests and the demo)."""

    capacity: int                   # C, per expert, this step
    routed_per_expert: torch.Tensor  # [E] (token, slot) pairs that chose each expert, all ranks
    tokens_per_expert: torch.Tensor  # [E/W] pairs my experts processed (kept), from all ranks
    sent_rows: int                  # kept pairs this rank dispatched
    received_rows: int              # rows this rank's experts received
    dropped: int                    # this rank's pairs over capacity


class ExpertParallelMoE(nn.Module):
    """A top-k mixture-of-experts layer with E/W experts per rank of ``group``.

    Args:
        router: ``nn.Linear(d, E, bias=False)``, replicated (every rank passes the same one).
        experts: all E experts (every rank passes the same); this rank keeps its E/W.
        top_k: experts per token. capacity_factor: C = ceil(cf * k * N / E), N over all ranks.
        aux_loss_coef: alpha of the load-balancing loss. group: the expert-parallel group.

    ``forward(x [N_r, d]) -> (out [N_r, d], aux)``: out[t] = sum over token t's kept slots
    of gate * expert(x[t]); aux is this rank's share of the load-balancing loss.
    Equivalent to: the same layer at W = 1 on every rank's tokens concatenated in rank
    order (its rows for this rank, and the sum of the W aux shares). The router's
    gradient is this rank's share: sum it over ranks (it is replicated, like DDP's);
    the experts' gradients are complete on their owner.
    Collective: every rank of ``group`` calls forward and backward (N_r may differ, even 0).
    Cost: see the module docstring.
    """

    def __init__(self, router: nn.Linear, experts: Experts, top_k: int = 2, capacity_factor: float = 1.25,
                 aux_loss_coef: float = 0.01, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_experts = experts.num_experts
        self.num_local = experts_per_rank(self.num_experts, self.world_size)
        if not 1 <= top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={self.num_experts}, got {top_k}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.top_k, self.capacity_factor, self.aux_loss_coef = top_k, capacity_factor, aux_loss_coef
        self.router = router
        self.experts = experts.shard(self.rank * self.num_local, self.num_local)
        self.stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group, W, E, k = self.group, self.world_size, self.num_experts, self.top_k
        num_tokens_here, d = x.shape
        probs, gates, experts = top_k_route(self.router(x), k)
        local_counts = torch.stack([torch.bincount(experts[:, s], minlength=E) for s in range(k)])  # [k, E]
        all_counts = torch.empty(W * k, E, dtype=torch.int64, device=x.device)
        all_gather_single(all_counts, local_counts, group=group)  # every rank's counts: k*E*8 B each
        all_counts = all_counts.view(W, k, E)
        num_tokens = int(all_counts[:, 0].sum())
        capacity = expert_capacity(num_tokens, E, k, self.capacity_factor)
        keep = capacity_keep(experts, all_counts, self.rank, capacity)
        aux = load_balancing_loss(probs, all_counts, num_tokens, self.aux_loss_coef)
        token_of = torch.arange(num_tokens_here, device=x.device).repeat_interleave(k)  # pair -> token
        expert_of = experts.reshape(-1)                                                  # pair -> expert
        # ### BEGIN SOLUTION 5.7: dispatch [guidelines_experts.md#dispatch-and-combine]
        # Goal: send each kept pair's token row to the rank that owns its expert (rank e // (E/W)),
        # grouped so that every rank receives, from each source, rows ordered by local expert.
        # Define for 5.8 and the code after it:
        #   order [P]        the kept pair ids (into token_of / expert_of), sorted by expert;
        #   send_splits      rows sent to each rank (list of W ints);
        #   recv_counts      [W, E/W] int64: rows received from rank i for local expert j;
        #   recv_splits      rows received from each rank (list of W ints);
        #   received         [sum(recv_splits), d], through the differentiable all_to_all_single.
        # Exchange the counts first (every rank must know what it receives before the tokens move).
        # Collective: every rank of `group`, two all-to-alls (counts, then tokens).
        kept = keep.reshape(-1).nonzero().squeeze(1)
        order = kept[torch.argsort(expert_of[kept], stable=True)]
        send_counts = torch.bincount(expert_of[order], minlength=E)      # [E] rows for each expert
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)      # E/W counts to each rank
        recv_counts = recv_counts.view(W, self.num_local)
        send_splits = send_counts.view(W, self.num_local).sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all_single(x.new_empty(sum(recv_splits), d), x[token_of[order]],
                                     recv_splits, send_splits, group=group)
        # ### END SOLUTION 5.7
        expert_out = self.experts(received, recv_counts)  # [sum(recv_splits), d], same row order
        # ### BEGIN SOLUTION 5.8: combine [guidelines_experts.md#dispatch-and-combine]
        # Goal: send every expert output row back to the rank its token came from (the dispatch
        # reversed), then out[t] = sum over t's kept pairs of gate * returned row; a token whose
        # pairs were all dropped gets zeros. `out` is [N_r, d], differentiable in x, router, experts.
        # Collective: every rank of `group`, one all-to-all.
        returned = all_to_all_single(x.new_empty(len(order), d), expert_out, send_splits, recv_splits, group=group)
        weighted = returned * gates.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x).index_add(0, token_of[order], weighted)
        # ### END SOLUTION 5.8
        self.stats = MoEStats(capacity, all_counts.sum(dim=(0, 1)), recv_counts.sum(dim=0), sum(send_splits),
                              sum(recv_splits), int((~keep).sum()))
        return out, aux
