"""Traces of your own run: what every rank did over time, in Chrome's trace-event format.

    ./entrypoint.sh --trace runs/trace                                 # any mode -> runs/trace/trace.json
    DISTLAB_TRACE=runs/trace RUN_MODE=ring_allreduce ./entrypoint.sh   # the same
    python -m distlab check 1.1 --trace runs/trace                     # every world the tests start

Open ``trace.json`` in https://ui.perfetto.dev (or chrome://tracing). One process per rank
("rank 0", "rank 1", ...); on its main track:

* every collective and send/receive the rank made (``cat: comm``), with its bytes, its group's
  size and, for a synchronous call, how long the rank was blocked in it;
* ``wait <op>`` (``cat: wait``): the rank blocked in ``work.wait()`` of an asynchronous op.

Time between those is left blank: the ledger saw no call there, so it cannot say whether the rank
computed, loaded data or waited for its launcher (the first seconds of a run are imports and the
rendezvous). Work a program measured itself goes on the rank's "measured" track through ``add_spans``
(``cat: compute``, or ``cat: idle`` for time spent waiting); a pipeline stage's schedule goes there
through ``schedule_spans`` (demos/pipeline.py): its forwards and backwards, and its idle time (the
bubble) as spans named by cause ("idle: waiting for activation", "idle: pipeline draining", ...).

The rank that completes a world's trace prints one line: where ``trace.json`` is and how to open it.

An asynchronous op (``isend``, ``batch_isend_irecv``, ``all_reduce(async_op=True)``) is drawn
on an "in flight" track of its rank, from the moment it was posted to the end of its wait; a send
whose receiver's wait ended earlier ends there (``args.delivered``): it was delivered then, however
late its sender waited for it. A bucket's all-reduce in flight while the main track is blank is
communication overlapped with backward.

The events come from a CommLedger (distlab/comm.py) that each rank keeps for its whole life
when ``DISTLAB_TRACE`` names a folder: the rank starts it where it joins its world
(``init_from_env``, or a test's ``run_distributed``) and writes ``raw/<world>.rank<r>.json``
when it leaves; ``merge`` turns those into one trace. Times are wall-clock nanoseconds from the
first rank's start (``time.time``), written as microseconds, so ranks on one machine line up;
across nodes, as well as their clocks agree. Each span's start and end are rounded to the
nanosecond and its duration is their difference, so a span never overlaps the one before it.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import sys
import time
from glob import escape as glob_escape
from pathlib import Path

import torch.distributed as dist

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
        self.peers: dict[int, int] = {}  # record of a send/receive -> its peer's global rank
        self.spans: list[list] = []  # [name, cat, start, end, args]: what the program measured itself

    def _record(self, op, nbytes, group, seconds, async_op) -> None:
        end = time.time()
        super()._record(op, nbytes, group, seconds, async_op)
        self.times.append([end - seconds, end])

    def _observe(self, call):
        """The ledger's record, then the peer of a send/receive and (via distlab.intercept) each Work's wait.

        An async op is in flight from before its call: the ledger records it after the call returns, and by
        then its receiver may have it (a busy machine can pause this thread there for milliseconds)."""
        before, posted = len(self.records), time.time()
        yield from super()._observe(call)
        ids = list(range(before, len(self.records)))
        if not ids:
            return
        for i in ids:
            if self.records[i].async_op:
                self.times[i][0] = posted
        if call.op == "batch_isend_irecv":
            p2p_op_list = call.arguments["p2p_op_list"]
            if len(ids) == len(p2p_op_list):
                self.peers.update({i: _peer_of_op(p) for i, p in zip(ids, p2p_op_list)})
            # One Work per P2POp, or one Work for the whole batch (NCCL)
            call.on_wait(lambda k, start, end: self.waited([ids[k]] if len(call.result) == len(ids) else ids,
                                                           start, end))
            return
        if call.op in ("send", "recv", "isend", "irecv"):
            self.peers[ids[-1]] = _peer(call.op, (), call.arguments)
        call.on_wait(lambda k, start, end: self.waited([ids[-1]], start, end))

    def waited(self, ids: list[int], start: float, end: float) -> None:
        self.waits.append((ids, start, end))
        for i in ids:
            self.done.setdefault(i, end)


def _global(rank: int | None, group_rank: int | None, group) -> int | None:
    if rank is not None:
        return int(rank)
    try:
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank
    except (RuntimeError, ValueError):
        return None


def _peer(op: str, args: tuple, kwargs: dict) -> int | None:
    """The peer (global rank) of ``dist.isend(tensor, dst, group, ...)`` and its kin."""
    key = "dst" if op in ("send", "isend") else "src"
    rank = kwargs.get(key, args[1] if len(args) > 1 else None)
    return _global(rank, kwargs.get(f"group_{key}"), kwargs.get("group", args[2] if len(args) > 2 else None))


def _peer_of_op(p) -> int | None:
    return _global(getattr(p, "peer", None), getattr(p, "group_peer", None), getattr(p, "group", None))


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


def active() -> bool:
    """Whether this process records a trace now (``DISTLAB_TRACE`` set, between start and finish)."""
    return _ACTIVE is not None


def add_spans(spans: list[tuple], clock=time.perf_counter) -> None:
    """Put spans this rank measured itself, ``(name, cat, start, end, args)`` read from ``clock``, on its
    "measured" track (``cat``: "compute" or "idle"). Nothing happens when no trace is recorded."""
    if _ACTIVE is not None:
        offset = time.time() - clock()
        _ACTIVE["ledger"].spans += [[n, c, s + offset, e + offset, dict(a)] for n, c, s, e, a in spans]


def schedule_spans(events: list[tuple], lane: object) -> list[tuple]:
    """One pipeline stage's step as trace spans: its forwards and backwards, and every moment between
    them as idle time named by its cause, so that the idle spans are the bubble.

    Args:
        events: one step's ``(lane, start, end, kind, label)`` of every stage (``PipelineStage.events``
            gathered): "F", "B", "wait" (blocked in a receive), others (e.g. "opt") count as compute.
        lane: this stage's lane.
    Returns ``(name, cat, start, end, args)`` covering the step's window, from the first stage's start to
    the last stage's end, without gaps; the idle spans' share of p windows is the measured bubble,
    (p-1)/(m+p-1) for GPipe and 1F1B with equal stage times.
    """
    if not events:
        return []
    t0, t1 = min(e[1] for e in events), max(e[2] for e in events)
    mine = sorted((e for e in events if e[0] == lane), key=lambda e: e[1])
    names = {"F": "forward", "B": "backward"}
    spans, cursor = [], t0
    for i, (_, start, end, kind, label) in enumerate(mine):
        if start > cursor:
            cause = "pipeline filling" if not spans else "no op (posting sends, bookkeeping)"
            spans.append((f"idle: {cause}", "idle", cursor, start, {}))
        start = max(start, cursor)
        if kind == "wait":
            after = next((e[3] for e in mine[i + 1:] if e[3] != "wait"), None)
            what = {"F": "activation", "B": "gradient"}.get(after, "a message")
            spans.append((f"idle: waiting for {what}", "idle", start, end, {}))
        else:
            name = names.get(kind, str(kind))
            spans.append((f"{name} {label}".strip(), "compute", start, end, {"micro-batch": str(label)}))
        cursor = max(cursor, end)
    if t1 > cursor:
        spans.append(("idle: pipeline draining" if mine else "idle: no op", "idle", cursor, t1, {}))
    return spans


def finish_rank() -> Path | None:
    """Stop recording; write this rank's raw file (and, under torchrun, the merged trace of its world)."""
    global _ACTIVE
    if _ACTIVE is None:
        return None
    run, _ACTIVE = _ACTIVE, None
    ledger: TraceLedger = run.pop("ledger")
    ledger.__exit__(None, None, None)
    records = [{"op": r.op, "bytes": r.nbytes, "group_size": r.group_size, "async": r.async_op,
                "start": t[0], "end": t[1], "done": ledger.done.get(i), "peer": ledger.peers.get(i)}
               for i, (r, t) in enumerate(zip(ledger.records, ledger.times))]
    raw = dict(run, t1=time.time(), records=records, waits=[[s, e, ids] for ids, s, e in ledger.waits],
               spans=ledger.spans, summary=ledger.summary())
    folder = Path(run["folder"])
    (folder / RAW).mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        # Ranks finish together: one at a time, so the last one's merge sees every rank's file.
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / RAW / f"{run['world']}.rank{run['rank']}.json"
        path.write_text(json.dumps(raw))
        if run["merge"]:
            out = merge(folder, world=run["world"])
            ranks = len(list((folder / RAW).glob(f"{glob_escape(run['world'])}.rank*.json")))
            if out is not None and ranks == run["world_size"]:  # the last rank of the world: say where it went
                print(where(out, ranks), file=sys.stderr, flush=True)
            return out
    return path


