"""``check``: run exactly one exercise's tests on the learner's templates, and say the verdict.

One pytest process, on only the test files that hold the exercise's tests (a text search in
course.test_files, no collection of the suite), with every other exercise's tests deselected
(``-p distlab.bugs`` and DISTLAB_EXERCISES). So the score printed is the whole exercise's:
none of its tests is left out. If some did not run (a crash, a timeout), the line says
"partial" and never shows those points as the exercise's.

Where the time goes for a phase-1 check (benchmarks/check_latency.py): starting Python and
torch in pytest and collecting (~2.7 s of CPU), the rank launcher's forkserver importing torch
again (~2.7 s of CPU, once per check, only where the tests start ranks), then the tests' worlds.
Starting that forkserver early, while pytest collects, was measured (1.1-1.3 finished, 6 runs
each way, interleaved, load 4-7): 10.7 s with, 10.7 s without, so the check does not.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from distlab.cockpit.course import REPO, Exercise, record_check, test_files
from distlab.deadlines import TIMEOUT_SCALE_ENV, timeout_scale

TIMEOUT_S = 600.0  # a whole exercise; a hung test is ended sooner by pytest-timeout (pyproject.toml)
# distlab.procs.TIE_ENV: pytest (and every rank it starts) dies with this process. Spelled out,
# not imported: distlab.procs imports torch, ~2 s that `check` would add before pytest even starts.
TIE_ENV = "DISTLAB_TIE_TO_PID"


def pytest_command(ex: Exercise, root: Path, results: Path, repo: Path = REPO) -> list[str]:
    files = test_files(ex, repo)
    if not files:
        raise ValueError(f"no test in {repo / 'tests'} is marked @pytest.mark.exercise({ex.name!r}): "
                         "the exercise's name in grading/weights.toml and in its tests must match")
    # hypothesis's and pytest-benchmark's plugins load with every pytest here (~1.4 s of imports for
    # hypothesis alone) and no test of the course uses them.
    cmd = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider",
           "-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "distlab.bugs", "--impl=templates",
           f"--results-json={results}", f"--rootdir={repo}", "-c", str(repo / "pyproject.toml")]
    if root.resolve() != repo.resolve():
        cmd.append(f"--student-dir={root.resolve()}")  # '=': see distlab/pytest_plugin.py
    return cmd


def run_check(ex: Exercise, root: Path, trace_dir: Path | None = None, repo: Path = REPO,
              warm: bool = False) -> dict:
    """Run ``ex``'s tests; return {"passed", "total", "points", "weight", "partial", "tests": [...]}.

    ``trace_dir``: every world the tests start writes its ranks' trace there (distlab.trace).
    ``warm``: run them in the checkout's warm launcher (distlab/cockpit/warm.py), started if none
    answers; only in the learner's own checkout (``--root`` elsewhere grades as an instructor does).
    """
    from distlab.bugs import EXERCISES_ENV

    with tempfile.TemporaryDirectory(prefix="distlab-check-") as tmp:
        results = Path(tmp) / "results.json"
        env = dict(os.environ, **{EXERCISES_ENV: json.dumps([ex.name]), TIE_ENV: str(os.getpid())})
        env.pop("PYTEST_ADDOPTS", None)
        if trace_dir is not None:
            from distlab.trace import TRACE_ENV, clear_raw

            clear_raw(trace_dir)  # this check's worlds only; the trace's own files, nothing else of the folder
            env[TRACE_ENV] = str(Path(trace_dir).resolve())
        cmd = pytest_command(ex, root, results, repo)
        limit = TIMEOUT_S * timeout_scale()  # its tests' own timeouts are scaled alike
        if warm and root.resolve() == repo.resolve():
            from distlab.cockpit import warm as launcher

            proc = launcher.run(root, repo, cmd, env, repo, limit)
        else:
            try:
                proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"the check of {ex.name} did not end within {limit:.0f} s: a slow machine? rerun, "
                                   f"or set {TIMEOUT_SCALE_ENV}=3 to wait longer") from None
        if not results.is_file():
            raise RuntimeError(f"pytest ended ({proc.returncode}) without results for {ex.name}:\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        data = json.loads(results.read_text())
    tests = [{"test": nodeid.split("::", 1)[-1], "outcome": r["outcome"], "message": r["message"]}
             for nodeid, r in data["per_test"].items() if r["exercise"] == ex.name and not r.get("scaffold")]
    graded = [t for t in tests if t["outcome"] != "skipped"]
    score = next((t for t in data["tests"] if t["name"] == ex.name), None)
    result = {"passed": sum(t["outcome"] == "passed" for t in graded), "total": len(graded),
              "points": score["score"] if score else 0.0, "weight": ex.weight,
              "partial": bool(score and score["partial"]) or not graded, "tests": tests}
    if not graded:
        result["output"] = (proc.stdout[-2000:] + proc.stderr[-1000:]).strip()
    record_check(root, ex, result)
    return result


def verdict_lines(ex: Exercise, result: dict) -> list[str]:
    """One line per test, then the exercise's score (or why it is not the whole exercise's)."""
    lines, previous = [], None
    for t in result["tests"]:
        mark = {"passed": "pass", "failed": "FAIL", "skipped": "skip"}.get(t["outcome"], t["outcome"])
        why = t["message"]
        if why and why == previous:
            why = "(same)"  # every test stopped at the same TODO: its line once
        elif why:
            previous = why
        lines.append(f"  {mark:<4}  {t['test']}" + (f"   {why}" if why == "(same)" else f"\n        {why}" if why else ""))
    p, n = result["passed"], result["total"]
    if not n:
        lines.append(f"{ex.name}: no test ran; pytest said:\n{result.get('output', '')}")
    elif result["partial"]:
        lines.append(f"{ex.name}: {p}/{n} tests, partial: not every test of the exercise ran, "
                     f"so {result['points']:.2f} is not the exercise's score (of {ex.weight:g})")
    else:
        state = "passing" if p == n else "failing"
        lines.append(f"{ex.name}: {p}/{n} tests, {result['points']:.2f}/{ex.weight:g} points, {state}")
    return lines


def passed(result: dict) -> bool:
    return bool(result["total"]) and result["passed"] == result["total"] and not result["partial"]
