"""The pytest plugin's grading parts, beside the bench's (distlab/pytest_plugin.py: ``--impl``, the score).

Loaded by pyproject.toml's addopts (``-p distlab.pytest_plugin -p distlab.grading.plugin``), in every run:
templates loaded by the tests go through the static rules and the bench guard (distlab/grading/attach.py).
A graded run (``--impl templates``) also gets the sandbox's audit hook in pytest's process; an instructor's
run (``--student-dir``) makes its verdicts in pytest's process, which never runs learner code: each graded
test's body runs in a forked child (distlab/grading/verdict.py). ``--record-reference`` keeps the
reference's checks for later grading runs (grading/gradescope/setup.sh).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from distlab import role
from distlab.grading import attach, sandbox

REPO = Path(__file__).resolve().parents[2]


def pytest_addoption(parser):
    parser.getgroup("distlab").addoption(
        "--record-reference", action="store_true",
        help="run every graded test on the reference and keep its checks for grading runs "
             "(grading/gradescope/setup.sh; distlab/grading/verdict.py)")


@pytest.hookimpl(trylast=True)  # after distlab/pytest_plugin.py's: the run's environment is set
def pytest_configure(config):
    attach.attach()
    if config.getoption("--impl") == "templates":
        _isolate_graded_run()
        if config.getoption("--student-dir"):  # an instructor's grading run: no template in this process
            role.become(role.GRADER)


def _isolate_graded_run() -> None:
    """A graded run: the sandbox's audit hook in this process too (single-process tests load templates
    here); as root with ranks to run as an unprivileged user (grading/gradescope/run_autograder), the
    reference modules preloaded by the forkserver, so ranks have them once they cannot read the files."""
    sandbox.install_hook()
    if os.environ.get(sandbox.RANK_USER_ENV) and os.geteuid() == 0:
        from distlab import spawn  # (torch: only here, where the ranks need the reference preloaded)

        spawn.preload(*[f"solutions.{p.parent.name}.{p.stem}" for p in sorted(REPO.glob("solutions/phase*/*.py"))
                        if p.stem != "__init__"])


@pytest.fixture(autouse=True)
def _tmp_path_open_to_rank_user(request):
    """Ranks graded as the unprivileged user write checkpoints to the test's tmp_path (pytest makes it 0700)."""
    if os.environ.get(sandbox.RANK_USER_ENV) and os.geteuid() == 0 and "tmp_path" in request.fixturenames:
        path = request.getfixturevalue("tmp_path")
        os.chmod(path, 0o777)
        for parent in list(path.parents)[:3]:  # test dir, numbered basetemp, pytest-of-root
            os.chmod(parent, parent.stat().st_mode | 0o011)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if role.current() == role.GRADER:
        from distlab.grading import verdict  # (torch: when a test runs, not when pytest starts)

        verdict.run_in_child(pyfuncitem)  # the learner's code loads there; its outcome comes back
        return True
    if pyfuncitem.config.getoption("--record-reference"):
        if pyfuncitem.get_closest_marker("exercise") is None:
            pytest.skip("not a graded test: no checks to record")
        from distlab.grading import verdict

        verdict.reference_checks(pyfuncitem)
        return True
    return None
