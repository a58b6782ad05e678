"""RUN_MODE=expert_parallel: a tiny mixture-of-experts model trained with E/W experts per rank.

    RUN_MODE=expert_parallel ./entrypoint.sh [--steps 40] [--experts 4] [--capacity-factor 1.25]
    NPROC=4 RUN_MODE=expert_parallel ./entrypoint.sh --experts 8
    IMPL=templates RUN_MODE=expert_parallel ./entrypoint.sh   # your template_moe.py

Model: embedding -> residual MoE layer (top-k router, capacity, E two-layer FFN experts)
-> linear head, on a synthetic token task (each token's target is a fixed random
permutation of it). Every step draws one global batch; rank r takes its slice (sizes
may differ by one). The replicated parameters (embedding, router, head) get their
gradient shares summed over ranks; each expert's gradient is complete on its owner.
Rank 0 also trains the same model as a single process (all E experts, the whole batch,
a group of one rank) and prints:

* the loss curves of both runs and their largest difference (float64 by default: the
  routing then takes the same decisions in both runs; in float32 a near tie can flip);
* tokens per expert over the run (routed and kept), a histogram in
  runs/expert_parallel/tokens_per_expert.png;
* the dropped fraction of (token, slot) pairs against the capacity factor;
* bytes per step and rank, measured by CommLedger and predicted by the formula.

``python -m demos.expert_parallel`` runs it as one rank. See
phase5_large_models/guidelines_experts.md.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from demos.sizes import multiple_of, positive
from distlab.comm import CommLedger
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0
from distlab.todo import run_demo

CAPACITY_SWEEP = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0]


class TinyMoEModel(nn.Module):
    """tokens -> embedding -> h + MoE(h) -> logits; returns (logits, this rank's aux-loss share)."""

    def __init__(self, embed: nn.Embedding, moe_layer: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.embed, self.moe, self.head = embed, moe_layer, head

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)
        y, aux = self.moe(h)
        return self.head(h + y), aux


def build(args, moe, group, dtype) -> TinyMoEModel:
    torch.manual_seed(0)  # every rank and both runs: the same initial model
    embed, head = nn.Embedding(args.vocab, args.d_model), nn.Linear(args.d_model, args.vocab)
    router, experts = nn.Linear(args.d_model, args.experts, bias=False), moe.Experts(args.experts, args.d_model, args.d_hidden)
    layer = moe.ExpertParallelMoE(router.to(dtype), experts.to(dtype), top_k=args.top_k,
                                  capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_coef, group=group)
    return TinyMoEModel(embed.to(dtype), layer, head.to(dtype))


def batch(step: int, args, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(args.vocab, (args.batch,), generator=torch.Generator().manual_seed(1000 + step))
    return tokens, perm[tokens]


def train_step(model, optimizer, tokens, targets, num_tokens, group) -> float:
    """One step on this rank's tokens; returns the global loss (main + aux)."""
    optimizer.zero_grad(set_to_none=True)
    logits, aux = model(tokens)
    loss = F.cross_entropy(logits, targets, reduction="sum") / num_tokens + aux  # shares sum to the global loss
    loss.backward()
    if dist.get_world_size(group) > 1:
        for name, p in model.named_parameters():
            if not name.startswith("moe.experts."):  # replicated: sum the shares (experts live on one rank)
                dist.all_reduce(p.grad, group=group)
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Expert parallelism: E/W experts per rank vs one process.")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64, help="tokens per step, all ranks together")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--d-hidden", type=int, default=32)
    parser.add_argument("--experts", type=int, default=None,
                        help="number of experts E, a multiple of the ranks (default: 4, rounded up to one)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--aux-coef", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--out-dir", default="runs/expert_parallel")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Experts that divide over ``world_size`` ranks, at least --top-k of them."""
    positive(args, "--steps", "--batch", "--top-k")
    args.experts = multiple_of(args.experts, max(4, args.top_k), world_size, "--experts", "the number of ranks")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k {args.top_k} is more than the {args.experts} experts (--experts): "
                         f"use --top-k {args.experts} or fewer")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        moe = load("phase5_large_models", "moe")
        W, rank, dtype = env.world_size, env.rank, getattr(torch, args.dtype)
        single_group, _ = dist.new_subgroups(group_size=1)  # every rank: a group of itself
        perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(7))
        model = build(args, moe, None, dtype).to(env.device)
        single = build(args, moe, single_group, dtype).to(env.device) if rank == 0 else None
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        single_opt = torch.optim.Adam(single.parameters(), lr=args.lr) if single else None
        layer, ledger = model.moe, CommLedger()
        curves = {f"expert parallel (W={W})": [], "single process": []}
        routed = torch.zeros(args.experts, dtype=torch.int64, device=env.device)
        kept = torch.zeros(args.experts // W, dtype=torch.int64, device=env.device)
        predicted = []
        log0(f"expert parallel: {args.experts} experts, {args.experts // W} per rank on {W} ranks ({env.backend}), "
             f"top-{args.top_k}, capacity factor {args.capacity_factor}, {args.batch} tokens/step, {args.dtype}")
        for step in range(args.steps):
            tokens, targets = (t.to(env.device) for t in batch(step, args, perm))
            mine = torch.tensor_split(torch.arange(args.batch), W)[rank]
            ledger.reset()
            with ledger:
                curves[f"expert parallel (W={W})"].append(
                    train_step(model, opt, tokens[mine], targets[mine], args.batch, None))
            s = layer.stats
            routed += s.routed_per_expert
            kept += s.tokens_per_expert
            # count all-gather + count all-to-all + dispatch and combine, forward and backward
            predicted.append((args.top_k + 1) * args.experts * 8 + 2 * (s.sent_rows + s.received_rows) * args.d_model
                             * torch.finfo(dtype).bits // 8)
            if single:
                curves["single process"].append(train_step(single, single_opt, tokens, targets, args.batch, single_group))
        a2a = ledger.bytes("all_to_all_single") + ledger.bytes("all_gather_single")
        per_rank = torch.tensor([a2a, predicted[-1]], dtype=torch.int64, device=env.device)
        every = [torch.zeros_like(per_rank) for _ in range(W)]
        dist.all_gather(every, per_rank)
        kept_all = [torch.zeros_like(kept) for _ in range(W)]
        dist.all_gather(kept_all, kept)
        kept_all = torch.cat(kept_all)

        # Dropped fraction against the capacity factor, on one fresh batch (no training).
        sweep = []
        tokens = batch(10_000, args, perm)[0].to(env.device)
        mine = torch.tensor_split(torch.arange(args.batch), W)[rank]
        with torch.no_grad():
            for cf in CAPACITY_SWEEP:
                layer.capacity_factor = cf
                model(tokens[mine])
                dropped = torch.tensor(layer.stats.dropped, device=env.device)
                dist.all_reduce(dropped)
                sweep.append((cf, dropped.item() / (args.top_k * args.batch)))
        layer.capacity_factor = args.capacity_factor

        if rank == 0:
            ours, theirs = curves[f"expert parallel (W={W})"], curves["single process"]
            diff = max(abs(a - b) for a, b in zip(ours, theirs))
            log0(format_table([{"run": name, "first loss": f"{c[0]:.4f}", "final loss": f"{c[-1]:.4f}"}
                               for name, c in curves.items()]))
            log0(f"largest |loss difference| over {args.steps} steps: {diff:.2e}")
            log0("\ntokens per expert over the run ((token, slot) pairs; routed = chosen, kept = within capacity):")
            log0(format_table([{"expert": e, "rank": e // (args.experts // W), "routed": int(routed[e]),
                                "kept": int(kept_all[e]), "dropped": int(routed[e] - kept_all[e])}
                               for e in range(args.experts)]))
            log0("\ndropped fraction vs capacity factor (after training, one batch of "
                 f"{args.batch} tokens x top-{args.top_k}):")
            log0(format_table([{"capacity factor": cf, "capacity C": moe.expert_capacity(args.batch, args.experts,
                                                                                        args.top_k, cf),
                                "dropped": f"{frac:.1%}"} for cf, frac in sweep]))
            log0("\nbytes per step (last step; counts all-gather + all-to-alls, forward + backward):")
            log0(format_table([{"rank": r, "measured": format_bytes(int(m)), "formula": format_bytes(int(p)),
                                "match": "yes" if m == p else "NO"} for r, (m, p) in enumerate(every)]))
            from distlab.plots import plot_bars, plot_loss_curves

            out = Path(args.out_dir)
            paths = [plot_bars({f"e{e} (r{e // (args.experts // W)})": int(kept_all[e]) for e in range(args.experts)},
                               out / "tokens_per_expert.png", "kept (token, slot) pairs", "tokens per expert"),
                     plot_bars({str(cf): 100 * frac for cf, frac in sweep}, out / "dropped_vs_capacity.png",
                               "dropped pairs (%)", "dropped fraction vs capacity factor"),
                     plot_loss_curves(curves, out / "loss.png", "expert parallel vs single process")]
            log0("plots: " + ", ".join(map(str, paths)))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
