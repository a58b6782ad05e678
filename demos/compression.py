"""Gradient compression hooks under torch DDP on digits: bytes per step and accuracy per method.

Trains the same seeded MLP (64-64-10, 4810 parameters) on scikit-learn's digits once
per method, with torch's ``DistributedDataParallel`` and the method's communication
hook (Phase 4's ``compression`` module: fp16/bf16 casts, top-k with error feedback,
PowerSGD), and prints the median bytes each rank sent per step (``CommLedger``) and
the test accuracy, next to the uncompressed fp32 all-reduce.

    RUN_MODE=compression ./entrypoint.sh                        # the reference solutions
    IMPL=templates RUN_MODE=compression ./entrypoint.sh         # your hooks (template_compression.py)
    RUN_MODE=compression ./entrypoint.sh --methods none topk --epochs 2

See phase4_production/guidelines.md#gradient-compression.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn

from demos.sizes import positive
from distlab.loader import load
from distlab.todo import run_demo

PHASE = "phase4_production"


def train_digits(method: str, rank: int, world_size: int, epochs: int = 4, global_batch: int = 64,
                 lr: float = 0.1, seed: int = 0, hook_and_state: tuple | None = None,
                 device: torch.device | str = "cpu") -> dict:
    """Train an MLP on digits under torch DDP with ``method``'s hook (or ``hook_and_state``).

    Returns the median bytes per step this rank sent through ``torch.distributed`` (hooks
    that start uncompressed, like torch's PowerSGD, count from their steady state) and
    the test accuracy.

    Collective: every rank must call it with the same arguments.
    """
    from distlab.comm import CommLedger
    from distlab.data import digits

    train, test = digits("train", flatten=True), digits("test", flatten=True)
    torch.manual_seed(seed)
    device = torch.device(device)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    hook, state = hook_and_state or load(PHASE, "compression").make_hook(method)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    x, y = (t.to(device) for t in train.tensors)
    per_rank = global_batch // world_size
    ledger, per_step = CommLedger(), []
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(y) - global_batch + 1, global_batch):
            idx = perm[start + rank * per_rank:start + (rank + 1) * per_rank]
            optimizer.zero_grad(set_to_none=True)
            with ledger:  # the hooks run inside backward
                nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            optimizer.step()
            per_step.append(ledger.bytes())
            ledger.reset()
    with torch.no_grad():
        x_test, y_test = (t.to(device) for t in test.tensors)
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return {"method": method, "bytes_per_step": statistics.median(per_step), "accuracy": accuracy,
            "steps": len(per_step)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Gradient compression hooks under torch DDP on digits.")
    parser.add_argument("--methods", nargs="+", default=["none", "fp16", "bf16", "topk", "powersgd"])
    parser.add_argument("--epochs", type=int, default=4)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Each rank takes 64 // world_size samples per step; the epochs must be positive."""
    positive(args, "--epochs")
    return args


def main(argv: list[str] | None = None) -> None:
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0

    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        rows = []
        for method in args.methods:
            result = train_digits(method, env.rank, env.world_size, epochs=args.epochs, device=env.device)
            rows.append(result)
            log0(f"{method:>9}: {format_bytes(result['bytes_per_step'])}/step, accuracy {result['accuracy']:.1%}")
        base = rows[0]["bytes_per_step"] if rows[0]["method"] == "none" else float("nan")
        log0("\n" + format_table([{"method": r["method"], "bytes/step/rank": format_bytes(r["bytes_per_step"]),
                                   "vs fp32": f"{r['bytes_per_step'] / base:.3f}x",
                                   "test accuracy": f"{r['accuracy']:.1%}"} for r in rows]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
