"""Strict mode: NCCL's point-to-point rules, checked on gloo (CPU), where nothing else would break.

Strict mode (``DISTLAB_STRICT_P2P=1``, set by the pytest plugin; or ``enable_strict()``)
checks NCCL's rules on every point-to-point operation of ``torch.distributed`` in this
process, ``distlab.p2p``'s or not (it handles ``ProcessGroup.send/recv`` through distlab.intercept):

(a) tags are dropped: messages match by order only, as on NCCL;
(b) the k-th send from a to b and the k-th receive on b from a must agree in bytes,
    dtype and tag (a tag mismatch means the code relied on tags);
(c) no pair of ranks may each send to the other in a launch (a call, or one batch)
    before the launch that receives the other's message: on NCCL both wait forever;
(d) a tensor must live on a device the group's backend serves (a CPU tensor on an
    NCCL group fails on a GPU node). ``simulate_backend("nccl")`` checks that on CPU.

Violations raise ``StrictP2PError`` in the rank that sees them. The checks meet on the
process group's store: each operation writes one small key, so detection does not
depend on timing. Cost: a few store round trips (~0.1 ms each) per message; strict
mode is for tests, not for benchmarks. While it is on, the size check (``distlab.p2p_sizes``)
sends no headers: check (b) covers sizes. The course's code imports these names from
``distlab.p2p``, whose batches are one launch each (``_launch``).
See phase1_data_parallel/guidelines.md#point-to-point-on-nccl.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distlab import intercept, p2p_sizes

STRICT_ENV = "DISTLAB_STRICT_P2P"
BACKEND_ENV = "DISTLAB_STRICT_P2P_BACKEND"  # simulate this backend in check (d), e.g. "nccl"


class StrictP2PError(RuntimeError):
    """A point-to-point pattern that NCCL would reject, mismatch or deadlock on."""


_on: list = []  # while on: its ProcessGroup handlers and its batch observer (distlab.intercept)
_tls = threading.local()
_simulated_backend: list[str] = []


def strict_enabled() -> bool:
    """Whether this process checks NCCL's point-to-point rules (see the module docstring)."""
    return bool(_on)


@contextlib.contextmanager
def _launch():
    """Everything posted inside is one launch (one batch) for check (c); re-entrant."""
    if getattr(_tls, "launch", None) is not None:
        yield
        return
    _tls.launch = {}  # group name -> this launch's index in that group, assigned on first use
    try:
        yield
    finally:
        _tls.launch = None


@contextlib.contextmanager
def simulate_backend(backend: str):
    """Check (d) as if every group ran on ``backend`` ("nccl", "cpu:gloo,cuda:nccl", ...)."""
    _simulated_backend.append(backend)
    try:
        yield
    finally:
        _simulated_backend.pop()


def _backend_for(pg, device: torch.device) -> str | None:
    name = _simulated_backend[-1] if _simulated_backend else os.environ.get(BACKEND_ENV) or str(dist.get_backend(pg))
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(","))
    return table.get(device.type)


@dataclass
class _PairState:
    """This rank's side of one (group, peer) pair."""

    sent: int = 0  # sends posted to the peer so far
    deferred: int = 0  # receives whose check waits for their completion
    received: int = 0  # receives posted from the peer so far
    # My sends whose effect on check (c) is still open: [send index, my launch, peer's recv launch or None]
    live: list = field(default_factory=list)


