"""PyTorch's flight recorder, read as the hang doctor's records.

torch records every collective a process group runs, whoever calls it: the ``dist.*``
functions the doctor wraps, but also DDP's gradient all-reduces and anything else that
calls the process group directly. ``_dump_fr_trace()`` returns that buffer (on gloo and
NCCL) as a pickled dict; on NCCL, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` makes each rank write
the same dict to a file named by ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` followed by its rank
(torch's ``fr_trace`` reads those files; so does ``python -m distlab.doctor``).
``to_records`` turns one dump into the doctor's records (op, seq, group, bytes, peer, t0,
t1), so ``doctor.diagnose`` merges the ranks' dumps as it merges their ledgers.

What the dump says, as read from torch 2.14 on gloo:

* ``collective_seq_id`` counts a group's collectives, so ``#n`` on one rank is ``#n`` on
  every member: the same numbering as the doctor's.
* gloo leaves ``state`` at "scheduled" and its completion times empty; an op it has finished
  is ``retired``. That mark comes a moment after the caller has returned from the op, and an
  op that failed (a peer's connection closed) is retired too: ``settle`` corrects both once
  the launcher knows how each rank ended. NCCL marks the ops it completed "completed".
* gloo does not record send/recv; NCCL names them ``send 0->1`` and ``recv 1<-0`` in group
  ranks (as torch's ``fr_trace`` parses them; NCCL's dumps are not exercised here).
* gloo's ``pg_config`` does not list its groups (one entry with an empty name), so
  ``dump()`` writes this process's own groups and their ranks there; a dump without them
  still maps the default group to WORLD.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import threading
import time
from collections import defaultdict

import torch.distributed as dist

LIMIT = 64  # records kept per rank, as many as the doctor's own ring buffer
_ITEMSIZE = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
             "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "UInt16": 2, "UInt32": 4, "UInt64": 8}


def ranks_key(ranks: list[int]) -> str:
    """A group's key in the doctor's records: its ranks ("0,2"), the same on every member."""
    return ",".join(map(str, ranks)) if len(ranks) <= 16 else f"{len(ranks)} ranks from {ranks[0]}"


# --------------------------------------------------------------------------- reading this process's recorder
def _c10d():
    import torch._C._distributed_c10d as c10d  # private: where torch keeps the flight recorder's dump

    return c10d


def _pg_config() -> dict[str, dict]:
    """This process's groups as ``pg_config`` should list them: name -> desc and ranks."""
    from torch.distributed import distributed_c10d

    out = {}
    try:
        for pg, name in list(distributed_c10d._world.pg_names.items()):
            out[name] = {"name": name, "desc": getattr(pg, "group_desc", ""),
                         "ranks": str(dist.get_process_group_ranks(pg))}
    except (RuntimeError, ValueError, KeyError):  # a group created or destroyed while we looked
        pass
    return out


def dump() -> dict:
    """This process's flight recorder (no stack traces), with its groups' ranks in ``pg_config``."""
    data = pickle.loads(_c10d()._dump_fr_trace(includeStackTraces=False))
    data["pg_config"] = {**data.get("pg_config", {}), **_pg_config()}
    return data


def status() -> dict:
    """Per group: the last op enqueued and completed (about 0.1 ms, where a full dump takes ms)."""
    try:
        return pickle.loads(_c10d()._dump_fr_trace(includeCollectives=False)).get("pg_status", {})
    except (AttributeError, RuntimeError):  # a torch without the flight recorder
        return {}


class Publisher:
    """Dumps the flight recorder when it has changed and then stood still for one look.

    A rank blocked in a collective (or back in compute) stands still: its dump is then
    taken once, not at every look, which keeps a training loop free of full dumps.
    """

    def __init__(self) -> None:
        self.seen: dict | None = None
        self.published: dict | None = None
        self.snap: dict | None = None

    def poll(self) -> dict | None:
        """``{"t": when, "records": [...]}`` when there is something new to publish, else None."""
        now = status()
        ready = now == self.seen and now != self.published
        self.seen = now
        if not ready:
            return None
        self.published, self.snap = now, snapshot()
        return self.snap

    def current(self) -> dict | None:
        """The last snapshot, if nothing has changed since (as of the last ``poll``)."""
        return self.snap if self.seen == self.published else None


