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
Two checks hold every point-to-point operation of ``torch.distributed`` in a process (this
module's or not) to those rules, each in a module of its own; their names are importable from here:

    distlab.p2p_strict   strict mode (``DISTLAB_STRICT_P2P=1``, set by the pytest plugin;
                         ``enable_strict()``): tags, order, sizes, opposite sends and devices as
                         NCCL sees them, raising ``StrictP2PError``
    distlab.p2p_sizes    the size check (on wherever the course's code runs: ``enable_size_check()``,
                         ``DISTLAB_P2P_SIZE_CHECK=0`` turns it off): a message shorter than its
                         receive buffer, or of another dtype, raises ``P2PSizeError``

See phase1_data_parallel/guidelines.md#point-to-point-on-nccl.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

# Re-exported: the strict checker's and the size check's API is importable from here (``p2p.enable_strict()``).
from distlab.p2p_sizes import (  # noqa: F401
    SIZE_CHECK_ENV, P2PSizeError, _deferred, _sized_send, defer_size_checks_on_cpu, disable_size_check,
    enable_size_check, flush_size_checks, size_check_enabled)
from distlab.p2p_strict import (  # noqa: F401
    BACKEND_ENV, STRICT_ENV, StrictP2PError, _launch, disable_strict, enable_strict, simulate_backend,
    strict_enabled)


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
