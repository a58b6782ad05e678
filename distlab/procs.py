"""Process hygiene: nothing a run starts outlives it.

Used by both launchers (``distlab.spawn`` for tests and demos, ``distlab.launch`` under torchrun)
and by the tests that check them: find a process's descendants and the processes a run marked
in their environment (``RUN_MARKER_ENV``), kill them all, and tie a process's life to another's
(the kernel's parent-death signal, a pidfd watch) so that a SIGKILLed launcher takes its ranks along.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

from distlab import doctor, doctor_watch

RUN_MARKER_ENV = "DISTLAB_RUN_ID"  # every process a run starts carries it: found and killed by it
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


class Deadline:
    """A job's deadline (torchrun's agent, a nested pytest: ``pids`` and their descendants), scaled by
    DISTLAB_TIMEOUT_SCALE, that waits like ``run_distributed``'s for a job still progressing on a busy machine.

    ``passed()`` is None while the job has time: before its deadline, or after it while its processes use
    CPU (or are runnable) on a busy machine (``doctor_watch.busy``; looks 0.5 s apart, ``doctor_watch.Looks``),
    up to ``doctor_watch.hard_cap_s``. Then it says why: "" for a plain timeout, or
    ``doctor_watch.slow_machine``'s line when the job was still progressing at the cap.
    """

    def __init__(self, pids: list[int], timeout_s: float) -> None:
        self.pids, self.timeout_s = pids, timeout_s * doctor_watch.timeout_scale()
        self.start = time.monotonic()
        self.cap = self.start + doctor_watch.hard_cap_s(self.timeout_s)
        self.looks = doctor_watch.Looks()
        self.moving = False

    def passed(self) -> str | None:
        now = time.monotonic()
        if now < self.start + self.timeout_s:
            return None
        if self.looks.seen is None or now - self.looks.seen[0] >= 0.5:
            moved, waited, wall = self.looks.look({p for root in self.pids for p in [root, *_descendants(root)]})
            if wall > 0:  # progress as doctor.Progress sees it, on a machine that keeps the job waiting for a CPU
                self.moving = moved and doctor_watch.busy(waited, wall)
        if not self.moving:
            return "" if self.looks.count >= 2 else None  # two looks, to tell a stuck job from a slow one
        return doctor_watch.slow_machine(None, now - self.start) if now >= self.cap else None


def communicate(proc: subprocess.Popen, timeout_s: float | None) -> tuple[bytes | str | None, str | None]:
    """``proc.communicate()`` under a ``Deadline`` of ``timeout_s`` (None: none): ``(output, None)``, or when the
    deadline passes (a plain timeout, or the slow machine's cap) the process is killed: ``(output, why)``."""
    deadline = Deadline([proc.pid], timeout_s) if timeout_s else None
    while True:
        try:
            return proc.communicate(timeout=0.5)[0], None
        except subprocess.TimeoutExpired:  # retrying loses no output
            why = deadline.passed() if deadline else None
            if why is not None:
                proc.kill()
                return proc.communicate()[0], why or f"ended after {round(deadline.timeout_s, 1):g} s"


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


def stop(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """End ``proc`` (a daemon this process started): SIGTERM, ``grace_s`` to exit on its own, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
