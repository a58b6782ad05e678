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
* leaves nothing behind: every rank is terminated (then killed) in ``finally``,
  with the processes it started; a rank dies with its launcher, even one killed by
  SIGKILL (a thread watching the launcher's pipe; the kernel's parent-death signal wakes
  a stopped rank), and so do the helper processes it started, in any session;
* says who hangs: every rank records its last communication ops (``distlab.doctor``);
  when no rank has made progress for ``hang_s`` seconds (``doctor.Progress``: a slow
  rank on a busy machine is progress), or on a timeout or a crash, the
  records are merged into one table that names the rank that never arrived and the op
  the others wait in ("rank 1 never entered all_reduce #3 (16 B) on WORLD ..."); PyTorch's
  flight recorder fills in the collectives torch issues itself (DDP's all-reduces).

Workers never read the environment; ``init_from_env`` is the torchrun-side twin:
it reads RANK/WORLD_SIZE/LOCAL_RANK, puts the script on ``cuda:LOCAL_RANK`` with
"cpu:gloo,cuda:nccl" when every local rank has a GPU (the CPU and gloo otherwise),
and runs as rank 0 of 1 without torchrun.
"""
from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import multiprocessing as mp
import os
import re
import pickle
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

from distlab import doctor, p2p, sandbox, trace
from distlab.todo import LearnerTODO

_CTX = None
RUN_MARKER_ENV = "DISTLAB_RUN_ID"  # every process a run starts carries it: found and killed by it
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
        # The bench's own modules and pytest (which every test module imports in every rank)
        # too: ~0.1 s per rank per test otherwise, a minute over the suite.
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim",
                                     "torch.testing", "torch.distributed.tensor", "distlab.launch",
                                     "pytest", "distlab.testing", "distlab.loader", "distlab.comm",
                                     "distlab.models", "distlab.sync", "distlab.p2p", "distlab.doctor"])
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


DEVICE_ENV = "DISTLAB_DEVICE"  # "cpu" or "cuda": where init_from_env puts a script's tensors


def resolve_device(local_rank: int, local_world_size: int) -> torch.device:
    """The device a script's model, batches and communicated tensors go to.

    ``DISTLAB_DEVICE`` decides when set ("cpu", or "cuda" for ``cuda:local_rank``);
    otherwise ``cuda:local_rank`` when every local rank has a GPU, else the CPU.
    """
    name = os.environ.get(DEVICE_ENV, "").strip().lower()
    if not name:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name = "cuda" if gpus >= local_world_size else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={name!r}: expected 'cpu' or 'cuda' (unset: cuda when every local rank "
                         f"has a GPU)")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device("cpu")


def resolve_backend(backend: str, world_size: int, device: torch.device | None = None) -> str:
    """The process-group backend for tensors on ``device``; "auto" never gives NCCL for CPU tensors.

    "auto" is "cpu:gloo,cuda:nccl" when ``device`` is a CUDA device (NCCL moves the CUDA
    tensors; gloo beside it keeps CPU-side control messages working: object collectives,
    ``monitored_barrier``), and "gloo" otherwise, including without a device:
    ``run_distributed``'s workers keep their tensors on the CPU unless a test asks for
    a backend. Any other name is returned as given.
    """
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if device is not None and device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for torchrun rendezvous in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- process hygiene
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux: /proc/PID/task/*/children; elsewhere: none known)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo_ = [], _children(pid)
    while todo_:
        child = todo_.pop()
        if child not in found:
            found.append(child)
            todo_ += _children(child)
    return found


def _marked(marker: str) -> list[int]:
    """Processes (of any session) whose environment carries ``marker`` in ``RUN_MARKER_ENV``
    (a run inside a run appends its own: ``outer:inner``)."""
    prefix, out = f"{RUN_MARKER_ENV}=".encode(), []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for entry in f.read().split(b"\0"):
                    if entry.startswith(prefix) and marker.encode() in entry[len(prefix):].split(b":"):
                        out.append(pid)
        except OSError:
            pass
    return out


def kill_process_tree(root: int | None = None, marker: str | None = None) -> list[int]:
    """SIGKILL ``root``, its descendants, and every process carrying ``marker`` in its environment.

    torchrun starts each worker in a session of its own, and a rank may start helpers that
    leave its session, so killing a process group is not enough: descendants are found
    through /proc (children lists), strays that were re-parented through the marker.
    Repeats until nothing is left (a process may fork while it is being killed).
    Returns the pids killed. Never kills the calling process.
    """
    killed: list[int] = []
    for _ in range(5):
        targets = ([root] if root else []) + (_descendants(root) if root else []) + (_marked(marker) if marker else [])
        targets = [p for p in dict.fromkeys(targets) if p != os.getpid() and _alive(p)]
        if not targets:
            break
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)  # let the kernel deliver before looking for new children
    return killed


def _alive(pid: int) -> bool:
    """Running or stopped (a zombie counts as gone: it only waits to be reaped)."""
    return doctor.thread_stat(pid)[0] not in ("", "Z", "X")


def marked_environ(marker: str) -> dict[str, str]:
    """``os.environ`` plus ``marker`` in RUN_MARKER_ENV, after the markers of enclosing runs:
    give it to a job's processes, then ``kill_process_tree(marker=marker)`` finds them all."""
    return {**os.environ, RUN_MARKER_ENV: ":".join(filter(None, [os.environ.get(RUN_MARKER_ENV), marker]))}


TIE_ENV = "DISTLAB_TIE_TO_PID"  # set by the pytest plugin: torchrun agents and workers die with that process


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Receive ``sig`` when the parent process dies (Linux's parent-death signal); at once if it already has.

    ``init_from_env`` calls it in every torchrun worker: a SIGKILLed agent (which cannot stop its
    workers) then takes them with it. Usable as a ``subprocess.Popen`` ``preexec_fn``. Not for
    a launcher a user starts by hand: ``nohup`` would no longer keep it alive.
    """
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


def tie_to(pid: int | str | None) -> None:
    """SIGKILL this process when process ``pid`` ends (a thread waits on its pidfd; Linux 5.3+).

    For processes that are not children of ``pid``: a torchrun agent below ``entrypoint.sh``
    below a test keeps a live parent (the shell) when the test's pytest is SIGKILLed or ended by
    pytest-timeout's thread method (``os._exit``). Its workers follow it by ``die_with_parent``.
    """
    try:
        pid = int(pid or 0)
    except ValueError:
        return
    if pid <= 0 or pid == os.getpid() or not hasattr(os, "pidfd_open"):
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        os.kill(os.getpid(), signal.SIGKILL)
    except OSError:
        return

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="distlab-tie", daemon=True).start()


def _die_with_launcher(alive, marker: str) -> None:
    """In a rank: die when the launching process does, whatever killed it."""
    # A stopped rank (SIGSTOP, a debugger) could not notice anything: the kernel sends it SIGCONT
    # when its parent (the forkserver, which exits with the launcher) dies. Not SIGKILL: the
    # watch below must first kill the helpers this world started, which would otherwise be
    # orphaned. As a subreaper the rank also inherits its own orphaned descendants.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGCONT)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def watch() -> None:  # the launcher holds the other end: EOF means it is gone (or done with us)
        try:
            alive.recv_bytes()
        except (EOFError, OSError):
            pass
        kill_process_tree(marker=marker)  # helpers this world started, in any session
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="distlab-launcher-watch", daemon=True).start()


def _drop_forkserver_alive_fd() -> None:
    """In a rank: close the write end of the forkserver's "alive" pipe, which every forkserver child inherits.

    The forkserver exits when that pipe has no writer left. A rank that held it (one stopped by
    SIGSTOP) kept its parent, the forkserver, alive after the launcher was SIGKILLed, so the
    parent-death signal that wakes the rank never came: 3 processes left for good. A rank that
    starts processes of its own gets a forkserver of its own (this one's pid is unknown here).
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _child(fn, rank, world_size, args, kwargs, backend, store_path, pg_timeout_s, env, conn, alive=None,
           doctor_path=None):
    # The forkserver was started with the environment of an earlier moment; use
    # the launching process's environment as it is now (DISTLAB_IMPL, ...).
    global _IN_RUN_DISTRIBUTED
    _IN_RUN_DISTRIBUTED = True
    os.environ.clear()
    os.environ.update(env)
    # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: follow the launcher's now
    # (a forkserver started under DETAIL kept wrapping every later run's groups; DDP then crashed).
    dist.set_debug_level_from_env()
    sandbox.enter_rank(store_path, doctor_path)  # a graded run: the audit hook is in before learner code loads
    if alive is not None:
        _drop_forkserver_alive_fd()
        _die_with_launcher(alive, env[RUN_MARKER_ENV].rsplit(":", 1)[-1])
    if doctor_path:
        # The doctor reads the last 64 ops; a dump of torch's default 2000 entries takes ~25 ms.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")
        doctor.install(rank, doctor_path)
    loopback = loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback  # local worlds talk over loopback only
    # world_size processes share the cores: one intra-op pool each would oversubscribe.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    message: tuple
    try:
        if "nccl" in backend:  # "nccl" or a device map such as "cpu:gloo,cuda:nccl": one GPU per rank
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s))
        except Exception as exc:  # before any of the caller's code ran: see run_distributed's retry
            raise InitError(f"process group initialisation failed: {exc}") from exc
        p2p.enable_size_check()  # a message shorter than its receive buffer raises (DISTLAB_P2P_SIZE_CHECK=0: off)
        trace.start_rank(rank, world_size)  # DISTLAB_TRACE=DIR: this rank's communication over time (distlab/trace.py)
        message = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:  # reported to the parent, never swallowed
        message = ("error", type(exc).__module__, type(exc).__qualname__, str(exc),
                   traceback.format_exc(), isinstance(exc, LearnerTODO))
    trace.finish_rank()  # before the sandbox's check: the ledger's patches of torch.distributed are gone
    message = sandbox.leave_rank(message)  # a refused action or a patched verdict function fails the rank
    doctor.write_flight_recorder()  # where this rank stopped, before the launcher reads it
    try:
        # Plain pickle, not the Pipe's: torch's multiprocessing pickler would pass tensors
        # as shared-memory handles, which die with this process before the parent reads them.
        payload = pickle.dumps(message)
    except Exception as exc:  # e.g. an unpicklable result
        payload = pickle.dumps(("error", "builtins", "RuntimeError", f"could not send the result back: {exc}",
                                traceback.format_exc(), False))
    # Helpers this rank started (it is their subreaper) end before the result goes out: once the
    # launcher has every result it terminates the ranks, and their helpers would be orphaned.
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
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
    text = f"{lead}{msg if msg.strip() else qualname.rsplit('.', 1)[-1] + ' (no message)'}"
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


class InitError(RuntimeError):
    """A rank could not join the process group (gloo's mesh set-up), before the caller's code ran."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    try:
        return _run_distributed_once(fn, world_size, *args, **kwargs)
    except RankError as exc:
        # Only a failure inside init_process_group, before ``fn`` ran in any rank: with worlds
        # made and torn down many times a second, gloo's mesh set-up on loopback was seen to
        # fail once in a few hundred worlds ("connectFullMesh ... Connection closed by peer").
        # Nothing of the caller's has run, so one fresh world (new store, new ports) is safe.
        if "distlab.launch.InitError" not in str(exc):
            raise
        return _run_distributed_once(fn, world_size, *args, **kwargs)


def _run_distributed_once(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
                    timeout_s: float = 60.0, pg_timeout_s: float | None = None, hang_s: float | None = None,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh ranks.

    Args:
        fn: a module-level function (it is pickled to the ranks).
        world_size: number of ranks, >= 1.
        backend: "gloo", "nccl", "cpu:gloo,cuda:nccl" or "auto" (gloo: the workers' tensors
            are on the CPU unless they choose otherwise); with NCCL, rank r uses ``cuda:r``.
        timeout_s: the whole run's deadline; ranks still running then are killed
            and ``TimeoutError`` names them (with the hang doctor's table).
        pg_timeout_s: the process group's timeout, after which a collective or
            recv without a peer raises inside the rank (default: ``timeout_s``: a rank
            that waits for a peer still running its own code, slowly on a busy machine,
            is not failed before the run's deadline; true hangs are named sooner by the
            doctor's watch, below).
        hang_s: when no unfinished rank has made progress for this long (none runnable,
            none using CPU on its main thread, no new communication op: ``doctor.Progress``)
            and the ranks' records name a culprit, raise ``HangError`` with the doctor's
            table at once (default: 5 s; 0 turns the doctor's watch off).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        The first failing rank's exception (same type where it is a built-in one,
        ``LearnerTODO`` for unfinished template code, ``RankError`` otherwise),
        with the rank and its traceback in the message; ``distlab.doctor.HangError``
        (a ``RuntimeError``) for a diagnosed hang or mismatched collective.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = resolve_backend(backend, world_size)
    if pg_timeout_s is None:
        pg_timeout_s = max(2.0, timeout_s)
    if hang_s is None:
        hang_s = min(5.0, pg_timeout_s / 2)  # a hang is named in seconds, a blocked rank's own timeout is later
    ctx = _context()
    tmpdir = tempfile.mkdtemp(prefix="distlab-")
    store_path = os.path.join(tmpdir, "store")
    procs, readers, alive = [], [], []
    marker = uuid.uuid4().hex
    env = marked_environ(marker)
    doctor_paths = [os.path.join(tmpdir, f"doctor.{rank}") for rank in range(world_size)]
    failed = False
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            alive_r, alive_w = ctx.Pipe(duplex=False)  # we never write: the rank sees EOF when we are gone
            p = ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, args, kwargs, backend, store_path,
                                  pg_timeout_s, env, writer, alive_r, doctor_paths[rank]))
            p.start()
            writer.close()
            alive_r.close()
            procs.append(p)
            readers.append(reader)
            alive.append(alive_w)
        return _collect(procs, readers, timeout_s, _Watch(procs, doctor_paths, hang_s))
    except BaseException:
        failed = True
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                if p.pid and doctor.thread_stat(p.pid)[0] in ("T", "t"):  # stopped: SIGTERM waits for SIGCONT
                    p.kill()
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        for c in readers + alive:
            c.close()
        if failed:  # helpers a rank started that outlived it (the normal path reaps them in the rank)
            kill_process_tree(marker=marker)
        shutil.rmtree(tmpdir, ignore_errors=True)



run_distributed.__doc__ = _run_distributed_once.__doc__

class _Watch:
    """The parent's side of the hang doctor: ranks' idleness, their records, the diagnosis."""

    def __init__(self, procs, paths, hang_s: float) -> None:
        self.procs, self.paths, self.hang_s = procs, paths, hang_s
        now = time.monotonic()
        self.busy_at = [now] * len(procs)  # when each rank last made progress (doctor.Progress)
        self.progress = [doctor.Progress(p.pid) for p in procs]

    def states(self, finished: dict[int, str]) -> dict[int, str]:
        out = dict(finished)
        for rank, p in enumerate(self.procs):
            if rank not in out and p.pid and doctor.thread_stat(p.pid)[0] in ("T", "t"):
                out[rank] = "stopped (SIGSTOP?)"
        return out

    def records(self) -> dict[int, list[dict]]:
        return {rank: doctor.read_records(path) for rank, path in enumerate(self.paths)}

    def hung(self, pending: set[int], finished: dict[int, str]) -> BaseException | None:
        """A HangError when no pending rank has made progress for ``hang_s`` and the records name a culprit.

        Progress, not CPU share: on a busy machine a rank running its own code may get a few
        percent of a core, and it is not hung (it is runnable, state R, or its main thread's CPU
        time moved); a rank blocked in a collective sleeps with its main thread's CPU time still.
        """
        if self.hang_s <= 0:
            return None
        now, records = time.monotonic(), self.records()
        for rank in pending:
            last = records[rank][-1]["i"] if records[rank] else -1
            if self.progress[rank].moved(last):
                self.busy_at[rank] = now
        if any(now - self.busy_at[r] < self.hang_s for r in pending):
            return None
        return self.diagnosis(records, finished, "hang", idle=True)

    def diagnosis(self, records, finished: dict[int, str], what: str, idle: bool = False) -> BaseException | None:
        states = self.states(finished)
        # A rank's flight-recorder file is current once it has returned or raised (it writes one last
        # time) or, when every running rank has sat idle for hang_s, if it is not stopped (its thread
        # writes within 0.5 s of the recorder going still). Other ranks' files may be out of date.
        current = {rank for rank, how in finished.items() if how.startswith(("returned", "raised"))}
        if idle and self.hang_s >= 0.5:
            current |= {rank for rank in range(len(self.procs)) if rank not in states}
        flight = {rank: doctor.read_flight_recorder(path) if rank in current else None
                  for rank, path in enumerate(self.paths)}
        findings, table, source = doctor.diagnose_all(records, flight, states, len(self.procs))
        return doctor.HangError(doctor.report(findings, table, what, source)) if findings else None


def _collect(procs, readers, timeout_s: float, watch: _Watch) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    finished: dict[int, str] = {}  # rank -> how it ended, for the doctor's table
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
            finished[rank] = f"died ({how})"
            return
        if msg[0] == "ok":
            results[rank] = msg[1]
            finished[rank] = "returned"
        else:
            errors[rank] = _rebuild(rank, *msg[1:])
            finished[rank] = f"raised {msg[2]}"

    while pending and not errors:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            report = watch.diagnosis(watch.records(), finished, "timeout")
            raise TimeoutError(
                f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s "
                "(a send/recv or collective that not every rank called?)"
                + (f"\n{report}" if report else ""))
        # Look at the ranks every half second: a deadlock is named in seconds, not at the timeout.
        ready = wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending],
                     timeout=min(remaining, 0.5))
        for rank in sorted(pending):
            if readers[rank] in ready or procs[rank].sentinel in ready:
                receive(rank)
        if not ready and not errors:
            hang = watch.hung(pending, finished)
            if hang is not None and not any(readers[r].poll() for r in pending):
                raise hang  # (a rank that reported meanwhile, e.g. its unfinished TODO, is heard first)
    if errors:
        # Ranks that already reported count too; prefer a root cause (an assertion,
        # a TODO) over the connection errors its peers see when it dies.
        for rank in sorted(pending):
            if readers[rank].poll():
                receive(rank)

        def secondary(item):
            rank, exc = item
            return any(word in str(exc).lower()[:300] for word in _SECONDARY), rank

        first = min(errors.items(), key=secondary)[1]
        # A timeout, a closed connection or a crash inside gloo (SIGABRT on a size mismatch)
        # blames whichever rank noticed first: the records say who never arrived.
        if secondary(min(errors.items(), key=secondary))[0] or "(signal 6)" in str(first):
            hang = watch.diagnosis(watch.records(), finished, "hang" if "signal 6" not in str(first) else "mismatch")
            if hang is not None:
                raise hang from first
        raise first
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
    if not _IN_RUN_DISTRIBUTED:  # run_distributed's ranks finish their trace themselves (_child)
        trace.finish_rank()
    gc.collect()
    if dist.is_initialized() and not _IN_RUN_DISTRIBUTED:
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
TRACEBACK_ENV = "DISTLAB_TRACEBACK"  # "1": torch's traceback above the one-line launch error


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


def torchrun(argv: list[str]) -> None:
    """``torchrun`` (same arguments) whose rendezvous stores listen only on the address they name.

    ``entrypoint.sh`` runs it as ``python -m distlab.launch ...``: with ``--standalone`` it adds
    ``--local-addr=127.0.0.1`` and GLOO_SOCKET_IFNAME=lo, so a one-machine job listens on loopback only.
    A failed job ends with ``distlab.todo.summarize_failure``'s few lines (the first failing rank
    and its error, once) and exit code 1, not torchrun's traceback and report of every rank.
    A start that fails ends with one line naming the cause and the fix, not torch's ~40-line
    traceback (``DISTLAB_TRACEBACK=1`` prints it above): MASTER_PORT in use on node 0, node 0 not
    answering at MASTER_ADDR:MASTER_PORT, MASTER_ADDR not resolving, and (exit code 2, before any
    worker starts) GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming no interface of this machine.
    """
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

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
    dist.TCPStore = c10d_rendezvous_backend.TCPStore = BoundTCPStore
    try:
        run.run(args)  # run.main without its @record, which logs that this agent has no error file
    except ChildFailedError as exc:
        from distlab.todo import summarize_failure

        print(summarize_failure(exc), file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as exc:
        line = _launch_error_line(exc, None if args.standalone else args.rdzv_endpoint)
        if line is None:
            raise
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exc()
        # The last thing the user reads: the cause and what to change (DISTLAB_TRACEBACK=1 shows torch's traceback)
        print(f"distlab.launch: {line}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    torchrun(sys.argv[1:])
