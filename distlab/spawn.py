"""``run_distributed``: a world of fresh local ranks for tests and demos.

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
  a stopped rank), and so do the helper processes it started, in any session
  (``distlab.procs``);
* says who hangs: every rank records its last communication ops (``distlab.doctor``);
  when no rank has made progress for ``hang_s`` seconds (``doctor.Progress``: a slow
  rank on a busy machine is progress), or on a timeout or a crash, the
  records are merged into one table that names the rank that never arrived and the op
  the others wait in ("rank 1 never entered all_reduce #3 (16 B) on WORLD ..."); PyTorch's
  flight recorder fills in the collectives torch issues itself (DDP's all-reduces);
* says when the machine is slow: a run still making progress at its deadline while its ranks wait
  for a CPU (a busy machine) is waited for, up to ``doctor_watch.HARD_CAP`` times the deadline (and
  within the test's pytest-timeout); past that it fails with "slow machine (load N on K cores), not
  your code: rerun" and names nobody. ``DISTLAB_TIMEOUT_SCALE`` multiplies every deadline here;
* says who skipped a collective: when a rank's check fails (an AssertionError) while others wait in a
  collective it never entered, the first line says so, and the failed check follows; any other error a
  rank raises is the cause and stays the verdict.

Inside a test, a learner's ``dist.all_reduce`` runs wrapped: the hang doctor records each op
(``distlab.doctor``), a ``CommLedger`` counts its bytes where the test opens one
(``distlab.comm``), and a send or receive also goes through the strict point-to-point checker
(``distlab.p2p``). The wrappers call torch's function unchanged; they only watch. In a grading run
each rank's result carries the checks it recorded (``distlab.testing``), for the grader's process to
compare (distlab/grading/verdict.py); an "ok" without them did not come from here and is refused.

This module is the launcher's side; a rank's own life is distlab/rank.py's, with the rank hooks a layer
above the bench (grading) gives every rank (distlab/hooks.py).

Workers never read the environment; ``distlab.launch.init_from_env`` is the torchrun-side twin.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import re
import shutil
import tempfile
import time
import uuid
from multiprocessing.connection import wait
from typing import Any, Callable

from distlab import doctor, doctor_watch, hooks, outcome, testing
from distlab.doctor_diagnosis import _pending, skipped
from distlab.devices import resolve_backend
from distlab.procs import kill_process_tree, marked_environ
from distlab.rank import InitError, child
from distlab.outcome import RankError  # noqa: F401 - its home was here: callers import it from spawn

_CTX = None


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
                                     "torch.testing", "torch.distributed.tensor", "distlab.spawn",
                                     "pytest", "distlab.testing", "distlab.loader", "distlab.comm",
                                     "distlab.models", "distlab.lessons.sync", "distlab.p2p", "distlab.doctor"])
    return _CTX


def preload(*modules: str) -> None:
    """Import ``modules`` once in the forkserver too, for every rank (before the first run: a forkserver
    already started keeps what it has)."""
    from multiprocessing import forkserver

    _context().set_forkserver_preload(forkserver._forkserver._preload_modules + list(modules))


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


_BENCH_FRAMES = tuple(f"{os.sep}distlab{os.sep}{name}" for name in ("spawn.py", "rank.py", "procs.py", "testing.py"))


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
    # The one rebuild (distlab/outcome.py), then the rank's own frames in place of the launcher's.
    exc = outcome.rebuild(("error", module, qualname, msg, tb, is_todo), rank)
    if not is_todo:  # a TODO is one line: the learner needs the TODO and the guideline section, not a traceback
        exc.rank_traceback = f"--- in rank {rank} ---\n{_learner_frames(tb, qualname.rsplit('.', 1)[-1], msg)}"
    return exc


# Errors that are usually a consequence of another rank failing first.
_SECONDARY = ("connection", "closed", "reset", "broken pipe", "timed out", "timeout", "peer")


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    try:
        return _run_distributed_once(fn, world_size, *args, **kwargs)
    except RankError as exc:
        # Only a failure inside init_process_group, before ``fn`` ran in any rank: with worlds
        # made and torn down many times a second, gloo's mesh set-up on loopback was seen to
        # fail once in a few hundred worlds ("connectFullMesh ... Connection closed by peer").
        # Nothing of the caller's has run, so one fresh world (new store, new ports) is safe.
        if f"{InitError.__module__}.InitError" not in str(exc):
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
            and ``TimeoutError`` names them (with the hang doctor's table), unless they are
            still making progress on a busy machine: then the run is waited for up to
            ``doctor_watch.HARD_CAP`` times as long, and fails with "slow machine ..." past that.
        pg_timeout_s: the process group's timeout, after which a collective or
            recv without a peer raises inside the rank (default: past the hard cap: a rank
            that waits for a peer still running its own code, slowly on a busy machine,
            is not failed before the run's deadline; true hangs are named sooner by the
            doctor's watch, below). Every deadline is multiplied by DISTLAB_TIMEOUT_SCALE.
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
    scale = doctor_watch.timeout_scale()
    timeout_s *= scale
    if hang_s is None:  # a hang is named in seconds, a blocked rank's own timeout is later
        hang_s = min(5.0 * scale, (timeout_s if pg_timeout_s is None else pg_timeout_s * scale) / 2)
    else:
        hang_s *= scale
    pg_timeout_s = max(2.0, timeout_s * (doctor_watch.HARD_CAP + 1)) if pg_timeout_s is None else pg_timeout_s * scale
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
            p = ctx.Process(target=child, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, args, kwargs, backend, store_path,
                                  pg_timeout_s, env, writer, alive_r, doctor_paths[rank], hooks.rank_hooks()))
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
    """The parent's side of the hang doctor: ranks' progress, their records, the diagnosis."""

    def __init__(self, procs, paths, hang_s: float) -> None:
        self.procs, self.paths, self.hang_s = procs, paths, hang_s
        self.started = now = time.monotonic()
        self.busy_at = [now] * len(procs)  # when each rank last made progress (doctor.Progress)
        self.progress = [doctor.Progress(p.pid) for p in procs]
        self.waited = [0.0] * len(procs)  # seconds each rank waited, runnable, for a CPU (kept after it ends)

    def states(self, finished: dict[int, str]) -> dict[int, str]:
        out = dict(finished)
        for rank, p in enumerate(self.procs):
            if rank not in out and p.pid and doctor.thread_stat(p.pid)[0] in ("T", "t"):
                out[rank] = "stopped (SIGSTOP?)"
        return out

    def records(self) -> dict[int, list[dict]]:
        return {rank: doctor.read_records(path) for rank, path in enumerate(self.paths)}

    def look(self, pending: set[int]) -> dict[int, list[dict]]:
        """Note which pending ranks made progress since the last look, and how long the ranks waited for a CPU.

        Progress, not CPU share: on a busy machine a rank running its own code may get a few
        percent of a core, and it is not hung (it is runnable, state R, or its main thread's CPU
        time moved); a rank blocked in a collective sleeps with its main thread's CPU time still.
        """
        now, records = time.monotonic(), self.records()
        for rank in pending:
            if self.progress[rank].moved(records[rank][-1]["i"] if records[rank] else -1):
                self.busy_at[rank] = now
        for rank, p in enumerate(self.procs):
            self.waited[rank] = max(self.waited[rank], doctor_watch.run_delay(p.pid) if p.pid else 0.0)
        return records

    def moving(self, pending: set[int]) -> list[int]:
        """The pending ranks that made progress within the last max(hang_s, 1 s) (looks are 0.5 s apart)."""
        return [r for r in sorted(pending) if time.monotonic() - self.busy_at[r] < max(self.hang_s, 1.0)]

    def slowed(self, pending: set[int]) -> bool:
        """Still progressing on a machine busy enough to slow the ranks down."""
        return bool(self.moving(pending)) and doctor_watch.busy(sum(self.waited), time.monotonic() - self.started)

    def hung(self, pending: set[int], finished: dict[int, str], records) -> BaseException | None:
        """A HangError when no pending rank has made progress for ``hang_s`` and the records name a culprit."""
        if self.hang_s <= 0 or any(time.monotonic() - self.busy_at[r] < self.hang_s for r in pending):
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
    start = time.monotonic()
    deadline, cap = start + timeout_s, start + doctor_watch.hard_cap_s(timeout_s)
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    raw: dict[int, tuple] = {}  # rank -> its error report, as it came
    finished: dict[int, str] = {}  # rank -> how it ended, for the doctor's table
    pending = set(range(len(procs)))
    checks: dict[int, list[dict]] = {}  # a grading run's records, per rank (distlab/testing.py)

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
        if msg[0] == "ok" and testing.recording() and (len(msg) < 3 or not isinstance(msg[2], list)):
            # Only the launcher's own code sends "ok" with the rank's records: this came from somewhere else.
            errors[rank] = RankError(f"rank {rank} reported success without the records of its checks (a result "
                                     "written into the rank's result pipe by other code: the test did not run)")
            finished[rank] = "forged a result"
        elif msg[0] == "ok":
            results[rank] = msg[1]
            checks[rank] = msg[2] if len(msg) > 2 and msg[2] is not None else []
            finished[rank] = "returned"
        else:
            errors[rank], raw[rank] = _rebuild(rank, *msg[1:]), msg
            finished[rank] = f"raised {msg[2]}"

    def hear(within_s: float) -> list:
        ready = wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=within_s)
        for rank in sorted(pending):
            if readers[rank] in ready or procs[rank].sentinel in ready:
                receive(rank)
        return ready

    while pending and not errors:
        now = time.monotonic()
        if now >= deadline and watch.slowed(pending):  # progressing on a busy machine: slow, not stuck
            if now >= cap:
                raise TimeoutError(doctor_watch.slow_machine(watch.moving(pending), now - start))
            deadline = min(cap, now + 0.5)
        elif now >= deadline:
            report = watch.diagnosis(watch.records(), finished, "timeout")
            spinning = bool(watch.moving(pending))
            raise TimeoutError(
                f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s "
                + ("(still running their own code on an idle machine: an endless loop?)" if spinning else
                   "(a send/recv or collective that not every rank called?)") + (f"\n{report}" if report else ""))
        # Look at the ranks every half second: a deadlock is named in seconds, not at the timeout.
        ready = hear(min(deadline - now, 0.5))
        if not ready and not errors:
            hang = watch.hung(pending, finished, watch.look(pending))
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

        first_rank, first = min(errors.items(), key=secondary)
        # A timeout, a closed connection or a crash inside gloo (SIGABRT on a size mismatch)
        # blames whichever rank noticed first: the records say who never arrived.
        if secondary((first_rank, first))[0] or "(signal 6)" in str(first):
            hang = watch.diagnosis(watch.records(), finished, "hang" if "signal 6" not in str(first) else "mismatch")
            if hang is not None:
                raise hang from first
        # A failed check (not a TODO, not an error its code raised on purpose, which is the cause itself): the
        # symptom of a collective it skipped?
        if first_rank in raw and not raw[first_rank][5] and raw[first_rank][2].rsplit(".", 1)[-1] == "AssertionError":
            # For the others to enter the one it skipped: until each is blocked in a collective or has ended (on a
            # busy machine that takes what it takes), within the run's deadline and 30 s (scaled). A rank that
            # entered it after this one exited failed there (connection closed): its record still says where.
            now = time.monotonic()
            settle = now + min(30.0 * doctor_watch.timeout_scale(), max(2.0, deadline - now))
            while pending and time.monotonic() < settle and not all(_pending(watch.records()[r]) for r in pending):
                hear(0.1)
            line = skipped(watch.records(), first_rank, len(procs))
            if line:
                _, module, qualname, text, tb, _ = raw[first_rank]
                table = doctor.table(watch.records(), watch.states(finished), time.time())
                raise _rebuild(first_rank, module, qualname, f"{line}\nrank {first_rank} then raised "
                               f"{qualname.rsplit('.', 1)[-1]}: {text}\nwhat each rank was doing:\n{table}", tb, False)
        raise first
    for rank in range(len(procs)):
        testing.add_records(checks[rank], rank)
    return [results[r] for r in range(len(procs))]
