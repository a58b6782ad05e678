# Generated from solutions/phase3_multi_node/parameter_server.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""A parameter server over point-to-point messages: sharded servers, workers, sync and async SGD.

Ranks 0..S-1 are servers, ranks S..W-1 are workers. The model's parameters are
split across the servers (greedy by size, so each holds about |params|/S bytes);
each server owns its shard and applies SGD to it. Every step a worker

    pulls   the current shard from every server (a status, then the values),
    computes a gradient on its own slice of the global batch,
    pushes  to each server the gradient of that server's shard.

A server does not know which worker pushes next, and NCCL has no "receive from any rank"
(nor tags). So a worker first announces its push in the server's inbox (``distlab.p2p.Inbox``,
on the process group's store), then sends; the server receives from the announced rank, in
arrival order. A worker posts its pushes and the receives of its next pull as one launch:
on NCCL a server's reply never waits behind another server (guidelines.md#parameter-server).

* sync: a server waits for all K workers' gradients of step t, applies their mean
  once, and replies to everyone: exactly single-process SGD on the global batch.
* async, staleness bound s (Stale Synchronous Parallel, Ho et al. 2013): a server
  applies each gradient as it arrives (lr/K each) and holds back the reply to a
  worker that would get more than s steps ahead of the slowest live worker. s=0 is
  synchronous again; larger s lets fast workers run ahead, on stale parameters.

Failures: a worker that raises or stops early tells every server (a LEAVE announcement). In sync
mode the servers reply ABORT to the others and everyone raises an error naming
it; in async mode the servers drop it and go on. Nothing waits forever: a worker
killed outright (no LEAVE) is caught by the store's timeout (the process group's).

Cost per worker step: |params| bytes pushed and |params| pulled; a server moves
2 K |shard| bytes per step: its network link is the bottleneck that sharding spreads.
See phase3_multi_node/guidelines.md#parameter-server.

Run the demo (sync, then async SGD on digits): ``NPROC=3 RUN_MODE=parameter_server
./entrypoint.sh`` (one server, two workers); ``IMPL=templates NPROC=3 RUN_MODE=parameter_server
./entrypoint.sh`` runs your template.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab import p2p
from distlab.lessons.flat_buckets import pack as _pack, unpack as _unpack
from distlab.todo import todo

PUSH, LEAVE = 0, 1  # worker -> server announcement kinds
OK, ABORT = 0, 1  # server -> worker reply status


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
    loads, owners = [0] * num_servers, [0] * len(sizes)  # noqa: F841 (loads: for TODO 3.7)
    # --- TODO 3.7: greedy parameter sharding ---
    # Goal: fill owners[i] = the server of tensor i, balancing the servers' total sizes
    # (`loads`) greedily: big tensors are placed first, each where the load is lowest so far.
    # Deterministic on every rank: ties go to the lower tensor index and the lower server id.
    raise todo("3.7 greedy parameter sharding", "guidelines.md#sharding-the-parameters")
    # --- end TODO 3.7 ---
    return owners


def server_loads(sizes: list[int], owners: list[int], num_servers: int) -> list[int]:
    """Total size held by each server."""
    loads = [0] * num_servers
    for size, server in zip(sizes, owners):
        loads[server] += size
    return loads


# --------------------------------------------------------------------------- server
def serve(shard: torch.Tensor, config: PSConfig, steps: int, inbox: p2p.Inbox | None = None) -> dict:
    """Run one server until every live worker has pushed ``steps`` gradients (or, in sync, one fails).

    Collective-free: learns who comes next from ``inbox`` (this server's; opened here if
    None), then talks to that worker alone, with messages that name it (``distlab.p2p``).
    Returns: ``{"pushes": n, "left": [worker ranks that left], "max_ahead": largest lead granted}``.
    Raises: RuntimeError naming the worker, in sync mode, when a worker leaves.
    """
    world_size = dist.get_world_size()
    inbox = p2p.Inbox(dist.get_rank(), "parameter_server") if inbox is None else inbox
    workers = list(range(config.num_servers, world_size))
    done = {w: 0 for w in workers}  # gradients applied per worker
    alive, held = set(workers), set()  # held: pushed, waiting for permission to go on
    replies, pushes, leads = [], 0, [0]
    grad = torch.empty_like(shard)
    pending_sync: dict[int, torch.Tensor] = {}

    def reply(worker: int, status: int, failed: int = -1, lead: int = 0) -> None:
        # Asynchronous: the worker has posted this receive already (with its push), so the
        # send completes without us. The values are a snapshot: later updates must not leak
        # into a message still in flight. The status lives where the shard does (NCCL: the GPU).
        leads.append(lead)
        status_t = torch.tensor([status, failed], device=shard.device)
        replies.append(p2p.batch([(status_t, worker), (shard.clone(), worker)]))

    for w in workers:
        reply(w, OK)  # the initial pull
    while alive and (held or any(done[w] < steps for w in alive)):
        src, note = inbox.next()  # who comes next (arrival order), and what it announced
        kind, step = map(int, note.split("|"))
        if kind == LEAVE:
            alive.discard(src)
            held.discard(src)
            if config.mode == "sync":
                return _abort(src, step, alive, set(pending_sync), reply, inbox, grad, replies)
            held = _release(held, done, alive, steps, config.staleness, reply)  # it may have been the slowest
            continue
        p2p.recv(grad, src)  # its send is posted: it announced, then sent
        pushes += 1
        done[src] = step + 1
        held.add(src)
        if config.mode == "sync":
            # --- TODO 3.8a: synchronous parameter server (server) ---
            # Goal: collect one gradient of this step from every live worker (`grad` is reused
            # for the next message), then apply their mean to `shard` once, in place and in a
            # deterministic order, and only then let every held worker go on with an OK reply.
            raise todo("3.8a synchronous parameter server (server)", "guidelines.md#synchronous-updates")
            # --- end TODO 3.8a ---
            continue
        # Async: apply at once; release every held worker not more than `staleness` steps
        # ahead of the slowest live worker that still has steps to do.
        # --- TODO 3.9a: asynchronous parameter server (apply at once) ---
        # Goal: apply this one gradient to `shard` at once, in place, with its share of the
        # learning rate, then let go every held worker that the staleness bound allows.
        raise todo("3.9a asynchronous parameter server (apply at once)", "guidelines.md#asynchronous-updates-and-the-staleness-bound")
        # --- end TODO 3.9a ---
    for work in replies:
        work.wait()
    return {"pushes": pushes, "left": sorted(set(workers) - alive), "max_ahead": max(leads)}


