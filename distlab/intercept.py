"""One interception point for ``torch.distributed``: the ledger, the doctor, the trace and the p2p checks observe it.

Each entry point of ``torch.distributed`` the course watches (the collectives, send/recv, isend/irecv,
``batch_isend_irecv``, barrier and the object collectives: :data:`OPS`) is replaced by one wrapper, in
``torch.distributed`` and in ``torch.distributed.distributed_c10d`` alike (the same function object, so
``dist.distributed_c10d.all_reduce`` is seen as ``dist.all_reduce`` is). The wrappers are installed while
anything observes (:func:`subscribe`, or :func:`install`; counted, so nested installs are fine) and the
last one out puts torch's own functions back (the same objects).

An observer is a function of one :class:`Call`. A plain function runs before the call; a generator runs
up to its ``yield`` before the call and on from there after it (``call.result`` is set), like a ``with``
around the call; if the call raises, the generator is closed at its ``yield`` (its ``finally`` runs, the
rest does not). ``call.on_wait(fn)`` asks for ``fn(index, start, end)`` when the returned Work (number
``index`` of a batch's list) has been waited for. Observers run in :data:`ORDER`, outermost first; two of
the same role in the order they subscribed::

    def count(call):
        if call.op == "all_reduce":
            calls.append(call.arguments["tensor"].numel())
    with intercept.observing("ledger", count):
        dist.all_reduce(t)

A call made while another is intercepted on the same thread (torch's ``send`` calls its ``isend``, a batch
calls isend/irecv per P2POp, an observer that calls a collective) goes straight to torch: each call is
seen once. host_sync patches tensor methods.

Under the functions, every collective and message ends in a method of torch's ProcessGroup (C++; a
group's own ``group.allreduce`` too): :func:`handle` puts one wrapper per method on the class, with
handlers in :data:`PG_ORDER` (the grader's refusals, the strict p2p checker, the size check).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import time
import weakref

import torch.distributed as dist

c10d = dist.distributed_c10d

# The entry points intercepted (those this torch has): the ledger's table and the doctor's.
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "gather",
       "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
       "all_to_all_single", "send", "isend", "recv", "irecv", "barrier", "monitored_barrier", "all_gather_object",
       "broadcast_object_list", "gather_object", "scatter_object_list", "batch_isend_irecv")
# Observers' roles, outermost first. The strict checker's launch spans everything the others do in a
# batch; a ledger times the doctor's bookkeeping with the call (microseconds), as it did when it wrapped
# the doctor's wrappers; the size check's result (a coalesced Work that checks sizes) is what the others see.
ORDER = ("p2p_strict", "ledger", "doctor", "p2p_sizes")

_HERE = os.path.dirname(os.path.realpath(__file__))
# Frames distlab.grading.rules looks through to find the course code that made a call: this module's
# wrappers, the ledger (its all_gather_single / reduce_scatter_single helpers call torch for the caller),
# the doctor, the trace and the flight recorder (the observers, and the bench's own calls inside them).
WRAPPER_FILES = tuple(os.path.join(_HERE, f) for f in
                      ("intercept.py", "comm.py", "doctor.py", "trace.py", "flight_recorder.py"))


def wrapper_files() -> tuple[str, ...]:
    """The files whose frames stand between a caller and torch (see :data:`WRAPPER_FILES`)."""
    return WRAPPER_FILES


def torch_function(fn):
    """torch's own function under any wrappers that mark what they wrap (``__wrapped_by_ledger__``)."""
    while hasattr(fn, "__wrapped_by_ledger__"):
        fn = fn.__wrapped_by_ledger__
    return fn


_TORCH_ISEND, _TORCH_IRECV = torch_function(c10d.isend), torch_function(c10d.irecv)


def p2p_kind(op) -> str | None:
    """"isend" or "irecv" for a P2POp's ``op`` (torch's function or any wrapper of it), else None."""
    fn = torch_function(op)
    return "isend" if fn is _TORCH_ISEND else "irecv" if fn is _TORCH_IRECV else None


