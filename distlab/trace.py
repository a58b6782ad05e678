"""Traces of your own run: what every rank did over time, in Chrome's trace-event format.

    DISTLAB_TRACE=runs/trace RUN_MODE=ring_allreduce ./entrypoint.sh   # any mode -> runs/trace/trace.json
    python -m distlab check 1.1 --trace runs/trace                     # every world the tests start

Open ``trace.json`` in https://ui.perfetto.dev (or chrome://tracing). One process per rank
("rank 0", "rank 1", ...); on its main track:

* every collective and send/receive the rank made (``cat: comm``), with its bytes, its group's
  size and, for a synchronous call, how long the rank was blocked in it;
* ``wait <op>`` (``cat: wait``): the rank blocked in ``work.wait()`` of an asynchronous op;
* ``compute`` (``cat: compute``): the time between two of those, where the rank ran its own code.

An asynchronous op (``isend``, ``batch_isend_irecv``, ``all_reduce(async_op=True)``) is drawn
on an "in flight" track of its rank, from the moment it was posted to the end of its wait: a
bucket's all-reduce in flight under ``compute`` is communication overlapped with backward.

The events come from a CommLedger (distlab/comm.py) that each rank keeps for its whole life
when ``DISTLAB_TRACE`` names a folder: the rank starts it where it joins its world
(``init_from_env``, or a test's ``run_distributed``) and writes ``raw/<world>.rank<r>.json``
when it leaves; ``merge`` turns those into one trace. Times are wall-clock microseconds
(``time.time``), so ranks on one machine line up; across nodes, as well as their clocks agree.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import time
from pathlib import Path

from distlab.comm import CommLedger

TRACE_ENV = "DISTLAB_TRACE"
RAW = "raw"


class TraceLedger(CommLedger):
    """A CommLedger that also keeps when each call was made and when its wait ended."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[list[float]] = []  # per record: [start, end] of the call itself
        self.waits: list[tuple[list[int], float, float]] = []  # (records, start, end) of work.wait()
        self.done: dict[int, float] = {}  # record -> end of its first wait

    def _record(self, op, nbytes, group, seconds, async_op) -> None:
        end = time.time()
        super()._record(op, nbytes, group, seconds, async_op)
        self.times.append([end - seconds, end])

    def _observe(self, call):
        """The ledger's record, then (via distlab.intercept) when each returned Work's wait ended."""
        before = len(self.records)
        yield from super()._observe(call)
        ids = list(range(before, len(self.records)))
        if not ids:
            return
        if call.op == "batch_isend_irecv":
            # One Work per P2POp, or one Work for the whole batch (NCCL)
            call.on_wait(lambda k, start, end: self.waited([ids[k]] if len(call.result) == len(ids) else ids,
                                                           start, end))
            return
        call.on_wait(lambda k, start, end: self.waited([ids[-1]], start, end))

    def waited(self, ids: list[int], start: float, end: float) -> None:
        self.waits.append((ids, start, end))
        for i in ids:
            self.done.setdefault(i, end)


# --- one rank's life ------------------------------------------------------------------------------
_ACTIVE: dict | None = None


def start_rank(rank: int, world_size: int, merge_when_done: bool = False) -> None:
    """With DISTLAB_TRACE set: record this rank's communication until ``finish_rank``."""
    global _ACTIVE
    folder = os.environ.get(TRACE_ENV, "").strip()
    if not folder or _ACTIVE is not None:
        return
    # One world: torchrun's job id and attempt (an elastic restart is a new world), or the launcher's
    # per-world marker (distlab.procs.RUN_MARKER_ENV).
    world = os.environ.get("DISTLAB_RUN_ID", "").rsplit(":", 1)[-1] or f"pid{os.getpid()}"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        world = f"{os.environ['TORCHELASTIC_RUN_ID']}.attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    label = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] or os.environ.get("RUN_MODE", "")
    ledger = TraceLedger().__enter__()
    _ACTIVE = {"folder": folder, "world": world, "label": label, "rank": rank, "world_size": world_size,
               "t0": time.time(), "ledger": ledger, "merge": merge_when_done}


def finish_rank() -> Path | None:
    """Stop recording; write this rank's raw file (and, under torchrun, the merged trace of its world)."""
    global _ACTIVE
    if _ACTIVE is None:
        return None
    run, _ACTIVE = _ACTIVE, None
    ledger: TraceLedger = run.pop("ledger")
    ledger.__exit__(None, None, None)
    records = [{"op": r.op, "bytes": r.nbytes, "group_size": r.group_size, "async": r.async_op,
                "start": t[0], "end": t[1], "done": ledger.done.get(i)}
               for i, (r, t) in enumerate(zip(ledger.records, ledger.times))]
    raw = dict(run, t1=time.time(), records=records, waits=[[s, e, ids] for ids, s, e in ledger.waits],
               summary=ledger.summary())
    folder = Path(run["folder"])
    (folder / RAW).mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        # Ranks finish together: one at a time, so the last one's merge sees every rank's file.
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / RAW / f"{run['world']}.rank{run['rank']}.json"
        path.write_text(json.dumps(raw))
        if run["merge"]:
            return merge(folder, world=run["world"])
    return path


