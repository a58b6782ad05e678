"""Start a rank under torchrun: ``init_from_env``; and ``python -m distlab.launch``, torchrun made safer.

``init_from_env()`` is what every script calls first: it reads RANK/WORLD_SIZE/LOCAL_RANK, puts
the script on ``cuda:LOCAL_RANK`` with "cpu:gloo,cuda:nccl" when every local rank has a GPU (the
CPU and gloo otherwise), and runs as rank 0 of 1 without torchrun. ``shutdown()`` ends it.

``python -m distlab.launch ARGS`` is ``torchrun ARGS`` (``entrypoint.sh`` uses it) whose rendezvous
store listens only on the address it names, and whose failures end in a few lines: the failing
rank's error, or the launch error (port taken, node 0 unreachable, a wrong interface, nodes missing
at the rendezvous timeout, node 0 lost mid-run) with its fix; a line every 30 s while it waits for
the other nodes; one line for a Ctrl-C.

The rest of the bench's launching lives beside it: ``distlab.spawn`` (``run_distributed``, the
tests' and demos' launcher), ``distlab.devices`` (device and backend), ``distlab.procs``
(nothing outlives a run).
"""
from __future__ import annotations

import gc
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

TRACEBACK_ENV = "DISTLAB_TRACEBACK"  # "1": torch's traceback and C++ log above the one-line launch error
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
# `python -m distlab.launch`, the torchrun agent: torch's C++ log is off in it (its store client logs
# every failed connection attempt with ~17 lines of C++ frames: 23 lines before an unreachable node 0
# was named). The agent's store and rendezvous errors reach Python as exceptions all the same, and end
# in the one-line cause or in torch's traceback. torch reads the level once, when it loads: hence here,
# before `import torch`. The workers get the user's setting back (torchrun()); a level the user set,
# or DISTLAB_TRACEBACK=1, keeps the agent's log too.
_AGENT_CPP_LOG_OFF = (__name__ == "__main__" and CPP_LOG_ENV not in os.environ
                      and os.environ.get(TRACEBACK_ENV, "") in ("", "0"))
if _AGENT_CPP_LOG_OFF:
    os.environ[CPP_LOG_ENV] = "FATAL"

import torch  # noqa: E402 (after the C++ log level above)
import torch.distributed as dist  # noqa: E402

from distlab import doctor, p2p, spawn, trace
from distlab.devices import DEVICE_ENV, free_port, loopback_interface, resolve_backend, resolve_device
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
    hang_timeout_s = doctor.watchdog_timeout(os.environ.get(doctor.HANG_TIMEOUT_ENV), timeout_s)
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
    The rank still exits by SIGINT, as Python does after an unhandled KeyboardInterrupt.
    """
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if any(isinstance(e, KeyboardInterrupt) for e in _chain(value)):
            return
        previous(kind, value, tb)

    sys.excepthook = hook


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
        if not spawn._IN_RUN_DISTRIBUTED:  # run_distributed's ranks finish their trace themselves (_child)
            trace.finish_rank()
        gc.collect()
        if dist.is_initialized() and not spawn._IN_RUN_DISTRIBUTED:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- torchrun, bound to what the user names
class BoundTCPStore(dist.TCPStore):
    """A TCPStore whose server listens on ``host_name``'s address only, not on every interface.

    torch's TCPStore server binds the wildcard address (all interfaces, IPv4 and IPv6)
    whatever host it is given; a socket bound here and handed over as ``master_listen_fd``
    keeps a single-node job's rendezvous on 127.0.0.1 and a multi-node one on MASTER_ADDR.
    """

    def __init__(self, host_name: str, port: int, *args: Any, is_master: bool = False, **kwargs: Any) -> None:
        self._listener = None
        if is_master and kwargs.get("master_listen_fd") is None:
            try:
                family, _, _, _, address = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)[0]
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(address)
                listener.listen(1024)
            except OSError:  # not an address of this machine (or taken): torch's own binding and error
                pass
            else:
                port = listener.getsockname()[1]
                kwargs["master_listen_fd"] = listener.fileno()
                self._listener = listener  # the server uses the descriptor: keep it open
        super().__init__(host_name, port, *args, is_master=is_master, **kwargs)


# --------------------------------------------------------------------------- launch errors, in one line


def socket_ifname_problem() -> str | None:
    """What is wrong with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, with the fix; None when both are fine.

    gloo takes a comma-separated list of interface names, each of which must exist; NCCL takes
    prefixes ("eth" matches eth0), "=name" for exact names and "^name" to exclude (not checked).
    Either fails deep inside the process group ("Unable to find address for: eht0") otherwise.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(var, "").strip()
        if not value or value.startswith("^"):
            continue
        wanted = [w for w in value.split(",") if w]
        if var == "GLOO_SOCKET_IFNAME":
            missing = [w for w in wanted if w not in names]
        elif value.startswith("="):
            missing = [] if any(w.lstrip("=") in names for w in wanted) else wanted
        else:
            missing = [] if any(n.startswith(w) for w in wanted for n in names) else wanted
        if missing:
            # An Ethernet or InfiniBand name if there is one (not docker0, veth*, ifb*): what connects nodes
            example = next((n for n in names if n.startswith(("eth", "en", "ib"))), "eth0")
            return (f"{var}={value} names no network interface of this machine ({', '.join(missing)} not "
                    f"found; it has: {', '.join(names)}): set it to the interface that reaches the other "
                    f"nodes (`ip -br addr` shows their addresses), e.g. {var}={example}, or unset it")
    return None