def _release(held: set, done: dict, alive: set, steps: int, staleness: int, reply) -> set:
    """Reply to each held worker whose lead over the slowest unfinished live worker is <= staleness.

    Returns the workers still held. A finished worker never holds others back.
    """
    still_held: set = set()
    # --- TODO 3.9b: asynchronous parameter server (staleness bound) ---
    # Goal: measure each held worker's lead over the slowest live worker that still has steps
    # to do (a finished worker holds nobody back); reply OK, with its lead, to every held worker
    # within `staleness`, in rank order; the others, still waiting, go into `still_held`.
    raise todo("3.9b asynchronous parameter server (staleness bound)", "guidelines.md#asynchronous-updates-and-the-staleness-bound")
    # --- end TODO 3.9b ---
    return still_held


def _abort(failed: int, step: int, alive: set, pushed: set, reply, inbox: p2p.Inbox, grad, replies) -> dict:
    """Sync mode: answer ABORT to every live worker at its next push (so none is left waiting), then raise."""
    for w in pushed:
        reply(w, ABORT, failed)
    waiting = alive - pushed
    while waiting:
        src, note = inbox.next()
        if int(note.split("|")[0]) == PUSH:
            p2p.recv(grad, src)
            reply(src, ABORT, failed)
        waiting.discard(src)
    for work in replies:  # delivered before we go: a worker must read ABORT, not a closed connection
        work.wait()
    raise RuntimeError(f"worker rank {failed} left at step {step}: a synchronous parameter server "
                       f"cannot finish the step without it, job aborted")


# --------------------------------------------------------------------------- worker
def work(model: nn.Module, owners: list[int], config: PSConfig, steps: int,
         get_batch: Callable[[int, int, int], tuple], loss_fn: Callable,
         on_pull: Callable[[int, nn.Module], None] | None = None,
         inboxes: list[p2p.Inbox] | None = None) -> list[float]:
    """Run one worker: pull, compute, push, ``steps`` times. Returns its losses.

    ``get_batch(step, worker_index, num_workers)`` gives this worker's slice of the step's
    global batch; ``on_pull(steps_done, model)`` (tests, logging) runs after every pull.
    ``inboxes[s]``: server s's inbox (opened here if None).
    If anything raises (or the batches run out), every server is told (LEAVE) before re-raising.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    params = list(model.parameters())
    mine = [[p for p, o in zip(params, owners) if o == s] for s in range(config.num_servers)]
    index, num_workers = rank - config.num_servers, world_size - config.num_servers
    if inboxes is None:
        inboxes = [p2p.Inbox(s, "parameter_server") for s in range(config.num_servers)]
    losses, step = [], 0

    def pull(pushes: list[tuple[torch.Tensor, int]] = ()) -> None:
        """Post ``pushes`` (gradient, server) and the receive of every server's reply as one launch;
        wait, then load the new values (or raise if a server aborted the job)."""
        statuses = [torch.zeros(2, dtype=torch.long, device=params[0].device) for _ in mine]
        shards = [torch.empty(sum(p.numel() for p in ps), dtype=params[0].dtype, device=params[0].device)
                  for ps in mine]
        p2p.batch(pushes, [(t, s) for s in range(config.num_servers) for t in (statuses[s], shards[s])]).wait()
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
            # --- TODO 3.8b: synchronous parameter server (worker push) ---
            # Goal: push this step's gradients: announce a PUSH of this step in every server's
            # inbox (servers cannot receive "from any worker"), then hand `pull` the gradients
            # of each server's parameters, packed into one message per server: it posts them
            # with the receives of the reply, as one launch.
            raise todo("3.8b synchronous parameter server (worker push)", "guidelines.md#synchronous-updates")
            # --- end TODO 3.8b ---
            if on_pull is not None:
                on_pull(step + 1, model)
    except JobAborted:
        raise  # the servers know already and have stopped listening
    except BaseException:  # our own failure, or an early exit: tell the servers, never leave them waiting
        for s in range(config.num_servers):
            inboxes[s].announce(f"{LEAVE}|{step}")
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