def where(path: Path, ranks: int) -> str:
    """The one line that says where a run's trace went and how to open it."""
    return (f"trace: {Path(path).resolve()} ({ranks} rank{'s' * (ranks != 1)}): open it in https://ui.perfetto.dev "
            f"(Open trace file) or chrome://tracing")


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

def _ns(t: float, t0: float) -> int:
    return round((t - t0) * 1e9)


def _span(name: str, cat: str, pid: int, tid: int, start: float, end: float, t0: float, args: dict) -> dict:
    """An "X" event: start and end rounded to the nanosecond, then dur = end - start, so that a span
    that ends where the next begins never overlaps it (rounded apart, ts and dur overlapped by 1 ns)."""
    a, b = _ns(start, t0), _ns(end, t0)
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": a / 1000, "dur": max(b - a, 0) / 1000,
            "args": args}


def events_of(raw: dict, pid: int, t0: float) -> list[dict]:
    """The trace events of one rank: comm and waits on tid 0, what it measured itself on tid 1, async ops
    in flight on tids 2+. Time no record covers stays blank (nothing measured it)."""
    rank, tid = raw["rank"], 0
    name = f"rank {rank}" + (f" ({raw['label']})" if raw.get("label") else "")
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
              {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "main"}}]
    main = []  # (start, end, name, cat, args) of the main track: synchronous calls and waits
    lanes: list[float] = []  # end of the last op on each in-flight track
    for r in raw["records"]:
        args = {"bytes": r["bytes"], "group_size": r["group_size"], "async": r["async"]}
        if r.get("peer") is not None:
            args["peer"] = r["peer"]
        if not r["async"]:
            main.append((r["start"], r["end"], r["op"], "comm", args))
            continue
        end = r["done"] if r["done"] is not None else raw["t1"]
        args["waited"] = r["done"] is not None
        if r.get("delivered") is not None and r["delivered"] < end:
            end = max(r["delivered"], r["start"])  # the receiver had it: no longer in flight, whenever the wait
            args["delivered"] = True
        lane = next((i for i, last in enumerate(lanes) if _ns(last, t0) <= _ns(r["start"], t0)), len(lanes))
        if lane == len(lanes):
            lanes.append(0.0)
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": lane + 2,
                           "args": {"name": f"in flight {lane + 1}"}})
        lanes[lane] = end
        events.append(_span(r["op"], "comm", pid, lane + 2, r["start"], end, t0, args))
    ops = raw["records"]
    for start, end, ids in raw["waits"]:
        what = sorted({ops[i]["op"] for i in ids})
        main.append((start, end, f"wait {'+'.join(what)}", "wait",
                     {"bytes": sum(ops[i]["bytes"] for i in ids), "ops": len(ids)}))
    cursor = float("-inf")
    for start, end, op, cat, args in sorted(main, key=lambda m: m[0]):
        # One thread makes these calls one after another; a start read as end - duration (two clocks)
        # may fall a hair before the previous end: it starts where that one ended.
        start = max(start, cursor)
        end = max(end, start)
        events.append(_span(op, cat, pid, tid, start, end, t0, args))
        cursor = end
    if raw.get("spans"):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "measured"}})
        cursor = float("-inf")
        for op, cat, start, end, args in sorted(raw["spans"], key=lambda m: m[2]):
            start = max(start, cursor)  # spans of one step end where the next begins (one clock offset each)
            end = max(end, start)
            events.append(_span(op, cat, pid, 1, start, end, t0, args))
            cursor = end
    return events[:3] + sorted(events[3:], key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))


def _deliveries(raws: list[dict]) -> None:
    """Each async send's ``delivered``: when its receiver's wait for it ended. Between two ranks messages
    match in the order posted (no tags: distlab/p2p.py), so the k-th send a -> b is b's k-th receive from a."""
    by_world: dict[str, dict[int, dict]] = {}
    for raw in raws:
        by_world.setdefault(raw["world"], {})[raw["rank"]] = raw
    for ranks in by_world.values():
        received: dict[tuple[int, int], list] = {}
        for b, raw in ranks.items():
            for r in raw["records"]:
                if r["op"] in ("recv", "irecv") and r.get("peer") is not None:
                    received.setdefault((r["peer"], b), []).append(r["end"] if not r["async"] else r["done"])
        for a, raw in ranks.items():
            sent: dict[int, int] = {}
            for r in raw["records"]:
                if r["op"] in ("send", "isend") and r.get("peer") is not None:
                    k = sent[r["peer"]] = sent.get(r["peer"], -1) + 1
                    got = received.get((a, r["peer"]), [])
                    r["delivered"] = got[k] if k < len(got) else None


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
    _deliveries(raws)
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
