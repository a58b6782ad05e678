"""What grading behind the jail costs: grading one exercise against running its tests.

For each exercise, three contenders, rotated per repeat (each a fresh process, as a user runs them):

* ``tests``: its tests on the reference, ``pytest tests/... -k <its tests> --impl solutions`` (the tests' own time);
* ``graded (recorded)``: ``python -m distlab.grading.grade --student-dir COPY --exercises NAME`` on an honest copy
  (every region of the exercise's lesson filled in from its solution), with the reference's checks recorded
  once beforehand, as Gradescope's ``setup.sh`` does (``pytest -m exercise --record-reference``);
* ``graded (cold)``: the same with an empty reference cache: each passing test is also run on the reference.

Results are checked: the grade must be the exercise's full points (an honest copy), and the tests must pass.
Rows: graded / tests, paired per repeat (1: grading costs nothing more than the tests themselves), by wall
time and by CPU time (user + system of the command and every process it waited for): on a busy machine the
wall time measures the load, the CPU time still measures the work. The issue's budget: about 2.

    python -m benchmarks.bench_grading [--repeats 3] [--exercises "1.4-1.5 distributed sampler" ...]

writes benchmarks/results/grading.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine_info, write_result
from benchmarks.harness import format_row, rotation, stat_row

REPO = Path(__file__).resolve().parent.parent
EXERCISES = ["1.4-1.5 distributed sampler", "3.1 ring reduce-scatter", "4.1 atomic checksummed save"]


def honest_copy(dest: Path) -> None:
    """Every template of the course with all its regions filled in from its solution."""
    from distlab import bugs

    for solution in sorted(REPO.glob("solutions/phase*/*.py")):
        template = REPO / solution.parent.name / f"template_{solution.name}"
        if template.is_file():
            ids = set(re.findall(r"BEGIN SOLUTION (\d+\.\d+)[a-z]?:", solution.read_text()))
            (dest / solution.parent.name).mkdir(parents=True, exist_ok=True)
            (dest / solution.parent.name / template.name).write_text(bugs.render_partial(solution, ids))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for descendants: ranks, jails, their pytest
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(wall s, CPU s, output) of one command."""
    start, cpu = time.monotonic(), _cpu()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    return time.monotonic() - start, _cpu() - cpu, proc.stdout + proc.stderr


def run(quick: bool = False, out_dir: Path | None = None, repeats: int = 3, exercises: list[str] | None = None) -> dict:
    """Each exercise's contenders, rotated per repeat; rows graded / tests (``quick``: the first exercise, 2 repeats)."""
    from distlab import bugs

    exercises = exercises or (EXERCISES[:1] if quick else EXERCISES)
    repeats = 2 if quick else repeats
    work = Path(tempfile.mkdtemp(prefix="distlab-bench-grading-"))
    rows, raw = {}, {}
    try:
        honest_copy(work / "copy")
        recorded, cold = work / "recorded", work / "cold"
        for name in exercises:
            files = bugs.exercise_test_files([name])
            base_env = {**os.environ, bugs.EXERCISES_ENV: json.dumps([name])}
            tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "distlab.bugs", *files,
                     "--impl=solutions"]
            grade = [sys.executable, "-m", "distlab.grading.grade", f"--student-dir={work / 'copy'}",
                     f"--out={work / 'results.json'}", "--exercises", name]
            subprocess.run([*tests, "--record-reference", "-m", "exercise"], cwd=REPO, capture_output=True,
                           env={**base_env, "DISTLAB_REFERENCE_CHECKS": str(recorded)}, timeout=1800)
            contenders = {"tests": (tests, base_env),
                          "graded (recorded)": (grade, {**os.environ, "DISTLAB_REFERENCE_CHECKS": str(recorded)}),
                          "graded (cold)": (grade, {**os.environ, "DISTLAB_REFERENCE_CHECKS": str(cold)})}
            times, cpus = {k: [] for k in contenders}, {k: [] for k in contenders}
            for repeat in range(repeats):
                shutil.rmtree(cold, ignore_errors=True)
                for who in rotation(list(contenders), repeat):
                    seconds, cpu, out = _run(*contenders[who])
                    if who == "tests":
                        assert re.search(r"\d+ passed", out) and " failed" not in out, out[-2000:]
                    else:
                        result = json.loads((work / "results.json").read_text())
                        (test,) = [t for t in result["tests"] if t["name"] == name]
                        assert test["score"] == test["max_score"] > 0, (who, test, out[-2000:])
                    times[who].append(seconds)
                    cpus[who].append(cpu)
            raw[name] = {"wall": times, "cpu": cpus}
            for who in ("graded (recorded)", "graded (cold)"):
                for kind, got in (("wall", times), ("CPU", cpus)):
                    ratios = [g / t for g, t in zip(got[who], got["tests"])]
                    rows[f"{name}: {who}, {kind}"] = stat_row(
                        [ratios], meaning=f"{who} / its tests' own {kind} time (1: no cost; budget about 2)",
                        metric="time", world_size=None, size=name, ours=statistics.median(got[who]),
                        builtin=statistics.median(got["tests"]), unit="s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"name": "grading", "machine": machine_info(), "repeats": repeats, "comparisons": rows, "times": raw}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "grading.json").write_text(json.dumps(result, indent=2, default=float))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exercises", nargs="*", default=EXERCISES)
    ap.add_argument("--quick", action="store_true", help="the first exercise, 2 repeats")
    args = ap.parse_args(argv)
    result = run(quick=args.quick, repeats=args.repeats, exercises=None if args.quick else args.exercises)
    for name, row in result["comparisons"].items():
        print(f"{name:<62} {format_row(row)}  (tests {row['builtin']:.1f} s, graded {row['ours']:.1f} s)")
    print(f"wrote {write_result('grading', result)}")


if __name__ == "__main__":
    main()