class _Strict:
    """Per-process state of the checker (one per rank)."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[str, int], _PairState] = {}
        self.launches: dict[str, int] = {}
        self._store = None

    @property
    def store(self):
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def launch_index(self, gname: str) -> int:
        current = getattr(_tls, "launch", None)
        if current is not None and gname in current:
            return current[gname]
        n = self.launches.get(gname, 0)
        self.launches[gname] = n + 1
        if current is not None:
            current[gname] = n
        return n

    @staticmethod
    def key(gname: str, src: int, dst: int, kind: str, k: int) -> str:
        return f"distlab/p2p/{gname}/{src}>{dst}/{kind}{k}"

    @staticmethod
    def describe(launch: int, tensor: torch.Tensor, tagno: int) -> str:
        return f"{launch}|{tensor.numel() * tensor.element_size()}|{str(tensor.dtype).replace('torch.', '')}|{tagno}"

    def check_device(self, pg, tensor: torch.Tensor, what: str) -> None:
        backend = _backend_for(pg, tensor.device)
        if backend is None or (backend == "nccl" and tensor.device.type != "cuda"):
            raise StrictP2PError(
                f"rank {pg.rank()}: {what} of a {tensor.device.type} tensor {tuple(tensor.shape)} on a group "
                f"whose backend for {tensor.device.type} tensors is {backend}: NCCL moves CUDA tensors only; "
                "put the tensor on the rank's device (or give the group a gloo backend for CPU)")

    def on_send(self, pg, tensor: torch.Tensor, dst: int, tagno: int) -> None:
        gname, me = pg.group_name, pg.rank()
        self.check_device(pg, tensor, f"send to group rank {dst}")
        state = self.pairs.setdefault((gname, dst), _PairState())
        launch = self.launch_index(gname)
        k = state.sent
        state.sent += 1
        # Written before the real send: a receiver that completes can always read it.
        self.store.set(self.key(gname, me, dst, "s", k), self.describe(launch, tensor, tagno))
        state.live.append([k, launch, None])
        return k

    @staticmethod
    def blocked_key(gname: str, rank: int) -> str:
        return f"distlab/p2p/{gname}/blocked/{rank}"

    def check_blocked(self, pg, dst: int, j: int) -> None:
        """Check (c) for a rank about to block in its send #j to ``dst`` (its blocked key is set):
        is ``dst`` blocked in a send to us that we have not received, while it has not posted
        the receive of ours? Both ranks write their key before reading the other's, so the
        second of the two always sees the first."""
        gname, me = pg.group_name, pg.rank()
        theirs = self.store.get(self.blocked_key(gname, dst)).decode() if self.store.check(
            [self.blocked_key(gname, dst)]) else ""
        if not theirs:
            return
        target, k = map(int, theirs.split("|"))
        received = self.pairs.setdefault((gname, dst), _PairState()).received
        if target == me and received <= k and not self.store.check([self.key(gname, me, dst, "r", j)]):
            raise StrictP2PError(
                f"rank {me} (group {gname}): ungrouped opposite sends with group rank {dst}: this rank "
                f"waits in its send #{j} to {dst}, which waits in its send #{k} to this rank, and neither "
                "has posted the receive. gloo may or may not get through; NCCL never does: post the two "
                "directions in one batch (distlab.p2p.exchange / send_recv / Outbox)")

    def on_recv(self, pg, tensor: torch.Tensor, src: int, tagno: int):
        """Publish this receive; returns the check to run once it has completed."""
        gname, me = pg.group_name, pg.rank()
        self.check_device(pg, tensor, f"receive from group rank {src}")
        state = self.pairs.setdefault((gname, src), _PairState())
        launch = self.launch_index(gname)
        k = state.received
        state.received += 1
        mine = self.describe(launch, tensor, tagno)
        self.store.set(self.key(gname, src, me, "r", k), mine)
        skey = self.key(gname, src, me, "s", k)
        state.deferred += 1  # checked once it has arrived (one store read; the send is known then)

        def deferred() -> None:
            state.deferred -= 1
            self.match(pg, src, k, mine, self.store.get(skey).decode())  # sent by now: it has arrived

        return deferred

    def match(self, pg, src: int, k: int, mine: str, theirs: str) -> None:
        gname, me = pg.group_name, pg.rank()
        r_launch, r_bytes, r_dtype, r_tag = mine.split("|")
        s_launch, s_bytes, s_dtype, s_tag = theirs.split("|")
        if (r_bytes, r_dtype) != (s_bytes, s_dtype) or r_tag != s_tag:
            why = ("the tags differ: NCCL ignores tags, so the code relied on them"
                   if (r_bytes, r_dtype) == (s_bytes, s_dtype) else "NCCL matches messages by order only")
            raise StrictP2PError(
                f"rank {pg.rank()} (group {gname}): receive #{k} from group rank {src} expects {r_bytes} bytes "
                f"of {r_dtype} (tag {r_tag}), but send #{k} from {src} to {me} is {s_bytes} bytes of "
                f"{s_dtype} (tag {s_tag}): {why}")
        self.check_cycle(pg, src, int(r_launch), int(s_launch))

    def check_cycle(self, pg, peer: int, my_recv_launch: int, their_send_launch: int) -> None:
        """Check (c): I sent y before (in an earlier launch than) receiving x, and the peer sent x
        before receiving y. On NCCL each waits for the other's receive: a deadlock."""
        gname, me = pg.group_name, pg.rank()
        state = self.pairs.setdefault((gname, peer), _PairState())
        still = []
        for entry in state.live:
            y, my_launch, their_recv_launch = entry
            if their_recv_launch is None:
                rkey = self.key(gname, me, peer, "r", y)
                if self.store.check([rkey]):
                    their_recv_launch = entry[2] = int(self.store.get(rkey).decode().split("|")[0])
            if (their_recv_launch is not None and my_launch < my_recv_launch
                    and their_send_launch < their_recv_launch):
                raise StrictP2PError(
                    f"rank {me} (group {gname}): ungrouped opposite sends with group rank {peer}: this rank "
                    f"sends its message #{y} to {peer} in launch {my_launch} and only receives from {peer} in "
                    f"launch {my_recv_launch}, while {peer} sends its message to this rank in launch "
                    f"{their_send_launch} before receiving #{y} in launch {their_recv_launch}. On NCCL a send "
                    "waits for its receive, so both wait forever: post the two directions in one "
                    "batch (distlab.p2p.exchange / send_recv / Outbox)")
            # Once the peer's sends (increasing launches) pass its receive of y, y can never matter
            # again; checks still deferred may come with earlier sends, so keep everything until then.
            if their_recv_launch is None or their_recv_launch > their_send_launch or state.deferred:
                still.append(entry)
        state.live = still


