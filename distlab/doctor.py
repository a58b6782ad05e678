"""The hang doctor: what every rank was doing when a job stopped moving, and who is to blame.

Every rank keeps a small ring buffer of its last communication ops (op, sequence
number, bytes, peer, group, start time, done or not) in a memory-mapped file, so
the records survive the rank: a stopped (SIGSTOP) or crashed rank is read like a
live one. The records come from wrappers on the public functions of
``torch.distributed`` (the ones ``CommLedger`` wraps, plus barrier and the object
collectives); a ``CommLedger`` entered later wraps these wrappers and sees the same calls.

Sequence numbers make the ranks' records comparable: the n-th collective a rank
enters on a group is ``#n`` of that group on every rank, and the k-th message rank s
sends to rank r is ``send #k`` on s and ``recv #k`` on r. ``diagnose`` merges the
ranks' records into one table whose first lines name the culprit:

    rank 3 never entered all_reduce #17 (4 KiB) on WORLD (it returned after barrier #16);
    ranks 0-2 waiting since 12.3 s

``run_distributed`` reads the files when no rank has made progress for a few seconds
(``Progress``; and on any timeout or crash); under torchrun, ``start_watchdog`` (started by
``init_from_env``, on unless DISTLAB_HANG_TIMEOUT=0) publishes the records to the
rendezvous store and prints the table when a rank stays blocked and no rank progresses that long.

The wrappers never see the collectives torch issues itself (DDP's gradient all-reduces):
PyTorch's flight recorder does (``distlab.flight_recorder``). Each rank also publishes its
flight recorder's records, and ``diagnose_all`` uses them when the doctor's own records do
not explain the hang: no finding, or a rank blocked in a collective the wrappers never saw.
``python -m distlab.doctor --flight-recorder PREFIX`` reads flight-recorder dump files (what
NCCL writes on a timeout) and prints the same report.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import inspect
import json
import mmap
import os
import pickle
import socket
import sys
import threading
import time
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist

from distlab import comm, flight_recorder
from distlab.metrics import format_bytes, nbytes
from distlab.todo import HANG_EXIT_CODE

SLOTS, SLOT_BYTES = 64, 256  # the last 64 ops per rank, 16 KiB
HANG_TIMEOUT_ENV = "DISTLAB_HANG_TIMEOUT"

# op -> the argument holding this rank's payload (as the ledger counts it), plus ops without one
_OPS = {**comm._PAYLOAD_ARG, "monitored_barrier": None, "all_gather_object": None,
        "broadcast_object_list": None, "gather_object": None, "scatter_object_list": None}
_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
_NO_SIZE_CHECK = ("all_to_all", "all_to_all_single", "barrier", "monitored_barrier")  # sizes may differ


class HangError(RuntimeError):
    """run_distributed's report of a hang or a mismatched collective: the doctor's table."""


class Recorder:
    """This rank's ring buffer, in a file others can read (or in anonymous memory)."""

    def __init__(self, rank: int, path: str | None = None) -> None:
        self.rank, self.path = rank, path
        size = SLOTS * SLOT_BYTES
        if path:
            with open(path, "wb") as f:
                f.write(b" " * size)
            with open(path, "r+b") as f:
                self.buf = mmap.mmap(f.fileno(), size)
        else:
            self.buf = mmap.mmap(-1, size)
        self.count = 0
        self.seq: dict[tuple, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.groups: dict[int, tuple] = {}

    def group_key(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "WORLD"
        entry = self.groups.get(id(group))
        if entry is None:
            key = flight_recorder.ranks_key(dist.get_process_group_ranks(group))
            entry = self.groups[id(group)] = (group, key)  # holds the group: its id is never reused
        return entry[1]

    def begin(self, op: str, group, nbytes: int, peer: int | None, async_op: bool) -> dict:
        key = self.group_key(group)
        with self.lock:
            channel = (key, _P2P[op], peer) if op in _P2P else (key,)
            self.seq[channel] += 1
            rec = {"i": self.count, "op": op, "seq": self.seq[channel], "g": key, "n": nbytes, "peer": peer,
                   "t0": time.time(), "t1": None, "async": async_op}
            self.count += 1
            self._write(rec)
        return rec

    def end(self, rec: dict) -> None:
        rec["t1"] = time.time()
        with self.lock:
            self._write(rec)

    def _write(self, rec: dict) -> None:
        data = json.dumps(rec, separators=(",", ":")).encode()[:SLOT_BYTES]
        start = (rec["i"] % SLOTS) * SLOT_BYTES
        self.buf[start:start + SLOT_BYTES] = data.ljust(SLOT_BYTES)

    def records(self) -> list[dict]:
        return parse(bytes(self.buf))


def parse(data: bytes) -> list[dict]:
    """The records in a ring buffer's bytes, oldest first (a slot torn by a concurrent write is skipped)."""
    out = []
    for k in range(len(data) // SLOT_BYTES):
        chunk = data[k * SLOT_BYTES:(k + 1) * SLOT_BYTES].strip()
        if chunk:
            try:
                out.append(json.loads(chunk))
            except ValueError:
                pass
    return sorted(out, key=lambda r: r["i"])


def read_records(path: str) -> list[dict]:
    try:
        with open(path, "rb") as f:
            return parse(f.read())
    except OSError:
        return []


def flight_recorder_path(path: str) -> str:
    """Where a rank whose ring buffer is ``path`` keeps its flight recorder's records."""
    return f"{path}.fr"


def write_flight_recorder() -> None:
    """Write this rank's flight-recorder records now (a rank about to report its result or
    error: the writer thread may not look again before the process ends)."""
    if _FLIGHT_WRITER is not None:
        _FLIGHT_WRITER.flush()


def read_flight_recorder(path: str) -> dict | None:
    """``{"t": time of the dump, "records": [...]}`` for the rank whose ring buffer is ``path``."""
    return flight_recorder.read(flight_recorder_path(path))


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


# --------------------------------------------------------------------------- recording wrappers
_RECORDER: Recorder | None = None
_FLIGHT_WRITER: flight_recorder.FileWriter | None = None


def install(rank: int, path: str | None = None) -> Recorder:
    """Record this process's communication from now on (once per process).

    With a ``path``, a thread also keeps this rank's flight-recorder records in
    ``flight_recorder_path(path)`` (see ``flight_recorder.Publisher``).
    """
    global _RECORDER, _FLIGHT_WRITER
    if _RECORDER is None:
        _RECORDER = Recorder(rank, path)
        if path:
            _FLIGHT_WRITER = flight_recorder.FileWriter(flight_recorder_path(path))
        for op, arg in _OPS.items():
            original = getattr(dist, op, None)
            if original is not None:
                setattr(dist, op, _wrap(op, arg, original))
        dist.batch_isend_irecv = _wrap_batch(dist.batch_isend_irecv)
        # torch accepts only its own isend/irecv in a P2POp: this P2POp unwraps them
        dist.P2POp = comm._LedgerP2POp
    return _RECORDER


def _peer(bound: dict) -> int | None:
    for name in ("dst", "src"):
        if bound.get(name) is not None:
            return int(bound[name])
    for name in ("group_dst", "group_src"):
        if bound.get(name) is not None:
            # group=None means WORLD, where group ranks are global ranks (get_global_rank(None, .) raises).
            return dist.get_global_rank(bound.get("group") or dist.group.WORLD, int(bound[name]))
    return None


def _wrap(op, arg, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # let torch raise its own error
            return original(*args, **kwargs)
        async_op = bool(bound.get("async_op", op in ("isend", "irecv")))
        rec = _RECORDER.begin(op, bound.get("group"), nbytes(bound.get(arg)) if arg else 0,
                              _peer(bound) if op in _P2P else None, async_op)
        result = original(*args, **kwargs)
        if not async_op:
            _RECORDER.end(rec)  # an op that raised stays "not done": where the rank was stuck
        return result

    wrapper.__wrapped_by_ledger__ = original  # comm._unwrap finds torch's own function
    return wrapper


def _wrap_batch(original):
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        for p in p2p_op_list:
            name = "isend" if comm._unwrap(p.op) is comm._unwrap(dist.isend) else "irecv"
            peer = p.peer
            if peer is None and getattr(p, "group_peer", None) is not None:  # P2POp(..., group_peer=)
                peer = dist.get_global_rank(p.group or dist.GroupMember.WORLD, p.group_peer)
            _RECORDER.begin(name, p.group, nbytes(p.tensor), peer, True)
        return original(p2p_op_list)

    return wrapper


# --------------------------------------------------------------------------- diagnosis
def _name(rec: dict) -> str:
    """``all_reduce #17 (4 KiB) on WORLD``, ``recv #2 from rank 1 (16 B)``."""
    if rec["op"] in _P2P:
        where = f" {'to' if _P2P[rec['op']] == 'send' else 'from'} rank {rec['peer']}"
        group = "" if rec["g"] == "WORLD" else f" on group [{rec['g']}]"
        return f"{rec['op']} #{rec['seq']}{where} ({format_bytes(rec['n'])}){group}"
    group = "WORLD" if rec["g"] == "WORLD" else f"group [{rec['g']}]"
    return f"{rec['op']} #{rec['seq']} ({format_bytes(rec['n'])}) on {group}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _pending(recs: list[dict]) -> dict | None:
    """The op a rank waits in: its last record, not done and not async."""
    last = recs[-1] if recs else None
    return last if last and last["t1"] is None and not last["async"] else None


def diagnose(records: dict[int, list[dict]], states: dict[int, str], world_size: int,
             now: float | None = None, unknown=()) -> tuple[list[str], str]:
    """Merge the ranks' records into findings (who never arrived, which sizes differ) and a table.

    Args:
        records: rank -> its ring buffer (``Recorder.records()``), oldest first.
        states: rank -> what the launcher knows ("running", "stopped (SIGSTOP)", "returned",
            "died (signal 6)", ...); ranks missing here are "running".
        unknown: ranks whose records are missing, not empty: never named as absent.
    Returns:
        (findings, table): findings name the culprit first; empty when nothing is wrong with
        the records (every rank in the same op, sizes equal: slow, not stuck).
    """
    now = time.time() if now is None else now
    members = {"WORLD": list(range(world_size))}
    entered: dict[int, dict] = {}  # rank -> {(group,) or (group, dir, peer): highest seq}
    by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)  # (group, op kind, seq[, peer pair]) -> rank -> rec
    for rank, recs in records.items():
        counts: dict[tuple, int] = defaultdict(int)
        for r in recs:
            if r["g"] != "WORLD" and r["g"][0].isdigit() and "ranks" not in r["g"]:
                members[r["g"]] = [int(x) for x in r["g"].split(",")]
            if r["op"] in _P2P:
                channel = (r["g"], _P2P[r["op"]], r["peer"])
                by_key[(r["g"], _P2P[r["op"]], rank, r["peer"], r["seq"])][rank] = r
            else:
                channel = (r["g"],)
                by_key[(r["g"], r["seq"])][rank] = r
            counts[channel] = max(counts[channel], r["seq"])
        entered[rank] = counts

    def state(rank: int) -> str:
        return states.get(rank, "running")

    def pending(rank: int) -> dict | None:
        return _pending(records.get(rank) or [])

    def whereabouts(rank: int) -> str:
        recs = records.get(rank) or []
        p = pending(rank)
        if p:
            where = f"it is blocked in {_name(p)} since {now - p['t0']:.1f} s"
        elif recs:
            where = f"its last op: {_name(recs[-1])}"
        else:
            where = "it has recorded no communication"
        s = state(rank)
        return where if s == "running" else f"{s}; {where}"

    findings: list[str] = []
    for rank in sorted(records):
        if state(rank).startswith("stopped"):
            findings.append(f"rank {rank} is {state(rank)}; {whereabouts(rank)}")
    stopped = list(findings)
    # collectives: who never entered the op the others wait in; who entered it with another op or size
    waiting: dict[tuple, list[int]] = defaultdict(list)
    for rank in sorted(records):
        p = pending(rank)
        if p and p["op"] not in _P2P:
            waiting[(p["g"], p["seq"])].append(rank)
    for (group, seq), ranks in sorted(waiting.items(), key=lambda kv: kv[0][1]):
        rec = records[ranks[0]][-1]
        since = now - min(records[r][-1]["t0"] for r in ranks)
        absent = [m for m in members.get(group, []) if entered.get(m, {}).get((group,), 0) < seq and m not in unknown]
        for m in absent:
            findings.append(f"rank {m} never entered {_name(rec)} ({whereabouts(m)})")
        if absent:
            findings.append(f"{_ranks(ranks)} waiting in it since {since:.1f} s")
        arrived = by_key.get((group, seq), {})
        calls: dict[str, list[int]] = defaultdict(list)
        for k, r in sorted(arrived.items()):
            calls[r["op"]].append(k)
        if len(calls) > 1:  # the odd ones out skipped a collective or called them out of order
            common = max(calls, key=lambda op: len(calls[op]))
            example = next(r for k, r in arrived.items() if r["op"] == common)
            for op, ranks_ in calls.items():
                if op != common:
                    findings.append(f"{_ranks(ranks_)} called {_name(arrived[ranks_[0]])} where "
                                    f"{_ranks(calls[common])} called {_name(example)} (a skipped or reordered collective)")
        elif rec["op"] not in _NO_SIZE_CHECK and len({r["n"] for r in arrived.values()}) > 1:
            findings.append(f"{rec['op']} #{seq} sizes differ between ranks: "
                            + ", ".join(f"rank {k} passed {format_bytes(r['n'])}" for k, r in sorted(arrived.items())))
    # point to point: a receive nobody sends, a send nobody receives. These come first: a rank
    # stuck in an unmatched send never reaches the collective its peers wait in.
    collective_findings, findings = findings[len(stopped):], stopped
    for rank in sorted(records):
        recs = records[rank]
        tail = [r for r in recs[::-1] if r["async"] or r is recs[-1]]  # the op it waits in, or its last async ops
        tail = [r for r in tail if r["op"] in _P2P and r["t1"] is None]
        for r in tail[:4]:
            peer, kind = r["peer"], _P2P[r["op"]]
            other = "recv" if kind == "send" else "send"
            got = entered.get(peer, {}).get((r["g"], other, rank), 0) if peer in records else None
            verb = "waits in" if not r["async"] else "issued"
            if got is not None and got < r["seq"]:
                did = "sent it" if kind == "recv" else "received from it"
                findings.append(f"rank {peer} never posted the {other} matching rank {rank}'s {_name(r)} "
                                f"(it {did} {got} message(s); {whereabouts(peer)}); rank {rank} {verb} it "
                                f"since {now - r['t0']:.1f} s")
            elif got is not None:
                match = by_key.get((r["g"], other, peer, rank, r["seq"]), {}).get(peer)
                if match and match["n"] != r["n"]:
                    # Told from the receiver's side, the one gloo aborts: what arrived, what it expected.
                    recv, send = (r, match) if kind == "recv" else (match, r)
                    receiver, sender = (rank, peer) if kind == "recv" else (peer, rank)
                    findings.append(f"rank {receiver} received {format_bytes(send['n'])} from rank {sender}, expected "
                                    f"{format_bytes(recv['n'])} (its {recv['op']} #{recv['seq']}): sender and receiver "
                                    "disagree on the message size; check the chunk index at that step "
                                    "(off by one?) and the uneven last chunk")
    return findings + collective_findings, table(records, states, now)


FLIGHT_RECORDER = "flight recorder"


def diagnose_all(records: dict[int, list[dict]], flight: dict[int, dict | None], states: dict[int, str],
                 world_size: int, now: float | None = None) -> tuple[list[str], str, str | None]:
    """``diagnose`` on the ranks' own records, or on their flight recorders' where those do not explain it.

    Args:
        flight: rank -> ``{"t": time of the dump, "records": [...]}`` (``flight_recorder.snapshot``),
            or None where there is none or it may be out of date (a rank still running when
            another crashed): such a rank is never named as absent.
    Returns:
        (findings, table, source): source is None for the doctor's records, ``FLIGHT_RECORDER``
        when the findings come from the flight recorders. These are used when the doctor's
        records name nothing, or when a rank's flight recorder, dumped after its last recorded
        op, shows it blocked in a collective the wrappers never saw (torch's own, such as DDP's).
    """
    findings, text = diagnose(records, states, world_size, now)
    dumps = {rank: snap for rank, snap in flight.items() if snap is not None}
    if not dumps:
        return findings, text, None
    settled = flight_recorder.settle({rank: snap["records"] for rank, snap in dumps.items()}, states)
    dumps = {rank: {**snap, "records": settled[rank]} for rank, snap in dumps.items()}

    def unseen(rank: int) -> bool:
        own = records.get(rank) or []
        last_event = max([own[-1]["t0"], own[-1]["t1"] or 0.0]) if own else 0.0
        return (_pending(dumps[rank]["records"]) is not None and _pending(own) is None
                and dumps[rank]["t"] >= last_event)  # a dump older than the rank's last op says nothing

    if findings and not any(unseen(rank) for rank in dumps):
        return findings, text, None
    unknown = set(range(world_size)) - set(dumps)
    fr_states = {rank: "no current FR dump" for rank in unknown}
    fr_findings, fr_text = diagnose({rank: snap["records"] for rank, snap in dumps.items()},
                                    {**fr_states, **states}, world_size, now, unknown)
    if fr_findings:
        return fr_findings, fr_text, FLIGHT_RECORDER
    return findings, text, None


def table(records: dict[int, list[dict]], states: dict[int, str], now: float) -> str:
    rows = [f"{'rank':>4}  {'state':<22} {'last op':<44} {'since':>7}"]
    for rank in sorted(set(records) | set(states)):
        recs = records.get(rank) or []
        last = recs[-1] if recs else None
        s = states.get(rank, "running")
        if last is None:
            rows.append(f"{rank:>4}  {s:<22} {'(no communication recorded)':<44}")
            continue
        done = "" if last["t1"] is None and not last["async"] else (" (async)" if last["async"] else " (done)")
        if s == "running" and not done:
            s = "blocked"
        since = now - (last["t1"] or last["t0"])
        rows.append(f"{rank:>4}  {s:<22} {_name(last) + done:<44} {since:>6.1f}s")
    return "\n".join(rows)


def report(findings: list[str], table_text: str, what: str = "hang", source: str | None = None) -> str:
    """One line naming the culprit, then the other findings and the table.

    ``source=FLIGHT_RECORDER`` says that the records are PyTorch's flight recorder's.
    """
    head = f"{what} diagnosed: " if source is None else f"{what} diagnosed from PyTorch's {source}: "
    head += "; ".join(findings[:2])
    rest = [f"  {f}" for f in findings[2:]]
    last = "last communication op" if source is None else "last collective in its flight recorder"
    return "\n".join([head, *rest, f"what each rank was doing ({last}):", table_text])


# --------------------------------------------------------------------------- torchrun watchdog
def watchdog_timeout(setting: str | None, run_timeout_s: float) -> float:
    """The watchdog's timeout in seconds from DISTLAB_HANG_TIMEOUT (0: off).

    Unset or empty: ``run_timeout_s``/10, between 10 and 30 s (a stopped or stuck rank is
    named in well under a minute; a healthy rank waits for a slow one much longer than
    that only if neither makes progress). "0" or "off": no watchdog.
    """
    setting = (setting or "").strip().lower()
    if not setting:
        return min(30.0, max(10.0, run_timeout_s / 10))
    if setting in ("0", "off", "none"):
        return 0.0
    try:
        value = float(setting)
    except ValueError:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={setting!r} is not a number of seconds (e.g. {HANG_TIMEOUT_ENV}=60; "
                         f"{HANG_TIMEOUT_ENV}=0 turns the watchdog off)") from None
    if value < 0:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={setting} must be >= 0 seconds ({HANG_TIMEOUT_ENV}=0 turns the watchdog off)")
    return value


def start_watchdog(store, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                   exit_on_fire: bool = True) -> threading.Thread:
    """Under torchrun: publish this rank's records and its flight recorder's to ``store``; if this
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
    recorder = _RECORDER or install(rank)
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


# --------------------------------------------------------------------------- python -m distlab.doctor
def main(argv: list[str] | None = None) -> int:
    """Diagnose a hang from the flight-recorder dump files of its ranks (``PREFIX<rank>``).

    A file that cannot be read as a dump (missing, unpicklable, or a pickle of something else)
    ends the command with one line on stderr naming the file and the problem, and exit code 2.
    """
    parser = argparse.ArgumentParser(
        prog="python -m distlab.doctor",
        description="Name the rank a hung job waited for, from PyTorch's flight-recorder dumps (one file per "
                    "rank, named PREFIX<rank>: what NCCL writes with TORCH_NCCL_DUMP_ON_TIMEOUT=1).")
    parser.add_argument("--flight-recorder", metavar="PREFIX|DIR", required=True,
                        help="the files' common prefix (e.g. /tmp/nccl_trace_rank_), or a folder holding them")
    args = parser.parse_args(argv)

    def refuse(message: str) -> None:  # a bad input is not a crash: one line, no traceback, no usage
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    try:
        paths = flight_recorder.find_dumps(args.flight_recorder)
    except (OSError, ValueError) as exc:
        refuse(str(exc))
    dumps, records = {}, {}
    for rank, path in sorted(paths.items()):
        try:
            dumps[rank] = flight_recorder.load(path)
            records[rank] = flight_recorder.cut(flight_recorder.to_records(dumps[rank]))
        except pickle.UnpicklingError as exc:
            refuse(f"{path}: {exc}")
        except (OSError, ValueError) as exc:  # load's ValueError names the file already
            refuse(str(exc) if path in str(exc) else f"{path}: {exc}")
        except EOFError:
            refuse(f"{path}: the file ends before the dump does (truncated? written while the rank died?)")
        except (KeyError, TypeError, IndexError, AttributeError) as exc:  # what load's checks missed
            refuse(f"{path}: not a flight-recorder dump this doctor can read ({type(exc).__name__}: {exc}); "
                   "pass the files torch wrote (TORCH_NCCL_DUMP_ON_TIMEOUT=1)")
    world_size = flight_recorder.world_size(dumps)
    states = {rank: "no dump file" for rank in range(world_size) if rank not in dumps}
    now = max(os.path.getmtime(path) for path in paths.values())  # "since" counts to the last dump
    findings, text = diagnose(records, states, world_size, now)
    print(report(findings or ["no rank is missing; every rank is in the same op or done"], text,
                 source=FLIGHT_RECORDER))
    return 0


if __name__ == "__main__":
    sys.exit(main())
