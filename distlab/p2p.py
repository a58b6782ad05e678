"""NCCL-safe point-to-point messages, and a strict mode that checks NCCL's rules on gloo.

gloo (CPU, what the tests run) forgives three things that NCCL (GPU) does not:

* **Tags.** NCCL has no tags: torch's NCCL process group ignores them, and the k-th
  send from rank a to rank b meets the k-th receive on b from a, whatever the tags.
* **Any-source receives.** ``dist.recv(t)`` without a source does not exist on NCCL.
* **Buffering.** NCCL launches point-to-point operations in order on a stream, and a
  send may wait until its receive is posted. Two ranks that each first send to the
  other, then receive (separately), can wait for each other forever; gloo buffers
  the messages and lets the same code run. Sends and receives that must happen at
  once go in one group: ``dist.batch_isend_irecv`` (ncclGroupStart/End underneath).

This module is the one way the course's code sends messages: every call below is one
grouped launch (``batch_isend_irecv``), peers are *group* ranks, nothing takes a tag
or receives from "anyone", and empty tensors are skipped (both ends know the sizes).

    exchange(send, recv, peer)            swap with one neighbour (grouped both ways)
    send_recv(send=a, to=r, recv=b, frm=l) ring step: send right, receive left, grouped
    batch(sends, recvs)                   any set of sends and receives, grouped; async
    send(t, to) / recv(t, frm)            one-sided, when the peer only receives / sends
    Outbox                                 pipelines: a send leaves with the next receive
    Inbox                                  senders announce themselves; the receiver names each one

Strict mode (``DISTLAB_STRICT_P2P=1``, set by the pytest plugin; or ``enable_strict()``)
checks NCCL's rules on every point-to-point operation of ``torch.distributed`` in this
process, this module's or not (it wraps ``ProcessGroup.send/recv``):

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
mode is for tests, not for benchmarks.

The size check (``enable_size_check()``, on wherever the course's code runs: ``init_from_env``
and the test launcher's ranks call it; ``DISTLAB_P2P_SIZE_CHECK=0`` turns it off) catches the one
mistake gloo lets through silently, strict mode or not: a message shorter than its receive buffer
(rank 0 sends 4 floats, rank 1 receives into 8 and keeps 4 stale values), or of another dtype.
Each send carries a 16-byte header (its bytes and dtype) as a second message in the same launch;
the receive compares it with its buffer when it completes and raises ``P2PSizeError``. Cost: one
tiny extra message per message (``benchmarks/bench_p2p_check.py`` measures it). On CUDA no host sync:
the header is copied to the host without blocking and checked at a later receive, once it has landed,
or at ``flush_size_checks()`` (one sync for all). Every rank must agree on the setting (the header is
part of the wire format). Under strict mode the strict checks (b) already cover it, so no header.
See phase1_data_parallel/guidelines.md#point-to-point-on-nccl.
"""
from __future__ import annotations

import contextlib
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from distlab.metrics import nbytes

STRICT_ENV = "DISTLAB_STRICT_P2P"
BACKEND_ENV = "DISTLAB_STRICT_P2P_BACKEND"  # simulate this backend in check (d), e.g. "nccl"
SIZE_CHECK_ENV = "DISTLAB_P2P_SIZE_CHECK"  # "0": no size header on messages (every rank alike)


class StrictP2PError(RuntimeError):
    """A point-to-point pattern that NCCL would reject, mismatch or deadlock on."""


class P2PSizeError(RuntimeError):
    """A message whose size or dtype differs from its receive buffer's (gloo accepts a shorter one)."""


