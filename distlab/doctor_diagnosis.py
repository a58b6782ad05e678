"""The hang doctor's diagnosis: the ranks' records merged into findings (who never arrived) and a table.

``diagnose`` reads the ring buffers of ``distlab.doctor`` (or a flight recorder's records in the
same form) and names the culprit first; ``diagnose_all`` falls back on PyTorch's flight recorder
where the doctor's own records do not explain the hang; ``report`` is the text a user reads. The
course's code imports these names from ``distlab.doctor``.
"""
from __future__ import annotations

import time
from collections import defaultdict

from distlab import flight_recorder
from distlab.metrics import format_bytes

_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
_NO_SIZE_CHECK = ("all_to_all", "all_to_all_single", "barrier", "monitored_barrier")  # sizes may differ


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


def skipped(records: dict[int, list[dict]], rank: int, world_size: int) -> str | None:
    """"rank 1 never entered all_gather #2 (32 B) on WORLD that rank 0 is waiting in ...": ``rank`` (which
    raised) left out a collective that other ranks sit in; None when no other rank waits in one it skipped."""
    mine = records.get(rank) or []
    for seq_key in sorted({(p["g"], p["seq"]) for r, recs in records.items() if r != rank
                           for p in [_pending(recs)] if p and p["op"] not in _P2P}, key=lambda k: k[1]):
        group, seq = seq_key
        members = range(world_size) if group == "WORLD" else (
            [int(x) for x in group.split(",")] if group[0].isdigit() and "ranks" not in group else [])
        if rank not in members or max([r["seq"] for r in mine if r["g"] == group and r["op"] not in _P2P],
                                      default=0) >= seq:
            continue
        waiting = [r for r, recs in sorted(records.items()) if r != rank and _pending(recs)
                   and (_pending(recs)["g"], _pending(recs)["seq"]) == seq_key]
        rec = _pending(records[waiting[0]])
        return (f"rank {rank} never entered {_name(rec)} that {_ranks(waiting)} {'is' if len(waiting) == 1 else 'are'} "
                "waiting in: a collective only some ranks call (every rank of the group must call it, in the same order)")
    return None


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
