"""The hang doctor: what every rank was doing when a job stopped moving, and who is to blame.

Every rank keeps a small ring buffer of its last communication ops (op, sequence
number, bytes, peer, group, start time, done or not) in a memory-mapped file, so
the records survive the rank: a stopped (SIGSTOP) or crashed rank is read like a
live one. The records come from observing the public functions of ``torch.distributed``
through ``distlab.intercept`` (the ones ``CommLedger`` counts, plus barrier and the object
collectives); a ``CommLedger`` sees the same calls there.

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

The diagnosis lives in ``distlab.doctor_diagnosis`` and the progress and watchdog in
``distlab.doctor_watch``; their names are importable from here. This module keeps the recording
(the ring buffer and its observer of ``distlab.intercept``).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import pickle
import sys
import threading
import time
from collections import defaultdict

import torch.distributed as dist

from distlab import comm, doctor_watch, flight_recorder, intercept
from distlab.doctor_diagnosis import _P2P
from distlab.metrics import nbytes
# Re-exported: the diagnosis and the watch are importable from here (``doctor.diagnose``, ``doctor.Progress``).
from distlab.doctor_diagnosis import FLIGHT_RECORDER, diagnose, diagnose_all, report, table  # noqa: F401
from distlab.doctor_watch import (  # noqa: F401
    HANG_TIMEOUT_ENV, Progress, stop_watchdog, this_node, thread_stat, watchdog_timeout)

SLOTS, SLOT_BYTES = 64, 256  # the last 64 ops per rank, 16 KiB

# op -> the argument holding this rank's payload (as the ledger counts it), plus ops without one
_OPS = {**comm._PAYLOAD_ARG, "monitored_barrier": None, "all_gather_object": None,
        "broadcast_object_list": None, "gather_object": None, "scatter_object_list": None}


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
        intercept.subscribe("doctor", _observe)  # for the process's life
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


def _observe(call: intercept.Call):
    """Records one intercepted call: entered now, done when a synchronous call returns (an op that raised
    stays "not done": where the rank was stuck). A batch records each P2POp as an isend/irecv."""
    if call.op == "batch_isend_irecv":
        for kind, p in call.p2p_ops():
            peer = p.peer
            if peer is None and getattr(p, "group_peer", None) is not None:  # P2POp(..., group_peer=)
                peer = dist.get_global_rank(p.group or dist.GroupMember.WORLD, p.group_peer)
            _RECORDER.begin(kind, p.group, nbytes(p.tensor), peer, True)
        return
    if call.op not in _OPS:
        return
    arg, bound, async_op = _OPS[call.op], call.arguments, call.async_op
    rec = _RECORDER.begin(call.op, bound.get("group"), nbytes(bound.get(arg)) if arg else 0,
                          _peer(bound) if call.op in _P2P else None, async_op)
    yield
    if not async_op:
        _RECORDER.end(rec)


def start_watchdog(store, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                   exit_on_fire: bool = True) -> threading.Thread:
    """``doctor_watch.start_watchdog`` on this rank's recorder (installed here if it is not yet): under
    torchrun, the doctor's table for all ranks when no rank progresses for ``timeout_s``."""
    return doctor_watch.start_watchdog(_RECORDER or install(rank), store, rank, world_size, timeout_s, interval_s,
                                       exit_on_fire)


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
