"""The grading switch (--impl, --student-dir, --results-json) and the per-exercise score
live in distlab/pytest_plugin.py, loaded by pyproject.toml's ``-p distlab.pytest_plugin``; what
grading adds, in distlab/grading/plugin.py (``-p distlab.grading.plugin``)."""

import os

import pytest

E2E_ENV = "DISTLAB_E2E"


def pytest_collection_modifyitems(config, items):
    """The end-to-end tier (marked ``e2e``): whole sessions played through nested processes (a learner's
    cockpit, an instructor's grading of a copy, every untouched template through a nested pytest,
    launchers killed): 526 s on a fresh clone, beside the main suite's 588 s. The main suite skips them
    unless ``DISTLAB_E2E=1`` or ``-m e2e`` selects them; ``.ci/run`` runs them after it, with their time.
    A graded test is never in the tier: skipping it would take it out of a score's denominator."""
    selected = os.environ.get(E2E_ENV) == "1" or "e2e" in (config.option.markexpr or "")
    skip = pytest.mark.skip(reason=f"the end-to-end tier: run it with {E2E_ENV}=1 python -m pytest -m e2e "
                                   "(.ci/run does, after the main suite)")
    for item in items:
        if item.get_closest_marker("e2e"):
            if item.get_closest_marker("exercise"):
                raise pytest.UsageError(f"{item.nodeid} grades an exercise: it cannot be in the e2e tier")
            if not selected:
                item.add_marker(skip)