def _resolves(host: str, within_s: float = 10.0) -> bool | None:
    """Whether ``host`` resolves here; None when the resolver did not answer within ``within_s``."""
    answer: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            answer.append(True)
        except (OSError, UnicodeError):
            answer.append(False)

    thread = threading.Thread(target=lookup, name="distlab-resolve", daemon=True)  # getaddrinfo has no timeout
    thread.start()
    thread.join(within_s)
    return answer[0] if answer else None


def _unresolved(host: str) -> str:
    return (f"MASTER_ADDR {host} does not resolve on this node: use node 0's host name as this node sees it "
            f"(`getent hosts {host}` must print its address), or its IP address (MASTER_ADDR=10.0.0.1)")


def _launch_error_line(exc: BaseException, endpoint: str | None) -> str | None:
    """One line naming the cause of a failed rendezvous start and its fix; None for other errors.

    torch reports both a taken port and an unreachable node 0 as "The connection to the C10d
    store has failed" after some 40 lines; the cause is in the chained exceptions.
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    text = "\n".join(chain)
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    except ValueError:
        host, port = endpoint or "?", 29400
    if re.search(r"EADDRINUSE|address already in use", text, re.I):
        return (f"port {port} is already in use on this node, so it cannot host the rendezvous at "
                f"{host}:{port}: choose another port, the same on every node (MASTER_PORT={free_port()} "
                f"./entrypoint.sh), or free it (`ss -ltnp 'sport = :{port}'` names the process holding it)")
    if not re.search(r"trying to connect|Connection refused|No route to host|Network is unreachable|"
                     r"failed to connect|RendezvousConnectionError", text, re.I):
        return None
    if _resolves(host) is False:
        return _unresolved(host)
    waited = re.search(r"timed out after (\d+)ms", text)
    within = f" within {int(waited.group(1)) / 1000:g} s" if waited else ""
    return (f"nobody answered at {host}:{port}{within}, where node 0 hosts the rendezvous: check that node 0 "
            f"is started (NODE_RANK=0, same MASTER_PORT), that {host} is its address (`getent hosts {host}`), "
            f"that this node has a route to it (`ip route get <its address>`) and that no firewall drops port "
            f"{port} (`python -c \"import socket; socket.create_connection(('{host}', {port}), 3)\"`)")


# --------------------------------------------------------------------------- the agent's rendezvous, watched
def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and len(seen) < 10:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


_STORE_LOST = re.compile(r"RendezvousConnectionError|Connection reset|Broken pipe|Connection refused|"
                         r"Connection closed|failed to connect|trying to connect|No route to host|"
                         r"Network is unreachable|timed out", re.I)


class RendezvousWatch:
    """What this agent saw of its rendezvous: how many nodes joined, and when the job started.

    ``python -m distlab.launch`` wraps the c10d rendezvous with it (``wrap``), so that

    * a node waiting for the others says so every ``interval_s`` (30 s at torch's default
      join timeout of 600 s): "waiting for 1 of 2 nodes at ADDR:PORT (1 joined), 30 s of 600";
    * a rendezvous that times out ends in one line saying how many nodes came and what to check
      (``timeout_line``), not a bare RendezvousTimeoutError;
    * a store lost after the job started is told apart from one that never answered
      (``lost_line``): node 0 was there, and went away at a known time.
    """

    def __init__(self, endpoint: str | None, say=None) -> None:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        self.endpoint = endpoint
        self.host, self.port = parse_rendezvous_endpoint(endpoint, default_port=29400) if endpoint else ("?", 0)
        self.say = say or (lambda line: print(f"distlab.launch: {line}", file=sys.stderr, flush=True))
        self.started_at: float | None = None  # wall-clock time of the first rendezvous that completed
        self.joined, self.min_nodes, self.timeout_s = 0, 0, 0.0

    @staticmethod
    def interval(timeout_s: float) -> float:
        """Seconds between two "waiting for" lines: 30 at the default 600 s, 1 at 20 s or less."""
        return min(30.0, max(1.0, timeout_s / 20))

    def _count(self, handler) -> int:
        try:  # torch's private state (refreshed by the joining thread about once a second)
            return len(handler._state_holder.state.participants)
        except AttributeError:
            return self.joined

    def wrap(self, next_rendezvous):
        """``DynamicRendezvousHandler.next_rendezvous``, reporting while it waits."""
        watch = self

        def watched(handler):
            settings = handler._settings
            watch.min_nodes, watch.timeout_s = settings.min_nodes, settings.timeout.join.total_seconds()
            stop, began = threading.Event(), time.monotonic()

            def report() -> None:
                while not stop.wait(watch.interval(watch.timeout_s)):
                    watch.joined = watch._count(handler)
                    if watch.joined < watch.min_nodes:
                        watch.say(f"waiting for {watch.min_nodes - watch.joined} of {watch.min_nodes} nodes at "
                                  f"{watch.endpoint} ({watch.joined} joined), {time.monotonic() - began:.0f} s "
                                  f"of {watch.timeout_s:g}")

            reporter = threading.Thread(target=report, name="distlab-rendezvous-progress", daemon=True)
            reporter.start()
            try:
                info = next_rendezvous(handler)
            finally:
                stop.set()
                reporter.join()
            watch.joined = watch._count(handler)  # (after a timeout torch has taken this node out: the last look stays)
            if watch.started_at is None:
                watch.started_at = time.time()
            return info

        return watched

    def timeout_line(self, exc: BaseException) -> str | None:
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

        if not any(isinstance(e, RendezvousTimeoutError) for e in _chain(exc)):
            return None
        joined = max(1, min(self.joined, self.min_nodes - 1))  # this node, at least, was there
        return (f"only {joined} of {self.min_nodes} nodes joined the rendezvous at {self.endpoint} within "
                f"{self.timeout_s:g} s, so the job never started: start the missing node(s) with NNODES="
                f"{self.min_nodes} and the same MASTER_ADDR, MASTER_PORT and RDZV_ID; a node that is started but "
                f"cannot reach {self.endpoint} says so in its own log; RDZV_TIMEOUT=<seconds> waits longer")

    def lost_line(self, exc: BaseException | None = None) -> str | None:
        """Node 0 (the rendezvous store's host) gone after the job started; None if it never started or
        the error is not about the store. With no ``exc`` (the workers failed first), node 0 counts as
        lost when it no longer accepts a connection."""
        if self.started_at is None or self.endpoint is None:
            return None
        now = time.time()
        if exc is not None:
            if not _STORE_LOST.search("\n".join(f"{type(e).__name__}: {e}" for e in _chain(exc))):
                return None
        else:
            try:
                socket.create_connection((self.host, self.port), timeout=2).close()
                return None  # node 0 still answers: the workers' own error is the cause
            except OSError:
                pass
        clock = time.strftime("%H:%M:%S", time.localtime(now))
        since = time.strftime("%H:%M:%S", time.localtime(self.started_at))
        after = ("this node's workers were stopped" if exc is not None
                 else "the workers' errors above follow from that")
        return (f"lost node 0 at {self.endpoint} (the host of the rendezvous) at {clock}, {now - self.started_at:.0f} s "
                f"into the job: it had answered since the job started ({since}), then its agent ended (its own "
                f"workers failed, it was stopped or killed, or its machine went down) or the network to it failed; "
                f"{after}. Node 0's log says which; then start the job again on every node")


class _AgentLogFilter(logging.Filter):
    """torch's agent warnings that only restate what the last line says: a death signal and the
    closing signal it sends each worker (a Ctrl-C), a rendezvous it cannot shut down (its store is gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if "death signal" in message:
            self.stopping = True
            return False
        if "has failed to shutdown the rendezvous" in message:
            return False
        return not (self.stopping and "closing signal" in message)


def torchrun(argv: list[str]) -> None:
    """``torchrun`` (same arguments) whose rendezvous stores listen only on the address they name.

    ``entrypoint.sh`` runs it as ``python -m distlab.launch ...``: with ``--standalone`` it adds
    ``--local-addr=127.0.0.1`` and GLOO_SOCKET_IFNAME=lo, so a one-machine job listens on loopback only.
    A failed job ends with ``distlab.todo.summarize_failure``'s few lines (the first failing rank
    and its error, once) and exit code 1, not torchrun's traceback and report of every rank.
    A start that fails ends with one line naming the cause and the fix, not torch's ~40-line
    traceback (``DISTLAB_TRACEBACK=1`` prints it above, with torch's C++ log): MASTER_PORT in use on
    node 0, node 0 not answering at MASTER_ADDR:MASTER_PORT, MASTER_ADDR not resolving, nodes
    missing when the rendezvous times out (``RendezvousWatch``; a line every 30 s while it waits),
    and (exit code 2, before any worker starts) GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming no
    interface of this machine. Node 0 lost after the job started is said as such (``lost_line``),
    not as a start that failed. Ctrl-C (SIGINT, or SIGTERM) ends the job with one line and exit
    code 128 + the signal; the workers (``init_from_env``) print nothing for it.
    """
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    tie_to(os.environ.get(TIE_ENV))  # under a test: the agent dies with the test's pytest, then its workers with it
    if _AGENT_CPP_LOG_OFF:
        os.environ.pop(CPP_LOG_ENV, None)  # the workers' C++ log is as the user set it
    if "--standalone" in argv:
        if not any(a.startswith(("--local-addr", "--local_addr")) for a in argv):
            argv = ["--local-addr=127.0.0.1", *argv]
        loopback = loopback_interface()
        if loopback:  # gloo's and NCCL's listening sockets, in every worker
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    args = run.parse_args(argv)
    problem = socket_ifname_problem()
    if problem:  # before any worker starts: each would fail with gloo's or NCCL's own words
        print(f"distlab.launch: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    if not args.standalone and args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        host = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)[0]
        if _resolves(host) is False:  # at once, not after torch's connection attempts (2 x 60 s by default)
            print(f"distlab.launch: {_unresolved(host)}", file=sys.stderr, flush=True)
            sys.exit(1)
    endpoint = None if args.standalone else args.rdzv_endpoint
    watch = RendezvousWatch(endpoint)
    DynamicRendezvousHandler.next_rendezvous = watch.wrap(DynamicRendezvousHandler.next_rendezvous)
    quiet = _AgentLogFilter()
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.rendezvous.dynamic_rendezvous"):
        logging.getLogger(name).addFilter(quiet)
    dist.TCPStore = c10d_rendezvous_backend.TCPStore = BoundTCPStore
    try:
        run.run(args)  # run.main without its @record, which logs that this agent has no error file
    except ChildFailedError as exc:
        from distlab.todo import summarize_failure

        summary = summarize_failure(exc)
        print(summary, file=sys.stderr, flush=True)
        # Node 0 gone, and the workers' error is one a lost peer causes (a closed connection, a signal):
        # then that is the news. A worker's own error (a ValueError, a TODO) stays the last word.
        first = summary.splitlines()[0]
        lost = watch.lost_line() if re.search(f"{_STORE_LOST.pattern}|no error recorded", first, re.I) else None
        if lost:
            print(f"distlab.launch: {lost}", file=sys.stderr, flush=True)
        sys.exit(1)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"distlab.launch: stopped by {name}{' (Ctrl-C)' if exc.sigval == signal.SIGINT else ''}: this node's "
              f"workers were ended", file=sys.stderr, flush=True)
        sys.exit(128 + int(exc.sigval))
    except Exception as exc:
        line = watch.timeout_line(exc) or watch.lost_line(exc) or _launch_error_line(exc, endpoint)
        if line is None:
            raise
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exc()
        # The last thing the user reads: the cause and what to change (DISTLAB_TRACEBACK=1 shows torch's traceback)
        print(f"distlab.launch: {line}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    torchrun(sys.argv[1:])
