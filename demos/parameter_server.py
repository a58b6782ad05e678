"""A parameter server trains an MLP on digits: synchronous SGD, then asynchronous with a staleness bound.

Ranks 0..S-1 serve the sharded parameters, the others work. Prints, per mode: the
workers' final loss and test accuracy, the largest lead a server granted a fast
worker (at most the staleness bound), the bytes each server holds, and wall time.

    NPROC=3 RUN_MODE=parameter_server ./entrypoint.sh                  # 1 server, 2 workers
    NPROC=4 RUN_MODE=parameter_server ./entrypoint.sh --servers 2      # the model sharded over 2
    IMPL=templates NPROC=3 RUN_MODE=parameter_server ./entrypoint.sh   # your template

A parameter server needs at least one server and one worker: without torchrun
(``python -m demos.parameter_server``, one process) it starts ``--local-ranks`` local
processes itself. See phase3_multi_node/guidelines.md#parameter-server.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.data import digits
from distlab.launch import init_from_env, run_distributed, shutdown
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0
from distlab.models import ToyMLP, seeded
from distlab.todo import run_demo


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--per-worker-batch", type=int, default=32)
    parser.add_argument("--local-ranks", type=int, default=3,
                        help="ranks to start locally when run as a single process (default: 3)")
    return parser


def _model() -> torch.nn.Module:
    return seeded(ToyMLP, 0, 64, 64, 10)


def _train(args: argparse.Namespace, world_size: int) -> None:
    """Every rank: sync, then async, each from the same seeded model; rank 0 prints the table."""
    ps = load("phase3_multi_node", "parameter_server")
    train, test = digits("train", flatten=True), digits("test", flatten=True)
    rows = []
    for mode, staleness in (("sync", 0), ("async", args.staleness)):
        config = ps.PSConfig(num_servers=args.servers, mode=mode, staleness=staleness, lr=0.2)
        num_workers = world_size - config.num_servers

        def get_batch(step, index, k):
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(step))
            idx = order[:args.per_worker_batch * k].tensor_split(k)[index]
            return train.tensors[0][idx], train.tensors[1][idx]

        model = _model()
        start = time.perf_counter()
        out = ps.parameter_server(model, config, args.steps, get_batch, F.cross_entropy)
        seconds = time.perf_counter() - start
        results = [None] * world_size
        if out["role"] == "worker":
            with torch.no_grad():
                out["accuracy"] = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
            out["final_loss"] = sum(out["losses"][-10:]) / 10
        out.pop("shard", None)
        dist.all_gather_object(results, out)
        servers = [r for r in results if r["role"] == "server"]
        workers = [r for r in results if r["role"] == "worker"]
        rows.append({"mode": f"{mode} (s={staleness})" if mode == "async" else mode,
                     "servers x workers": f"{len(servers)} x {num_workers}",
                     "final loss (worker mean)": f"{sum(w['final_loss'] for w in workers) / len(workers):.3f}",
                     "test accuracy": f"{sum(w['accuracy'] for w in workers) / len(workers):.3f}",
                     "max lead granted": max(s["max_ahead"] for s in servers),
                     "server loads": " / ".join(format_bytes(s["load_bytes"]) for s in servers),
                     "seconds": f"{seconds:.1f}"})
        log0(f"{rows[-1]['mode']}: done in {seconds:.1f} s")
    log0(f"\n== parameter server on digits, {args.steps} steps, ToyMLP(64, 64, 10) ==")
    log0(format_table(rows))


def _local_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    _train(args, world_size)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    ps = load("phase3_multi_node", "parameter_server")
    env = init_from_env()
    try:
        # The plan first (3.7): every rank computes the same owner of each tensor.
        sizes = [p.numel() * p.element_size() for p in _model().parameters()]
        loads = ps.server_loads(sizes, ps.assign_shards(sizes, args.servers), args.servers)
        log0(f"ToyMLP(64, 64, 10): {len(sizes)} tensors, {format_bytes(sum(sizes))}, sharded over "
             f"{args.servers} server(s): " + " / ".join(format_bytes(n) for n in loads))
        if env.world_size > 1:
            _train(args, env.world_size)
            return
    finally:
        shutdown()
    # One process: a server and a worker cannot share it, so start a local world
    # (fresh processes, gloo over loopback) and play every role there.
    if args.local_ranks <= args.servers:
        raise ValueError(f"--local-ranks {args.local_ranks} - --servers {args.servers} = "
                         f"{args.local_ranks - args.servers} workers: need at least one")
    log0(f"one process: starting {args.local_ranks} local ranks "
         f"({args.servers} server(s), {args.local_ranks - args.servers} worker(s))")
    run_distributed(_local_rank, args.local_ranks, args, timeout_s=600)


if __name__ == "__main__":
    run_demo(main)
