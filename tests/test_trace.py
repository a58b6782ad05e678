"""Traces (distlab/trace.py): a mode's run and a test's world, as Perfetto would load them.

Each trace is checked three ways: the trace-event schema (what Perfetto and chrome://tracing
read), the events of each rank against that rank's CommLedger summary, and the counts and bytes
against the textbook: what the mode's code must send, worked out here from its arguments.
"""
from __future__ import annotations

import json
import os
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import load, trace
from distlab.comm import CommLedger
from distlab.spawn import run_distributed

REPO = Path(__file__).resolve().parent.parent


def validate(path: Path) -> list[dict]:
    """The trace-event schema; spans on one track never partly overlap (Perfetto drops such slices)."""
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    tracks = defaultdict(list)
    for e in events:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["args"], dict), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index"), e
            continue
        assert e["cat"] in ("comm", "wait", "compute"), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        tracks[e["pid"], e["tid"]].append(e)
    for track, spans in tracks.items():
        spans.sort(key=lambda e: e["ts"])
        for a, b in zip(spans, spans[1:]):
            # 0.01 us: ts and dur are rounded to the nanosecond each
            assert b["ts"] >= a["ts"] + a["dur"] - 0.01, f"track {track}: {a} and {b} overlap"
    named = {e["pid"] for e in events if e["name"] == "process_name"}
    assert named == {p for p, _ in tracks}, "every rank's process is named"
    return events


def comm_of(events: list[dict], pid: int) -> dict[str, dict[str, int]]:
    calls, nbytes = Counter(), Counter()
    for e in events:
        if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "comm":
            calls[e["name"]] += 1
            nbytes[e["name"]] += e["args"]["bytes"]
    return {op: {"calls": calls[op], "bytes": nbytes[op]} for op in sorted(calls)}


def run_mode(mode: str, folder: Path, *args: str, flag: bool = False) -> Path:
    """``RUN_MODE=mode ./entrypoint.sh args`` traced into ``folder``: by DISTLAB_TRACE, or by ``--trace`` (flag)."""
    env = {k: v for k, v in os.environ.items() if k != "DISTLAB_TRACE"}
    env.update(RUN_MODE=mode, NPROC="2", DISTLAB_IMPL="solutions", IMPL="solutions")
    if flag:
        args = ("--trace", str(folder), *args)
    else:
        env["DISTLAB_TRACE"] = str(folder)
    proc = subprocess.run(["./entrypoint.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return folder / "trace.json"


@pytest.mark.e2e
def test_ring_allreduce_mode_trace_matches_its_ledger_and_the_ring(tmp_path: Path):
    path = run_mode("ring_allreduce", tmp_path, "--sizes-mb", "0.01", "--repeats", "2", flag=True)
    events = validate(path)
    ledgers = json.loads(path.read_text())["otherData"]["ledger_per_pid"]
    W, n = 2, int(0.01 * (1 << 20)) // 4 * 4  # the demo's tensor, in bytes
    checked, timed = 1001 * 4, 1 + 2  # its correctness check's tensor; warm-up + --repeats calls per size
    ring_bytes = 2 * (checked + timed * n)  # the ring and the pipelined ring
    sent = 0
    for rank in range(W):
        mine = comm_of(events, rank)
        assert mine == ledgers[str(rank)], f"rank {rank}: trace {mine} vs ledger {ledgers[str(rank)]}"
        # dist.all_reduce: the expected value of each of 3 contenders, the built-in's own check, then its timing
        assert mine["all_reduce"] == {"calls": 3 + 1 + timed, "bytes": 4 * checked + timed * n}, mine
        assert mine["barrier"]["calls"] == 3 * 2 * 2, mine  # 3 contenders x 2 repeats x before/after
        assert mine["isend"]["calls"] == mine["irecv"]["calls"], mine
        sent += mine["isend"]["bytes"]
    # Cost of a ring all-reduce: every rank sends 2(W-1)/W of the tensor; all ranks 2(W-1) tensors.
    assert sent == 2 * (W - 1) * ring_bytes, f"{sent} B sent in all, expected {2 * (W - 1) * ring_bytes}"
    assert {e["cat"] for e in events if e["ph"] == "X"} == {"comm", "wait", "compute"}


@pytest.mark.e2e
def test_pipeline_1f1b_mode_trace_matches_its_ledger_and_the_schedule(tmp_path: Path):
    steps, m, batch, hidden = 2, 4, 16, 64
    path = run_mode("pipeline_1f1b", tmp_path, "--epochs", "1", "--steps", str(steps), "--microbatches", str(m),
                    "--batch", str(batch), "--hidden", str(hidden), "--out-dir", str(tmp_path / "plots"))
    events = validate(path)
    ledgers = json.loads(path.read_text())["otherData"]["ledger_per_pid"]
    activation = batch // m * hidden * 4  # one micro-batch's activations (float32), and its gradient back
    for rank in range(2):
        mine = comm_of(events, rank)
        assert mine == ledgers[str(rank)], f"rank {rank}: trace {mine} vs ledger {ledgers[str(rank)]}"
        # stage 0 sends each micro-batch's activations forward, stage 1 each gradient back
        assert mine["isend"] == {"calls": steps * m, "bytes": steps * m * activation}, mine
        assert mine["irecv"] == {"calls": steps * m, "bytes": steps * m * activation}, mine
        waits = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "wait"]
        assert waits, f"rank {rank}: a pipeline stage waits for its peer (the bubble)"


def _worker_traced_ring(rank, world_size, numel):
    ring = load("phase3_multi_node", "ring_allreduce", impl="solutions")
    ledger = CommLedger()  # the test's own record, beside the trace's
    x = torch.arange(numel, dtype=torch.float32)
    with ledger:
        ring.ring_allreduce(x)
        dist.all_reduce(x, async_op=True).wait()
    return ledger.summary()


def test_run_distributed_worlds_trace_matches_each_rank_ledger(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(trace.TRACE_ENV, str(tmp_path))
    worlds = [run_distributed(_worker_traced_ring, w, 1001, timeout_s=120) for w in (2, 3)]
    path = trace.merge(tmp_path)
    events = validate(path)
    for index, (world_size, summaries) in enumerate(zip((2, 3), worlds)):
        sent = 0
        for rank, summary in enumerate(summaries):
            mine = comm_of(events, 100 * index + rank)
            assert mine == summary, f"world {index} rank {rank}: trace {mine} vs the worker's ledger {summary}"
            sent += mine["isend"]["bytes"]
        assert sent == 2 * (world_size - 1) * 1001 * 4  # the ring's cost, all ranks together
    inflight = [e for e in events if e["ph"] == "X" and e["name"] == "all_reduce"]
    assert inflight and all(e["tid"] > 0 and e["args"]["waited"] for e in inflight), inflight
