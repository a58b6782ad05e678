"""The pytest plugin's grading parts, beside the bench's (distlab/pytest_plugin.py: ``--impl``, the score).

Loaded by pyproject.toml's addopts (``-p distlab.pytest_plugin -p distlab.grading.plugin``), in every run:
templates loaded by the tests go through the static rules and the bench guard (distlab/grading/attach.py),
which are teaching messages. A learner's own run (``--impl templates``) also gets the audit hook.

An instructor's grading run (``--impl templates --student-dir=DIR``) is where the walls are: pytest's
process never runs learner code. Before the first test, each exercise's tests run in a jail of their own
(distlab/grading/jail.py: a private copy of the bench without the reference, an unprivileged identity,
read-only everything but its scratch); what comes out is data. Each graded test's verdict is then made
here, from that data and the same test run on the reference (distlab/grading/verdict.py).
``--record-reference`` keeps the reference's checks for later grading runs (grading/gradescope/setup.sh), and the
lint's allowances the jails take as data.
"""
from __future__ import annotations

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
        if config.getoption("--student-dir"):  # an instructor's grading run: no learner code in this process
            role.become(role.GRADER)
        else:  # a learner's own run, or a grading jail's: single-process tests load templates in this process
            sandbox.install_hook()  # the audit hook's messages
            from distlab.grading.rules import install_builtin_rules  # (torch: only in a run that tests templates)

            install_builtin_rules()  # torch's own all_reduce, sampler, ... refused to the templates that teach them
    if config.getoption("--record-reference"):  # the lint's allowances too: each grading run's jail takes them
        from distlab.grading import jail  # as data, and rendering them from every solution is ~5 s of CPU

        jail.allowances()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    """In a grading run, before the first test: every exercise's tests in a jail of their own."""
    if role.current() == role.GRADER and session.items and not session.config.option.collectonly:
        from distlab.grading import jail  # (torch: only in a grading run)

        try:
            session.config._jail_outcomes = jail.run_groups(session.items, session.config.getoption("--student-dir"))
        except jail.JailUnavailable as exc:
            pytest.exit(f"not graded: {exc}", returncode=3)
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
