"""Exercises are graded independently: an exercise finished alone scores full marks.

A scratch student copy holds the generated templates with only the sampled exercises
finished (their regions filled from the solutions, every other TODO still raising), and
their tests run against it with ``--impl=templates``. The sample is the exercises that
used to fail with another exercise's TODO (4.2 with 4.1, 4.6 and 4.5-4.6 with 4.7 and the
checkpoint), one per module so that one pytest run checks them all. Dependencies that remain
by design are listed in grading/weights.toml. The full measurement over every exercise:
``python -m distlab.bugs`` reports a dependency as "leak".
"""
from __future__ import annotations

from pathlib import Path

import pytest

from distlab import bugs

# One exercise per solution module: each is the only finished TODO of its module.
SAMPLE = ["4.2 verified load", "4.6 reshard flat optimizer state", "4.12 straggler detection",
          "1.4-1.5 distributed sampler"]


def test_sample_is_one_exercise_per_module():
    modules = [m for e in SAMPLE for m in bugs.modules_of(bugs.exercise_ids(e))]
    assert len(modules) == len(set(modules)) == len(SAMPLE), modules


def test_partial_template_finishes_only_the_named_exercise():
    solution = bugs.REPO / "solutions" / "phase4_production" / "checkpoint.py"
    text = bugs.render_partial(solution, {"4.2"})
    assert 'raise todo("4.1 ' in text and 'raise todo("4.4a ' in text, "other exercises must stay unfinished"
    assert 'raise todo("4.2' not in text and "verify_file(path)" in text, "4.2 must hold the solution's code"
    assert "solutions" not in "".join(line for line in text.splitlines() if line.startswith(("import", "from")))


@pytest.mark.e2e
def test_exercise_finished_alone_scores_full(tmp_path: Path):
    finished = set().union(*(bugs.exercise_ids(e) for e in SAMPLE))
    copy = bugs.student_copy(tmp_path / "copy", finished)
    results = bugs.run_exercises(copy, SAMPLE, timeout_s=240)
    problems = []
    for exercise, tests in results.items():
        status, message = bugs.verdict(tests)
        if status != "missed":  # "missed" = every test passed
            problems.append(f"{exercise}: {status}: {message}")
    assert not problems, "exercises finished alone must pass:\n" + "\n".join(problems)