class P2POp(c10d.P2POp):
    """``dist.P2POp`` while intercepted. torch accepts only the isend/irecv that ``distributed_c10d`` names
    (``op is isend``): this one takes torch's function or any wrapper of it, and its ``op`` is always the
    function c10d names now (the wrapper while installed, torch's after), so it works before, during and after."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, _current(op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs) -> None:
        super().__init__(_current(op), *args, **kwargs)

    @property
    def op(self):
        return getattr(c10d, self._kind) if self._kind else self._op

    @op.setter
    def op(self, value) -> None:
        self._kind, self._op = p2p_kind(value), value


def _current(op):
    kind = p2p_kind(op)
    return getattr(c10d, kind) if kind else op  # not isend/irecv: torch's own check refuses it


def _as_ours(p):
    """``p``, or a copy of it (every field alike) that is our P2POp, when its ``op`` is not today's."""
    if type(p) is P2POp or not isinstance(p, c10d.P2POp) or p.op is _current(p.op):
        return p
    ours = object.__new__(P2POp)
    ours.__dict__.update(vars(p))
    ours.op = p.op  # the property: the function c10d names now
    return ours


class Call:
    """One intercepted call as its observers see it: ``op``, the bound ``arguments``, and after it ``result``."""

    __slots__ = ("op", "arguments", "result", "_waits")

    def __init__(self, op: str, arguments: dict) -> None:
        self.op, self.arguments, self.result, self._waits = op, arguments, None, []

    @property
    def async_op(self) -> bool:
        return self.op in ("isend", "irecv", "batch_isend_irecv") or bool(self.arguments.get("async_op", False))

    @property
    def group(self):
        return self.arguments.get("group")

    def p2p_ops(self) -> list[tuple[str, object]]:
        """A batch's ``(kind, P2POp)`` pairs, kind "isend" or "irecv"."""
        return [(p2p_kind(p.op) or "irecv", p) for p in self.arguments.get("p2p_op_list", ())]

    def on_wait(self, fn) -> None:
        """Call ``fn(index, start, end)`` (``time.time()``) after each returned Work's ``wait()``."""
        self._waits.append(fn)


class _WatchedWork:
    """A returned Work whose ``wait()`` is reported to the observers that asked; the rest is the Work's."""

    def __init__(self, work, index: int, waits: list) -> None:
        self._work, self._index, self._waits = work, index, waits

    def wait(self, *args, **kwargs):
        start = time.time()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            end = time.time()
            for fn in self._waits:
                fn(self._index, start, end)

    def __getattr__(self, name):
        return getattr(self._work, name)


# --------------------------------------------------------------------------- observers
_lock = threading.RLock()
_tls = threading.local()  # .busy: an intercepted call is running on this thread
_subs: list["Subscription"] = []
_table: dict[str, tuple] = {}  # op -> its observers' hooks in order (replaced whole: calls read it unlocked)
_installs = 0
_patched: list[tuple[object, str, object, object]] = []  # (owner, name, torch's, ours)


class Subscription:
    """One observer's place; ``cancel()`` removes it (and uninstalls the wrappers with the last one)."""

    def __init__(self, role: str, hook, ops) -> None:
        self.role, self.hook, self.ops = role, hook, ops

    def cancel(self) -> None:
        with _lock:
            if self not in _subs:
                return
            _subs.remove(self)
            _rebuild()
            uninstall()


def subscribe(role: str, hook, ops=None) -> Subscription:
    """Observe the calls of ``ops`` (all of :data:`OPS` if None) with ``hook``, in ``role``'s place in ORDER."""
    if role not in ORDER:
        raise ValueError(f"intercept role {role!r} is not one of {ORDER}: declare its place in ORDER first")
    sub = Subscription(role, hook, frozenset(ops) if ops is not None else None)
    with _lock:
        install()
        _subs.append(sub)
        _rebuild()
    return sub