_state: _Strict | None = None


class _CheckedWork:
    """A receive's Work whose ``wait`` also runs the deferred order check."""

    def __init__(self, work, check) -> None:
        self._work, self._check = work, check

    def wait(self, *args, **kwargs):
        try:
            result = self._work.wait(*args, **kwargs)
        except Exception:
            self._run_check()  # a clearer reason than gloo's, if there is one
            raise
        self._run_check()
        return result

    def _run_check(self) -> None:
        check, self._check = self._check, None
        if check is not None:
            check()

    def __getattr__(self, name):
        return getattr(self._work, name)


class _CheckedSendWork(_CheckedWork):
    """A send's Work: before blocking in ``wait``, check (c) for a peer blocked in a send to us."""

    def __init__(self, work, pg, dst: int, k: int) -> None:
        super().__init__(work, None)
        self._pg, self._dst, self._k = pg, dst, k

    def wait(self, *args, **kwargs):
        pg, me = self._pg, self._pg.rank()
        if self._work.is_completed() or _state.store.check([_state.key(pg.group_name, me, self._dst, "r", self._k)]):
            return self._work.wait(*args, **kwargs)  # its receive is posted: this send cannot block for good
        key = _state.blocked_key(pg.group_name, me)
        _state.store.set(key, f"{self._dst}|{self._k}")
        _state.check_blocked(self._pg, self._dst, self._k)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            _state.store.set(key, "")


# ProcessGroup handlers (distlab.intercept): ``inner`` is the method's next step inward.
def _strict_send(inner, self, tensors, dst, tag):
    ks = [_state.on_send(self, t, dst, tag) for t in tensors]
    work = inner(self, tensors, dst, 0)  # (a): tags mean nothing on NCCL
    return _CheckedSendWork(work, self, dst, ks[-1])


def _strict_recv(inner, self, tensors, src, tag):
    checks = [_state.on_recv(self, t, src, tag) for t in tensors]
    work = inner(self, tensors, src, 0)
    checks = [c for c in checks if c is not None]
    if not checks:
        return work
    return _CheckedWork(work, lambda: [c() for c in checks])


def _strict_recv_anysource(inner, self, tensors, tag):
    raise StrictP2PError(f"rank {self.rank()}: a receive from any source: NCCL has none; receive from a "
                         "known rank (the schedule says who sends next) or use a collective")


def _strict_batch(call: intercept.Call):
    with _launch():  # a raw dist.batch_isend_irecv is one launch too (this module marks its own batches itself)
        yield


def enable_strict() -> None:
    """Check NCCL's point-to-point rules in this process from now on (idempotent)."""
    global _state
    if _on:
        return
    p2p_sizes.strict_started()  # strict check (b) covers sizes: messages go without headers
    _state = _Strict()
    _on.append(intercept.handle("p2p_strict", {"send": _strict_send, "recv": _strict_recv,
                                               "recv_anysource": _strict_recv_anysource}))
    # Observed through distlab.intercept, outermost: the doctor and the ledgers see the same batches.
    _on.append(intercept.subscribe("p2p_strict", _strict_batch, ops=("batch_isend_irecv",)))


def disable_strict() -> None:
    """Undo ``enable_strict`` (tests of the checker itself)."""
    global _state
    while _on:
        _on.pop().cancel()
    _state = None
    p2p_sizes.strict_ended()


if os.environ.get(STRICT_ENV, "") not in ("", "0"):
    enable_strict()
