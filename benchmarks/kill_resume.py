"""Kill a rank, let torchrun restart the job, resume: N times. Bitwise equal to never stopping? How fast?

    python -m benchmarks.kill_resume                 # 20 runs (minutes)
    python -m benchmarks.kill_resume --runs 3 --seed 1 --json /tmp/kill_resume.json

Each run is one torchrun job of the fault-tolerance harness (demos/fault_tolerance.py,
RUN_MODE=fault_tolerance) on 2 local ranks with ``--max-restarts=3``, started through the
loopback launcher that entrypoint.sh uses (``python -m distlab.launch --standalone``). Attempts
0, 1 and 2 each SIGKILL a rank (chosen at random, rank 0 included: it writes the replicated
state) at a random step of an increasing sequence; attempt 3 finishes. The uninterrupted
baseline is the same command without kills. A run counts as equal when every final parameter
is ``torch.equal`` to the baseline's (same world size, kernels and order of sums: anything else
means some state was not restored).

Recovery time: from the line a rank prints as it is killed to the line the restarted job's
rank 0 prints once it has resumed (or found nothing to resume from), both timestamped as they
arrive here: torchrun noticing the death, stopping the survivors, starting fresh ranks,
rendezvous, finding and loading the checkpoint. Not part of the suite or of
``benchmarks.run``: tests/test_phase4.py runs one such job per suite run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from distlab.procs import kill_process_tree, marked_environ

REPO = Path(__file__).resolve().parent.parent
STEPS = 12  # demos/fault_tolerance.py's default --steps


def run_job(ckpt_dir: Path, out: Path, crash_steps: list[int], crash_ranks: list[int],
            timeout_s: float) -> list[tuple[float, str]]:
    """One torchrun job of the harness; its output lines, each with the time it arrived."""
    cmd = [sys.executable, "-m", "distlab.launch", "--standalone", "--nnodes=1", "--nproc_per_node=2",
           "--max-restarts=3", "--monitor-interval=0.1", "-m", "demos.fault_tolerance",
           "--ckpt-dir", str(ckpt_dir), "--out", str(out), "--steps", str(STEPS)]
    if crash_steps:
        cmd += ["--crash-at-step", *map(str, crash_steps), "--crash-rank", *map(str, crash_ranks)]
    marker = os.urandom(8).hex()  # every process of the job carries it (workers leave the agent's session)
    env = dict(marked_environ(marker), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
        reader.join(timeout=10)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the job did not finish within {timeout_s:.0f} s:\n"
                           + "\n".join(line for _, line in lines[-40:])) from None
    finally:
        kill_process_tree(proc.pid, marker)  # the agent and every worker still alive, in any session
        proc.wait()
    if code != 0 or not out.is_file():
        raise RuntimeError(f"torchrun exited {code}:\n" + "\n".join(line for _, line in lines[-40:]))
    return lines


def recovery_times(lines: list[tuple[float, str]]) -> list[float]:
    """Seconds from each injected kill to the next attempt's resume (or fresh start) on rank 0."""
    times, killed_at = [], None
    for t, line in lines:
        if "injected crash (SIGKILL)" in line and killed_at is None:
            killed_at = t
        elif killed_at is not None and ("resumed from" in line or "no loadable checkpoint" in line):
            times.append(t - killed_at)
            killed_at = None
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Repeat kill-a-rank-and-resume; count bitwise-equal results.")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="for the kill steps and ranks (default: random)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per torchrun job")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"--runs {args.runs} must be at least 1")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="distlab-kill-resume-") as tmp:
        tmp = Path(tmp)
        start = time.monotonic()
        run_job(tmp / "baseline", tmp / "baseline.pt", [], [], args.timeout)
        baseline_s = time.monotonic() - start
        expected = torch.load(tmp / "baseline.pt", weights_only=True)
        runs = []
        for i in range(args.runs):
            crash_steps = sorted(rng.sample(range(1, STEPS), 3))
            crash_ranks = [rng.randrange(2) for _ in crash_steps]
            out = tmp / f"run{i}.pt"
            start = time.monotonic()
            lines = run_job(tmp / f"run{i}", out, crash_steps, crash_ranks, args.timeout)
            final = torch.load(out, weights_only=True)
            diff = max((final[k].double() - v.double()).abs().max().item() for k, v in expected.items())
            equal = all(torch.equal(final[k], v) for k, v in expected.items())
            runs.append({"crash_steps": crash_steps, "crash_ranks": crash_ranks, "bitwise_equal": equal,
                         "max_abs_diff": diff, "recovery_s": [round(t, 3) for t in recovery_times(lines)],
                         "wall_s": round(time.monotonic() - start, 2)})
            r = runs[-1]
            print(f"run {i + 1}/{args.runs}: kills at steps {crash_steps} of ranks {crash_ranks}: "
                  f"{'bitwise equal' if equal else f'DIFFERS (max abs diff {diff:.3e})'}, "
                  f"recovery {', '.join(f'{t:.2f}' for t in r['recovery_s'])} s, run {r['wall_s']:.1f} s", flush=True)
    recoveries = [t for r in runs for t in r["recovery_s"]]
    summary = {"runs": len(runs), "bitwise_equal": sum(r["bitwise_equal"] for r in runs), "seed": seed,
               "kills": 3 * len(runs), "recoveries_seen": len(recoveries),
               "recovery_s": {"min": min(recoveries), "median": statistics.median(recoveries),
                              "max": max(recoveries)} if recoveries else None,
               "baseline_wall_s": round(baseline_s, 2), "load_average_before": load_before,
               "load_average_after": os.getloadavg()[0], "cores": os.cpu_count(), "torch": torch.__version__,
               "per_run": runs}
    rec = summary["recovery_s"]
    print(f"\n{summary['bitwise_equal']}/{summary['runs']} runs bitwise equal to the uninterrupted run "
          f"(seed {seed}); {len(recoveries)} recoveries of {summary['kills']} kills"
          + (f": min {rec['min']:.2f} s, median {rec['median']:.2f} s, max {rec['max']:.2f} s" if rec else "")
          + f"; load average {load_before:.1f} -> {summary['load_average_after']:.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    summary = main()
    sys.exit(0 if summary["bitwise_equal"] == summary["runs"] else 1)
