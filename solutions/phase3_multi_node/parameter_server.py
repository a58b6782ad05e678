"""A parameter server over point-to-point messages: sharded servers, workers, sync and async SGD.

Ranks 0..S-1 are servers, ranks S..W-1 are workers. The model's parameters are
split across the servers (greedy by size, so each holds about |params|/S bytes);
each server owns its shard and applies SGD to it. Every step a worker

    pulls   the current shard from every server (a status header, then the values),
    computes a gradient on its own slice of the global batch,
    pushes  to each server the gradient of that server's shard (a header, then the values).

* sync: a server waits for all K workers' gradients of step t, applies their mean
  once, and replies to everyone: exactly single-process SGD on the global batch.
* async, staleness bound s (Stale Synchronous Parallel, Ho et al. 2013): a server
  applies each gradient as it arrives (lr/K each) and holds back the reply to a
  worker that would get more than s steps ahead of the slowest live worker. s=0 is
  synchronous again; larger s lets fast workers run ahead, on stale parameters.

Failures: a worker that raises or stops early tells every server (LEAVE). In sync
mode the servers reply ABORT to the others and everyone raises an error naming
it; in async mode the servers drop it and go on. Nothing waits forever: a worker
killed outright (no LEAVE) is caught by the process group's timeout.

Cost per worker step: |params| bytes pushed and |params| pulled; a server moves
2 K |shard| bytes per step: its network link is the bottleneck that sharding spreads.
See phase3_multi_node/guidelines.md#parameter-server.

Run: ``RUN_MODE=parameter_server ./entrypoint.sh`` (NPROC=3: one server, two workers, digits).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

PUSH, LEAVE = 0, 1  # worker -> server header kinds
OK, ABORT = 0, 1  # server -> worker reply status
_HEADER, _DATA = 1, 2  # tags: a header from any worker never matches a data message


class JobAborted(RuntimeError):
    """A server aborted the job (sync mode) because some other worker left."""


@dataclass(frozen=True)
class PSConfig:
    """Roles and rules: ``num_servers`` servers (ranks 0..S-1), the rest workers."""

    num_servers: int = 1
    mode: str = "sync"  # "sync" or "async"
    staleness: int = 0  # async only: how many steps a worker may run ahead of the slowest
    lr: float = 0.1

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.num_servers < 1 or self.staleness < 0:
            raise ValueError(f"need num_servers >= 1 and staleness >= 0, got {self.num_servers}, {self.staleness}")


# --------------------------------------------------------------------------- sharding
def assign_shards(sizes: list[int], num_servers: int) -> list[int]:
    """The server of each tensor: largest first, each to the least-loaded server so far (ties: lowest id).

    Greedy "longest processing time first": the most loaded server holds at most
    4/3 of the optimum (Graham 1969), and with many small tensors nearly 1/S of the total.
    """
    if num_servers > len(sizes):
        raise ValueError(f"{num_servers} servers but only {len(sizes)} parameter tensors: a server would hold nothing")
    loads, owners = [0] * num_servers, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(num_servers), key=lambda s: (loads[s], s))
        owners[i] = server
        loads[server] += sizes[i]
    return owners


def server_loads(sizes: list[int], owners: list[int], num_servers: int) -> list[int]:
    """Total size held by each server."""
    loads = [0] * num_servers
    for size, server in zip(sizes, owners):
        loads[server] += size
    return loads


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))


# --------------------------------------------------------------------------- server
def serve(shard: torch.Tensor, config: PSConfig, steps: int) -> dict:
    """Run one server until every live worker has pushed ``steps`` gradients (or, in sync, one fails).

    Collective-free: talks to the workers with send/recv only.
    Returns: ``{"pushes": n, "left": [worker ranks that left], "max_ahead": largest lead granted}``.
    Raises: RuntimeError naming the worker, in sync mode, when a worker leaves.
    """
    world_size = dist.get_world_size()
    workers = list(range(config.num_servers, world_size))
    done = {w: 0 for w in workers}  # gradients applied per worker
    alive, held = set(workers), set()  # held: pushed, waiting for permission to go on
    replies, pushes, leads = [], 0, [0]
    header, grad = torch.zeros(2, dtype=torch.long), torch.empty_like(shard)
    pending_sync: dict[int, torch.Tensor] = {}

    def reply(worker: int, status: int, failed: int = -1, lead: int = 0) -> None:
        # isend: a blocking send could wait on a worker that is itself waiting on another server.
        # The values are a snapshot: later updates must not leak into a message still in flight.
        leads.append(lead)
        replies.append(dist.isend(torch.tensor([status, failed]), dst=worker, tag=_HEADER))
        replies.append(dist.isend(shard.clone(), dst=worker, tag=_DATA))

    for w in workers:
        reply(w, OK)  # the initial pull
    while alive and (held or any(done[w] < steps for w in alive)):
        src = dist.recv(header, tag=_HEADER)  # from any worker
        kind, step = header.tolist()
        if kind == LEAVE:
            alive.discard(src)
            held.discard(src)
            if config.mode == "sync":
                return _abort(src, step, alive, set(pending_sync), reply, header, grad, replies)
            held = _release(held, done, alive, steps, config.staleness, reply)  # it may have been the slowest
            continue
        dist.recv(grad, src=src, tag=_DATA)
        pushes += 1
        done[src] = step + 1
        held.add(src)
        if config.mode == "sync":
            # Wait for every worker's gradient of this step, apply their mean once, release all.
            pending_sync[src] = grad.clone()
            if set(pending_sync) == alive:
                total = sum(pending_sync[w] for w in sorted(pending_sync))  # rank order: deterministic
                shard -= config.lr * total / len(workers)
                pending_sync.clear()
                for w in sorted(held):
                    reply(w, OK)
                held.clear()
            continue
        # Async: apply at once; release every held worker not more than `staleness` steps
        # ahead of the slowest live worker that still has steps to do.
        shard -= (config.lr / len(workers)) * grad
        held = _release(held, done, alive, steps, config.staleness, reply)
    for work in replies:
        work.wait()
    return {"pushes": pushes, "left": sorted(set(workers) - alive), "max_ahead": max(leads)}


def _release(held: set, done: dict, alive: set, steps: int, staleness: int, reply) -> set:
    """Reply to each held worker whose lead over the slowest unfinished live worker is <= staleness.

    Returns the workers still held. A finished worker never holds others back.
    """
    behind = [done[w] for w in alive if done[w] < steps]
    slowest = min(behind) if behind else steps
    still_held = set()
    for w in sorted(held):
        if done[w] - slowest <= staleness:
            reply(w, OK, lead=done[w] - slowest)
        else:
            still_held.add(w)
    return still_held


def _abort(failed: int, step: int, alive: set, pushed: set, reply, header, grad, replies) -> dict:
    """Sync mode: answer ABORT to every live worker at its next push (so none is left waiting), then raise."""
    for w in pushed:
        reply(w, ABORT, failed)
    waiting = alive - pushed
    while waiting:
        src = dist.recv(header, tag=_HEADER)
        if header[0].item() == PUSH:
            dist.recv(grad, src=src, tag=_DATA)
            reply(src, ABORT, failed)
        waiting.discard(src)
    for work in replies:  # delivered before we go: a worker must read ABORT, not a closed connection
        work.wait()
    raise RuntimeError(f"worker rank {failed} left at step {step}: a synchronous parameter server "
                       f"cannot finish the step without it, job aborted")


# --------------------------------------------------------------------------- worker
def work(model: nn.Module, owners: list[int], config: PSConfig, steps: int,
         get_batch: Callable[[int, int, int], tuple], loss_fn: Callable,
         on_pull: Callable[[int, nn.Module], None] | None = None) -> list[float]:
    """Run one worker: pull, compute, push, ``steps`` times. Returns its losses.

    ``get_batch(step, worker_index, num_workers)`` gives this worker's slice of the step's
    global batch; ``on_pull(steps_done, model)`` (tests, logging) runs after every pull.
    If anything raises (or the batches run out), every server is told (LEAVE) before re-raising.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    params = list(model.parameters())
    mine = [[p for p, o in zip(params, owners) if o == s] for s in range(config.num_servers)]
    index, num_workers = rank - config.num_servers, world_size - config.num_servers
    losses, step = [], 0

    def pull() -> None:
        statuses = [torch.zeros(2, dtype=torch.long) for _ in mine]
        shards = [torch.empty(sum(p.numel() for p in ps), dtype=params[0].dtype) for ps in mine]
        works = [dist.irecv(t, src=s, tag=tag) for s in range(config.num_servers)
                 for t, tag in ((statuses[s], _HEADER), (shards[s], _DATA))]
        for w in works:
            w.wait()
        for s, status in enumerate(statuses):
            if status[0].item() == ABORT:
                raise JobAborted(f"rank {rank}: server {s} aborted the job because worker rank "
                                   f"{status[1].item()} left")
            _unpack(shards[s], mine[s])

    try:
        pull()
        for step in range(steps):
            model.zero_grad(set_to_none=False)
            x, y = get_batch(step, index, num_workers)
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.item())
            for s, ps in enumerate(mine):  # push: a header, then this server's gradients
                dist.send(torch.tensor([PUSH, step]), dst=s, tag=_HEADER)
                dist.send(_pack([p.grad for p in ps]), dst=s, tag=_DATA)
            pull()
            if on_pull is not None:
                on_pull(step + 1, model)
    except JobAborted:
        raise  # the servers know already and have stopped listening
    except BaseException:  # our own failure, or an early exit: tell the servers, never leave them waiting
        for s in range(config.num_servers):
            dist.send(torch.tensor([LEAVE, step]), dst=s, tag=_HEADER)
        raise
    return losses


