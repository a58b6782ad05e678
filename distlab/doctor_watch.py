"""When a run is stuck rather than slow: a rank's progress, and the watchdog of a torchrun job.

``Progress`` tells a rank that waits from one that works (``run_distributed`` and the watchdog both
use it); ``start_watchdog`` (started by ``init_from_env`` through ``distlab.doctor.start_watchdog``,
on unless DISTLAB_HANG_TIMEOUT=0) publishes the ranks' records to the rendezvous store and prints
the doctor's table when a rank stays blocked and no rank progresses that long. The course's code
imports these names from ``distlab.doctor``.

A slow machine is said, never blamed. Every course deadline (``run_distributed``'s run deadline and its
process group's timeout, ``init_from_env``'s, the watchdog's, pytest-timeout's per-test limits) is
multiplied by ``DISTLAB_TIMEOUT_SCALE`` (default 1; e.g. 3 on a machine you know is slow). A run whose
ranks keep making progress past its deadline on a busy machine (its ranks wait for a CPU: ``run_delay``;
or the machine keeps tasks waiting: ``machine_busy``)
is waited for, up to ``HARD_CAP`` times the deadline (or the test's own pytest-timeout, less a margin);
if it is still going then, ``slow_machine`` says so ("slow machine (load 37.2 on 2 cores), not your
code: rerun ...") and names nobody.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from distlab import flight_recorder
from distlab.deadlines import TIMEOUT_SCALE_ENV, timeout_scale  # noqa: F401 - the launcher's spelling
from distlab.doctor_diagnosis import _pending, diagnose_all, report
from distlab.todo import HANG_EXIT_CODE

HANG_TIMEOUT_ENV = "DISTLAB_HANG_TIMEOUT"


# --------------------------------------------------------------------------- progress
def thread_stat(pid: int, tid: int | None = None) -> tuple[str, int]:
    """(state letter, CPU clock ticks used) of process ``pid`` (all its threads), or of its thread
    ``tid`` alone, from /proc; ("", 0) when it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "", 0
    return fields[0], int(fields[11]) + int(fields[12])


class Progress:
    """Whether a rank's own code moved since the last look: a hang is a lack of progress, not of CPU.

    A rank progresses when its main thread (where its Python code, its collectives and, on the CPU,
    its backward run) is runnable or in uninterruptible I/O (state R or D: a rank waiting for a core
    on a busy machine is R), or used any CPU since the last look, or recorded a new communication op.
    A rank blocked in a collective or a recv sleeps (state S) and uses no CPU on its main thread;
    helper threads (the flight-recorder writer, the watchdog) are not counted. A stopped rank
    (state T) never progresses.
    """

    def __init__(self, pid: int, tid: int | None = None) -> None:
        self.pid, self.tid = pid, tid or pid  # the main thread's id is the process's
        self.seen: tuple[int, object] | None = None

    def moved(self, last_op: object) -> bool:
        state, ticks = thread_stat(self.pid, self.tid)
        seen, self.seen = self.seen, (ticks, last_op)
        if state in ("", "T", "t", "Z", "X"):
            return False
        return state in ("R", "D") or seen is None or seen != (ticks, last_op)


# --------------------------------------------------------------------------- deadlines on a busy machine
TEST_DEADLINE_ENV = "DISTLAB_TEST_DEADLINE"  # when pytest-timeout ends the current test (time.time()), set below
HARD_CAP = 10  # a run that keeps progressing on a busy machine is waited for up to 10x its deadline
BUSY_SHARE = 0.2  # the ranks waited for a CPU for 20% of the run's wall time (summed): the machine is busy
PRESSURE = "/proc/pressure/cpu"  # Linux's pressure stall information for CPUs (4.20+)


def machine_load() -> str:
    """``load 37.2 on 2 cores``: the 1-minute load average and the cores this process may use."""
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return "load unknown"
    return f"load {load:.1f} on {cores} core{'s' if cores != 1 else ''}"