@contextlib.contextmanager
def observing(role: str, hook, ops=None):
    """``subscribe`` for the length of a ``with`` block."""
    sub = subscribe(role, hook, ops)
    try:
        yield sub
    finally:
        sub.cancel()


def _rebuild() -> None:
    global _table
    ordered = sorted(_subs, key=lambda s: ORDER.index(s.role))  # stable: a role's subscribers in order
    _table = {op: tuple(s.hook for s in ordered if s.ops is None or op in s.ops) for op in OPS}


def install() -> None:
    """Put the wrappers in place (counted: each ``install`` needs its ``uninstall``)."""
    global _installs
    with _lock:
        _installs += 1
        if _installs == 1:
            _patch()


def uninstall() -> None:
    """Undo one ``install``; the last one puts torch's functions back (identity)."""
    global _installs
    with _lock:
        if _installs == 0:
            raise RuntimeError("intercept.uninstall() without an install(): each install() needs one uninstall()")
        _installs -= 1
        if _installs == 0:
            for owner, name, original, ours in reversed(_patched):
                if getattr(owner, name, None) is ours:  # someone wrapped over ours: theirs stays (ours passes through)
                    setattr(owner, name, original)
            _patched.clear()


def installed() -> bool:
    return _installs > 0


def _patch() -> None:
    for op in OPS:
        mine, theirs = getattr(dist, op, None), getattr(c10d, op, None)
        if mine is None:
            continue  # not in this torch release
        wrapped = _wrap(op, mine)
        _set(dist, op, wrapped)
        if theirs is mine:
            _set(c10d, op, wrapped)
        elif theirs is not None:  # someone replaced one of the two: each keeps what it had, under a wrapper
            _set(c10d, op, _wrap(op, theirs))
    _set(dist, "P2POp", P2POp)  # c10d's stays torch's class: torch checks isinstance(p, P2POp) against it


def _set(owner, name: str, value) -> None:
    _patched.append((owner, name, getattr(owner, name), value))
    setattr(owner, name, value)


_signatures: dict = {}
_ours: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # our wrappers -> what each wraps


def _wrap(op: str, target):
    target = _ours.get(target, target)  # a wrapper of ours left behind (see uninstall): wrap what it wrapped

    @functools.wraps(target)
    def wrapper(*args, **kwargs):
        hooks = _table.get(op)
        if not hooks or getattr(_tls, "busy", False) or _installs == 0:
            return target(*args, **kwargs)
        return _run(op, target, hooks, args, kwargs)

    wrapper.__wrapped_by_ledger__ = target  # torch_function() finds torch's function under it
    _ours[wrapper] = target
    return wrapper


def _run(op: str, target, hooks: tuple, args: tuple, kwargs: dict):
    signature = _signatures.get(target)
    if signature is None:
        signature = _signatures[target] = inspect.signature(target)
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return target(*args, **kwargs)  # torch raises its own error
    if op == "batch_isend_irecv" and isinstance(arguments.get("p2p_op_list"), list):
        # A P2POp made with torch's class holds the isend/irecv of its day; torch compares it with today's.
        ops = [_as_ours(p) for p in arguments["p2p_op_list"]]
        arguments["p2p_op_list"], args, kwargs = ops, (ops,), {}
    call = Call(op, arguments)
    _tls.busy = True
    running = []
    try:
        for hook in hooks:
            gen = hook(call)
            if gen is not None:
                try:
                    next(gen)
                except StopIteration:
                    continue
                running.append(gen)
        call.result = target(*args, **kwargs)
        while running:  # innermost first, as nested ``with`` blocks end
            try:
                next(running.pop())
            except StopIteration:
                pass
            else:
                raise RuntimeError(f"an observer of {op} yielded twice: yield once, around the call")
    finally:
        for gen in reversed(running):  # the call or an observer raised: close the rest at their yield
            gen.close()
        _tls.busy = False
    if call._waits:
        result = call.result
        if isinstance(result, list):
            call.result = [_WatchedWork(w, i, call._waits) for i, w in enumerate(result)]
        elif hasattr(result, "wait"):
            call.result = _WatchedWork(result, 0, call._waits)
    return call.result


