"""RUN_MODE=sharded_checkpoint: save a sharded FSDP2 model + AdamW state at W ranks, load it at W'.

The first run trains and saves (the course's format, 5.11, written asynchronously, 5.13,
while the next steps run; and torch.distributed.checkpoint beside it) plus the unsharded
state for the check. A later run with another NPROC finds the checkpoint and loads it at
its own world size (5.12): every tensor must come back bit-exact, and the loader position
with it.

    NPROC=2 RUN_MODE=sharded_checkpoint ./entrypoint.sh --dir runs/sharded_ckpt   # save at 2
    NPROC=3 RUN_MODE=sharded_checkpoint ./entrypoint.sh --dir runs/sharded_ckpt   # load at 3
    IMPL=templates NPROC=2 RUN_MODE=sharded_checkpoint ./entrypoint.sh           # your template
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from demos.sizes import at_least
from distlab.launch import init_from_env, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0
from distlab.models import ToyMLP
from distlab.todo import run_demo


def _model(seed: int, mesh):
    torch.manual_seed(seed)
    model = ToyMLP(16, 30, 5)
    for unit in [*model.children(), model]:
        fully_shard(unit, mesh=mesh)  # FSDP2 puts the shards on the mesh's device
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(state: dict, lesson) -> dict:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in lesson.flatten(state).items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Sharded checkpoints with resharding.")
    parser.add_argument("--dir", default="runs/sharded_ckpt")
    parser.add_argument("--steps", type=int, default=5)
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Steps of 8 samples split over the ranks; the save happens 3 steps before the end."""
    at_least(args.steps, 3, "--steps", " (the checkpoint is saved at step --steps - 3)")
    if world_size > 8:
        raise ValueError(f"{world_size} ranks: the demo splits steps of 8 samples over the ranks, "
                         "so it runs on 8 ranks at most; use NPROC x NNODES <= 8")
    return args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        lesson, root = load("phase5_large_models", "sharded_checkpoint"), Path(args.dir)
        model, opt = _model(seed=env.rank + 1, mesh=init_device_mesh(env.device.type, (env.world_size,)))
        ours = root / "ours"
        if (ours / lesson.METADATA).exists():
            model_sd, optim_sd = get_state_dict(model, opt)
            rows = []
            for fmt in ("ours", "dcp"):
                state = {"model": model_sd, "optim": optim_sd, "loader": {"position": 0}, "world_size": 0}
                start = time.perf_counter()
                if fmt == "ours":
                    state = lesson.load_sharded(state, ours)
                else:
                    dcp.load(state, checkpoint_id=str(root / "dcp"))
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                seconds = time.perf_counter() - start
                got, ref = _full(dict(zip(("model", "optim"), get_state_dict(model, opt))), lesson), \
                    torch.load(root / "reference.pt", weights_only=True, map_location=env.device)
                exact = all(torch.equal(got[k].to(v.device), v) for k, v in ref.items() if torch.is_tensor(v))
                rows.append({"format": fmt, "saved at W": state["world_size"],
                             "loaded at W": env.world_size, "bit-exact": exact, "loader": state["loader"],
                             "load s": f"{seconds:.3f}"})
            log0("\n" + format_table(rows))
            return
        x, y = torch.randn(8 * args.steps, 16).to(env.device), torch.randint(5, (8 * args.steps,)).to(env.device)
        for step in range(args.steps):
            xb, yb = x[8 * step:8 * step + 8].chunk(env.world_size)[env.rank], y[8 * step:8 * step + 8].chunk(env.world_size)[env.rank]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            if step == args.steps - 3:  # save here, asynchronously, and keep training
                model_sd, optim_sd = get_state_dict(model, opt)
                state = {"model": model_sd, "optim": optim_sd, "loader": {"position": 8 * (step + 1)},
                         "world_size": env.world_size}
                reference = _full({"model": model_sd, "optim": optim_sd}, lesson)
                handle = lesson.async_save_sharded(state, ours)
                dcp.save(state, checkpoint_id=str(root / "dcp"))
                if env.rank == 0:
                    torch.save(reference, root / "reference.pt")
        handle.wait()
        dist.barrier()
        mine = (ours / f"rank{env.rank}.pt").stat().st_size
        sizes = [0] * env.world_size
        dist.all_gather_object(sizes, mine)
        log0(f"saved at W={env.world_size} in {root}: rank files {[format_bytes(s) for s in sizes]}, "
             f"{len(list((root / 'dcp').iterdir()))} DCP files. Run again with another NPROC to load it there.")
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
