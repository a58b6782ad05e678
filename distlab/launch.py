"""Start a rank under torchrun: ``init_from_env``; and ``python -m distlab.launch``, torchrun made safer.

``init_from_env()`` is what every script calls first: it reads RANK/WORLD_SIZE/LOCAL_RANK, puts
the script on ``cuda:LOCAL_RANK`` with "cpu:gloo,cuda:nccl" when every local rank has a GPU (the
CPU and gloo otherwise), and runs as rank 0 of 1 without torchrun. ``shutdown()`` ends it.

``python -m distlab.launch ARGS`` is ``torchrun ARGS`` (``entrypoint.sh`` uses it) whose rendezvous
store listens only on the address it names, and whose failures end in a few lines: the failing
rank's error, or the launch error (port taken, node 0 unreachable, a wrong interface, nodes missing
at the rendezvous timeout, node 0 lost mid-run) with its fix; a line every 30 s while it waits for
the other nodes; one line for a Ctrl-C.

The agent is ``distlab.launch_agent`` (``torchrun``, ``BoundTCPStore``) and its one-line errors
``distlab.launch_errors``; their names are importable from here. The rest of the bench's launching
lives beside it: ``distlab.spawn`` (``run_distributed``, the tests' and demos' launcher),
``distlab.devices`` (device and backend), ``distlab.procs`` (nothing outlives a run).
"""
from __future__ import annotations

import gc
import os
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta

TRACEBACK_ENV = "DISTLAB_TRACEBACK"  # "1": torch's traceback and C++ log above the one-line launch error
# (the same name as distlab.launch_agent's: read here before torch is imported)
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
# `python -m distlab.launch`, the torchrun agent: torch's C++ log is off in it (its store client logs
# every failed connection attempt with ~17 lines of C++ frames: 23 lines before an unreachable node 0
# was named). The agent's store and rendezvous errors reach Python as exceptions all the same, and end
# in the one-line cause or in torch's traceback. torch reads the level once, when it loads: hence here,
# before `import torch`. The workers get the user's setting back (__main__ below); a level the user set,
# or DISTLAB_TRACEBACK=1, keeps the agent's log too.
_AGENT_CPP_LOG_OFF = (__name__ == "__main__" and CPP_LOG_ENV not in os.environ
                      and os.environ.get(TRACEBACK_ENV, "") in ("", "0"))
if _AGENT_CPP_LOG_OFF:
    os.environ[CPP_LOG_ENV] = "FATAL"

import torch  # noqa: E402 (after the C++ log level above)
import torch.distributed as dist  # noqa: E402

from distlab import doctor, p2p, role, trace
from distlab.devices import DEVICE_ENV, resolve_backend, resolve_device
from distlab.doctor_watch import timeout_scale
# The agent and its one-line errors, importable from here (`from distlab.launch import BoundTCPStore`).
from distlab.launch_agent import BoundTCPStore, torchrun  # noqa: E402
from distlab.launch_errors import (  # noqa: E402,F401
    RendezvousWatch, _chain, _launch_error_line, socket_ifname_problem)
from distlab.procs import TIE_ENV, die_with_parent, tie_to
# Moved to distlab.spawn, still importable from here for scripts written before the split:
# `from distlab.launch import run_distributed` (spawn never imports launch: no cycle).
from distlab.spawn import RankError, run_distributed  # noqa: E402,F401 (re-exported)


