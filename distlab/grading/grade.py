"""Grade a student's copy: run the phase tests against it, write Gradescope's results.json.

    python -m distlab.grading.grade --student-dir=~/submissions/alice --out results.json
    python -m distlab.grading.grade --submission uploads/ --out results.json   # template files only
    python -m distlab.grading.grade                      # this checkout's templates
    python -m distlab.grading.grade --tests tests/test_phase1.py -- -x   # one phase, extra pytest args
    python -m distlab.grading.grade --autograder-zip autograder.zip      # Gradescope's autograder bundle
    python -m distlab.grading.grade --submission up/ --exercises "1.4-1.5 distributed sampler"  # some exercises only

The tests come from this (the instructor's) checkout; the code under test from
``--student-dir`` (its ``phaseN_*/template_*.py`` by default, ``--impl solutions``
to grade a copy's ``solutions/``), or from ``--submission``: a folder of the
``template_*.py`` files a student uploaded, anywhere inside it; the ones not uploaded
are the untouched templates. One Gradescope test per exercise: score = its weight
(grading/weights.toml) times the share of its tests passed, scaffold tests excluded;
output = one line per failure ("rank 1, step 2, parameter fc1.weight: max abs diff
2.0e-02" or "TODO 3.1 ...: not implemented yet"). On Gradescope, grading/gradescope/
run_autograder calls ``--submission /autograder/submission``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from distlab import bugs

REPO = Path(__file__).resolve().parents[2]


def phase_test_files() -> list[str]:
    """The graded test files: one or more per phase (the bench's own tests are not graded)."""
    return sorted(glob.glob(str(REPO / "tests" / "test_phase*.py")))


def grade(student_dir: str | None, out: str, impl: str = "templates", tests: list[str] | None = None,
          pytest_args: list[str] | None = None, timeout_s: float = 3600) -> dict:
    """Run pytest on the student's code and return (and write) the Gradescope results."""
    cmd = [sys.executable, "-m", "pytest", *(tests or phase_test_files()), f"--impl={impl}",
           f"--results-json={os.path.abspath(out)}", "-q", "-p", "no:cacheprovider",
           "-p", "no:hypothesispytest", "-p", "no:benchmark",  # no graded test uses them: ~2 s of imports
           f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"), *(pytest_args or [])]
    if student_dir is None and impl == "templates":
        student_dir = str(REPO)  # this checkout's templates, graded behind the same walls (distlab/grading/jail.py)
    if student_dir:
        if not Path(student_dir).is_dir():
            raise FileNotFoundError(f"--student-dir {student_dir} is not a directory")
        cmd.append(f"--student-dir={os.path.abspath(student_dir)}")
    returncode = run_and_reap(cmd, timeout_s)
    if not Path(out).is_file():
        raise RuntimeError(f"pytest exited ({returncode}) and wrote no {out}: see its output above")
    results = json.loads(Path(out).read_text())
    results.pop("per_test", None)  # Gradescope wants score/tests; keep the file lean
    results["output"] = f"graded {'the copy in ' + student_dir if student_dir != str(REPO) else 'this checkout'} (--impl {impl})"
    Path(out).write_text(json.dumps(results, indent=2))
    return results


def run_and_reap(cmd: list[str], timeout_s: float) -> int | str:
    """Run ``cmd`` in the checkout; on a timeout (or any exit) kill it and everything it started.

    pytest runs in a new session, but the ranks and torchrun workers it starts may leave that
    session (torchrun gives each worker its own), so the whole tree is killed: descendants
    through /proc and strays through an environment marker every process of the run inherits.
    Returns the exit code, or "killed: ended after N s" (N scaled; "killed: slow machine ..." when it was
    still progressing at the hard cap).
    """
    from distlab.procs import communicate, kill_process_tree, marked_environ  # (torch.distributed, through the doctor)

    marker = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, env=marked_environ(marker))
    try:  # scaled, and waited past while still progressing on a busy machine (procs.Deadline)
        _, why = communicate(proc, timeout_s)
        returncode: int | str = proc.returncode if why is None else f"killed: {why}"
    finally:
        kill_process_tree(proc.pid, marker)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of its session
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return returncode


def student_copy_from_submission(submission: str | Path, dest: str | Path) -> list[str]:
    """Lay out a student copy in ``dest``: every template of this checkout, overlaid by the
    ``template_*.py`` files found anywhere in ``submission``. Returns the files taken from it.

    Raises ValueError naming a file that matches no template (a typo would grade as untouched).
    """
    dest = Path(dest)
    known = {p.name: p for p in REPO.glob("phase*/template_*.py")}
    for p in known.values():
        (dest / p.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest / p.parent.name / p.name)
    taken, unknown = [], []
    found: dict[str, list[Path]] = {}
    for f in sorted(Path(submission).rglob("*.py")):
        found.setdefault(f.name, []).append(f)
    if twice := {name: paths for name, paths in found.items() if name in known and len(paths) > 1}:
        # Both would be copied over one another and the one sorting last graded: which, the student cannot tell.
        name, paths = sorted(twice.items())[0]
        raise ValueError(f"{name} was uploaded {len(paths)} times: "
                         f"{' and '.join(str(p.relative_to(submission)) for p in paths)}; upload one file per template")
    for f in sorted(Path(submission).rglob("*.py")):
        if f.name in known:
            shutil.copy(f, dest / known[f.name].parent.name / f.name)
            taken.append(f"{known[f.name].parent.name}/{f.name}")
        elif f.name.startswith("template_"):
            unknown.append(f.name)
    if unknown:
        raise ValueError(f"submitted {unknown} match no template of the course; expected names like "
                         f"{sorted(known)[:3]}")
    return taken


def autograder_zip(path: str | Path) -> Path:
    """Gradescope's autograder bundle: setup.sh and run_autograder at the top, the checkout beside them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    path = Path(path)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for rel in files:
            if (REPO / rel).is_file() and not rel.startswith("benchmarks/results/"):
                z.write(REPO / rel, rel)
        for name in ("setup.sh", "run_autograder"):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable, as Gradescope runs them directly
            z.writestr(info, (REPO / "grading" / "gradescope" / name).read_text())
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student-dir", default=None, help="the student's copy of the repository")
    parser.add_argument("--out", default="results.json", help="where to write Gradescope's results.json")
    parser.add_argument("--impl", default="templates", choices=["templates", "solutions"])
    parser.add_argument("--tests", nargs="*", default=None, help="test files (default: every tests/test_phase*.py)")
    parser.add_argument("--submission", default=None,
                        help="a folder holding a student's template_*.py files (Gradescope's /autograder/submission)")
    parser.add_argument("--autograder-zip", default=None, metavar="ZIP", help="write Gradescope's autograder bundle")
    parser.add_argument("--exercises", nargs="*", default=None, metavar="NAME",
                        help='grade only these exercises (ids in distlab/course.toml, e.g. "1.4-1.5")')
    args = parser.parse_args(argv)
    if args.exercises:
        from distlab.manifest import canonical

        args.exercises = [canonical(e) for e in args.exercises]  # an id ("1.4-1.5") or a full name
        os.environ[bugs.EXERCISES_ENV] = json.dumps(args.exercises)  # read by the -p distlab.bugs plugin
        extra = ["-p", "distlab.bugs", *extra]
        args.tests = args.tests or bugs.exercise_test_files(args.exercises)
    if args.autograder_zip:
        print(f"wrote {autograder_zip(args.autograder_zip)}: upload it as the assignment's autograder")
        return 0
    if args.submission:
        if args.student_dir:
            parser.error("--submission and --student-dir exclude each other")
        with tempfile.TemporaryDirectory(prefix="distlab-submission-") as copy:
            try:
                taken = student_copy_from_submission(args.submission, copy)
            except ValueError as exc:  # Gradescope shows results.json, not our exit status: say it there
                Path(args.out).write_text(json.dumps({"score": 0, "output": f"submission refused: {exc}",
                                                      "visibility": "visible", "tests": []}, indent=2))
                print(f"submission refused: {exc}; wrote {args.out}")
                return 0
            print(f"grading {len(taken)} submitted file(s): {', '.join(taken) or 'none'}")
            results = grade(copy, args.out, "templates", args.tests, extra)
            results["output"] = f"graded the submitted files: {', '.join(taken) or 'none'}"
            Path(args.out).write_text(json.dumps(results, indent=2))
    else:
        results = grade(args.student_dir, args.out, args.impl, args.tests, extra)
    print(f"\nscore {results['score']}/{results['max_score']}; wrote {args.out}")
    for t in results["tests"]:
        print(f"  {t['name']:<45} {t['score']:>5}/{t['max_score']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