# --------------------------------------------------------------------------- the layer
class P2PWork:
    """The pending operations of one launch; ``wait()`` waits for all of them."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def batch(sends: Iterable[tuple[torch.Tensor, int]] = (), recvs: Iterable[tuple[torch.Tensor, int]] = (),
          group: dist.ProcessGroup | None = None) -> P2PWork:
    """Post ``sends`` and ``recvs`` (pairs ``(tensor, group_rank)``) as one grouped launch.

    Asynchronous: returns at once; ``wait()`` before reading a received tensor or writing a
    sent one. Between one pair of ranks, messages in one direction match in the order they
    are posted, here and in later launches. Empty tensors are skipped.

    Equivalent to: ``dist.batch_isend_irecv`` with ``P2POp(dist.isend/irecv, ...)``.
    Collective: every peer named must post the matching operations, in the same order.
    Cost: the bytes of the sends out, of the receives in; one launch.
    """
    group = dist.group.WORLD if group is None else group  # explicit: wrappers (ledger, doctor) see the group
    ops = [(True, _contiguous(t, "send"), peer) for t, peer in sends if t.numel()]
    ops += [(False, _contiguous(t, "recv"), peer) for t, peer in recvs if t.numel()]
    if not ops:
        return P2PWork([])
    with _launch():
        if len(ops) == 1:
            # One operation is a launch by itself; plain isend/irecv also spares NCCL the rule that
            # a group's first batch_isend_irecv must involve all of its ranks (torch's docs).
            is_send, tensor, peer = ops[0]
            return P2PWork([dist.isend(tensor, group=group, group_dst=peer) if is_send
                            else dist.irecv(tensor, group=group, group_src=peer)])
        return P2PWork(list(dist.batch_isend_irecv(
            [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, group=group, group_peer=peer)
             for is_send, tensor, peer in ops])))


def _contiguous(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if what == "recv" and not tensor.is_contiguous():
        raise ValueError(f"a receive buffer must be contiguous (got strides {tensor.stride()}): "
                         "receive into a contiguous tensor and copy it into place")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def send_recv(send: torch.Tensor | None = None, to: int | None = None, recv: torch.Tensor | None = None,
              frm: int | None = None, group: dist.ProcessGroup | None = None,
              async_op: bool = False) -> P2PWork | None:
    """Send ``send`` to group rank ``to`` and receive ``recv`` from group rank ``frm``, grouped.

    The ring step: every rank sends right and receives left at once. Either side may be
    None (the ends of a line). Waits unless ``async_op``.

    Equivalent to: ``dist.isend(send, to)`` + ``dist.irecv(recv, frm)``, waited, but safe on NCCL.
    Collective: ``to`` must receive from this rank and ``frm`` send to it in the same order.
    Cost: ``send.nbytes`` out, ``recv.nbytes`` in, one launch.
    """
    work = batch([(send, to)] if send is not None else [], [(recv, frm)] if recv is not None else [], group)
    if async_op:
        return work
    work.wait()
    return None


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None,
             async_op: bool = False) -> P2PWork | None:
    """Swap with group rank ``peer``: send ``send`` and receive ``recv``, grouped (``peer`` does the same).

    Equivalent to: each rank's ``send`` landing in the other's ``recv``.
    Collective: both ranks call it together. Cost: ``send.nbytes`` out, ``recv.nbytes`` in.
    """
    return send_recv(send, peer, recv, peer, group, async_op)


def send(tensor: torch.Tensor, to: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``tensor`` to group rank ``to`` and wait until it may be reused.

    Only for a peer that is, or will be, waiting in the matching receive: if ``to`` first
    sends to this rank, use ``exchange``/``send_recv`` instead (NCCL would deadlock).
    Collective: ``to`` calls ``recv`` from this rank. Cost: ``tensor.nbytes`` out.
    """
    batch([(tensor, to)], (), group).wait()


