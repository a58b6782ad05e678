"""How long ``python -m distlab check`` takes to give its verdict on a phase-1 exercise.

The learner's inner loop: edit, check, read the verdict. Each phase-1 exercise is checked as
the learner runs it: ``python -m distlab check ID`` in their own checkout (a clone of the
repository, its templates in two states; a new process each time), and with ``--warm`` by the
checkout's warm launcher (started once before the runs, as a learner's first warm check starts
it). With ``--with-root`` also as ``check ID --root COPY`` from another checkout (a copy of the
templates only: graded as an instructor grades, each test's body in a child of its own: slower).
The two states: untouched (every test stops at the TODO: the usual verdict while working) and
finished (every test runs to the end: the slowest verdict). Runs are interleaved (exercise by
exercise, each state in turn) so that a change in the machine's load hits them alike; the
1-minute load average is recorded around each run, since the machine may be shared.

    python -m benchmarks.check_latency [--runs 5] [--quick]

writes benchmarks/results/check_latency.json (median, min and max wall seconds per case, and the
CPU seconds used: a figure the machine's load does not change much).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_result
from distlab.bugs import student_copy
from distlab.cockpit import course

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 10.0  # the promise: a phase-1 verdict in under 10 s on 2 cores


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def learner_checkout(dest: Path, finished: set[str]) -> Path:
    """A clone of this checkout (its tracked files) whose templates have ``finished`` filled in."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return student_copy(dest, finished)  # the templates, over the clone's


def timed_check(key: str, root: Path, in_checkout: bool,
                warm: bool = False) -> tuple[float, float, int, tuple[float, float]]:
    """Wall seconds, CPU seconds (the check and every process it started, reaped: pytest, the
    forkserver, the ranks), exit code, and the 1-minute load average before and after."""
    before, cpu = os.getloadavg()[0], _children_cpu_s()
    start = time.perf_counter()
    if in_checkout:  # the learner's own clone: its distlab, its tests, its templates
        cmd, cwd = [sys.executable, "-m", "distlab", "check", key, *(["--warm"] if warm else [])], root
        env = dict(os.environ, PYTHONPATH=str(root))
    else:
        cmd, cwd, env = [sys.executable, "-m", "distlab", "check", key, "--root", str(root)], REPO, None
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if proc.returncode != (0 if root.name.startswith("finished") else 1):
        print(f"unexpected exit {proc.returncode} of check {key} on {root.name}:\n{proc.stdout[-3000:]}"
              f"{proc.stderr[-2000:]}", flush=True)
    return seconds, _children_cpu_s() - cpu, proc.returncode, (before, os.getloadavg()[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 runs, finished state only")
    parser.add_argument("--with-root", action="store_true", help="also check ID --root COPY (graded as by an "
                        "instructor: each test's body in a child process)")
    args = parser.parse_args(argv)
    runs = 2 if args.quick else args.runs
    exercises = [ex for ex in course.exercises() if ex.phase == 1]
    ids = {i for ex in exercises for i in ex.ids}
    cases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="distlab-bench-check-") as tmp:
        roots = {"finished": (learner_checkout(Path(tmp) / "finished", ids), True)}
        if not args.quick:
            roots["untouched"] = (learner_checkout(Path(tmp) / "untouched", set()), True)
        for state in list(roots):  # the same checkouts, checked by their warm launcher (started below)
            roots[f"{state}, --warm"] = (*roots[state], True)
        if args.with_root:
            roots["finished, --root"] = (student_copy(Path(tmp) / "finished-root", ids), False)
            roots["untouched, --root"] = (student_copy(Path(tmp) / "untouched-root", set()), False)
        warm_roots = sorted({r for r, _, *warm in roots.values() if warm})
        learner_env = {r: dict(os.environ, PYTHONPATH=str(r)) for r in warm_roots}
        try:
            for root in warm_roots:  # started once, as a learner's first warm check does (~2 s, not timed)
                subprocess.run([sys.executable, "-m", "distlab", "warm"], cwd=root, env=learner_env[root],
                               check=True, capture_output=True)
            plan = [(ex, state) for ex in exercises for state in roots]
            for run in range(runs):
                for ex, state in plan:
                    name = f"{ex.key} {state}"
                    seconds, cpu_s, rc, load = timed_check(ex.key, *roots[state])
                    if state.endswith("--warm"):  # the work is the server's child, not ours: wall time only
                        cpu_s = None
                    case = cases.setdefault(name, {"exercise": ex.name, "state": state, "seconds": [],
                                                   "cpu_seconds": [], "load_1min": [], "unexpected_verdicts": 0})
                    # a finished copy must pass (exit 0), an untouched one fail (1); printed above if not
                    case["unexpected_verdicts"] += rc != (0 if state.startswith("finished") else 1)
                    case["seconds"].append(round(seconds, 2))
                    case["cpu_seconds"].append(None if cpu_s is None else round(cpu_s, 2))
                    case["load_1min"].append([round(x, 2) for x in load])
                    cpu = "    -  " if cpu_s is None else f"{cpu_s:6.2f} s"
                    print(f"run {run + 1}/{runs}  {name:<42} {seconds:6.2f} s  cpu {cpu}   "
                          f"load {load[0]:.1f} -> {load[1]:.1f}", flush=True)
        finally:
            for root in warm_roots:
                subprocess.run([sys.executable, "-m", "distlab", "warm", "--stop"], cwd=root, env=learner_env[root],
                               capture_output=True)
    for case in cases.values():
        s = case["seconds"]
        cpu = [c for c in case["cpu_seconds"] if c is not None]
        case.update(median_s=statistics.median(s), min_s=min(s), max_s=max(s),
                    median_cpu_s=statistics.median(cpu) if cpu else None)
    loads = [x for c in cases.values() for pair in c["load_1min"] for x in pair]
    path = write_result("check_latency", {
        "target_s": TARGET_S, "runs": runs, "cases": cases,
        "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "note": "wall time of `python -m distlab check ID` in a learner's checkout (--root: from another "
                "checkout, graded as by an instructor) (a new process), per run, and the CPU "
                "time of it and every process it started (on an idle 2-core machine the wall time is at least "
                "half of that); untouched: every test stops at the TODO; finished: every test runs"})
    print(f"\n{'case':<44} {'median':>8} {'min':>7} {'max':>7} {'cpu':>7}")
    for name, c in cases.items():
        cpu = "      -" if c["median_cpu_s"] is None else f"{c['median_cpu_s']:6.2f}s"
        print(f"{name:<44} {c['median_s']:7.2f}s {c['min_s']:6.2f}s {c['max_s']:6.2f}s {cpu}")
    print(f"load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
