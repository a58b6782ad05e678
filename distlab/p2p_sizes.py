"""The size check: a point-to-point message must fill its receive buffer exactly (gloo lets a short one through).

``enable_size_check()`` is on wherever the course's code runs: ``init_from_env`` and the test
launcher's ranks call it; ``DISTLAB_P2P_SIZE_CHECK=0`` turns it off. It catches the one mistake gloo
lets through silently, strict mode or not: a message shorter than its receive buffer (rank 0 sends
4 floats, rank 1 receives into 8 and keeps 4 stale values), or of another dtype. Each send carries a
16-byte header (its bytes and dtype) as a second message in the same launch; the receive compares
it with its buffer when it completes and raises ``P2PSizeError``. Cost: one tiny extra message per
message (``benchmarks/bench_p2p_check.py`` measures it). On CUDA no host sync: the header is copied
to the host without blocking and checked at a later receive, once it has landed, or at
``flush_size_checks()`` (one sync for all). Every rank must agree on the setting (the header is part
of the wire format). Under strict mode (``distlab.p2p_strict``) the strict checks (b) already cover
it, so no header: strict mode calls ``strict_started``/``strict_ended`` here.

It handles ``ProcessGroup.send/recv`` through distlab.intercept (every point-to-point operation of
``torch.distributed`` in this process, ``distlab.p2p``'s or not). The course's code imports these names from ``distlab.p2p``.
See phase1_data_parallel/guidelines.md#point-to-point-on-nccl.
"""
from __future__ import annotations

import contextlib
import os
import threading
import zlib

import torch
import torch.distributed as dist

from distlab import intercept
from distlab.metrics import nbytes

SIZE_CHECK_ENV = "DISTLAB_P2P_SIZE_CHECK"  # "0": no size header on messages (every rank alike)


class P2PSizeError(RuntimeError):
    """A message whose size or dtype differs from its receive buffer's (gloo accepts a shorter one)."""


# --------------------------------------------------------------------------- the size check
_sized: intercept.Handle | None = None  # its ProcessGroup handlers, while headers are sent
_size_wanted = False
_HEADER_TAG = 1 << 30  # headers travel under tag ^ this (gloo): a header never meets a payload
_DTYPE_NAMES: dict[int, str] = {}  # dtype code -> name, for every dtype torch has (_dtype_code)
_sized_tls = threading.local()  # receives posted inside one batch_isend_irecv (coalescing backends)
_under_strict = False  # strict mode (distlab.p2p_strict) is on: it checks sizes itself, no headers


def enable_size_check() -> bool:
    """Check every point-to-point message's size and dtype against its receive buffer (idempotent).

    On unless ``DISTLAB_P2P_SIZE_CHECK=0``; returns whether it is on. Call it in every rank
    (``init_from_env`` and ``run_distributed`` do), before the first message. See the module docstring.
    """
    global _size_wanted
    if os.environ.get(SIZE_CHECK_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    _size_wanted = True
    if not _under_strict:  # strict mode checks sizes itself
        _install_size_check()
    return True


def disable_size_check() -> None:
    """Undo ``enable_size_check`` (benchmarks and tests of the check itself)."""
    global _size_wanted
    _size_wanted = False
    _uninstall_size_check()


def size_check_enabled() -> bool:
    """Whether a message shorter than its buffer (or of another dtype) raises in this process."""
    return _sized is not None or (_size_wanted and _under_strict)


def _install_size_check() -> None:
    global _batch_subscription, _sized
    if _sized is not None:
        return
    _sized = intercept.handle("p2p_sizes", {"send": _sized_send, "recv": _sized_recv,
                                            "recv_anysource": _sized_recv_anysource})
    if _batch_subscription is None:  # a batch's receives are checked at its Work's wait
        _batch_subscription = intercept.subscribe("p2p_sizes", _sized_batch, ops=("batch_isend_irecv",))


_batch_subscription: intercept.Subscription | None = None


def _sized_batch(call: intercept.Call):
    """A batch's receives, checked when its Work is waited for. On NCCL a batch returns one
    coalesced Work, not ours: its ``wait`` then checks the batch's receives (``_ThenCheck``)."""
    _sized_tls.checks = []
    try:
        yield
        checks = _sized_tls.checks
    finally:
        _sized_tls.checks = None
    works = call.result
    if checks and works and not any(isinstance(w, _SizedRecvWork) for w in works):
        call.result = [*works[:-1], _ThenCheck(works[-1], checks)]


def _uninstall_size_check() -> None:
    global _batch_subscription, _sized
    if _sized is not None:
        _sized.cancel()
        _sized = None
    if _batch_subscription is not None:
        _batch_subscription.cancel()
        _batch_subscription = None


def strict_started() -> None:
    """Strict mode begins (``p2p_strict.enable_strict``): its check (b) covers sizes, messages go without headers."""
    global _under_strict
    _under_strict = True
    _uninstall_size_check()


def strict_ended() -> None:
    """Strict mode ends (``p2p_strict.disable_strict``): headers again if the size check is wanted."""
    global _under_strict
    _under_strict = False
    if _size_wanted:
        _install_size_check()


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


# ProcessGroup handlers (distlab.intercept): ``inner`` is the method's next step inward (torch's, here).
def _sized_send(inner, self, tensors, dst, tag):
    header = inner(self, [_header(tensors)], dst, tag ^ _HEADER_TAG)
    return _SizedSendWork([header, inner(self, tensors, dst, tag)])


def _sized_recv(inner, self, tensors, src, tag):
    header = torch.empty(2, dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    header_work = inner(self, [header], src, tag ^ _HEADER_TAG)
    work = _SizedRecvWork(inner(self, tensors, src, tag), header_work, header, tensors, self, src)
    if getattr(_sized_tls, "checks", None) is not None:
        _sized_tls.checks.append(work)
    return work


def _sized_recv_anysource(inner, self, tensors, tag):
    # The header names the sender; the payload is received from it when waited for.
    header = torch.empty(2, dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    return _AnySourceWork(inner(self, [header], tag ^ _HEADER_TAG), header, tensors, self, tag)


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
            self._work = intercept.pg_below("p2p_sizes", "recv")(self._pg, self._tensors, self._src, self._tag)
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