def recv(tensor: torch.Tensor, frm: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into ``tensor`` (contiguous) from group rank ``frm``; returns ``tensor``.

    Collective: ``frm`` calls ``send`` (or posts a send) to this rank. Cost: ``tensor.nbytes`` in.
    """
    batch((), [(tensor, frm)], group).wait()
    return tensor


class Outbox:
    """Sends that leave together with this rank's next receive (pipelines: send forward / receive backward).

    ``put(t, peer)`` queues a send; ``recv(buf, peer)`` posts every queued send and the
    receive as one launch and waits for the receive (``recv_all`` for several receives
    in one launch); ``flush()`` posts the queued sends
    alone (before work that receives nothing); ``finish()`` flushes and waits for every
    send. In 1F1B's steady state a stage sends an activation forward and receives a
    gradient back from the same neighbour: grouped, NCCL needs no buffering for it.

    A queued tensor is sent as it is when posted: do not modify it after ``put``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._queued: list[tuple[torch.Tensor, int]] = []
        self._pending: list[P2PWork] = []

    def put(self, tensor: torch.Tensor, peer: int) -> None:
        self._queued.append((tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        self.recv_all([(tensor, peer)])
        return tensor

    def recv_all(self, recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Post every queued send and all of ``recvs`` as one launch; wait for the receives.

        Receives that must be in flight together go here, not in successive ``recv`` calls:
        a launch on NCCL waits for the one before it, sends included. With none, a ``flush``.
        """
        recvs = [(t, peer) for t, peer in recvs if t.numel()]
        if not recvs:
            self.flush()
            return
        sends, self._queued = self._queued, []
        work = batch(sends, recvs, self.group)
        # Wait for the receives only (the last ops; a backend that returns one handle per batch
        # waits for all): the sends are waited for in finish(), their buffers kept until then.
        nsends = max(len(work.works) - len(recvs), 0)
        receive = work.works[nsends:]
        work.works = work.works[:nsends]
        P2PWork(receive).wait()
        self._pending.append(work)

    def flush(self) -> None:
        if self._queued:
            sends, self._queued = self._queued, []
            self._pending.append(batch(sends, (), self.group))

    def finish(self) -> None:
        self.flush()
        for work in self._pending:
            work.wait()
        self._pending.clear()


class Inbox:
    """Messages to one rank from senders it cannot name in advance (a parameter server's workers).

    NCCL has no any-source receive, and a receive posted for a rank that is not sending
    holds up every launch behind it. So a sender first *announces* itself in the
    receiver's inbox, then posts its send as usual; the receiver takes the announcements
    in the order they were made (``next``) and receives from exactly that rank. The
    announcements travel on the process group's key-value store (the one every group
    has for its rendezvous): a few bytes each, no tensor, no NCCL. First come, first served.

        inbox = Inbox(owner=0, name="ps")       # on every rank of the group, same name, same order
        inbox.announce("push")                  # a sender, before its send to rank 0
        sender, note = inbox.next()             # rank 0: who comes next; then recv(..., frm=sender)

    A sender must post its send right after announcing (nothing in between that waits on the
    owner), so that the owner's receive never waits on anything but that send.
    Cost: two store writes per announcement, one read and one delete per ``next``.
    ``next`` waits up to the store's timeout (the process group's): a sender that died
    without announcing its leave is an error there, not a hang.
    """

    def __init__(self, owner: int, name: str, group: dist.ProcessGroup | None = None) -> None:
        group = dist.group.WORLD if group is None else group
        self.owner, self.rank = owner, dist.get_rank(group)
        self.store = dist.distributed_c10d._get_default_store()
        base = f"distlab/inbox/{group.group_name}/{name}/{owner}"
        # The n-th inbox of this name on this rank is the n-th on every rank: a fresh queue per use.
        self.prefix = f"{base}/{self.store.add(f'{base}/opened/{self.rank}', 1)}"
        self.taken = 0

    def announce(self, note: str = "") -> None:
        """Join the owner's queue (then post the send); ``note``: a short string the owner gets with it."""
        ticket = self.store.add(f"{self.prefix}/count", 1)
        self.store.set(f"{self.prefix}/{ticket}", f"{self.rank}|{note}")

    def next(self) -> tuple[int, str]:
        """The owner: ``(sender's group rank, note)`` of the next announcement, waiting for it."""
        self.taken += 1
        key = f"{self.prefix}/{self.taken}"
        sender, note = self.store.get(key).decode().split("|", 1)
        self.store.delete_key(key)
        return int(sender), note


# --------------------------------------------------------------------------- strict mode
_PG = torch._C._distributed_c10d.ProcessGroup
_REAL: dict[str, object] = {}
_tls = threading.local()
_simulated_backend: list[str] = []


def strict_enabled() -> bool:
    """Whether this process checks NCCL's point-to-point rules (see the module docstring)."""
    return bool(_REAL)


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


def _strict_send(self, tensors, dst, tag):
    ks = [_state.on_send(self, t, dst, tag) for t in tensors]
    work = _REAL["send"](self, tensors, dst, 0)  # (a): tags mean nothing on NCCL
    return _CheckedSendWork(work, self, dst, ks[-1])


def _strict_recv(self, tensors, src, tag):
    checks = [_state.on_recv(self, t, src, tag) for t in tensors]
    work = _REAL["recv"](self, tensors, src, 0)
    checks = [c for c in checks if c is not None]
    if not checks:
        return work
    return _CheckedWork(work, lambda: [c() for c in checks])


def _strict_recv_anysource(self, tensors, tag):
    raise StrictP2PError(f"rank {self.rank()}: a receive from any source: NCCL has none; receive from a "
                         "known rank (the schedule says who sends next) or use a collective")


def _strict_batch(p2p_op_list):
    with _launch():
        return _REAL["batch_isend_irecv"](p2p_op_list)


def _method(name: str):
    """``ProcessGroup.<name>`` as the class holds it: pybind's method descriptor, which binds ``self``
    when set back (``getattr(_PG, name)`` is the bare builtin, which would not)."""
    return _PG.__dict__[name] if name in _PG.__dict__ else getattr(_PG, name)


def enable_strict() -> None:
    """Check NCCL's point-to-point rules in this process from now on (idempotent)."""
    global _state
    if _REAL:
        return
    _uninstall_size_check()  # strict check (b) covers sizes: messages go without headers
    _state = _Strict()
    for name, fn in (("send", _strict_send), ("recv", _strict_recv), ("recv_anysource", _strict_recv_anysource)):
        _REAL[name] = _method(name)
        setattr(_PG, name, fn)
    # A raw dist.batch_isend_irecv is one launch too (this module marks its own batches itself).
    # Wrap what dist.batch_isend_irecv is now (the hang doctor's or a ledger's wrapper, if
    # installed), so they keep seeing batched sends and receives under strict mode too.
    c10d = dist.distributed_c10d
    _REAL["batch_isend_irecv"] = dist.batch_isend_irecv
    _REAL["c10d.batch_isend_irecv"] = c10d.batch_isend_irecv
    c10d.batch_isend_irecv = dist.batch_isend_irecv = _strict_batch


def disable_strict() -> None:
    """Undo ``enable_strict`` (tests of the checker itself)."""
    global _state
    for name in ("send", "recv", "recv_anysource"):
        if name in _REAL:
            setattr(_PG, name, _REAL[name])
    if "batch_isend_irecv" in _REAL:
        dist.batch_isend_irecv = _REAL["batch_isend_irecv"]
        dist.distributed_c10d.batch_isend_irecv = _REAL["c10d.batch_isend_irecv"]
    _REAL.clear()
    _state = None
    if _size_wanted:
        _install_size_check()


# --------------------------------------------------------------------------- the size check
_SIZED: dict[str, object] = {}  # the real ProcessGroup methods while headers are sent
_size_wanted = False
_HEADER_TAG = 1 << 30  # headers travel under tag ^ this (gloo): a header never meets a payload
_DTYPE_NAMES: dict[int, str] = {}  # dtype code -> name, for every dtype torch has (_dtype_code)
_sized_tls = threading.local()  # receives posted inside one batch_isend_irecv (coalescing backends)


def enable_size_check() -> bool:
    """Check every point-to-point message's size and dtype against its receive buffer (idempotent).

    On unless ``DISTLAB_P2P_SIZE_CHECK=0``; returns whether it is on. Call it in every rank
    (``init_from_env`` and ``run_distributed`` do), before the first message. See the module docstring.
    """
    global _size_wanted
    if os.environ.get(SIZE_CHECK_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    _size_wanted = True
    if not _REAL:  # strict mode checks sizes itself
        _install_size_check()
    return True


def disable_size_check() -> None:
    """Undo ``enable_size_check`` (benchmarks and tests of the check itself)."""
    global _size_wanted
    _size_wanted = False
    _uninstall_size_check()


def size_check_enabled() -> bool:
    """Whether a message shorter than its buffer (or of another dtype) raises in this process."""
    return bool(_SIZED) or (_size_wanted and strict_enabled())


def _install_size_check() -> None:
    if _SIZED:
        return
    for name, fn in (("send", _sized_send), ("recv", _sized_recv), ("recv_anysource", _sized_recv_anysource)):
        _SIZED[name] = _method(name)
        setattr(_PG, name, fn)
    if not getattr(dist.batch_isend_irecv, "_distlab_sized", False):
        # Installed once and never removed (others may have wrapped it since): a pass-through
        # whenever the check is off. On NCCL a batch returns one coalesced Work, not ours.
        real = dist.batch_isend_irecv

        def batch_isend_irecv(p2p_op_list):
            _sized_tls.checks = []
            try:
                works = real(p2p_op_list)
                checks = _sized_tls.checks
            finally:
                _sized_tls.checks = None
            if checks and works and not any(isinstance(w, _SizedRecvWork) for w in works):
                works = [*works[:-1], _ThenCheck(works[-1], checks)]
            return works

        batch_isend_irecv._distlab_sized = True
        dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv


def _uninstall_size_check() -> None:
    for name, fn in _SIZED.items():
        setattr(_PG, name, fn)
    _SIZED.clear()


def _dtype_code(dtype: torch.dtype) -> int:
    name = str(dtype).replace("torch.", "")
    code = zlib.crc32(name.encode())  # the same number on every rank, whatever the order of import
    _DTYPE_NAMES[code] = name
    return code


def _describe(tensors: list[torch.Tensor]) -> list[int]:
    """``[bytes, dtype code]`` of a message."""
    return [nbytes(tensors), _dtype_code(tensors[0].dtype) if tensors else 0]


for _dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
    _dtype_code(_dtype)  # a receiver can name any dtype a sender used


def _header(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The message's ``_describe`` as a tensor on its device (NCCL sends device memory only)."""
    return torch.tensor(_describe(tensors), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")


def _sized_send(self, tensors, dst, tag):
    header = _SIZED["send"](self, [_header(tensors)], dst, tag ^ _HEADER_TAG)
    return _SizedSendWork([header, _SIZED["send"](self, tensors, dst, tag)])


def _sized_recv(self, tensors, src, tag):
    header = torch.empty(2, dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    header_work = _SIZED["recv"](self, [header], src, tag ^ _HEADER_TAG)
    work = _SizedRecvWork(_SIZED["recv"](self, tensors, src, tag), header_work, header, tensors, self, src)
    if getattr(_sized_tls, "checks", None) is not None:
        _sized_tls.checks.append(work)
    return work


def _sized_recv_anysource(self, tensors, tag):
    # The header names the sender; the payload is received from it when waited for.
    header = torch.empty(2, dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    return _AnySourceWork(_SIZED["recv_anysource"](self, [header], tag ^ _HEADER_TAG), header, tensors, self, tag)


class _SizedSendWork:
    """A send and its header: both waited for."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self, *args, **kwargs):
        return all([w.wait(*args, **kwargs) for w in self._works])

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def __getattr__(self, name):
        return getattr(self._works[-1], name)


class _SizedRecvWork:
    """A receive whose ``wait`` compares the sender's header with the buffer."""

    _counts: dict[tuple[str, int], int] = {}

    def __init__(self, work, header_work, header: torch.Tensor, tensors: list, pg, src: int) -> None:
        self._work, self._header_work, self._header, self._tensors, self._pg, self._src = \
            work, header_work, header, tensors, pg, src
        key = (pg.group_name, src)
        self._k = _SizedRecvWork._counts.get(key, 0)  # this receive's number from src, for the message
        _SizedRecvWork._counts[key] = self._k + 1

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self.check(*args, **kwargs)
        return result

    def check(self, *args, **kwargs) -> None:
        if self._header_work is None:
            return
        work, self._header_work = self._header_work, None
        try:
            if not (isinstance(self, _AnySourceWork) and self._src is not None):  # waited for already
                work.wait(*args, **kwargs)
        except Exception as exc:
            raise P2PSizeError(
                f"{_who(self._pg)}: receive #{self._k} from {_peer(self._pg, self._src)} came without its size "
                f"header: every rank must run with the same {SIZE_CHECK_ENV} (unset, or 0 on all ranks)") from exc
        _poll_deferred(block=False)  # earlier receives' headers that have landed
        if self._header.device.type != "cpu" or _defer_on_cpu:
            _defer(self)  # no host sync: the verdict is read at a later receive or flush_size_checks()
        else:
            self._verify(*self._header.tolist())  # the header is host memory: nothing to wait for

    def _verify(self, sent_bytes: int, code: int) -> None:
        expected = _describe(self._tensors)
        if [sent_bytes, code] != expected:
            sent_dtype, dtype = _DTYPE_NAMES.get(code, f"dtype #{code}"), _DTYPE_NAMES[expected[1]]
            stale = f": the last {expected[0] - sent_bytes} bytes of the buffer keep old values" \
                if sent_bytes < expected[0] else ""
            raise P2PSizeError(
                f"{_who(self._pg)}: receive #{self._k} from {_peer(self._pg, self._src)} got {sent_bytes} bytes of "
                f"{sent_dtype} into a buffer of {expected[0]} bytes of {dtype} {_shapes(self._tensors)}{stale}. "
                f"Sender and receiver must agree on every message's size and dtype (the uneven last chunk? "
                f"an off-by-one index?); {SIZE_CHECK_ENV}=0 turns this check off")

    def is_completed(self) -> bool:
        return self._work.is_completed() and (self._header_work is None or self._header_work.is_completed())

    def __getattr__(self, name):
        return getattr(self._work, name)


# --------------------------------------------------------------------------- deferred verdicts (CUDA)
# On a GPU, reading a received header is a device-to-host sync per message: the CPU would wait for
# the GPU after every receive. Instead the header is copied into pinned host memory without blocking,
# behind a CUDA event; each later receive polls the events (``Event.query``: no wait) and checks the
# headers that have landed; ``flush_size_checks()`` waits once for the rest. A wrong size is still
# reported with the same message, a few receives later. ``defer_size_checks_on_cpu()`` plays this path
# with CPU tensors, so a CPU test can count its host syncs (distlab.host_sync).
_deferred: list[tuple[_SizedRecvWork, torch.Tensor, object]] = []
_defer_on_cpu = False
_MAX_DEFERRED = 1024  # headers waiting: beyond this, wait for the oldest (a bound on pinned memory)


class _Landed:
    """The event of a CPU header: already there."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _defer(work: _SizedRecvWork) -> None:
    header = work._header
    if header.device.type == "cpu":
        _deferred.append((work, header, _Landed()))
        return
    host = torch.empty(header.shape, dtype=header.dtype, pin_memory=True)
    host.copy_(header, non_blocking=True)  # ordered after the receive: its work was waited for (stream)
    event = torch.cuda.Event()
    event.record()
    _deferred.append((work, host, event))
    if len(_deferred) > _MAX_DEFERRED:
        _deferred[0][2].synchronize()


def _poll_deferred(block: bool) -> None:
    """Check every deferred header that has landed (``block``: wait for all of them first)."""
    if block and _deferred:
        _deferred[-1][2].synchronize()  # one wait: the events complete in stream order
    while _deferred and (block or _deferred[0][2].query()):
        work, host, _ = _deferred.pop(0)
        work._verify(*(int(v) for v in host.numpy()))  # host memory: .numpy() reads it without a sync


def flush_size_checks() -> None:
    """Check the size headers still in flight (CUDA: one host sync for all); raises ``P2PSizeError``.

    Call it where a step already waits for the GPU (after the optimizer step, at a checkpoint)."""
    _poll_deferred(block=True)


@contextlib.contextmanager
def defer_size_checks_on_cpu():
    """Take the CUDA path (deferred verdicts) with CPU tensors too: for tests that meter host syncs."""
    global _defer_on_cpu
    previous, _defer_on_cpu = _defer_on_cpu, True
    try:
        yield
    finally:
        flush_size_checks()
        _defer_on_cpu = previous


class _AnySourceWork(_SizedRecvWork):
    def __init__(self, header_work, header, tensors, pg, tag) -> None:
        self._work, self._header_work, self._header, self._tensors, self._pg = None, header_work, header, tensors, pg
        self._tag, self._src, self._k = tag, None, 0

    def wait(self, *args, **kwargs):
        if self._work is None:
            self._header_work.wait(*args, **kwargs)
            self._src = self._header_work._source_rank()
            self._work = _SIZED["recv"](self._pg, self._tensors, self._src, self._tag)
        return super().wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work is not None and super().is_completed()

    def _source_rank(self) -> int:
        return self._src if self._src is not None else self._header_work._source_rank()


class _ThenCheck:
    """A coalesced batch's Work (NCCL) whose ``wait`` also checks the batch's receives."""

    def __init__(self, work, checks: list) -> None:
        self._work, self._checks = work, checks

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        for check in self._checks:
            check.check()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _who(pg) -> str:
    return f"rank {dist.get_rank()}" if pg.group_name == dist.group.WORLD.group_name else \
        f"rank {dist.get_rank()} (group rank {pg.rank()} of {pg.group_name})"


def _peer(pg, group_rank: int) -> str:
    try:
        return f"rank {dist.get_global_rank(pg, group_rank)}"
    except (RuntimeError, ValueError):
        return f"group rank {group_rank}"


def _shapes(tensors: list) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


if os.environ.get(STRICT_ENV, "") not in ("", "0"):
    enable_strict()
