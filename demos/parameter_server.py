"""A parameter server trains an MLP on digits: synchronous SGD, then asynchronous with a staleness bound.

Ranks 0..S-1 serve the sharded parameters, the others work. Prints, per mode: the
workers' final loss and test accuracy, the largest lead a server granted a fast
worker (at most the staleness bound), the bytes each server holds, and wall time.

    NPROC=3 RUN_MODE=parameter_server ./entrypoint.sh                  # 1 server, 2 workers
    NPROC=4 RUN_MODE=parameter_server ./entrypoint.sh --servers 2      # the model sharded over 2
    IMPL=templates NPROC=3 RUN_MODE=parameter_server ./entrypoint.sh   # your template

Async can only differ from sync with two workers or more: a single worker is always the
slowest, so it never runs ahead and its gradients are never stale. With fewer (``NPROC=2``,
the default, is 1 server x 1 worker; or one process, ``python -m demos.parameter_server``)
rank 0 starts a local world of ``--local-ranks`` processes (gloo, CPU) and runs there,
and says so. See phase3_multi_node/guidelines.md#parameter-server.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from demos.sizes import positive
from distlab.data import digits
from distlab.launch import init_from_env, shutdown
from distlab.spawn import run_distributed
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0
from distlab.models import ToyMLP, seeded
from distlab.todo import run_demo

MIN_WORKERS = 2  # with one worker, async is sync: nobody to run ahead of, no stale gradient


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--per-worker-batch", type=int, default=32)
    parser.add_argument("--local-ranks", type=int, default=3,
                        help=f"ranks to start locally when the job has fewer than {MIN_WORKERS} workers (default: 3)")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Any world size works (too few workers: a local world, see local_world_size); the sizes must be positive."""
    positive(args, "--steps", "--servers", "--per-worker-batch")
    tensors = len(list(_model().parameters()))
    if args.servers > tensors:
        raise ValueError(f"--servers {args.servers}: ToyMLP(64, 64, 10) has {tensors} parameter tensors, and every "
                         f"server needs one; use --servers {tensors} or fewer")
    return args


def _model() -> torch.nn.Module:
    return seeded(ToyMLP, 0, 64, 64, 10)


def local_world_size(world_size: int, args: argparse.Namespace) -> int:
    """0 when a world of ``world_size`` ranks has workers enough; else the size of the local world to start."""
    if world_size - args.servers >= MIN_WORKERS:
        return 0
    return max(args.local_ranks, args.servers + MIN_WORKERS)


def _train(args: argparse.Namespace, world_size: int, device: torch.device = torch.device("cpu"),
           data: tuple | None = None, owners: list[int] | None = None) -> list[dict]:
    """Every rank: sync, then async, each from the same seeded model; rank 0 prints the table.

    ``data``: (train, test) datasets of 64 features and 10 classes (default: digits);
    ``owners``: the server of each parameter (default: the greedy sharding of 3.7).
    Returns one result per mode (the same on every rank): mode, workers' mean final loss
    and test accuracy, largest lead granted, server loads, seconds.
    """
    ps = load("phase3_multi_node", "parameter_server")
    train, test = data or (digits("train", flatten=True), digits("test", flatten=True))
    results_per_mode = []
    for mode, staleness in (("sync", 0), ("async", args.staleness)):
        config = ps.PSConfig(num_servers=args.servers, mode=mode, staleness=staleness, lr=0.2)
        num_workers = world_size - config.num_servers

        def get_batch(step, index, k):
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(step))
            idx = order[:args.per_worker_batch * k].tensor_split(k)[index]
            return train.tensors[0][idx].to(device), train.tensors[1][idx].to(device)

        model = _model().to(device)
        start = time.perf_counter()
        out = ps.parameter_server(model, config, args.steps, get_batch, F.cross_entropy, owners=owners)
        seconds = time.perf_counter() - start
        results = [None] * world_size
        if out["role"] == "worker":
            with torch.no_grad():
                x_test, y_test = (t.to(device) for t in test.tensors)
                out["accuracy"] = (model(x_test).argmax(1) == y_test).float().mean().item()
            last = out["losses"][-10:]
            out["final_loss"] = sum(last) / len(last)
        out.pop("shard", None)
        dist.all_gather_object(results, out)
        servers = [r for r in results if r["role"] == "server"]
        workers = [r for r in results if r["role"] == "worker"]
        results_per_mode.append({
            "mode": f"{mode} (s={staleness})" if mode == "async" else mode, "servers": len(servers),
            "workers": num_workers, "final_loss": sum(w["final_loss"] for w in workers) / len(workers),
            "accuracy": sum(w["accuracy"] for w in workers) / len(workers),
            "max_lead": max(s["max_ahead"] for s in servers), "loads": [s["load_bytes"] for s in servers],
            "seconds": seconds})
        log0(f"{results_per_mode[-1]['mode']}: done in {seconds:.1f} s")
    log0(f"\n== parameter server on digits, {args.steps} steps, ToyMLP(64, 64, 10) ==")
    log0(format_table([{"mode": r["mode"], "servers x workers": f"{r['servers']} x {r['workers']}",
                        "final loss (worker mean)": f"{r['final_loss']:.4f}",
                        "test accuracy": f"{r['accuracy']:.3f}", "max lead granted": r["max_lead"],
                        "server loads": " / ".join(format_bytes(n) for n in r["loads"]),
                        "seconds": f"{r['seconds']:.1f}"} for r in results_per_mode]))
    sync, stale = results_per_mode
    log0(f"\nWhat differs: sync applies the mean of the {num_workers} workers' gradients once per step, "
         "so every worker waits for the slowest (lead 0) and the run is single-process SGD on the global "
         f"batch. Async applies each gradient as it arrives and lets a worker go on up to s={args.staleness} "
         "steps ahead of the slowest: its next gradient is computed on parameters that lack the others' "
         f"latest updates (stale). Max lead granted: {sync['max_lead']} (sync) vs {stale['max_lead']} (async); "
         f"final loss {sync['final_loss']:.4f} vs {stale['final_loss']:.4f}.")
    return results_per_mode


def _local_rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    return _train(args, world_size)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ps = load("phase3_multi_node", "parameter_server")
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        # The plan first (3.7): every rank computes the same owner of each tensor.
        sizes = [p.numel() * p.element_size() for p in _model().parameters()]
        loads = ps.server_loads(sizes, ps.assign_shards(sizes, args.servers), args.servers)
        log0(f"ToyMLP(64, 64, 10): {len(sizes)} tensors, {format_bytes(sum(sizes))}, sharded over "
             f"{args.servers} server(s): " + " / ".join(format_bytes(n) for n in loads))
        local = local_world_size(env.world_size, args)
        if not local:
            _train(args, env.world_size, env.device)
            return
        if env.world_size == 1:
            why = "one process: a server and a worker cannot share it"
        else:
            why = (f"{env.world_size} ranks, {args.servers} server(s): 1 worker, and async would equal sync "
                   "(a lone worker is always the slowest: nobody to run ahead of, no stale gradient)")
        log0(f"{why}. Starting {local} local ranks instead ({args.servers} server(s), "
             f"{local - args.servers} workers; gloo, CPU)")
    finally:
        shutdown()
    if env.rank != 0:
        return  # rank 0 runs the local world
    run_distributed(_local_rank, local, args, backend="gloo", timeout_s=600)


if __name__ == "__main__":
    run_demo(main)
