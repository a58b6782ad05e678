"""The grading plugin itself: it must yield a score whatever the learner's code raises,
and it must run with the instructor's configuration, never the student's."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

LEARNER_TESTS = '''
import pytest

@pytest.mark.exercise("9.1 empty")
def test_empty_message():
    raise ValueError("")

@pytest.mark.exercise("9.2 unicode")
def test_unicode_message():
    raise AssertionError("\\n\\nrang 1: différence ≥ 2e-2 " + "x" * 5000)

@pytest.mark.exercise("9.3 system exit")
def test_system_exit():
    raise SystemExit(7)

@pytest.mark.exercise("9.4 passes")
def test_passes():
    pass

def _interrupted(rank, world_size):
    if rank == 1:
        raise KeyboardInterrupt  # what a learner's stray input() or Ctrl-C handler can leave
    return rank

def _exits(rank, world_size):
    if rank == 0:
        raise SystemExit("")
    return rank

@pytest.mark.exercise("9.5 keyboard interrupt in a rank")
def test_keyboard_interrupt_in_a_rank():
    from distlab.spawn import run_distributed
    run_distributed(_interrupted, 2, timeout_s=30)

@pytest.mark.exercise("9.6 system exit in a rank")
def test_system_exit_in_a_rank():
    from distlab.spawn import run_distributed
    run_distributed(_exits, 2, timeout_s=30)
'''


def _pytest(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
def test_any_learner_exception_still_yields_a_score(tmp_path):
    tests = tmp_path / "test_learner.py"
    tests.write_text(LEARNER_TESTS)
    out = tmp_path / "results.json"
    proc = _pytest(str(tests), f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"), f"--results-json={out}")
    assert "INTERNALERROR" not in proc.stdout + proc.stderr, proc.stdout[-3000:]
    results = json.loads(out.read_text())
    by_name = {t["name"]: t for t in results["tests"]}
    assert results["score"] == 1 and by_name["9.4 passes"]["score"] == 1
    assert "ValueError (no message)" in by_name["9.1 empty"]["output"]
    assert "différence ≥ 2e-2" in by_name["9.2 unicode"]["output"]
    assert "rank 1" in by_name["9.5 keyboard interrupt in a rank"]["output"]
    assert "KeyboardInterrupt" in by_name["9.5 keyboard interrupt in a rank"]["output"]
    assert by_name["9.5 keyboard interrupt in a rank"]["score"] == 0
    assert "rank 0: SystemExit (no message)" in by_name["9.6 system exit in a rank"]["output"]
    assert by_name["9.6 system exit in a rank"]["score"] == 0
    assert len(results["per_test"]) == 6, results["per_test"].keys()


def test_student_dir_with_a_space_is_refused_with_the_fix(tmp_path):
    """``--student-dir /copy`` would make pytest read the copy's pyproject.toml."""
    copy = tmp_path / "copy"
    (copy / "tests").mkdir(parents=True)
    (copy / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (copy / "tests" / "conftest.py").write_text("")
    proc = _pytest("--impl", "templates", "--student-dir", str(copy), "tests/test_phase1.py", "--collect-only")
    assert proc.returncode != 0
    assert "write --student-dir=DIR (with '=')" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


CHEATS = {
    "star import": "from solutions.phase1_data_parallel.collectives import *\n",
    "importlib by name": "import importlib\n"
                         "globals().update(vars(importlib.import_module('solutions.phase1_data_parallel.collectives')))\n",
    "name built at run time": "import importlib\n"
                              "_m = importlib.import_module('solu' + 'tions.phase1_data_parallel.collectives')\n"
                              "allreduce_allgather_sum = _m.allreduce_allgather_sum\n",
    "another template": "from phase1_data_parallel.template_trainer import *\n",
}


@pytest.mark.parametrize("cheat", list(CHEATS))
def test_a_template_that_imports_the_solutions_is_refused(cheat, tmp_path, monkeypatch):
    from distlab import loader

    (tmp_path / "phase1_data_parallel").mkdir()
    (tmp_path / "phase1_data_parallel" / "template_collectives.py").write_text(CHEATS[cheat])
    monkeypatch.setenv(loader.IMPL_ENV, "templates")
    monkeypatch.setenv(loader.STUDENT_DIR_ENV, str(tmp_path))
    with pytest.raises(loader.IntegrityError, match="scores 0 until"):
        loader.load("phase1_data_parallel", "collectives")
    with pytest.raises(loader.IntegrityError):  # and again: no half-imported module is cached
        loader.load("phase1_data_parallel", "collectives")


def test_the_reference_asked_for_explicitly_comes_from_this_checkout(tmp_path, monkeypatch):
    from distlab import loader

    monkeypatch.setenv(loader.STUDENT_DIR_ENV, str(tmp_path))  # a copy without solutions/
    ref = loader.load("phase1_data_parallel", "collectives", impl="solutions")
    assert Path(ref.__file__).resolve() == REPO / "solutions" / "phase1_data_parallel" / "collectives.py"


@pytest.mark.e2e
def test_a_cheating_copy_scores_zero(tmp_path):
    copy = tmp_path / "copy"
    (copy / "phase1_data_parallel").mkdir(parents=True)
    (copy / "phase1_data_parallel" / "template_collectives.py").write_text(CHEATS["star import"])
    out = tmp_path / "results.json"
    _pytest("tests/test_phase1.py", "--impl=templates", f"--student-dir={copy}", f"--results-json={out}",
            "-k", "allreduce_matches_builtin_and_single_process and 2-")
    results = json.loads(out.read_text())
    assert results["score"] == 0 and results["tests"], results
    assert all("scores 0 until" in r["message"] for r in results["per_test"].values()), \
        results["per_test"]


def test_every_graded_exercise_is_in_the_manifest_with_points():
    """Each exercise a graded test marks (by id or full name) is an entry of distlab/course.toml, and the
    points the score uses are the manifest's (read here with tomllib), but where grading/weights.toml overrides them."""
    import tomllib

    from distlab.manifest import lookup
    from distlab.pytest_plugin import load_weights

    named = set()
    for f in REPO.glob("tests/test_phase*.py"):
        named |= set(re.findall(r'pytest\.mark\.exercise\("([^"]+)"\)', f.read_text()))
    missing = sorted(m for m in named if lookup(m) is None)
    assert not missing, f"add these exercises to distlab/course.toml (CONTRIBUTING.md): {missing}"
    manifest = {f"{e['id']} {e['title']}": float(e["points"])
                for e in tomllib.loads((REPO / "distlab" / "course.toml").read_text())["exercise"]}
    override = tomllib.loads((REPO / "grading" / "weights.toml").read_text()).get("weights", {})
    expected = dict(manifest, **{lookup(k).name: float(v) for k, v in override.items()})
    assert load_weights() == expected and all(v > 0 for v in expected.values())


def test_scores_are_weighted_and_scaffold_tests_do_not_count():
    from distlab.pytest_plugin import exercise_scores

    results = {"a": {"exercise": "1.1 x", "outcome": "passed", "scaffold": False, "message": ""},
               "b": {"exercise": "1.1 x", "outcome": "failed", "scaffold": False, "message": "boom"},
               "c": {"exercise": "1.1 x", "outcome": "passed", "scaffold": True, "message": ""},
               "d": {"exercise": "1.2 y", "outcome": "passed", "scaffold": True, "message": ""}}
    scores = exercise_scores(results, {"1.1 x": 3})
    assert (scores["1.1 x"]["points"], scores["1.1 x"]["weight"], scores["1.1 x"]["total"]) == (1.5, 3, 2)
    assert "1.2 y" not in scores  # only scaffold tests: nothing to score


@pytest.mark.e2e
@pytest.mark.timeout(400)  # a nested grading run with its own 300 s deadline
def test_run_autograder_grades_a_submission_of_template_files_only(tmp_path):
    """Gradescope's entry point, dry-run: the student uploaded one finished template."""
    root = tmp_path / "autograder"
    (root / "submission" / "my files").mkdir(parents=True)
    shutil.copy(REPO / "solutions/phase1_data_parallel/data_loader.py",
                root / "submission" / "my files" / "template_data_loader.py")
    env = {**os.environ, "AUTOGRADER": str(root), "SOURCE": str(REPO), "PYTHON": sys.executable,
           "GRADE_ARGS": "--tests tests/test_phase1.py -- -k sampler"}
    proc = subprocess.run([str(REPO / "grading/gradescope/run_autograder")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # inside the test's 400 s
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((root / "results" / "results.json").read_text())
    scores = {t["name"]: (t["score"], t["max_score"]) for t in results["tests"]}
    assert scores["1.4-1.5 distributed sampler"] == (2, 2), scores
    assert all(t["visibility"] == "visible" and "execution_time" in t for t in results["tests"])
    assert "phase1_data_parallel/template_data_loader.py" in results["output"]


def test_a_misnamed_submission_is_refused_by_name(tmp_path):
    from distlab.grading.grade import student_copy_from_submission

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "template_colectives.py").write_text("")
    with pytest.raises(ValueError, match=r"template_colectives.py'\] match no template"):
        student_copy_from_submission(tmp_path / "sub", tmp_path / "copy")


def test_autograder_zip_has_its_scripts_at_the_top(tmp_path):
    import zipfile

    from distlab.grading.grade import autograder_zip

    with zipfile.ZipFile(autograder_zip(tmp_path / "autograder.zip")) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "requirements.txt", "grading/weights.toml"} <= names
        assert z.getinfo("run_autograder").external_attr >> 16 & 0o111


# --------------------------------------------------------------------------- the score line (bench)
def test_score_of_an_exercise_with_tests_left_out_is_marked_partial():
    from distlab.pytest_plugin import exercise_scores, gradescope_results, score_line

    ex = "1.1-1.3 all-reduce three ways"
    passed = {"exercise": ex, "outcome": "passed", "scaffold": False, "message": ""}
    results = {"t::a": passed, "t::gpu": dict(passed, outcome="skipped"), "t::s": dict(passed, exercise="1.4 s")}
    collected = {"t::a": ex, "t::b": ex, "t::c": ex, "t::gpu": ex, "t::s": "1.4 s"}  # -k left out b and c
    scores = exercise_scores(results, {ex: 3, "1.4 s": 2}, collected, {"t::b", "t::c"})
    s = scores[ex]
    assert (s["total"], s["expected"], s["partial"], s["points"]) == (1, 3, True, 3.0), s  # skipped: not expected
    assert not scores["1.4 s"]["partial"], scores["1.4 s"]
    line = score_line(ex, s)
    assert "partial (1 of 3 tests selected)" in line and "3.00/3 points" not in line, line
    assert score_line("1.4 s", scores["1.4 s"]).endswith("2.00/2 points"), score_line("1.4 s", scores["1.4 s"])
    s_run = exercise_scores(results, {ex: 3}, collected)[ex]  # none deselected: -x stopped, or a crash
    assert "partial (1 of 3 tests run)" in score_line(ex, s_run), score_line(ex, s_run)
    report = gradescope_results(scores, results, 1.0)
    assert report["partial"] and [t["partial"] for t in report["tests"]] == [True, False], report["tests"]
    assert report["tests"][0]["output"].startswith("partial: 1 of 3 tests run"), report["tests"][0]["output"]
    assert exercise_scores(results, {ex: 3})[ex]["partial"] is False  # nothing known about collection: as before


def test_every_graded_test_lives_in_a_file_the_graders_run():
    """distlab.grading.grade (Gradescope) and distlab.bugs run the phase test files only: a test marked with an
    exercise anywhere else would count in a learner's pytest and never on Gradescope."""
    import ast

    from distlab.grading.grade import phase_test_files

    graded_files = {Path(f).name for f in phase_test_files()}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # decorators only: test code inside strings is not
            if isinstance(node, ast.FunctionDef) and any(  # the marker itself, not a string that names it
                    ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("mark.exercise")
                    for d in node.decorator_list):
                assert path.name in graded_files, f"{path.name}::{node.name} is graded but not in {sorted(graded_files)}"


def test_recorded_values_reach_the_grader_as_plain_data():
    """A learner's value that equals the expected one in the rank (a numpy int, a named tuple, a device) is
    recorded as data torch.load(weights_only=True) reads back, and still equals it in the grader's process."""
    import collections

    import numpy as np
    import torch

    from distlab import testing
    from distlab.grading import verdict

    pair = collections.namedtuple("pair", "a b")
    cases = [([np.int64(3), np.float32(0.5)], [3, 0.5]), (pair(1, 2), (1, 2)),
             ((torch.device("cpu"), torch.optim.AdamW, torch.float32), (torch.device("cpu"), torch.optim.AdamW,
                                                                        torch.float32)),
             ({"all_reduce": {"calls": np.int32(2)}}, {"all_reduce": {"calls": 2}})]
    saved = testing._records
    try:
        testing._records = []
        for actual, expected in cases:
            testing.assert_equal(actual, expected, "a learner's value")
        records = verdict._loads(verdict._dumps(testing.take_records()))
    finally:
        testing._records = saved
    verdict.compare(records, records)
    assert all(r["actual"] == r["expected"] for r in records), records


def test_the_score_line_calls_unfinished_only_a_todo_stub_not_a_diagnosis_that_names_a_todo():
    """A deleted zero_grad outside the TODOs is diagnosed as "you edited train_step (not a TODO)", and a
    diagnosis may point at a TODO; neither is an unfinished TODO (issue 32: the line said '<- unfinished: TODO 1.6')."""
    from distlab.pytest_plugin import score_line

    s = {"passed": 0, "total": 1, "points": 0.0, "weight": 3, "partial": False}
    edited = "you edited train_step (not a TODO): rank 0, step 1: your broadcast_parameters (TODO 1.6) or the update?"
    assert "unfinished" not in score_line("1.6-1.8", {**s, "failures": [f"t::a: {edited}"]})
    stub = "rank 1: TODO 1.6 broadcast the parameters: not implemented yet (see phase1_data_parallel/guidelines.md)"
    assert score_line("1.6-1.8", {**s, "failures": [f"t::a: {stub}"]}).endswith("<- unfinished: TODO 1.6")
