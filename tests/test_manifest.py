"""The course's manifest (distlab/course.toml, distlab/manifest.py) and ``python -m distlab dev check``.

The checker is run on a small course built here (one solution with two regions, its template, guidelines,
a test file, an override of the points), whole and then broken one way at a time: each break must be
named in one line. Points and markers are compared with the manifest's file read by tomllib directly.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from distlab import manifest

REPO = Path(__file__).resolve().parent.parent

SOLUTION = '''def f():
    # ### BEGIN SOLUTION 7.1: add [guidelines.md#adding]
    return 1
    # ### END SOLUTION 7.1


def g():
    # ### BEGIN SOLUTION 7.2: multiply [guidelines.md#adding]
    return 2
    # ### END SOLUTION 7.2
'''
GUIDE = '''# Phase 7

## Adding

<details><summary>Hints for TODO 7.1</summary>

1. one
</details>

<details><summary>Hints for TODO 7.2</summary>

1. two
</details>
'''
TESTS = '''import pytest


@pytest.mark.exercise("7.1-7.2")
def test_a():
    pass
'''
ENTRY = '''[[exercise]]
id = "7.1-7.2"
title = "add and multiply"
points = 2
todos = ["7.1", "7.2"]
lessons = ["phase7_x/template_lesson.py"]
tests = ["tests/test_phase7.py"]
guide = "phase7_x/guidelines.md#adding"
'''


def small_course(root: Path) -> Path:
    for rel, text in {"solutions/phase7_x/lesson.py": SOLUTION, "phase7_x/template_lesson.py": "# generated\n",
                      "phase7_x/guidelines.md": GUIDE, "tests/test_phase7.py": TESTS,
                      "grading/weights.toml": '[weights]\n"7.1-7.2" = 3\n', "course.toml": ENTRY}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "course.toml"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def test_dev_check_finds_no_problem_in_the_course():
    assert manifest.check(REPO) == []


@pytest.mark.parametrize("where, old, new, expected", [
    ("solutions/phase7_x/lesson.py", "SOLUTION 7.2: multiply", "SOLUTION 7.3: multiply", "TODO 7.3 (phase7_x/template_lesson.py) belongs to no exercise"),
    ("course.toml", 'lessons = ["phase7_x/template_lesson.py"]', 'lessons = ["phase7_x/template_other.py"]', "lesson phase7_x/template_other.py does not exist"),
    ("course.toml", "guidelines.md#adding", "guidelines.md#subtracting", "guide anchor #subtracting is no heading"),
    ("tests/test_phase7.py", 'exercise("7.1-7.2")', 'exercise("7.1")', "no test marked @pytest.mark.exercise(\"7.1-7.2\")"),
    ("tests/test_phase7.py", 'exercise("7.1-7.2")', 'exercise("7.1-7.2 add and multiply")', None),  # the full name still counts
    ("phase7_x/guidelines.md", "Hints for TODO 7.2", "Hints for 7.2", "no '<summary>Hints for TODO 7.2</summary>' block"),
    ("grading/weights.toml", '"7.1-7.2" = 3', '"7.9" = 3', "grading/weights.toml: '7.9' names no exercise"),
    ("course.toml", 'title = "add and multiply"\n', "", "lacks title"),
    ("course.toml", 'todos = ["7.1", "7.2"]', 'todos = ["7.1", "7.2", "7.4"]', "lists TODO 7.4, outside its range"),
])
def test_dev_check_names_each_break_in_one_line(tmp_path: Path, where, old, new, expected):
    path = small_course(tmp_path)
    assert manifest.check(tmp_path, path) == [], "the small course is whole before the break"
    edit(tmp_path / where, old, new)
    manifest._load.cache_clear()
    problems = manifest.check(tmp_path, path)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems
        assert all("\n" not in p for p in problems), problems


def test_a_test_file_marking_an_exercise_must_be_in_its_tests(tmp_path: Path):
    path = small_course(tmp_path)
    (tmp_path / "tests" / "test_phase7_more.py").write_text(TESTS)
    assert any("tests/test_phase7_more.py marks tests of 7.1-7.2 but is not in its tests" in p
               for p in manifest.check(tmp_path, path))


def test_markers_by_id_or_full_name_name_the_same_exercise():
    raw = tomllib.loads((REPO / "distlab" / "course.toml").read_text())["exercise"]
    assert [e["id"] for e in raw] == [ex.id for ex in manifest.exercises()]
    for e in raw:
        full = f"{e['id']} {e['title']}"
        assert manifest.canonical(e["id"]) == manifest.canonical(full) == full
    assert manifest.canonical("9.1 empty") == "9.1 empty", "a marker of no exercise is left as it is"


def test_points_come_from_the_manifest_and_the_instructors_override_by_id(tmp_path: Path):
    raw = {f"{e['id']} {e['title']}": float(e["points"])
           for e in tomllib.loads((REPO / "distlab" / "course.toml").read_text())["exercise"]}
    assert manifest.weights(tmp_path / "absent.toml") == raw, "no grading/ (a jail): the manifest's points"
    override = tmp_path / "weights.toml"
    override.write_text('[weights]\n"1.4-1.5" = 7\n"1.1-1.3 all-reduce three ways" = 5\n')
    got = manifest.weights(override)
    assert got["1.4-1.5 distributed sampler"] == 7 and got["1.1-1.3 all-reduce three ways"] == 5
    assert {k: v for k, v in got.items() if not k.startswith(("1.4-1.5", "1.1-1.3"))} == \
        {k: v for k, v in raw.items() if not k.startswith(("1.4-1.5", "1.1-1.3"))}


def test_the_marker_rewrite_keeps_every_test_on_its_exercise(tmp_path: Path):
    """``python -m distlab.manifest --rewrite-markers tests/test_*.py`` (run once at integration): every marker
    of a manifest exercise becomes its id, each test still names the same exercise, nothing else changes."""
    files = sorted(REPO.glob("tests/test_*.py"))
    for f in files:
        (tmp_path / f.name).write_text(f.read_text())
    subprocess.run([sys.executable, "-m", "distlab.manifest", "--rewrite-markers", *map(str, tmp_path.glob("test_*.py"))],
                   cwd=REPO, check=True, capture_output=True, timeout=60)
    marker = re.compile(r'mark\.exercise\(\s*"([^"]+)"')
    ids = {ex.id for ex in manifest.exercises()}
    for f in files:
        before, after = f.read_text(), (tmp_path / f.name).read_text()
        old, new = marker.findall(before), marker.findall(after)
        assert [manifest.canonical(m) for m in old] == [manifest.canonical(m) for m in new], f.name
        assert all(m in ids for m in new if manifest.lookup(m)), f"{f.name}: {new}"
        assert marker.sub("", before) == marker.sub("", after), f"{f.name}: more than markers changed"


def test_dev_check_is_a_cockpit_command():
    proc = subprocess.run([sys.executable, "-m", "distlab", "dev", "check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "exercises, no problem" in proc.stdout, proc.stdout + proc.stderr


def test_a_bug_of_the_catalogue_may_name_its_exercise_by_id(tmp_path: Path):
    from distlab import bugs

    (tmp_path / "p.toml").write_text('[[bug]]\nid = "x"\nexercise = "1.4-1.5"\nfile = "f.py"\nold = "a"\nnew = "b"\n')
    assert [b.exercise for b in bugs.catalogue(tmp_path)] == ["1.4-1.5 distributed sampler"]
