"""What grading behind the jail costs: grading one exercise against running its tests.

For each exercise, three contenders, rotated per repeat (each a fresh process, as a user runs them):

* ``tests``: its tests on the reference, ``pytest tests/... -k <its tests> --impl solutions`` (the tests' own time);
* ``graded (recorded)``: ``python -m distlab.grading.grade --student-dir COPY --exercises NAME`` on an honest copy
  (every region of the exercise's lesson filled in from its solution), with the reference's checks recorded
  once beforehand, as Gradescope's ``setup.sh`` does (``pytest -m exercise --record-reference``);
* ``graded (cold)``: the same with an empty reference cache: each passing test is also run on the reference.

Results are checked: the grade must be the exercise's full points (an honest copy), and the tests must pass.
Rows: graded / tests, paired per repeat (1: grading costs nothing more than the tests themselves).
The issue's budget: about 2.

    python -m benchmarks.bench_grading [--repeats 3] [--exercises "1.4-1.5 distributed sampler" ...]

writes benchmarks/results/grading.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_result
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


def _run(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    return time.monotonic() - start, proc.stdout + proc.stderr


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exercises", nargs="*", default=EXERCISES)
    args = ap.parse_args(argv)
    from distlab import bugs

    work = Path(tempfile.mkdtemp(prefix="distlab-bench-grading-"))
    rows, raw = [], {}
    try:
        honest_copy(work / "copy")
        recorded, cold = work / "recorded", work / "cold"
        for name in args.exercises:
            files = bugs.exercise_test_files([name])
            selection = json.dumps([name])
            base_env = {**os.environ, bugs.EXERCISES_ENV: selection}
            tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "distlab.bugs", *files,
                     "--impl=solutions"]
            grade = [sys.executable, "-m", "distlab.grading.grade", f"--student-dir={work / 'copy'}",
                     f"--out={work / 'results.json'}", "--exercises", name]
            subprocess.run([*tests, "--record-reference", "-m", "exercise"], cwd=REPO, capture_output=True,
                           env={**base_env, "DISTLAB_REFERENCE_CHECKS": str(recorded)}, timeout=1800)
            contenders = {"tests": (tests, base_env),
                          "graded (recorded)": (grade, {**os.environ, "DISTLAB_REFERENCE_CHECKS": str(recorded)}),
                          "graded (cold)": (grade, {**os.environ, "DISTLAB_REFERENCE_CHECKS": str(cold)})}
            times = {k: [] for k in contenders}
            for repeat in range(args.repeats):
                shutil.rmtree(cold, ignore_errors=True)
                for who in rotation(list(contenders), repeat):
                    seconds, out = _run(*contenders[who])
                    if who == "tests":
                        assert re.search(r"\d+ passed", out) and " failed" not in out, out[-2000:]
                    else:
                        result = json.loads((work / "results.json").read_text())
                        (test,) = [t for t in result["tests"] if t["name"] == name]
                        assert test["score"] == test["max_score"] > 0, (who, test, out[-2000:])
                    times[who].append(seconds)
            raw[name] = times
            for who in ("graded (recorded)", "graded (cold)"):
                ratios = [g / t for g, t in zip(times[who], times["tests"])]
                row = stat_row([ratios], meaning=f"{who} / its tests' own time (1: no cost; budget about 2)",
                               metric="time", world_size=None, size=name, ours=min(times[who]),
                               builtin=min(times["tests"]), unit="s")
                rows.append(row)
                print(f"{name:<36} {who:<18} {format_row(row)}  (tests {sorted(times['tests'])[len(ratios) // 2]:.1f} s)",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {write_result('grading', {'rows': rows, 'times': raw})}")


if __name__ == "__main__":
    main()