def run_delay(pid: int) -> float:
    """Seconds the main thread of ``pid`` has waited, runnable, for a CPU (/proc/PID/schedstat); 0.0 if unknown."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Looks:
    """What a set of processes did between two looks at /proc: the probe of every deadline that follows a job's
    progress (``distlab.procs.Deadline``, the rendezvous' ``launch_agent.JoinDeadline``)."""

    def __init__(self) -> None:
        self.seen: tuple[float, dict] | None = None  # (when, {pid: (state, CPU ticks, run delay)}) at the last look
        self.count = 0

    def look(self, pids) -> tuple[bool, float, float]:
        """``(moved, waited_s, wall_s)`` since the last look: whether any of ``pids`` (the living ones) is runnable
        or in disk sleep, or used CPU; how long they waited for a CPU, summed; the time between (0 at the first)."""
        now = time.monotonic()
        stats = {p: (*thread_stat(p), run_delay(p)) for p in pids}
        stats = {p: s for p, s in stats.items() if s[0] not in ("", "Z", "X")}
        before, when = self.seen[1] if self.seen else {}, self.seen[0] if self.seen else now
        common = [p for p in stats if p in before]
        moved = any(s[0] in ("R", "D") for s in stats.values()) or any(stats[p][1] != before[p][1] for p in common)
        waited = sum(stats[p][2] - before[p][2] for p in common)
        self.seen, self.count = (now, stats), self.count + 1
        return moved, waited, now - when


def busy(waited_s: float, wall_s: float) -> bool:
    """The machine slowed the run: its ranks waited ``waited_s`` (summed) for a CPU in ``wall_s``, or the machine
    as a whole keeps tasks waiting (``machine_busy``). A starved process's wait reaches /proc only when it gets
    a CPU (schedstat is written then), so over half a second it reads 0.04 s one look and 2 s the next."""
    return (waited_s > 0 and waited_s >= BUSY_SHARE * wall_s) or machine_busy()


def machine_busy() -> bool:
    """Some task waited for a CPU ``BUSY_SHARE`` of the last 10 s (/proc/pressure/cpu); without pressure
    stall information, a 1-minute load average above the cores this process may use."""
    try:
        with open(PRESSURE) as f:
            return float(f.readline().split()[1].split("=")[1]) >= 100 * BUSY_SHARE
    except (OSError, IndexError, ValueError):
        pass
    try:
        return os.getloadavg()[0] > len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return False


def slow_machine(ranks: list[int] | None, waited_s: float, what: str | None = None) -> str:
    """The one line for a run (``ranks``; None: a job's processes) still progressing when its hard cap passed
    (``what``: what was still going, in place of the ranks' progress)."""
    who = f"ranks {ranks}" if ranks is not None else "its processes"
    return (f"slow machine ({machine_load()}), not your code: rerun (or set {TIMEOUT_SCALE_ENV}="
            f"{max(2, 2 * timeout_scale()):g}); {what or f'{who} were still making progress after {waited_s:.0f} s'}")


TEST_MARGIN_S = 10  # before pytest-timeout fires, for the run's own report to arrive (tests/test_timeouts.py's)


def hard_cap_s(timeout_s: float) -> float:
    """How long a run with deadline ``timeout_s`` (scaled) that keeps progressing on a busy machine is waited
    for: ``HARD_CAP`` times the deadline, ending ``TEST_MARGIN_S`` before the current test's pytest-timeout
    (never before the deadline itself)."""
    left = test_time_left()
    cap = timeout_s * HARD_CAP if left is None else min(timeout_s * HARD_CAP, left - TEST_MARGIN_S)
    return max(timeout_s, cap)


def test_time_left() -> float | None:
    """Seconds before pytest-timeout ends the current test (``set_test_timer``), or None outside one."""
    try:
        return float(os.environ[TEST_DEADLINE_ENV]) - time.time()
    except (KeyError, ValueError):
        return None


def set_test_timer(item, settings) -> bool:
    """pytest-timeout's ``pytest_timeout_set_timer`` with the test's timeout scaled by DISTLAB_TIMEOUT_SCALE,
    and the moment it fires in ``TEST_DEADLINE_ENV``: a run waited for on a busy machine ends before it."""
    import pytest_timeout

    settings = settings._replace(timeout=settings.timeout * timeout_scale())
    os.environ[TEST_DEADLINE_ENV] = repr(time.time() + settings.timeout)
    pytest_timeout.pytest_timeout_set_timer(item, settings)
    cancel = item.cancel_timeout

    def cancel_and_forget() -> None:
        os.environ.pop(TEST_DEADLINE_ENV, None)
        cancel()

    item.cancel_timeout = cancel_and_forget
    return True


# --------------------------------------------------------------------------- torchrun watchdog
def watchdog_timeout(setting: str | None, run_timeout_s: float) -> float:
    """The watchdog's timeout in seconds from DISTLAB_HANG_TIMEOUT (0: off).

    Unset or empty: ``run_timeout_s``/10, between 10 and 30 s (a stopped or stuck rank is
    named in well under a minute; a healthy rank waits for a slow one much longer than
    that only if neither makes progress). "0" or "off": no watchdog. Either is multiplied by
    DISTLAB_TIMEOUT_SCALE (``run_timeout_s`` is the caller's own, unscaled).
    """
    setting = (setting or "").strip().lower()
    if not setting:
        return min(30.0, max(10.0, run_timeout_s / 10)) * timeout_scale()
    if setting in ("0", "off", "none"):
        return 0.0
    try:
        value = float(setting)
    except ValueError:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={setting!r} is not a number of seconds (e.g. {HANG_TIMEOUT_ENV}=60; "
                         f"{HANG_TIMEOUT_ENV}=0 turns the watchdog off)") from None
    if value < 0:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={setting} must be >= 0 seconds ({HANG_TIMEOUT_ENV}=0 turns the watchdog off)")
    return value * timeout_scale()


def start_watchdog(recorder, store, rank: int, world_size: int, timeout_s: float,
                   interval_s: float | None = None, exit_on_fire: bool = True) -> threading.Thread:
    """Under torchrun: publish this rank's records (``recorder``: ``distlab.doctor``'s ``Recorder``, which
    ``doctor.start_watchdog`` passes) and its flight recorder's to ``store``; if this
    rank stays blocked in one op (an op of the wrappers, or a collective of its flight recorder,
    such as DDP's) for ``timeout_s`` while no rank of the job makes progress, print the doctor's
    table for all ranks (the first rank to fire prints; ``diagnose_all`` picks the records that
    explain it) and end the process with ``HANG_EXIT_CODE`` so torchrun tears the job down (or
    restarts it). Across nodes (torchrun's GROUP_RANK; ``this_node``) a rank blocked while another
    has diagnosed the hang ends with it, without waiting for its own timeout; the first of each other
    node's ranks prints that report too (or where it is), and all end together (``exit_at``), so that
    every node's log holds what its agent's summary points at.

    Progress is shared through one store counter: a rank adds to it when it records a new op,
    or when its main thread runs (``Progress``) while it is not blocked in an op. So rank 1
    waiting in a barrier while rank 0 writes a checkpoint, or while a busy machine deschedules
    rank 0, is not a hang; a stopped rank, or one stuck in a lock or a spin, is.

    ``stop_watchdog`` ends the thread; it runs at interpreter exit (atexit) and in
    ``launch.shutdown``: a daemon thread still inside a store call while the process tears down
    its C++ objects aborted ranks at exit ("terminate called without an active exception", seen
    on every multi-node run in containers, where a store call takes long enough to be caught).
    A store that fails (its host gone at the end of the job) ends the watch quietly.
    """
    global _WATCHDOG
    interval_s = interval_s or max(0.2, min(1.0, timeout_s / 4))
    progress = Progress(os.getpid(), threading.main_thread().native_id)

    stop = threading.Event()

    def loop() -> None:
        try:
            watch()
        except Exception:  # the store went away (the job is ending, or its host is gone): nothing to watch
            if not stop.is_set():
                print(f"distlab hang doctor (rank {rank}): the watchdog stopped: its store failed",
                      file=sys.stderr, flush=True)

    def watch() -> None:
        published, token, seen = None, None, (None, time.time())  # seen: (job counter, when it last moved)
        publisher = flight_recorder.Publisher()
        while not stop.wait(interval_s):
            recs = recorder.records()
            blob = json.dumps(recs)
            if blob != published:
                store.set(f"doctor/{rank}", blob)
                published = blob
            snap = publisher.poll()
            if snap is not None:
                store.set(f"doctor/fr/{rank}", json.dumps(snap))
            fr = publisher.current()
            fr_recs = flight_recorder.cut(fr["records"]) if fr else []
            stuck = _pending(recs) or _pending(fr_recs)
            last = (recs[-1]["i"] if recs else -1, fr_recs[-1]["i"] if fr_recs else -1)  # the newest ops
            moved = progress.moved(last)
            if last != token or (moved and not stuck):
                store.add("doctor/progress", 1)
            token = last
            if not stuck:
                continue
            counter = store.add("doctor/progress", 0)
            if counter != seen[0]:
                seen = (counter, time.time())
            idle_since = max(stuck["t0"], seen[1])
            node = this_node()
            # Across nodes, a rank blocked while another has diagnosed the hang is part of it: it ends now,
            # with that report in its node's log, not later with the connection error the firer's exit
            # causes (on loopback the other node's summary was "Connection closed by peer", no report).
            joins = node is not None and store.check(["doctor/report"])
            if time.time() - idle_since < timeout_s and not joins:
                continue
            if store.add("doctor/fired", 1) == 1:
                if node:
                    store.add(f"doctor/printed/{node}", 1)  # this node's log gets the report from this rank
                    store.set("doctor/firer", json.dumps({"rank": rank, "node": node}))  # where to look, if it is late
                keys = [f"doctor/{r}" for r in range(world_size)]
                everyone = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
                states = {r: "no records published" for r in range(world_size) if r not in everyone}
                flight = {r: json.loads(store.get(f"doctor/fr/{r}")) if store.check([f"doctor/fr/{r}"]) else None
                          for r in range(world_size)}
                findings, text, source = diagnose_all(everyone, flight, states, world_size)
                text = report(findings or ["no rank is missing; every rank is blocked in the same op"], text,
                              source=source)
                where = f", {node}" if node else ""
                print(f"distlab hang doctor (rank {rank}{where}, {HANG_TIMEOUT_ENV}={timeout_s:g}; no rank made "
                      f"progress for {time.time() - idle_since:.0f} s):\n{text}", file=sys.stderr, flush=True)
                # Across nodes every blocked rank ends at exit_at, after the others' have read the report (above):
                # one that ended first would close its connections, and a peer's collective would fail with
                # "Connection closed by peer" before its watchdog said why.
                exit_at = time.time() + (2 * interval_s if node else 0.0)
                store.set("doctor/report", json.dumps({"rank": rank, "node": node, "text": text, "exit_at": exit_at}))
                stop.wait(max(0.0, exit_at - time.time()))
            elif node:
                first = _read_report(store, min(10.0, max(2.0, timeout_s)))
                if store.add(f"doctor/printed/{node}", 1) == 1:
                    _print_anothers_report(store, rank, node, first)
                if first:
                    stop.wait(max(0.0, min(float(first.get("exit_at", 0.0)) - time.time(), 4 * interval_s)))
            if exit_on_fire:
                os._exit(HANG_EXIT_CODE)
            return

    thread = threading.Thread(target=loop, name="distlab-hang-watchdog", daemon=True)
    thread.start()
    if _WATCHDOG is None:
        atexit.register(stop_watchdog)
    _WATCHDOG = (thread, stop)
    return thread


def this_node() -> str | None:
    """This rank's machine as its user names it, "node 1" (NODE_RANK, else torchrun's GROUP_RANK) with its
    host name where that says more; None outside a multi-node torchrun job (GROUP_WORLD_SIZE: nodes)."""
    if "GROUP_RANK" not in os.environ or int(os.environ.get("GROUP_WORLD_SIZE") or 1) < 2:
        return None
    number = os.environ.get("NODE_RANK", "").strip() or os.environ["GROUP_RANK"]
    host = socket.gethostname()
    return f"node {number}" + ("" if host in (f"node{number}", "localhost", "") else f" ({host})")


def _read_report(store, within_s: float) -> dict | None:
    """The first firing rank's report ({"rank", "node", "text", "exit_at"}); None if not there within ``within_s``."""
    try:
        store.wait(["doctor/report"], timedelta(seconds=within_s))
        return json.loads(store.get("doctor/report"))
    except Exception:  # not written in time (its rank died first), or the store went away
        return None


def _print_anothers_report(store, rank: int, node: str, first: dict | None) -> None:
    """The first rank to fire is on another node: its report goes to this node's log too.

    Each node's agent ends with "ended by the hang doctor's watchdog: its report above ... names the
    rank to blame" (``summarize_failure``); after a network cut the report was in one node's log only.
    Without the report (``first`` is None: it did not come in time) say where it is instead.
    """
    if first is None:
        try:
            firer = json.loads(store.get("doctor/firer")) if store.check(["doctor/firer"]) else {}
        except Exception:
            firer = {}
        who = f"rank {firer['rank']} on {firer['node']}" if firer else "a rank of another node"
        log = f"{firer['node']}'s log" if firer else "that node's log"
        print(f"distlab hang doctor (rank {rank}, {node}): {who} diagnosed this hang first: see {log} for its "
              f"report (\"hang diagnosed: ...\", naming the rank to blame)", file=sys.stderr, flush=True)
        return
    where = f", {first['node']}" if first.get("node") else ""
    print(f"distlab hang doctor (rank {rank}, {node}): the report of rank {first['rank']}{where}, which "
          f"diagnosed this hang first:\n{first['text']}", file=sys.stderr, flush=True)


_WATCHDOG: tuple[threading.Thread, threading.Event] | None = None


def stop_watchdog(timeout_s: float = 5.0) -> None:
    """End this process's watchdog thread, waiting up to ``timeout_s`` for a store call in flight."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        thread, stop = _WATCHDOG
        stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout_s)
        _WATCHDOG = None
