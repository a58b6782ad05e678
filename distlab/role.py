"""Which process this is, for the little code that behaves differently in each.

* ``MAIN``: pytest's process, a script, a torchrun worker (the default);
* ``RANK``: a rank started by ``run_distributed`` (distlab/rank.py, before the caller's code runs);
* ``TEST_CHILD``: a graded test's body, forked by the grader (distlab/grading/verdict.py);
* ``GRADER``: pytest's process of an instructor's grading run, where the verdicts are made: no
  learner code may run here (``load()`` refuses a template, distlab/loader.py).

One value per process, set where the process takes up its job; a forked process keeps its parent's
until it sets its own (a forkserver's children start from the forkserver's: ``MAIN``).
"""
from __future__ import annotations

MAIN, RANK, TEST_CHILD, GRADER = "main", "rank", "test child", "grader"
_current = MAIN


def current() -> str:
    return _current


def become(role: str) -> None:
    global _current
    if role not in (MAIN, RANK, TEST_CHILD, GRADER):
        raise ValueError(f"unknown process role {role!r}")
    _current = role


def is_rank() -> bool:
    """True inside a rank started by ``run_distributed``."""
    return _current == RANK
