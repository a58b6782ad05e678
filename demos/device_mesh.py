"""RUN_MODE=device_mesh: TinyGPT on a dp x tp DeviceMesh (DTensor TP + FSDP2), next to one process.

The course's 2D grid (phase 2's build_grid + ParallelGPT blocks, phase 3's ZeRO-3) in
torch's words: ``build_mesh`` (5.10a), the TinyGPT plan (5.9) applied with
``parallelize_module`` on mesh["tp"], ``fully_shard`` on mesh["dp"] (5.10b). The summary:
the loss beside the single-process loss on the same global batch (equal), parameters
per rank, and the collectives one step issues (DTensor's, counted by CommDebugMode;
FSDP2's, counted by the CommLedger).

    NPROC=4 RUN_MODE=device_mesh ./entrypoint.sh                           # dp 2 x tp 2
    NPROC=4 RUN_MODE=device_mesh ./entrypoint.sh --tp-size 4 --sequence-parallel
    IMPL=templates NPROC=4 RUN_MODE=device_mesh ./entrypoint.sh            # your template_mesh_parallel.py
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch
import torch.distributed as dist

from demos.sizes import grid_2d, positive
from distlab.comm import CommLedger
from distlab.data import synthetic_tokens
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, progress
from distlab.models import GPTConfig, TinyGPT
from distlab.todo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="TinyGPT on a DeviceMesh: DTensor tensor parallel x FSDP2.")
    parser.add_argument("--tp-size", type=int, default=None,
                        help="default: 2 where it divides the world size, else 1")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: 8, rounded up to a multiple of the data-parallel size")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A tp size that divides the ranks and TinyGPT's heads, vocabulary and 16 tokens; a batch the replicas share."""
    positive(args, "--steps")
    grid_2d(args, world_size, {"TinyGPT's n_head": 4, "vocabulary": 64, "sequence length": 16}, 8)
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # TinyGPT returns (logits, loss): FSDP2 warns about in-place ops on views, which it never sees.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        lesson = load("phase5_large_models", "mesh_parallel")
        mesh = lesson.build_mesh(env.world_size, args.tp_size, env.device.type)
        dp_size, tp_size = mesh.shape
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=64)
        torch.manual_seed(0)  # every rank builds the same full model; the mesh keeps its shard
        reference = TinyGPT(cfg)
        model = lesson.parallelize_tinygpt(copy.deepcopy(reference), mesh, args.sequence_parallel)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0)
        tokens, targets = synthetic_tokens(n_seq=args.global_batch * args.steps, seq_len=16, vocab_size=64).tensors
        per, dp_rank = args.global_batch // dp_size, mesh.get_local_rank("dp")
        log0(f"mesh {mesh.mesh_dim_names} {tuple(mesh.shape)}: rank 0's tp row {mesh['tp'].mesh.tolist()}, "
             f"dp column {mesh['dp'].mesh.tolist()}")
        dtensor_comm, ledger = lesson.CommBytes(), CommLedger()
        for step in progress(range(args.steps), desc="2D mesh"):
            x = tokens[step * args.global_batch:(step + 1) * args.global_batch]
            y = targets[step * args.global_batch:(step + 1) * args.global_batch]
            opt.zero_grad(set_to_none=True)
            last = step == args.steps - 1
            with (dtensor_comm if last else torch.enable_grad()), (ledger if last else torch.enable_grad()):
                loss = model(x[dp_rank * per:(dp_rank + 1) * per].to(env.device),
                             y[dp_rank * per:(dp_rank + 1) * per].to(env.device))[1]
                loss.backward()
                opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = reference(x, y)[1]
            ref_loss.backward()
            ref_opt.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh.get_group("dp"))  # mean over replicas = the global batch's loss
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        log0("\n" + format_table([{
            "ranks": env.world_size, "dp x tp": f"{dp_size} x {tp_size}", "seq. parallel": args.sequence_parallel,
            "loss (mesh)": f"{loss.item() / dp_size:.4f}", "loss (one process)": f"{ref_loss.item():.4f}",
            "params/rank": local, "params (full)": sum(p.numel() for p in reference.parameters())}]))
        log0("collectives of the last step on rank 0 (payload bytes):\n" + format_table(
            [{"by": "DTensor (tp)", "op": op, "calls": n, "bytes": format_bytes(dtensor_comm.nbytes[op])}
             for op, n in sorted(dtensor_comm.calls().items())] +
            [{"by": "FSDP2 (dp)", "op": op, "calls": ledger.calls(op), "bytes": format_bytes(ledger.bytes(op))}
             for op in ("all_gather_single", "reduce_scatter_single", "all_reduce") if ledger.calls(op)]))
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