def parameter_server(model: nn.Module, config: PSConfig, steps: int, get_batch, loss_fn,
                     on_pull=None, owners: list[int] | None = None) -> dict:
    """Play this rank's role (server or worker) for ``steps`` steps; every rank calls it.

    ``model`` must be built identically on every rank (servers take their shard's initial
    values from it). ``owners[i]``: the server of parameter i (default: ``assign_shards``).
    Returns ``{"role": ..., ...}``: the server's stats, or the worker's losses.
    Collective: all ranks must call it (with the same config, steps and owners).
    """
    world_size = dist.get_world_size()
    if world_size <= config.num_servers:
        raise ValueError(f"world size {world_size} - {config.num_servers} servers = "
                         f"{world_size - config.num_servers} workers: need at least one")
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    owners = assign_shards(sizes, config.num_servers) if owners is None else owners
    rank = dist.get_rank()
    if rank < config.num_servers:
        shard = _pack([p for p, o in zip(model.parameters(), owners) if o == rank])
        stats = serve(shard, config, steps)
        return {"role": "server", "load_bytes": server_loads(sizes, owners, config.num_servers)[rank],
                "shard": shard, **stats}
    return {"role": "worker", "losses": work(model, owners, config, steps, get_batch, loss_fn, on_pull)}


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    import torch.nn.functional as F

    from distlab.data import digits
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0
    from distlab.models import ToyMLP, seeded

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--per-worker-batch", type=int, default=32)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        train, test = digits("train", flatten=True), digits("test", flatten=True)
        rows = []
        for mode, staleness in (("sync", 0), ("async", args.staleness)):
            config = PSConfig(num_servers=args.servers, mode=mode, staleness=staleness, lr=0.2)
            num_workers = env.world_size - config.num_servers

            def get_batch(step, index, k):
                order = torch.randperm(len(train), generator=torch.Generator().manual_seed(step))
                idx = order[:args.per_worker_batch * k].tensor_split(k)[index]
                return train.tensors[0][idx], train.tensors[1][idx]

            model = seeded(ToyMLP, 0, 64, 64, 10)
            start = time.perf_counter()
            out = parameter_server(model, config, args.steps, get_batch, F.cross_entropy)
            seconds = time.perf_counter() - start
            results = [None] * env.world_size
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
    finally:
        shutdown()


if __name__ == "__main__":
    main()