def clear_raw(folder: str | Path) -> int:
    """Delete the ranks' raw files a trace wrote under ``folder`` (``raw/<world>.rank<r>.json``) and nothing
    else: a user's own ``raw/`` folder keeps its other files, a symbolic link is never followed. Returns
    how many went."""
    raw, gone = Path(folder) / RAW, 0
    if raw.is_dir() and not raw.is_symlink():
        for path in raw.glob("*.rank*.json"):
            if re.fullmatch(r"[\w.-]+\.rank[0-9]+\.json", path.name) and path.is_file() and not path.is_symlink():
                path.unlink()
                gone += 1
    return gone


# --- raw files -> one trace -----------------------------------------------------------------------

def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def events_of(raw: dict, pid: int, t0: float) -> list[dict]:
    """The trace events of one rank: comm and waits on tid 0 with compute between; async ops in flight on tids 1+."""
    rank, tid = raw["rank"], 0
    name = f"rank {rank}" + (f" ({raw['label']})" if raw.get("label") else "")
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
              {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "main"}}]
    busy = []  # spans of the main track: synchronous calls and waits
    lanes: list[float] = []  # end of the last op on each in-flight track
    for r in raw["records"]:
        args = {"bytes": r["bytes"], "group_size": r["group_size"], "async": r["async"]}
        if not r["async"]:
            busy.append((r["start"], r["end"]))
            events.append({"name": r["op"], "cat": "comm", "ph": "X", "pid": pid, "tid": tid,
                           "ts": _us(r["start"], t0), "dur": _us(r["end"], r["start"]), "args": args})
            continue
        end = r["done"] if r["done"] is not None else raw["t1"]
        args["waited"] = r["done"] is not None
        lane = next((i for i, last in enumerate(lanes) if last <= r["start"]), len(lanes))
        if lane == len(lanes):
            lanes.append(0.0)
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": lane + 1,
                           "args": {"name": f"in flight {lane + 1}"}})
        lanes[lane] = end
        events.append({"name": r["op"], "cat": "comm", "ph": "X", "pid": pid, "tid": lane + 1,
                       "ts": _us(r["start"], t0), "dur": _us(end, r["start"]), "args": args})
    ops = raw["records"]
    for start, end, ids in raw["waits"]:
        busy.append((start, end))
        what = sorted({ops[i]["op"] for i in ids})
        events.append({"name": f"wait {'+'.join(what)}", "cat": "wait", "ph": "X", "pid": pid, "tid": tid,
                       "ts": _us(start, t0), "dur": _us(end, start),
                       "args": {"bytes": sum(ops[i]["bytes"] for i in ids), "ops": len(ids)}})
    cursor = raw["t0"]
    for start, end in sorted(busy) + [(raw["t1"], raw["t1"])]:
        if start > cursor:
            events.append({"name": "compute", "cat": "compute", "ph": "X", "pid": pid, "tid": tid,
                           "ts": _us(cursor, t0), "dur": _us(start, cursor), "args": {}})
        cursor = max(cursor, end)
    return events[:3] + sorted(events[3:], key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))


def merge(folder: str | Path, world: str | None = None) -> Path | None:
    """Every rank's raw file under ``folder`` (of ``world`` only, if named) -> ``folder/trace.json``.

    One process per rank (pid = rank; with several worlds, as in a check, pid = 100 * world + rank,
    each named after its test). Returns the path, or None when no rank wrote a file.
    """
    folder = Path(folder)
    raws = [json.loads(p.read_text()) for p in sorted((folder / RAW).glob("*.rank*.json"))]
    raws = [r for r in raws if world is None or r["world"] == world]
    if not raws:
        return None
    worlds = sorted({r["world"] for r in raws}, key=lambda w: min(r["t0"] for r in raws if r["world"] == w))
    t0 = min(r["t0"] for r in raws)
    events, ledgers = [], {}
    for raw in sorted(raws, key=lambda r: (worlds.index(r["world"]), r["rank"])):
        pid = raw["rank"] if len(worlds) == 1 else 100 * worlds.index(raw["world"]) + raw["rank"]
        events += events_of(raw, pid, t0)
        ledgers[str(pid)] = raw["summary"]
    out = folder / "trace.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                               "otherData": {"ledger_per_pid": ledgers, "worlds": worlds}}))
    tmp.replace(out)
    return out
