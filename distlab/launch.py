"""Start a process group, for tests and demos (``run_distributed``) and under torchrun (``init_from_env``).

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` fresh processes and returns their results in rank order. It is the
one launcher every test and demo uses, and it keeps the promises a course needs:

* fast: processes come from a forkserver that has already imported torch, so a
  2-rank world starts in well under a second after the first (never plain fork
  after torch has run ops: its thread pools do not survive a fork);
* no fixed port: ranks meet on a FileStore in a fresh temporary directory, so
  parallel runs never collide;
* fails fast: the process group gets a short timeout, so a ``recv`` without a
  matching ``send`` raises in seconds; the first rank that raises makes the parent
  raise at once, with the rank in the message and the remote traceback attached;
  a learner's unfinished TODO comes back as one line;
* leaves nothing behind: every rank is terminated (then killed) in ``finally``.

Workers never read the environment; ``init_from_env`` is the torchrun-side twin:
it reads RANK/WORLD_SIZE/LOCAL_RANK, picks NCCL when every local rank has a GPU
(gloo otherwise), pins the device, and runs as rank 0 of 1 without torchrun.
"""
from __future__ import annotations

import atexit
import builtins
import gc
import multiprocessing as mp
import os
import re
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

from distlab.todo import LearnerTODO

_CTX = None
_IN_RUN_DISTRIBUTED = False  # True inside a rank started by run_distributed


def _context():
    # One forkserver per parent process, with torch imported once (~2 s) so that
    # every later rank starts in tens of milliseconds. Also preloaded: what the first
    # optimizer (torch._dynamo, ~0.7 s) and the first assert_close (DTensor, ~0.6 s)
    # would otherwise import again in every rank of every test.
    global _CTX
    if _CTX is None:
        atexit.register(_stop_helpers)
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim",
                                     "torch.testing", "torch.distributed.tensor", "distlab.launch"])
    return _CTX


def _stop_helpers() -> None:
    # The forkserver and multiprocessing's resource tracker would otherwise outlive this
    # process by a moment and, where nothing reaps orphans (a container's PID 1), stay
    # behind as zombies. Stop and reap them ourselves (private but stable since 3.8).
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        try:
            helper._stop()
        except Exception:
            pass


