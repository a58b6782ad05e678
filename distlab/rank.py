"""A rank of ``run_distributed``, from its start to its result (the launcher's side is distlab/spawn.py).

:func:`child` runs in each rank the launcher starts: it takes up the launcher's environment, ties the
rank's life to the launcher's (``distlab.procs``), starts the hang doctor's records, joins the process
group, runs the caller's function and sends back ``("ok", result, records)`` or the exception, as a
message of plain values.

The rank hooks (distlab/hooks.py) come with the rank's work and run around the caller's code: what a
layer above the bench does in every rank without the bench knowing it (a graded run's sandbox).
"""
from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from distlab import doctor, hooks, outcome, p2p, role, testing, trace
from distlab.devices import loopback_interface
from distlab.procs import _PR_SET_CHILD_SUBREAPER, _PR_SET_PDEATHSIG, RUN_MARKER_ENV, _descendants, _prctl, kill_process_tree


class InitError(RuntimeError):
    """A rank could not join the process group (gloo's mesh set-up), before the caller's code ran."""


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


def child(fn, rank, world_size, args, kwargs, backend, store_path, pg_timeout_s, env, conn, alive=None,
          doctor_path=None, rank_hooks=()):
    """A rank's whole life, in the process the launcher started: ``fn``'s result or its exception goes
    back through ``conn`` as a message (distlab/spawn.py ``_collect`` reads it)."""
    # The forkserver was started with the environment of an earlier moment; use
    # the launching process's environment as it is now (DISTLAB_IMPL, ...).
    role.become(role.RANK)
    hooks.set_rank_hooks(rank_hooks)  # the worlds this rank starts get them too
    os.environ.clear()
    os.environ.update(env)
    # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: follow the launcher's now
    # (a forkserver started under DETAIL kept wrapping every later run's groups; DDP then crashed).
    dist.set_debug_level_from_env()
    if env.get(testing.RECORD_ENV):
        testing.start_recording()  # a grading run: this rank's checks go back with its result
    for hook in rank_hooks:
        hook.enter(store_path, doctor_path)  # before the caller's code loads (a graded run: the audit hook)
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
        result = fn(rank, world_size, *args, **kwargs)
        p2p.flush_size_checks()  # headers still in flight (CUDA's deferred check) are read before "ok"
        message = ("ok", result, testing.take_records() if testing.recording() else None)
    except BaseException as exc:  # reported to the parent, never swallowed
        message = outcome.failure(exc)
    trace.finish_rank()  # before the hooks' checks: the ledger's patches of torch.distributed are gone
    for hook in reversed(rank_hooks):
        message = hook.leave(message)  # a graded run: a refused action or a patched verdict function fails the rank
    doctor.write_flight_recorder()  # where this rank stopped, before the launcher reads it
    try:
        # Plain pickle, not the Pipe's: torch's multiprocessing pickler would pass tensors
        # as shared-memory handles, which die with this process before the parent reads them.
        payload = pickle.dumps(message)
    except Exception as exc:  # e.g. an unpicklable result
        payload = pickle.dumps(outcome.failure_text(f"could not send the result back: {exc}", traceback.format_exc()))
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
