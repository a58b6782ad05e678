"""Launch errors in one line: what went wrong when a torchrun job could not start or lost node 0, and the fix.

``socket_ifname_problem`` checks GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME before anything starts;
``_launch_error_line`` turns torch's ~40-line rendezvous failure into its cause (a port taken,
node 0 not answering, MASTER_ADDR not resolving); ``RendezvousWatch`` follows the agent's
rendezvous (a line every 30 s while it waits, how many nodes came when it times out, node 0 lost
after the job started). ``python -m distlab.launch`` (``distlab.launch_agent``) prints them; the
course's code imports these names from ``distlab.launch``.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time

from distlab.devices import free_port


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
