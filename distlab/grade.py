"""Grade a student's copy: run the phase tests against it, write Gradescope's results.json.

    python -m distlab.grade --student-dir ~/submissions/alice --out results.json
    python -m distlab.grade                      # this checkout's templates
    python -m distlab.grade --tests tests/test_phase1.py -- -x   # one phase, extra pytest args

The tests come from this (the instructor's) checkout; the code under test from
``--student-dir`` (its ``phaseN_*/template_*.py`` by default, ``--impl solutions``
to grade a copy's ``solutions/``). One Gradescope test per exercise: score = tests
passed, max_score = tests run, output = one line per failure ("rank 1, step 2,
parameter fc1.weight: max abs diff 2.0e-02" or "TODO 3.1 ...: not implemented yet").
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def phase_test_files() -> list[str]:
    """The graded test files: one or more per phase (the bench's own tests are not graded)."""
    return sorted(glob.glob(str(REPO / "tests" / "test_phase*.py")))


def grade(student_dir: str | None, out: str, impl: str = "templates", tests: list[str] | None = None,
          pytest_args: list[str] | None = None, timeout_s: float = 3600) -> dict:
    """Run pytest on the student's code and return (and write) the Gradescope results."""
    cmd = [sys.executable, "-m", "pytest", *(tests or phase_test_files()), f"--impl={impl}",
           f"--results-json={os.path.abspath(out)}", "-q", "-p", "no:cacheprovider",
           f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"), *(pytest_args or [])]
    if student_dir:
        if not Path(student_dir).is_dir():
            raise FileNotFoundError(f"--student-dir {student_dir} is not a directory")
        cmd.append(f"--student-dir={os.path.abspath(student_dir)}")
    proc = subprocess.run(cmd, cwd=REPO, timeout=timeout_s)
    if not Path(out).is_file():
        raise RuntimeError(f"pytest exited with code {proc.returncode} and wrote no {out}: see its output above")
    results = json.loads(Path(out).read_text())
    results.pop("per_test", None)  # Gradescope wants score/tests; keep the file lean
    results["output"] = f"graded {'the copy in ' + student_dir if student_dir else 'this checkout'} (--impl {impl})"
    Path(out).write_text(json.dumps(results, indent=2))
    return results


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
    args = parser.parse_args(argv)
    results = grade(args.student_dir, args.out, args.impl, args.tests, extra)
    total = sum(t["max_score"] for t in results["tests"])
    print(f"\nscore {results['score']}/{total}; wrote {args.out}")
    for t in results["tests"]:
        print(f"  {t['name']:<40} {t['score']:>3}/{t['max_score']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