def snapshot() -> dict:
    """This rank's flight recorder as the doctor's records, stamped with the time of the dump."""
    try:
        records = to_records(dump())
    except (AttributeError, RuntimeError):
        records = []
    return {"t": time.time(), "records": records}


# --------------------------------------------------------------------------- the file run_distributed reads
class FileWriter:
    """Keeps this rank's snapshot in ``path`` from a thread, which runs while the rank is blocked."""

    def __init__(self, path: str, interval_s: float = 0.25) -> None:
        self.path, self.publisher, self.lock = path, Publisher(), threading.Lock()
        threading.Thread(target=self._loop, args=(interval_s,), name="distlab-flight-recorder", daemon=True).start()

    def _loop(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            with self.lock:
                snap = self.publisher.poll()
                if snap is not None:
                    self._write(snap)

    def flush(self) -> None:
        """Write now, unless the file already holds the recorder as it is."""
        with self.lock:
            now = status()
            if now != self.publisher.published:
                self.publisher.seen = now
                self.publisher.published, self.publisher.snap = now, snapshot()
                self._write(self.publisher.snap)

    def _write(self, snap: dict) -> None:
        tmp = f"{self.path}.tmp"  # whole or not at all: the launcher may read it at any time
        try:
            with open(tmp, "w") as f:
                json.dump(snap, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError:  # the launcher removed the folder: it has stopped reading
            pass


def read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- a dump -> the doctor's records
def _groups(data: dict) -> dict[str, tuple[str, list[int] | None]]:
    """pg name -> (the doctor's group key, member ranks or None when the dump does not say)."""
    out = {}
    for name, cfg in (data.get("pg_config") or {}).items():
        if not name:  # gloo's placeholder entry
            continue
        ranks = [int(r) for r in re.findall(r"-?\d+", str(cfg.get("ranks", "")))]
        key = "WORLD" if cfg.get("desc") == "default_pg" else ranks_key(ranks) if ranks else f"pg {name}"
        out[name] = (key, ranks or None)
    return out


def _nbytes(sizes, dtypes) -> int:
    total = 0
    for shape, dtype in zip(sizes or [], dtypes or []):
        numel = 1
        for d in shape:
            numel *= d
        total += numel * _ITEMSIZE.get(dtype, 1)
    return total


def _done(entry: dict) -> bool:
    if entry["profiling_name"].startswith("gloo:"):
        return bool(entry.get("retired"))  # gloo's state stays "scheduled"
    return entry.get("state") == "completed"


def to_records(data: dict, keep: int = 4 * LIMIT) -> list[dict]:
    """One rank's dump as the doctor's records (its last ``keep`` ops), oldest first.

    Collectives keep torch's sequence number; sends and receives are numbered per
    peer in the dump (``send #k to rank r``), as the doctor numbers them. Every op not
    completed has ``t1`` None; ``cut`` keeps the first of them, where the rank waits.
    """
    groups = _groups(data)
    out: list[dict] = []
    p2p_seq: dict[tuple, int] = defaultdict(int)
    for e in sorted(data.get("entries", []), key=lambda e: e["record_id"]):
        op, _, meta = e["profiling_name"].partition(":")[2].partition(" ")
        pg_name, desc = e["process_group"]
        key, ranks = groups.get(pg_name, ("WORLD" if desc == "default_pg" else f"pg {pg_name}", None))
        peer = None
        if op in ("send", "recv"):
            # "send 0->1" (from -> to), "recv 1<-0" (at <- from): group ranks
            local = int(re.split(r"->|<-", meta)[1])
            peer = ranks[local] if ranks and 0 <= local < len(ranks) else local
            p2p_seq[(key, op, peer)] += 1
            seq = p2p_seq[(key, op, peer)]
        elif e.get("is_p2p"):  # a batch of sends and receives with no single peer
            continue
        else:
            seq = e["collective_seq_id"]
        sizes, dtypes = e.get("input_sizes"), e.get("input_dtypes")
        if op == "scatter":  # only the root has inputs; every rank has its output
            sizes, dtypes = e.get("output_sizes"), e.get("output_dtypes")
        t0 = e["time_created_ns"] / 1e9
        t1 = (e.get("time_discovered_completed_ns") or e["time_created_ns"]) / 1e9 if _done(e) else None
        out.append({"i": e["record_id"], "op": op, "seq": seq, "g": key, "n": _nbytes(sizes, dtypes),
                    "peer": peer, "t0": t0, "t1": t1, "async": False})
    return out[-keep:]


def cut(records: list[dict], limit: int = LIMIT) -> list[dict]:
    """The records up to the first op not completed, which is where the rank waits (a group
    runs its ops in order; those queued behind it are left out): its last ``limit``."""
    for k, r in enumerate(records):
        if r["t1"] is None:
            records = records[:k + 1]
            break
    return records[-limit:]


def settle(records: dict[int, list[dict]], states: dict[int, str]) -> dict[int, list[dict]]:
    """The ranks' records once the launcher knows how each ended (see the module docstring), ``cut``.

    A rank that returned waits in nothing. A rank that raised failed in its last collective
    when a member of that group that ended too (its records are final) never entered it: a
    collective cannot complete without every member.
    """
    def ended(rank: int) -> bool:
        return states.get(rank, "").startswith(("returned", "raised"))

    entered = {rank: {r["g"]: r["seq"] for r in recs if r["op"] not in ("send", "recv")}
               for rank, recs in records.items()}
    out = {}
    for rank, recs in records.items():
        recs = [dict(r) for r in recs]
        collectives = [r for r in recs if r["op"] not in ("send", "recv")]
        if states.get(rank) == "returned":
            for r in recs:
                r["t1"] = r["t1"] or r["t0"]
        elif states.get(rank, "").startswith("raised") and collectives:
            last = collectives[-1]
            members = range(max(records) + 1) if last["g"] == "WORLD" else (
                [int(x) for x in last["g"].split(",")] if re.fullmatch(r"[\d,]+", last["g"]) else [])
            if any(ended(m) and entered[m].get(last["g"], 0) < last["seq"]
                   for m in members if m != rank and m in records):
                last["t1"] = None
        out[rank] = cut(recs)
    return out


# --------------------------------------------------------------------------- dump files (NCCL's, or written by hand)
class _DataOnly(pickle.Unpickler):
    """A dump holds dicts, lists, strings and numbers: anything else is refused, not run."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a flight-recorder dump holds no objects; refusing {module}.{name}")


def load(path: str) -> dict:
    """One dump file, checked: a ``ValueError`` names the file and what is wrong with it."""
    with open(path, "rb") as f:
        data = _DataOnly(f).load()
    problem = malformed(data)
    if problem:
        raise ValueError(f"{path} is not a flight-recorder dump this doctor can read: {problem}")
    return data


_INT, _NUM, _STR = (int,), (int, float), (str,)
# What ``to_records``, ``_groups`` and ``world_size`` read from an entry: key -> (types, required).
_ENTRY_KEYS = {"record_id": (_INT, True), "profiling_name": (_STR, True), "process_group": ((list, tuple), True),
               "time_created_ns": (_NUM, True), "collective_seq_id": (_INT, False),
               "time_discovered_completed_ns": (_NUM + (type(None),), False), "state": (_STR + (type(None),), False),
               "is_p2p": ((bool, int, type(None)), False), "input_sizes": ((list, tuple, type(None)), False),
               "output_sizes": ((list, tuple, type(None)), False), "input_dtypes": ((list, tuple, type(None)), False),
               "output_dtypes": ((list, tuple, type(None)), False)}


def _kind(value) -> str:
    return f"{value!r}"[:40] + f" ({type(value).__name__})"


def malformed(data) -> str | None:
    """What keeps ``data`` from being read as a dump (the first problem), or None when it can be.

    torch writes the dumps, but a file named like one may hold anything: a truncated or
    hand-made pickle, another tool's dict, a dump of a torch whose format changed. The
    doctor refuses those in one line instead of failing deep inside ``to_records``.
    """
    if not isinstance(data, dict):
        return f"it holds a {type(data).__name__}, not the dict torch writes"
    if "entries" not in data:
        return f"it has no 'entries' (its keys: {', '.join(map(str, list(data)[:8])) or 'none'})"
    if not isinstance(data["entries"], (list, tuple)):
        return f"'entries' is {_kind(data['entries'])}, not a list"
    config = data.get("pg_config")
    if config is not None and not (isinstance(config, dict) and all(isinstance(c, dict) for c in config.values())):
        return f"'pg_config' is {_kind(config)}, not a dict of groups"
    for i, e in enumerate(data["entries"]):
        if not isinstance(e, dict):
            return f"entry {i} is {_kind(e)}, not a dict"
        for key, (types, required) in _ENTRY_KEYS.items():
            if key not in e:
                if required:
                    return f"entry {i} has no {key!r}"
                continue
            if not isinstance(e[key], types) or (isinstance(e[key], bool) and types in (_INT, _NUM)):
                return f"entry {i}: {key!r} is {_kind(e[key])}"
        pg = e["process_group"]
        if len(pg) != 2 or not all(isinstance(x, str) for x in pg):
            return f"entry {i}: 'process_group' is {_kind(pg)}, not (name, description)"
        op, _, meta = e["profiling_name"].partition(":")[2].partition(" ")
        if op in ("send", "recv"):
            if not re.fullmatch(r"\s*-?\d+\s*(->|<-)\s*-?\d+\s*", meta):
                return f"entry {i}: {op} {meta!r} names no peer (expected e.g. 'send 0->1')"
        elif not e.get("is_p2p") and "collective_seq_id" not in e:
            return f"entry {i} ({e['profiling_name']}) has no 'collective_seq_id'"
        for sizes, dtypes in (("input_sizes", "input_dtypes"), ("output_sizes", "output_dtypes")):
            shapes = e.get(sizes) or []
            if not all(isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s) for s in shapes):
                return f"entry {i}: {sizes!r} is {_kind(shapes)}, not a list of shapes"
            if not all(isinstance(d, str) for d in e.get(dtypes) or []):
                return f"entry {i}: {dtypes!r} is {_kind(e.get(dtypes))}, not a list of dtype names"
    return None


def find_dumps(target: str) -> dict[int, str]:
    """rank -> file, for ``PREFIX<rank>`` files, or the ``<something><rank>`` files of a directory."""
    if os.path.isdir(target):
        folder, names = target, os.listdir(target)
        by_prefix: dict[str, dict[int, str]] = defaultdict(dict)
        for name in names:
            m = re.fullmatch(r"(.*?)(\d+)", name)
            if m:
                by_prefix[m[1]][int(m[2])] = os.path.join(folder, name)
        if len(by_prefix) != 1:
            found = ", ".join(sorted(f"{p}<rank>" for p in by_prefix)) or "none"
            raise ValueError(f"{target}: expected files named PREFIX<rank> with one prefix; found {found} "
                             "(pass the prefix instead: --flight-recorder DIR/PREFIX)")
        return dict(next(iter(by_prefix.values())))
    folder, prefix = os.path.split(target)
    folder = folder or "."
    out = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", name)
        if m:
            out[int(m[1])] = os.path.join(folder, name)
    if not out:
        raise ValueError(f"no flight-recorder dumps named {target}<rank>")
    return out


def world_size(dumps: dict[int, dict]) -> int:
    """The default group's size where a dump says it, else the highest rank + 1."""
    sizes = [max(dumps) + 1]
    for data in dumps.values():
        for cfg in (data.get("pg_config") or {}).values():
            if cfg.get("desc") == "default_pg":
                sizes.append(len(re.findall(r"\d+", str(cfg.get("ranks", "")))))
    return max(sizes)