@dataclass(frozen=True)
class DistEnv:
    """What a torchrun-launched script learns about itself."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(backend: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Initialise the default process group from torchrun's environment.

    The device (``env.device``) is ``cuda:LOCAL_RANK`` when every local rank has a GPU and
    the CPU otherwise, or what ``DISTLAB_DEVICE`` says ("cpu", "cuda"); every script puts
    its model, batches and communicated tensors there. "auto" then picks the backend for
    it: "cpu:gloo,cuda:nccl" on CUDA (NCCL for the tensors, gloo for CPU-side control
    messages), "gloo" on the CPU.

    Without torchrun (no RANK in the environment) this runs as rank 0 of 1, so every
    script also runs as a plain ``python -m``.

    The store is prefixed with a generation the ranks agree on through the store
    (``agree_on_generation``): after an elastic restart, ranks must not read the keys
    (addresses, barriers) the previous start left in the reused store.

    Inside ``run_distributed`` (a process group already exists) it describes that
    group instead, so a script's ``main()`` can also be driven from a test: the device is
    the current CUDA device when the group has NCCL, ``cuda:rank`` with ``DISTLAB_DEVICE=cuda``
    (modulo the GPUs there are: ranks may share one), else the CPU.

    A watchdog thread in every rank records its communication and, when a rank has been
    blocked in one op and no rank of the job has made progress for DISTLAB_HANG_TIMEOUT
    seconds (default: ``timeout_s``/10, between 10 and 30 s; ``DISTLAB_HANG_TIMEOUT=0`` turns
    it off), prints the hang doctor's table for all ranks (who never arrived, what the others
    wait in) and ends the rank with exit code 75, so torchrun stops (or restarts) the job
    instead of waiting for the process group's timeout. A rank that is slow (a checkpoint
    save, a busy machine) is progress, not a hang.

    Every worker dies with its torchrun agent (the parent-death signal), even a SIGKILLed one.

    Collective: every rank must call it (it is the rendezvous).
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        rank = dist.get_rank()
        device = torch.device("cpu")
        if "nccl" in backend:
            device = torch.device("cuda", torch.cuda.current_device())
        elif os.environ.get(DEVICE_ENV, "").strip():  # e.g. CUDA tensors on a gloo world
            gpus = torch.cuda.device_count()
            device = resolve_device(rank % gpus if gpus else rank, 1)  # ranks share the GPUs there are
            if device.type == "cuda":
                torch.cuda.set_device(device)
        return DistEnv(rank, dist.get_world_size(), rank, backend, device)
    # Every rank, before its first message: sizes travel with p2p messages (DISTLAB_P2P_SIZE_CHECK=0: off).
    p2p.enable_size_check()
    if "RANK" not in os.environ:
        device = resolve_device(0, 1)
        backend = resolve_backend(backend, 1, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        trace.start_rank(0, 1, merge_when_done=True)
        return DistEnv(0, 1, 0, backend, device)
    problem = socket_ifname_problem()  # plain torchrun does not check it before starting the workers
    if problem:
        raise ValueError(problem)
    rank = int(os.environ["RANK"])
    run_timeout_s, timeout_s = timeout_s, timeout_s * timeout_scale()  # DISTLAB_TIMEOUT_SCALE (doctor_watch.py)
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = resolve_device(local_rank, local_world)
    backend = resolve_backend(backend, world_size, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = BoundTCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=(rank == 0 and not agent_store),
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    generation = agree_on_generation(store, rank, world_size)
    store = dist.PrefixStore(f"distlab/generation_{generation}", store)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        die_with_parent()  # the agent: a SIGKILLed agent cannot stop its workers itself
        _quiet_ctrl_c()
    tie_to(os.environ.get(TIE_ENV))
    hang_timeout_s = doctor.watchdog_timeout(os.environ.get(doctor.HANG_TIMEOUT_ENV), run_timeout_s)
    if hang_timeout_s:
        doctor.install(rank)
        # A connection of its own: the watchdog must not queue behind a store call the rank is stuck in.
        # Its calls take milliseconds; a short timeout bounds the wait for one in flight at exit.
        own = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                            timeout=timedelta(seconds=min(timeout_s, max(10.0, hang_timeout_s))),
                            wait_for_workers=False)
        doctor.start_watchdog(dist.PrefixStore(f"distlab/generation_{generation}/doctor", own), rank, world_size,
                              hang_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if "nccl" in backend else None)
    trace.start_rank(rank, world_size, merge_when_done=True)  # DISTLAB_TRACE=DIR: DIR/trace.json when the job ends
    return DistEnv(rank, world_size, local_rank, backend, device)


def _quiet_ctrl_c() -> None:
    """A worker ended by Ctrl-C exits without a traceback: its agent says "stopped by SIGINT" once.

    A terminal's Ctrl-C reaches every process of the job at once (and the agent sends its workers
    SIGINT again): each rank printed its KeyboardInterrupt's traceback, 27-92 lines in all. Installed
    before ``init_process_group``, whose hook (the "[rank0]:" prefix) calls this one and prints what
    it prints: nothing for a KeyboardInterrupt, or an error raised while one was being handled.
    The rank still exits by SIGINT, as Python does after an unhandled KeyboardInterrupt. A Ctrl-C that
    lands in code Python cannot raise from (a weakref callback of an import's lock, a ``__del__``) is
    printed by ``sys.unraisablehook`` as "Exception ignored in ...": silent too (seen in CI, 1 in ~50).
    """
    previous, previous_unraisable = sys.excepthook, sys.unraisablehook

    def hook(kind, value, tb) -> None:
        if any(isinstance(e, KeyboardInterrupt) for e in _chain(value)):
            return
        previous(kind, value, tb)

    def unraisable(info) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):
            previous_unraisable(info)

    sys.excepthook, sys.unraisablehook = hook, unraisable


_REQUESTS = "distlab/generation_requests"  # a queue in the store: "ask:<id>" and "joined:<generation>"


def agree_on_generation(store: dist.Store, rank: int, world_size: int) -> int:
    """A number that is new at every start of the job and the same on all its ranks.

    torchrun reuses one store across elastic restarts, so each start's keys need a prefix of
    their own. Not TORCHELASTIC_RESTART_COUNT: when a node is lost, the agent whose worker
    failed restarts counting one, while an agent that only saw the membership change restarts
    without counting (torch's elastic agent: "membership changes do not count as retries"), so
    the new ranks had different counts and, prefixed by them, waited for each other forever.
    Nor the rendezvous round, which torch does not hand to workers. What all ranks of one start
    share is the store and rank 0: rank 0 takes the next number from a counter, every other rank
    asks rank 0 for it through a queue (blocking pops, no polling) and confirms once it has it.

    The previous start's ranks are all stopped before this start begins (an agent stops its
    workers before it rendezvouses again), so whatever they left in the queue is stale: rank 0
    answers their questions too (no one reads the answers) and counts only confirmations of its
    own generation. A rank that never comes makes the others fail at the store's timeout.

    Collective: every rank of the start must call it (``init_from_env`` does).
    """
    if rank != 0:
        me = uuid.uuid4().hex
        store.queue_push(_REQUESTS, f"ask:{me}")
        generation = int(store.get(f"distlab/generation_answer/{me}"))  # blocks until rank 0 answers
        store.delete_key(f"distlab/generation_answer/{me}")
        store.queue_push(_REQUESTS, f"joined:{generation}")
        return generation
    generation = store.add("distlab/generation", 1)
    joined = 0
    while joined < world_size - 1:
        kind, _, value = store.queue_pop(_REQUESTS).decode().partition(":")
        if kind == "ask":
            store.set(f"distlab/generation_answer/{value}", str(generation))
        elif value == str(generation):  # a confirmation from the previous start is stale
            joined += 1
    return generation


def shutdown() -> None:
    """Destroy the default process group if there is one (call in ``finally``).

    Inside ``run_distributed`` the launcher owns the group and destroys it itself.
    Unreachable objects that still hold communication state (a DDP reducer in a
    reference cycle, a pending send) are collected first, while the group exists.
    """
    doctor.stop_watchdog()  # before the group and its store go: a watch mid-call would abort the rank at exit
    try:
        p2p.flush_size_checks()  # size headers still in flight (CUDA defers their check): a short message raises
    finally:
        if not role.is_rank():  # run_distributed's ranks finish their trace themselves (_child)
            trace.finish_rank()
        gc.collect()
        if dist.is_initialized() and not role.is_rank():
            dist.destroy_process_group()


if __name__ == "__main__":
    if _AGENT_CPP_LOG_OFF:
        os.environ.pop(CPP_LOG_ENV, None)  # the workers' C++ log is as the user set it
    torchrun(sys.argv[1:])
