"""Context parallelism on one long sequence: ring attention (contiguous, zig-zag) and Ulysses.

Every rank builds the same whole sequence (Q, K, V and an output gradient) and runs
torch's causal ``scaled_dot_product_attention`` on it: the single-process baseline.
Then each strategy runs on this rank's tokens, forward and backward, and the table
shows, per strategy: the median time of a forward+backward (slowest rank), the bytes
each rank sends (most of any rank), the attention scores each rank computes (fewest
and most: the causal load balance) and the largest difference from the baseline
(output and dQ/dK/dV, over all ranks).

    NPROC=4 RUN_MODE=context_parallel ./entrypoint.sh                        # 2048 tokens, 4 ranks
    NPROC=4 RUN_MODE=context_parallel ./entrypoint.sh --seq-len 4096 --heads 4
    IMPL=templates NPROC=4 RUN_MODE=context_parallel ./entrypoint.sh         # your templates

``python -m demos.context_parallel`` runs it as one rank (no communication).
See phase5_large_models/guidelines_context.md.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from demos.sizes import at_least, multiple_of, positive
from distlab.comm import CommLedger
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, median, sync_device, time_repeats
from distlab.todo import run_demo

PHASE = "phase5_large_models"


def _gather_ints(value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, in rank order (collective)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(v) for v in every]


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None,
                        help="default: 8, rounded up to a multiple of the ranks (Ulysses splits the heads)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Heads that Ulysses splits over ``world_size`` ranks; tokens for the zig-zag's 2W chunks."""
    positive(args, "--batch", "--head-dim", "--repeats")
    at_least(args.seq_len, 2 * world_size, "--seq-len", f" (the zig-zag split cuts it into 2 x {world_size} chunks)")
    args.heads = multiple_of(args.heads, 8, world_size, "--heads", "the number of ranks")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ring = load(PHASE, "ring_attention")
    ulysses = load(PHASE, "ulysses")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        W, rank = env.world_size, env.rank
        contiguous = ring.sequence_layout(args.seq_len, W, "contiguous")
        zigzag = ring.sequence_layout(args.seq_len, W, "zigzag")
        seq_lens = [p.numel() for p in contiguous]
        torch.manual_seed(0)  # every rank: the same whole sequence
        shape = (args.batch, args.heads, args.seq_len, args.head_dim)
        Q, K, V, dO = (torch.randn(shape).to(env.device) for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (Q, K, V)]
        ref = F.scaled_dot_product_attention(*whole, is_causal=True)
        ref.backward(dO)
        ref_grads = [t.grad for t in whole]
        ref_time = median(time_repeats(lambda: F.scaled_dot_product_attention(
            *[t.detach().requires_grad_() for t in (Q, K, V)], is_causal=True).backward(dO), args.repeats,
            sync=lambda: sync_device(env.device)))

        T, H = args.seq_len, args.heads
        strategies = {
            "ring, contiguous": (contiguous, lambda q, k, v, stats: ring.ring_attention(q, k, v, contiguous, stats=stats)),
            "ring, zig-zag": (zigzag, lambda q, k, v, stats: ring.ring_attention(q, k, v, zigzag, stats=stats)),
            "Ulysses": (contiguous, lambda q, k, v, stats: ulysses.ulysses_attention(q, k, v, seq_lens)),
        }
        rows = [{"strategy": "one process (every token)", "fwd+bwd": f"{ref_time * 1e3:.1f} ms",
                 "sent/rank": "0 B", "scores/rank (min..max)": f"{H * T * (T + 1) // 2:,} (causal half)",
                 "max/mean": "-", "max |diff|": "-"}]
        for name, (layout, fn) in strategies.items():
            pos = layout[rank]

            def step(stats=None):
                q, k, v = (t[:, :, pos].clone().requires_grad_() for t in (Q, K, V))
                out = fn(q, k, v, stats)
                out.backward(dO[:, :, pos])
                return out, (q.grad, k.grad, v.grad)

            stats, ledger = {}, CommLedger()
            with ledger:
                out, grads = step(stats)
            diff = max([(out - ref[:, :, pos]).abs().max().item()]
                       + [(g - r[:, :, pos]).abs().max().item() for g, r in zip(grads, ref_grads)])
            seconds = _max_over_ranks(median(time_repeats(step, args.repeats, sync=lambda: (
                sync_device(env.device), dist.barrier()))), env.device)
            # Ring: scores computed, all heads. Ulysses: its H/W heads of whole causal rows
            # (a causal kernel skips the masked half), the same on every rank by construction.
            scores = stats["score_elements"] * H if "score_elements" in stats else (H // W) * T * (T + 1) // 2
            work = _gather_ints(scores, env.device)
            rows.append({"strategy": f"{name} ({W} ranks)", "fwd+bwd": f"{seconds * 1e3:.1f} ms",
                         "sent/rank": format_bytes(_max_over_ranks(ledger.wire_bytes(), env.device)),
                         "scores/rank (min..max)": f"{min(work):,}..{max(work):,}",
                         "max/mean": f"{max(work) / (sum(work) / W):.2f}",
                         "max |diff|": f"{_max_over_ranks(diff, env.device):.1e}"})
        log0(f"context parallelism: causal attention, batch {args.batch} x {H} heads x {T} tokens x "
             f"{args.head_dim}, float32, {W} rank(s)")
        log0(format_table(rows))
        log0("sent/rank (n = B*H*T*D*4 bytes): ring = K/V blocks twice + dK/dV accumulators, "
             "(4(W-1)/W + 2) n, whatever W; Ulysses = 4 all-to-alls, 8 n/W * (W-1)/W, shrinking with W")
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
