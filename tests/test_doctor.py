"""The hang doctor: each classic hang is named, with its culprit, within seconds (not at the timeout).

Every case runs under ``run_distributed`` with a 30 s deadline (process-group timeout
15 s) and ``hang_s=1``: the diagnosis must come from the doctor's watch of idle ranks or
from the crash it explains, never from a timeout, and it must name the rank to blame.
"""
from __future__ import annotations

import inspect
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.comm import CommLedger
from distlab.doctor import HangError, diagnose
from distlab.launch import run_distributed


def _worker_skips_a_collective(rank, world_size):
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank != world_size - 1:  # the last rank forgets the second all-reduce
        dist.all_reduce(t)
    dist.barrier()


def _worker_mismatched_sizes(rank, world_size):
    dist.all_reduce(torch.ones(4 if rank == 0 else 8))


def _worker_mismatched_p2p(rank, world_size):
    # a ring chunk off by one: rank 0 sends 4 elements where rank 1 expects its 3 (gloo aborts rank 1)
    x = torch.zeros(4 if rank == 0 else 3)
    dist.send(x, 1) if rank == 0 else dist.recv(x, 0)


def _worker_send_without_recv(rank, world_size):
    if rank == 0:
        dist.send(torch.ones(4), 1)  # rank 1 never posts the matching recv
    dist.barrier()


def _worker_pipeline_fewer_microbatches(rank, world_size):
    micro_batches = 1  # fewer than the 3 stages; the schedule below wrongly loops over stages
    x = torch.ones(4)
    for m in range(world_size - 1 if rank > 0 else micro_batches):
        if rank > 0:
            dist.recv(x, rank - 1)
        if rank < world_size - 1 and m < micro_batches:
            dist.send(x, rank + 1)
    # The step ends with a collective (a gradient all-reduce would do the same): rank 0 waits
    # there instead of exiting, whose closed connections would race the diagnosis.
    dist.barrier()


def _worker_stopped_rank(rank, world_size):
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)


@pytest.mark.parametrize("worker, world_size, expected", [
    (_worker_skips_a_collective, 3, ["rank 2 called barrier #2 (0 B) on WORLD where ranks 0, 1 called all_reduce #2 (16 B) on WORLD"]),
    (_worker_mismatched_sizes, 2, ["all_reduce #1 sizes differ between ranks: rank 0 passed 16 B, rank 1 passed 32 B"]),
    (_worker_mismatched_p2p, 2, ["rank 1 received 16 B from rank 0, expected 12 B (its recv #1): "
                                 "sender and receiver disagree on the message size; check the chunk index"]),
    (_worker_send_without_recv, 2, ["rank 1 never posted the recv matching rank 0's send #1 to rank 1 (16 B)"]),
    (_worker_pipeline_fewer_microbatches, 3,
     ["rank 0 never posted the send matching rank 1's recv #2 from rank 0 (16 B)"]),
    (_worker_stopped_rank, 3, ["rank 1 is stopped", "rank 1 never entered all_reduce #2 (16 B) on WORLD"]),
], ids=["skipped-collective", "mismatched-sizes", "mismatched-p2p", "send-without-recv", "pipeline-fewer-microbatches",
        "stopped-rank"])
def test_the_doctor_names_the_culprit_of_each_classic_hang_within_seconds(worker, world_size, expected, request):
    run_distributed(_worker_skips_a_collective, 1)  # the forkserver's one-time start is not what is timed
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        run_distributed(worker, world_size, timeout_s=30, hang_s=1)
    elapsed = time.monotonic() - start
    message = str(info.value)
    first_line = message.splitlines()[0]
    assert elapsed < 10, f"the diagnosis took {elapsed:.1f} s:\n{message}"
    for text in expected:
        assert text in message, message
    assert any(text in first_line for text in expected), f"the first line does not name the culprit:\n{message}"
    # docs/troubleshooting.md quotes this case's worker and the doctor's output: both must be today's.
    case = request.node.callspec.id
    code, printed = _guide_cases().get(case, (None, None))
    assert code is not None, f"docs/troubleshooting.md has no '<!-- doctor-case: {case} -->' block for this hang"
    assert code == inspect.getsource(worker).rstrip(), f"the guide quotes another {worker.__name__}:\n{code}"
    assert _normalise(printed) == _normalise(message), \
        f"the guide's output for {case} is not what the doctor prints today:\n{message}"


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"


def _guide_cases() -> dict[str, tuple[str, str]]:
    """case id -> (the worker's code, the doctor's output) quoted after ``<!-- doctor-case: id -->``."""
    blocks = re.findall(r"<!-- doctor-case: ([\w-]+) -->\s*```python\n(.*?)\n```\s*```text\n(.*?)\n```",
                        GUIDE.read_text(), flags=re.S)
    return {case: (code, printed) for case, code, printed in blocks}


def _normalise(text: str) -> list[str]:
    """The doctor's output without what changes from run to run: times, the table's column padding,
    and whether a rank left waiting on a peer that died or returned is still blocked or has raised
    already (it raises once that peer's connection closes: a race with the diagnosis)."""
    text = re.sub(r"\d+\.\d+ ?s\b", "<time>", text)
    text = re.sub(r"; raised \w+;", ";", text)  # the first line says "...; raised RuntimeError; it is blocked in ..."
    lines = [re.sub(r"^(\s*\d+\s+)(blocked|raised \w+)\b", r"\1<waiting>", line) for line in text.strip().splitlines()]
    return [" ".join(line.split()) for line in lines]


def _rec(i, op, seq, n=16, peer=None, done=False, asynch=False, t0=100.0):
    return {"i": i, "op": op, "seq": seq, "g": "WORLD", "n": n, "peer": peer, "t0": t0,
            "t1": t0 + 0.1 if done else None, "async": asynch}


def test_a_slow_collective_that_every_rank_entered_is_not_called_a_hang():
    # Both ranks are inside all_reduce #2 with equal sizes: in flight, nobody to blame.
    records = {r: [_rec(0, "all_reduce", 1, done=True), _rec(1, "all_reduce", 2)] for r in range(2)}
    findings, table = diagnose(records, {}, 2, now=110.0)
    assert findings == [], findings
    assert "blocked" in table and "all_reduce #2 (16 B) on WORLD" in table, table


def _worker_ledger_under_the_doctor(rank, world_size):
    # run_distributed records every op for the doctor; a ledger entered on top counts as before.
    peer = 1 - rank
    with CommLedger() as ledger:
        dist.all_reduce(torch.ones(4))
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer),
                                       dist.P2POp(dist.irecv, torch.empty(2), peer)])
        for req in reqs:
            req.wait()
    from distlab import doctor
    ops = [(r["op"], r["seq"], r["peer"]) for r in doctor._RECORDER.records()]
    return ledger.summary(), ops


def test_the_doctor_and_a_ledger_see_the_same_calls():
    for rank, (summary, ops) in enumerate(run_distributed(_worker_ledger_under_the_doctor, 2)):
        assert summary == {"all_reduce": {"calls": 1, "bytes": 16}, "irecv": {"calls": 1, "bytes": 8},
                           "isend": {"calls": 1, "bytes": 8}}, summary
        assert ops == [("all_reduce", 1, None), ("isend", 1, 1 - rank), ("irecv", 1, 1 - rank)], ops