# --------------------------------------------------------------------------- ProcessGroup methods
# A handler stands in the call: ``handler(proceed, pg, *args, **kwargs)`` acts before, refuses (raises), replaces
# (calls ``proceed(pg, ...)``, the next handler inward then torch's method, with any arguments, any number of
# times) or wraps the result. Roles, outermost first: a refusal comes before anything is recorded or sent (and
# the grader's frame walk looks through this file and grading's only: a p2p handler's frame would hide the
# template); the strict checker and the size check never handle send/recv together (strict checks sizes).
PG_ORDER = ("rules", "p2p_strict", "p2p_sizes")
PG = c10d.ProcessGroup  # torch._C._distributed_c10d.ProcessGroup
_pg_handles: list["Handle"] = []  # in PG_ORDER (sorted stably: a role's handles in the order they came)
_pg_torch: dict[str, object] = {}  # method -> torch's own (the class's entry: pybind binds self), while wrapped
_pg_chains: dict[str, object] = {}  # method -> its outermost handler, bound to the rest (replaced whole)


class Handle:
    """One role's handlers of ProcessGroup methods; ``cancel()`` removes them (torch's method back with the last)."""

    def __init__(self, role: str, handlers: dict) -> None:
        self.role, self.handlers = role, handlers

    def cancel(self) -> None:
        with _lock:
            if self in _pg_handles:
                _pg_handles.remove(self)
                _pg_rebuild()


def handle(role: str, handlers: dict) -> Handle:
    """Stand ``handlers`` (method name -> handler, see :data:`PG_ORDER`) in ProcessGroup's methods, in
    ``role``'s place; a name this torch's ProcessGroup does not define is skipped."""
    if role not in PG_ORDER:
        raise ValueError(f"ProcessGroup role {role!r} is not one of {PG_ORDER}: declare its place in PG_ORDER first")
    h = Handle(role, {name: fn for name, fn in handlers.items() if name in vars(PG)})
    with _lock:
        _pg_handles.append(h)
        _pg_handles.sort(key=lambda x: PG_ORDER.index(x.role))
        _pg_rebuild()
    return h


def pg_roles(name: str) -> tuple[str, ...]:
    """The roles that handle ``ProcessGroup.<name>`` now, outermost first."""
    return tuple(h.role for h in _pg_handles if name in h.handlers)


def pg_below(role: str, name: str):
    """``proceed`` for ``ProcessGroup.<name>`` as ``role`` gets it: the handlers inward of it, then torch's."""
    inner = [h.handlers[name] for h in _pg_handles
             if name in h.handlers and PG_ORDER.index(h.role) > PG_ORDER.index(role)]
    return _pg_chain(inner, _pg_torch.get(name, vars(PG)[name]))


def _pg_chain(handlers: list, torchs):
    for fn in reversed(handlers):
        torchs = functools.partial(fn, torchs)  # no frame of its own: the grader's walk sees the wrapper, then torch
    return torchs


def _pg_rebuild() -> None:
    global _pg_chains
    names = {name for h in _pg_handles for name in h.handlers}
    for name in names - _pg_torch.keys():  # one wrapper per method, put in place once
        _pg_torch[name] = vars(PG)[name]
        setattr(PG, name, _pg_wrapper(name, _pg_torch[name]))
    _pg_chains = {name: _pg_chain([h.handlers[name] for h in _pg_handles if name in h.handlers], _pg_torch[name])
                  for name in names}
    for name in _pg_torch.keys() - names:  # no handler left: torch's own entry back (the same object)
        setattr(PG, name, _pg_torch.pop(name))


def _pg_wrapper(name: str, torchs):
    def method(self, *args, **kwargs):
        return _pg_chains.get(name, torchs)(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method
