"""``python -m distlab.launch``: torchrun whose stores listen only on the address they name, its failures in a few lines.

``torchrun(argv)`` is ``torchrun ARGV`` (``entrypoint.sh`` runs it through ``python -m distlab.launch``)
whose rendezvous store listens only on the address it names (``BoundTCPStore``), and whose failures
end in a few lines: the failing rank's error, or the launch error (``distlab.launch_errors``) with
its fix; a line every 30 s while it waits for the other nodes; one line for a Ctrl-C. The wait for the
other nodes follows progress (``JoinDeadline``): the join timeout times DISTLAB_TIMEOUT_SCALE, then longer while
the nodes keep coming, and a node still starting at the hard cap is said slow, not missing. The course's
code imports these names from ``distlab.launch``, whose ``__main__`` calls ``torchrun``.
"""
from __future__ import annotations

import logging
import math
import os
import re
import signal
import socket
import sys
import time
import traceback
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from distlab import doctor_watch
from distlab.devices import loopback_interface
from distlab.launch_errors import (RendezvousWatch, _STORE_LOST, _chain, _launch_error_line, _resolves, _unresolved,
                                   socket_ifname_problem)
from distlab.procs import TIE_ENV, tie_to

# "1": torch's traceback and C++ log above the one-line launch error (distlab/launch.py reads it too,
# before torch is imported, to leave the agent's C++ log on).
TRACEBACK_ENV = "DISTLAB_TRACEBACK"


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


# --------------------------------------------------------------------------- a join deadline driven by progress
def scaled_join_timeout(rdzv_conf: str) -> str:
    """torchrun's ``--rdzv_conf`` with its join timeout (torch's default 600 s) times DISTLAB_TIMEOUT_SCALE."""
    conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
    conf["join_timeout"] = f"{max(1, round(float(conf.get('join_timeout', 600)) * doctor_watch.timeout_scale()))}"
    return ",".join(f"{key}={value}" for key, value in conf.items())


def _peer_agents(endpoint: str) -> list[int]:
    """Launchers on this machine (torchrun, ``distlab.launch``) naming ``endpoint`` in their command line,
    other than this process: the nodes of this job that run here (a test's, or several agents on one host)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        launchers = ("distlab.launch", "torchrun", "torch.distributed.run")
        if any(endpoint in a for a in args) and any(name in a for a in args for name in launchers):
            found.append(pid)
    return found


class SlowRendezvous(RendezvousTimeoutError):
    """The rendezvous ran past its hard cap while the missing nodes were still starting (its one line)."""


class JoinDeadline:
    """The join timeout of torch's c10d rendezvous, driven by progress as ``run_distributed``'s deadline is.

    torch gives up on the missing nodes when the join timeout (already scaled: ``scaled_join_timeout``)
    passes. Here, past it, the rendezvous waits while the nodes show signs of coming, up to
    ``doctor_watch.hard_cap_s``: a node joined (or left) within the last ``WINDOW_S``, or an agent of the
    job on this machine that has not joined yet used CPU (importing torch on a busy machine). A node
    elsewhere shows nothing before it joins: it never came, as far as this node can tell.
    """

    WINDOW_S = 3.0  # a sign counts this long: a busy machine's peer gets the CPU in bursts, looks are 0.5 s apart

    def __init__(self, timeout_s: float, endpoint: str | None) -> None:
        self.timeout_s, self.endpoint = timeout_s, endpoint
        self.start = time.monotonic()
        self.cap = self.start + doctor_watch.hard_cap_s(timeout_s)
        self.members: object = None
        self.peers = doctor_watch.Looks()
        self.looked = self.last_sign = self.over_at = None
        self.slow = False

    def _signs(self, state) -> bool:
        members = (frozenset(state.participants), frozenset(state.wait_list))
        joined = {node.pid for node in members[0] | members[1]}
        sign = self.members is not None and members != self.members
        self.members = members
        peers = [p for p in _peer_agents(self.endpoint) if p not in joined] if self.endpoint else []
        return self.peers.look(peers)[0] or sign

    def check(self, state) -> float:
        """The deadline to give torch's join step: infinity while the join may wait, else when the wait ended."""
        if self.over_at is not None:
            return self.over_at
        now = time.monotonic()
        # Signs are looked for from WINDOW_S before the timeout on (a /proc scan every 0.5 s, not for 600 s)
        if now >= self.start + self.timeout_s - self.WINDOW_S and (self.looked is None or now - self.looked >= 0.5):
            self.looked = now
            if self._signs(state):
                self.last_sign = now
        if now < self.start + self.timeout_s:
            return math.inf
        coming = self.last_sign is not None and now - self.last_sign <= self.WINDOW_S
        if coming and now < self.cap:
            return math.inf
        self.slow, self.over_at = coming, now
        return now

    def slow_line(self, joined: int, min_nodes: int) -> str:
        return doctor_watch.slow_machine(None, self.over_at - self.start, f"{joined} of {min_nodes} nodes joined the "
                                         f"rendezvous at {self.endpoint} in {self.over_at - self.start:.0f} s and the "
                                         f"others were still starting")


def progress_driven(next_rendezvous, endpoint: str | None):
    """``DynamicRendezvousHandler.next_rendezvous`` whose join step waits by ``JoinDeadline``, not a fixed time."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousJoinOp

    def joined(handler):
        deadline = JoinDeadline(handler._settings.timeout.join.total_seconds(), endpoint)
        run = handler._op_executor.run

        def run_with(state_handler, op_deadline, update_deadline=None):
            if isinstance(state_handler, _RendezvousJoinOp):  # torch's rollback and timeout, at our moment
                return run(lambda ctx, _: state_handler(ctx, deadline.check(ctx.state)), op_deadline, update_deadline)
            return run(state_handler, op_deadline, update_deadline)

        handler._op_executor.run = run_with
        try:
            return next_rendezvous(handler)
        except RendezvousTimeoutError as exc:
            if deadline.slow:
                joined_ = len(deadline.members[0]) if deadline.members else 1
                raise SlowRendezvous(deadline.slow_line(max(1, joined_), handler._settings.min_nodes)) from exc
            raise
        finally:
            del handler._op_executor.run

    return joined


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
    missing when the rendezvous times out (``RendezvousWatch``; a line every 30 s while it waits; past the
    scaled join timeout it waits on while nodes keep coming, ``JoinDeadline``, then says "slow machine ..."),
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
    if not args.standalone:  # DISTLAB_TIMEOUT_SCALE on the wait for the other nodes; past it, their progress
        args.rdzv_conf = scaled_join_timeout(args.rdzv_conf)
    watch = RendezvousWatch(endpoint)
    DynamicRendezvousHandler.next_rendezvous = watch.wrap(progress_driven(DynamicRendezvousHandler.next_rendezvous,
                                                                          endpoint))
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
        slow = next((e for e in _chain(exc) if isinstance(e, SlowRendezvous)), None)
        line = str(slow) if slow else (watch.timeout_line(exc) or watch.lost_line(exc)
                                       or _launch_error_line(exc, endpoint))
        if line is None:
            raise
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exc()
        # The last thing the user reads: the cause and what to change (DISTLAB_TRACEBACK=1 shows torch's traceback)
        print(f"distlab.launch: {line}", file=sys.stderr, flush=True)
        sys.exit(1)
