"""RUN_MODE=zero: train TinyGPT with ZeRO stage 1, 2 or 3 and print per-rank memory and traffic.

    RUN_MODE=zero ./entrypoint.sh --stage 3 [--compute-dtype bfloat16] [--steps 40]
    IMPL=templates RUN_MODE=zero ./entrypoint.sh --stage 1   # your template_zero.py (2: also; 3: template_fsdp.py)
    RUN_MODE=zero ./entrypoint.sh --stage 2 --offload-optimizer cpu       # ZeRO-Offload
    RUN_MODE=zero ./entrypoint.sh --deepspeed-config configs/zero2_offload.json

Stages 1 and 2 run ``ZeroOptimizer`` (phase3_multi_node/zero.py), stage 3
``FullyShardedDataParallel`` (phase3_multi_node/fsdp.py). The summary shows, per rank,
the bytes held for parameters, gradients and optimizer state (compare the fractions
with phase3_multi_node/guidelines_ddp_zero.md#memory-math) and the bytes each
collective moved per step.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from demos.sizes import positive
from distlab.comm import CommLedger
from distlab.data import synthetic_tokens
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress, sync_device
from distlab.models import GPTConfig, TinyGPT
from distlab.todo import run_demo
from distlab.lessons.zero_config import load_zero_config

PHASE = "phase3_multi_node"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="ZeRO-1/2/3 training of TinyGPT on synthetic tokens.")
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="stage 3 only: dtype of the gathered parameters")
    parser.add_argument("--offload-optimizer", choices=["none", "cpu"], default="none",
                        help="stages 1-2: optimizer state and step on the CPU (ZeRO-Offload)")
    parser.add_argument("--deepspeed-config", metavar="PATH", help="DeepSpeed-style JSON (distlab/lessons/zero_config.py): its "
                        "stage, offload, bucket size, bf16, batch, accumulation and optimizer replace the flags")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Nothing here depends on the world size (each rank draws its own --batch sequences)."""
    positive(args, "--steps", "--batch")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        ds, accum = None, 1
        if args.deepspeed_config:
            ds = load_zero_config(args.deepspeed_config, env.world_size)
            if ds.stage == 0 or (ds.dtype != "float32" and ds.stage < 3) or ds.dtype == "float16":
                raise ValueError(f"{args.deepspeed_config}: stage {ds.stage} with {ds.dtype}: this demo runs "
                                 "stages 1-3 in float32, or 3 in bfloat16 (demos/imagenet.py: stage 0, bf16, fp16)")
            args.stage, args.batch, accum = ds.stage, ds.micro_batch_size, ds.gradient_accumulation_steps
            args.compute_dtype = ds.dtype
        if args.offload_optimizer != "none" and args.stage == 3:
            raise ValueError("--offload-optimizer: stages 1-2 only (the course's FSDP does not offload)")
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
        torch.manual_seed(env.rank)  # construction broadcasts rank 0's weights
        model = TinyGPT(cfg).to(env.device)
        opt, kw = (ds.optimizer_class, ds.optimizer_kwargs) if ds and ds.optimizer_class else \
            (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1))
        if args.stage == 3:
            dtype = torch.bfloat16 if args.compute_dtype == "bfloat16" else None
            zero = load(PHASE, "fsdp").FullyShardedDataParallel(model, compute_dtype=dtype,
                                                                **(ds.fsdp_kwargs() if ds else {}))
            optimizer, forward = opt(zero.parameters(), **kw), zero  # a torch optimizer on the flat shards
        else:
            offload = None if args.offload_optimizer == "none" else args.offload_optimizer
            zkw = ds.zero_kwargs() if ds else dict(stage=args.stage, offload_device=offload)
            zero = load(PHASE, "zero").ZeroOptimizer(model.parameters(), opt, **{"bucket_size_mb": 0.25, **zkw}, **kw)
            optimizer, forward = zero, model  # ZeroOptimizer is the optimizer
        inputs, targets = synthetic_tokens(n_seq=1024, seq_len=cfg.block_size, vocab_size=cfg.vocab_size).tensors
        g = torch.Generator().manual_seed(1234 + env.rank)  # each rank draws its own sequences
        ledger = CommLedger()
        log0(f"ZeRO-{args.stage}: {env.world_size} ranks ({env.backend}), TinyGPT "
             f"{sum(p.numel() for p in model.parameters()) if args.stage < 3 else 'sharded'} params")
        start, first_loss = time.perf_counter(), None
        for step in progress(range(args.steps), desc=f"ZeRO-{args.stage}"):
            optimizer.zero_grad()
            with ledger:
                for _ in range(accum):  # gradient_accumulation_steps backwards add up before one step
                    idx = torch.randint(len(inputs), (args.batch,), generator=g)
                    x, y = inputs[idx].to(env.device), targets[idx].to(env.device)
                    logits = forward(x)
                    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    (loss / accum).backward()
                optimizer.step()
            first_loss = loss.item() if first_loss is None else first_loss
        sync_device(env.device)  # CUDA work is queued: time it when it is done
        elapsed = time.perf_counter() - start
        mem, peak = zero.memory_bytes(), zero.memory.peak  # at rest, and the peak sampled at every hook
        row = {"rank": env.rank, **{k: format_bytes(v) for k, v in mem.items()},
               **{f"peak {k}": format_bytes(v) for k, v in peak.items()}}
        if zero.overlap.history:  # stage 2/3: when the first reduce-scatter started in the last backward
            last = zero.overlap.history[-1]
            row["first reduce-scatter at hook"] = f"{last['first_launch_hook']}/{last['hooks']}"
        if zero.memory.peak_cuda:
            row["cuda max allocated"] = format_bytes(zero.memory.peak_cuda)
        rows = [None] * env.world_size
        dist.all_gather_object(rows, row)
        log0("\n" + format_table(rows))
        traffic = {op: format_bytes(v["bytes"] / args.steps) for op, v in ledger.summary().items()}
        log0("\n" + format_table([{"stage": args.stage, "loss first -> last": f"{first_loss:.3f} -> {loss.item():.3f}",
                                   "step ms": f"{1000 * elapsed / args.steps:.1f}",
                                   **{f"{op}/step": b for op, b in traffic.items()}}]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