def loopback_interface() -> str | None:
    """Name of the loopback interface ("lo" on Linux, "lo0" on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" means NCCL when there is one GPU per rank, gloo otherwise."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for torchrun rendezvous in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, args, kwargs, backend, store_path, pg_timeout_s, env, conn):
    # The forkserver was started with the environment of an earlier moment; use
    # the launching process's environment as it is now (DISTLAB_IMPL, ...).
    global _IN_RUN_DISTRIBUTED
    _IN_RUN_DISTRIBUTED = True
    os.environ.clear()
    os.environ.update(env)
    loopback = loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback  # local worlds talk over loopback only
    # world_size processes share the cores: one intra-op pool each would oversubscribe.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    message: tuple
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        message = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:  # reported to the parent, never swallowed
        message = ("error", type(exc).__module__, type(exc).__qualname__, str(exc),
                   traceback.format_exc(), isinstance(exc, LearnerTODO))
    try:
        # Plain pickle, not the Pipe's: torch's multiprocessing pickler would pass tensors
        # as shared-memory handles, which die with this process before the parent reads them.
        payload = pickle.dumps(message)
    except Exception as exc:  # e.g. an unpicklable result
        payload = pickle.dumps(("error", "builtins", "RuntimeError", f"could not send the result back: {exc}",
                                traceback.format_exc(), False))
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class RankError(RuntimeError):
    """A rank failed with an exception whose type could not be rebuilt in the parent."""


_BENCH_FRAMES = tuple(f"{os.sep}distlab{os.sep}{name}" for name in ("launch.py", "testing.py"))


def _learner_frames(tb: str, qualname: str, msg: str) -> str:
    """The rank's traceback without the bench's frames (launcher, assertion helpers) and
    without the final exception line, which the message above it already shows."""
    first = msg.splitlines()[0] if msg.strip() else ""
    cut = tb.rfind(f"{qualname}: {first}") if first else -1
    if cut > 0:
        tb = tb[:cut]
    keep = [block for block in re.split(r"(?m)^(?=  File )", tb)
            if not (block.startswith("  File ") and any(f in block.split("\n")[0] for f in _BENCH_FRAMES))]
    return "".join(keep).rstrip()


def _rebuild(rank: int, module: str, qualname: str, msg: str, tb: str, is_todo: bool) -> BaseException:
    # The rank leads the message once: test messages that already start with it keep theirs.
    lead = "" if re.match(rf"rank {rank}\b", msg) else f"rank {rank}: "
    if is_todo:
        # One line: the learner needs the TODO and the guideline section, not a traceback.
        return LearnerTODO(f"{lead}{msg}")
    text = f"{lead}{msg}"
    exc_type = getattr(builtins, qualname, None) if module == "builtins" else None
    exc = None
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        try:
            exc = exc_type(text)
        except Exception:
            pass
    if exc is None:
        exc = RankError(f"{module}.{qualname}: {text}")
    # Shown by distlab.pytest_plugin under the one-line message, instead of the launcher's frames.
    exc.rank_traceback = f"--- in rank {rank} ---\n{_learner_frames(tb, qualname.rsplit('.', 1)[-1], msg)}"
    return exc


# Errors that are usually a consequence of another rank failing first.
_SECONDARY = ("connection", "closed", "reset", "broken pipe", "timed out", "timeout", "peer")


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
                    timeout_s: float = 60.0, pg_timeout_s: float | None = None,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh ranks.

    Args:
        fn: a module-level function (it is pickled to the ranks).
        world_size: number of ranks, >= 1.
        backend: "gloo", "nccl" or "auto" (NCCL when there is a GPU per rank).
        timeout_s: the whole run's deadline; ranks still running then are killed
            and ``TimeoutError`` names them.
        pg_timeout_s: the process group's timeout, after which a collective or
            recv without a peer raises inside the rank (default: ``timeout_s``/2,
            at most 30 s, so the rank's own error arrives before the deadline).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        The first failing rank's exception (same type where it is a built-in one,
        ``LearnerTODO`` for unfinished template code, ``RankError`` otherwise),
        with the rank and its traceback in the message.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = resolve_backend(backend, world_size)
    if pg_timeout_s is None:
        pg_timeout_s = min(30.0, max(2.0, timeout_s / 2))
    ctx = _context()
    tmpdir = tempfile.mkdtemp(prefix="distlab-")
    store_path = os.path.join(tmpdir, "store")
    procs, readers = [], []
    env = dict(os.environ)
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, args, kwargs, backend, store_path,
                                  pg_timeout_s, env, writer))
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        return _collect(procs, readers, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        for r in readers:
            r.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(procs, readers, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    pending = set(range(len(procs)))

    def receive(rank: int) -> None:
        pending.discard(rank)
        try:
            msg = pickle.loads(readers[rank].recv_bytes())
        except (EOFError, OSError):
            procs[rank].join(timeout=1)
            code = procs[rank].exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            errors[rank] = RankError(f"rank {rank} died ({how}) without reporting a result")
            return
        if msg[0] == "ok":
            results[rank] = msg[1]
        else:
            errors[rank] = _rebuild(rank, *msg[1:])

    while pending and not errors:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s "
                "(a send/recv or collective that not every rank called?)")
        ready = wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending],
                     timeout=remaining)
        for rank in sorted(pending):
            if readers[rank] in ready or procs[rank].sentinel in ready:
                receive(rank)
    if errors:
        # Ranks that already reported count too; prefer a root cause (an assertion,
        # a TODO) over the connection errors its peers see when it dies.
        for rank in sorted(pending):
            if readers[rank].poll():
                receive(rank)

        def secondary(item):
            rank, exc = item
            return any(word in str(exc).lower()[:300] for word in _SECONDARY), rank

        raise min(errors.items(), key=secondary)[1]
    return [results[r] for r in range(len(procs))]


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

    Without torchrun (no RANK in the environment) this runs as rank 0 of a
    1-rank gloo world, so every script also runs as a plain ``python -m``.

    The store is prefixed with torchrun's restart count: after an elastic restart,
    ranks must not read the keys (addresses, barriers) the previous attempt left.

    Inside ``run_distributed`` (a process group already exists) it describes that
    group instead, so a script's ``main()`` can also be driven from a test.

    Collective: every rank must call it (it is the rendezvous).
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        rank = dist.get_rank()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return DistEnv(rank, dist.get_world_size(), device.index or 0, backend, device)
    if "RANK" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return DistEnv(0, 1, 0, "gloo", torch.device("cpu"))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = resolve_backend(backend, local_world)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=(rank == 0 and not agent_store),
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"distlab/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return DistEnv(rank, world_size, local_rank, backend, device)


def shutdown() -> None:
    """Destroy the default process group if there is one (call in ``finally``).

    Inside ``run_distributed`` the launcher owns the group and destroys it itself.
    Unreachable objects that still hold communication state (a DDP reducer in a
    reference cycle, a pending send) are collected first, while the group exists.
    """
    gc.collect()
    if dist.is_initialized() and not _IN_RUN_DISTRIBUTED:
        dist.destroy_process_group()
