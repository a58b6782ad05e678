"""The seeded-bug catalogue: realistic learner bugs, each one the tests must catch.

    python -m distlab.bugs                 # every bug in grading/bugs/*.toml, one pytest run each
    python -m distlab.bugs --sample 3      # a fast, seeded sample (CI)
    python -m distlab.bugs --only 3.4-plain-ring 1.7-no-divide
    python -m distlab.bugs --list

A bug is a small source transform of a solution (``old`` -> ``new``, ``old`` found exactly
once) and the exercise whose tests must catch it. For each bug a scratch student copy is
laid out: every template generated from its solution, except that the mutated solution's
module has the bug's exercise finished (its regions hold the mutated solution code) and
every other exercise left as ``raise todo(...)``. The exercise's tests then run against
that copy (``--impl=templates --student-dir=COPY``), with nothing but that exercise done:

* caught: one of the exercise's tests fails with a message (not a LearnerTODO, not a timeout);
* missed: every test passes;
* timeout: it was only caught by a deadline (a hang is not a diagnosis);
* slow machine: its tests were still progressing on a busy machine at their hard cap: rerun it;
* leak: a test failed with another exercise's TODO (the exercise is not graded independently);
* control failed: the copy fails without the bug too (the failure is not the bug's).

The result (catch rate, time, one line per bug) goes to benchmarks/results/bug_catalogue.json.
The same copy builder serves tests/test_independence.py (:func:`student_copy`, :func:`run_exercises`).

This module is also a pytest plugin (``-p distlab.bugs``): with ``DISTLAB_EXERCISES`` set
(a JSON list of exercise names) it deselects every test of another exercise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CATALOGUE = REPO / "grading" / "bugs"
RESULTS = REPO / "benchmarks" / "results" / "bug_catalogue.json"
EXERCISES_ENV = "DISTLAB_EXERCISES"
# A deadline, not a diagnosis: the launcher's, gloo's, pytest-timeout's, or this module's own.
_TIMEOUT = re.compile(r"did not finish within|Timed out waiting|Failed: Timeout|^Timeout")
_SLOW = "slow machine ("  # doctor_watch.slow_machine's line: a run or job still progressing at its hard cap


# --- pytest plugin: run only the named exercises' tests -------------------------------------------

def pytest_collection_modifyitems(config, items):
    wanted = os.environ.get(EXERCISES_ENV)
    if not wanted:
        return
    from distlab.manifest import canonical

    wanted = {canonical(w) for w in json.loads(wanted)}  # ids or full names, as the markers
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("exercise")
        (keep if marker and canonical(marker.args[0]) in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# --- exercises, regions and the scratch copy ------------------------------------------------------

def exercise_ids(exercise: str) -> set[str]:
    """The TODO ids an exercise name covers: "4.1-4.4 automatic recovery" -> {"4.1", ..., "4.4"}."""
    m = re.match(r"(\d+)\.(\d+)(?:-(\d+)\.(\d+))?\s", exercise + " ")
    if not m:
        raise ValueError(f"exercise {exercise!r} does not start with an id like '3.4' or '4.1-4.4'")
    major, lo = int(m[1]), int(m[2])
    hi = int(m[4]) if m[3] else lo
    if m[3] and int(m[3]) != major:
        raise ValueError(f"exercise {exercise!r} spans phases {major} and {m[3]}")
    return {f"{major}.{i}" for i in range(lo, hi + 1)}


def _base(region_id: str) -> str:
    return region_id.rstrip("abcdefghijklmnopqrstuvwxyz")


def modules_of(ids: set[str]) -> list[Path]:
    """The solution modules holding a region of one of ``ids``."""
    from distlab import templates

    return [s for s in templates.sources(REPO)
            if any(_base(r.id) in ids for r in templates.regions(s.read_text(), s.name))]


def render_partial(solution: Path, finished: set[str], text: str | None = None) -> str:
    """The template of ``solution`` with the regions whose id is in ``finished`` filled in.

    ``text`` replaces the solution's source (a mutated solution). The generator itself renders
    it: the finished regions' markers become TODO markers, so their code is copied as ordinary code
    (with the ``# template:`` substitutions) between them, and every other region becomes its ``raise todo(...)``.
    """
    from distlab import templates

    text = solution.read_text() if text is None else text
    lines, out, skip_end = text.splitlines(), [], None
    for line in lines:  # a finished region keeps its TODO markers, as in a learner's file
        if (m := templates.BEGIN.match(line)) and _base(m["id"]) in finished:
            skip_end = m["id"]
            out.append(f"{m['indent']}# --- TODO {m['id']}: {m['title']} ---")
            continue
        if (m := templates.END.match(line)) and m["id"] == skip_end:
            skip_end = None
            out.append(f"{line[:len(line) - len(line.lstrip())]}# --- end TODO {m['id']} ---")
            continue
        out.append(line)
    with tempfile.TemporaryDirectory(prefix="distlab-render-") as tmp:
        rel = solution.resolve().relative_to(REPO / "solutions")
        path = Path(tmp) / "solutions" / rel
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(out) + "\n")
        return templates.render(path, Path(tmp))


def student_copy(dest: Path, finished: set[str], mutations: dict[Path, str] | None = None) -> Path:
    """Lay out a student copy in ``dest``: every template as generated, with the exercises in
    ``finished`` (TODO ids) filled in from their solutions, and ``mutations`` (solution path ->
    mutated source) used in place of those solutions' text."""
    from distlab import templates

    mutations = {Path(k).resolve(): v for k, v in (mutations or {}).items()}
    for solution in templates.sources(REPO):
        target = templates.template_path(solution, REPO).relative_to(REPO)
        (dest / target.parent).mkdir(parents=True, exist_ok=True)
        (dest / target).write_text(render_partial(solution, finished, mutations.get(solution.resolve())))
    return dest


def outside_edit_note(exercise: str, student_root) -> str | None:
    """The line that leads a failing test's message when the learner's module for ``exercise`` was edited
    outside its TODO regions ("you edited train_step (not a TODO) ..."), or None. Compares the learner's
    template with the one ``python -m distlab.templates`` generates from the solution."""
    from distlab import templates
    from distlab.regions import MarkerError, edited_outside_todos

    try:
        solutions = modules_of(exercise_ids(exercise))
    except ValueError:  # not an exercise (the bench's own tests)
        return None
    notes = []
    for solution in solutions:
        rel = templates.template_path(solution).relative_to(templates.REPO)  # the same place in the copy
        mine = Path(student_root) / rel
        try:
            where = edited_outside_todos(mine.read_text(), templates.render(solution)) if mine.is_file() else []
        except (OSError, UnicodeDecodeError, MarkerError):  # unreadable: the failure's message stands alone
            continue
        if where:
            notes.append(f"{', '.join(where[:3])} in {rel.as_posix()}")
    if not notes:
        return None
    return (f"you edited {'; '.join(notes)} (not a TODO): restore the given code there, "
            f"the failure may be that edit's")


def exercise_test_files(exercises: list[str]) -> list[str]:
    phases = sorted({exercise_ids(e).pop().split(".")[0] for e in exercises})
    return [str(p) for ph in phases for p in sorted((REPO / "tests").glob(f"test_phase{ph}*.py"))]


def run_job(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[subprocess.CompletedProcess, str | None]:
    """Run ``cmd`` (a nested pytest) to its end, or to its deadline: ``timeout_s`` times DISTLAB_TIMEOUT_SCALE,
    past which a job still using CPU on a busy machine is waited for up to the hard cap (``procs.Deadline``).

    Returns its result and None, or what stopped it: "did not finish within N s", or on a busy machine
    ``slow_machine``'s line (a bug is then not marked "timeout": the machine, not the code, was slow).
    Nothing the job started outlives it.
    """
    from distlab.procs import RUN_MARKER_ENV, Deadline, kill_process_tree, marked_environ

    marker = os.urandom(8).hex()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, RUN_MARKER_ENV: marked_environ(marker)[RUN_MARKER_ENV]},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = Deadline([proc.pid], timeout_s)
    try:
        while True:
            try:  # communicate again after its timeout loses no output (the pipes keep being read)
                out, err = proc.communicate(timeout=0.5)
                return subprocess.CompletedProcess(cmd, proc.returncode, out, err), None
            except subprocess.TimeoutExpired:
                over = deadline.passed()
                if over is not None:
                    return subprocess.CompletedProcess(cmd, None, "", ""), (
                        over or f"pytest did not finish within {deadline.timeout_s:g} s")
    finally:
        kill_process_tree(proc.pid, marker)
        proc.wait()


def run_exercises(copy: Path, exercises: list[str], *, timeout_s: float = 120, stop_first: bool = False,
                  per_test_timeout_s: float = 60) -> dict[str, list[dict]]:
    """Run ``exercises``' tests against the student copy; return exercise -> per-test results (by full name)."""
    from distlab.manifest import canonical

    exercises = [canonical(e) for e in exercises]  # an id or a full name; the results use the full name
    with tempfile.TemporaryDirectory(prefix="distlab-bugs-out-") as out_dir:
        out = Path(out_dir) / "results.json"
        cmd = [sys.executable, "-m", "pytest", *exercise_test_files(exercises), "-q", "-p", "no:cacheprovider",
               "-p", "distlab.bugs", "--impl=templates", f"--student-dir={copy}", f"--results-json={out}",
               f"--timeout={per_test_timeout_s:g}", f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml")]
        if stop_first:
            cmd.append("-x")
        env = dict(os.environ, **{EXERCISES_ENV: json.dumps(exercises)})
        proc, over = run_job(cmd, env, timeout_s)
        if over is not None:  # a deadline, or a slow machine: the exercises' tests never reported
            return {e: [{"outcome": "failed", "message": over, "error_type": "TimeoutError"}] for e in exercises}
        if not out.is_file():
            raise RuntimeError(f"pytest wrote no results ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        per_test = json.loads(out.read_text())["per_test"]
    by_exercise: dict[str, list[dict]] = {e: [] for e in exercises}
    for nodeid, r in per_test.items():
        if r["exercise"] in by_exercise and not r.get("scaffold"):
            by_exercise[r["exercise"]].append(dict(r, nodeid=nodeid))
    return by_exercise


def verdict(results: list[dict]) -> tuple[str, str]:
    """("caught" | "missed" | "timeout" | "slow machine" | "leak" | "no tests", the first failure's message)."""
    failed = [r for r in results if r["outcome"] == "failed"]
    if not results:
        return "no tests", ""
    if not failed:
        return "missed", ""
    # A test's own assertion is a diagnosis even when it quotes a timeout (a heartbeat's message).
    real = [r for r in failed if r.get("error_type") == "AssertionError" or (
            r.get("error_type") != "LearnerTODO" and "not implemented yet" not in r["message"]
            and not _TIMEOUT.search(r["message"]) and r.get("error_type") != "TimeoutError"
            and not r["message"].startswith(_SLOW))]
    if real:
        return "caught", real[0]["message"]
    if any(r.get("error_type") == "LearnerTODO" or "not implemented yet" in r["message"] for r in failed):
        return "leak", failed[0]["message"]
    slow = [r for r in failed if r["message"].startswith(_SLOW)]
    if slow:  # still progressing when its hard cap passed, on a busy machine: not the bug's doing, rerun it
        return "slow machine", slow[0]["message"]
    return "timeout", failed[0]["message"]


# --- the catalogue ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bug:
    id: str
    exercise: str
    file: str
    edits: tuple[tuple[str, str], ...]  # (old, new): each old occurs once in the solution
    why: str
    finished: tuple[str, ...] = ()  # other TODO ids the bug's copy finishes too
    expect: str = ""  # a regex the first line of the failure must match: it names the cause

    def mutated(self) -> str:
        source = (REPO / self.file).read_text()
        for old, new in self.edits:
            n = source.count(old)
            if n != 1:
                raise ValueError(f"bug {self.id}: `old` occurs {n} times in {self.file} (it must occur once); "
                                 f"the solution changed: update grading/bugs/: {old.strip()[:80]!r}")
            source = source.replace(old, new)
        return source


def catalogue(path: Path = CATALOGUE) -> list[Bug]:
    """Every ``[[bug]]`` of ``path``'s *.toml files; an ``[[expect]]`` (id, expect) gives a bug of another file
    the regex its failure's first line must match (grading/bugs/diagnoses.toml)."""
    from distlab.manifest import canonical  # a bug names its exercise by id or full name

    bugs, expects = [], {}
    for f in sorted(path.glob("*.toml")):
        data = tomllib.loads(f.read_text())
        expects.update({e["id"]: e["expect"] for e in data.get("expect", [])})
        for b in data.get("bug", []):
            edits = [(e["old"], e["new"]) for e in b.get("edit", [])] or [(b["old"], b["new"])]
            bugs.append(Bug(b["id"], canonical(b["exercise"]), b["file"], tuple(edits), b.get("why", ""),
                            tuple(b.get("finished", ())), b.get("expect", "")))
            re.compile(bugs[-1].expect)  # a bad pattern fails here, not after minutes of runs
    ids = [b.id for b in bugs]
    if dup := sorted({i for i in ids if ids.count(i) > 1}):
        raise ValueError(f"bug ids used twice in {path}: {dup}")
    if unknown := sorted(set(expects) - set(ids)):
        raise ValueError(f"[[expect]] for bug ids not in {path}: {unknown}")
    for i, e in expects.items():
        re.compile(e)
    return [replace(b, expect=expects[b.id]) if b.id in expects else b for b in bugs]


_CONTROLS: dict[tuple[str, frozenset[str]], tuple[str, str]] = {}  # the unmutated copy's verdict, per run


def run_bug(bug: Bug, *, timeout_s: float = 240, control: bool = True) -> dict:
    start = time.monotonic()
    mutated = bug.mutated()
    finished = exercise_ids(bug.exercise) | set(bug.finished)
    with tempfile.TemporaryDirectory(prefix="distlab-bug-") as tmp:
        copy = student_copy(Path(tmp), finished, {REPO / bug.file: mutated})
        results = run_exercises(copy, [bug.exercise], timeout_s=timeout_s, stop_first=True)[bug.exercise]
    status, message = verdict(results)
    # Named: the bug's own first line matches its `expect` (None where the bug gives none).
    named = bool(re.search(bug.expect, message)) and status == "caught" if bug.expect else None
    if status == "caught" and control:
        # The control: the same copy without the bug must pass, or the failure is not the bug's.
        # Bugs of one exercise share it: it runs once per exercise and finished set.
        key = (bug.exercise, frozenset(finished))
        if key not in _CONTROLS:
            with tempfile.TemporaryDirectory(prefix="distlab-bug-control-") as tmp:
                control = run_exercises(student_copy(Path(tmp), finished), [bug.exercise], timeout_s=timeout_s,
                                        stop_first=True)[bug.exercise]
            _CONTROLS[key] = verdict(control)
        control_status, control_message = _CONTROLS[key]
        if control_status != "missed":
            status, message = "control failed", f"without the bug: {control_status}: {control_message}"
    return {"id": bug.id, "exercise": bug.exercise, "status": status, "message": message[:300], "named": named,
            "seconds": round(time.monotonic() - start, 1), "why": bug.why}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=None, metavar="N", help="run N bugs chosen by --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, metavar="ID", help="run these bug ids")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    parser.add_argument("--timeout-s", type=float, default=240, help="per bug's pytest run (a busy machine: more)")
    parser.add_argument("--no-control", action="store_true", help="skip the unmutated copy's run (first lines only)")
    parser.add_argument("--out", default=None, help=f"results JSON (default {RESULTS.relative_to(REPO)} for a "
                        "full run; none for --sample/--only)")
    args = parser.parse_args(argv)
    bugs = catalogue()
    if args.list:
        stale = 0
        for b in bugs:
            try:
                b.mutated()
                note = ""
            except ValueError as exc:  # the solution changed under the transform
                stale, note = stale + 1, f"  STALE: {exc}"
            print(f"{b.id:<32} {b.exercise:<46} {b.why}{note}")
        print(f"{len(bugs)} bugs, {stale} stale")
        return 1 if stale else 0
    full = args.sample is None and args.only is None
    if args.only is not None:
        unknown = sorted(set(args.only) - {b.id for b in bugs})
        if unknown:
            parser.error(f"unknown bug ids {unknown} (see --list)")
        bugs = [b for b in bugs if b.id in args.only]
    if args.sample is not None:
        bugs = random.Random(args.seed).sample(bugs, min(args.sample, len(bugs)))
    start, rows = time.monotonic(), []
    for b in bugs:
        try:
            row = run_bug(b, timeout_s=args.timeout_s, control=not args.no_control)
        except ValueError as exc:  # a stale transform is reported, not run, and counts as not caught
            row = {"id": b.id, "exercise": b.exercise, "status": "stale", "message": str(exc)[:300],
                   "seconds": 0.0, "why": b.why}
        rows.append(row)
        mark = {True: "named ", False: "symptom", None: ""}[row.get("named")]
        print(f"{row['status']:<8} {mark:<7} {row['seconds']:>6.1f} s  {b.id:<32} {row['message'][:200]}", flush=True)
    caught = sum(r["status"] == "caught" for r in rows)
    if expecting := [r for r in rows if r.get("named") is not None]:
        print(f"the first line names the cause for {sum(r['named'] for r in expecting)}/{len(expecting)} bugs "
              "with an `expect`")
    seconds = round(time.monotonic() - start, 1)
    print(f"\ncaught {caught}/{len(rows)} ({100 * caught / max(len(rows), 1):.0f}%) in {seconds} s")
    out = args.out or (str(RESULTS) if full else None)
    if out:
        summary = {"bugs": len(rows), "caught": caught, "catch_rate": round(caught / max(len(rows), 1), 4),
                   "seconds": seconds, "by_status": {s: sum(r["status"] == s for r in rows)
                                                     for s in sorted({r["status"] for r in rows})},
                   "command": "python -m distlab.bugs", "results": rows}
        Path(out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
