"""Grading plugged into the bench: the loader's template checks and the launcher's rank hook.

The bench offers the places (distlab/hooks.py) and never imports grading; :func:`attach` fills them in,
in pytest's process (distlab/grading/plugin.py) and, through the rank hook, in every rank it starts.
"""
from __future__ import annotations

from distlab import hooks
from distlab.grading import isolation, sandbox


def _guard():
    """Around a template's import: the bench's verdict functions remembered (a teaching message: the walls
    are the jail's, distlab/grading/jail.py)."""
    return isolation.BenchGuard().restore


def _enter_rank(*scratch: str) -> None:
    attach()  # the rank's own loads are checked too
    sandbox.enter_rank(*scratch)  # a graded run: the audit hook is in before learner code loads
    if sandbox.graded():  # torch's own all_reduce, sampler, ... refused to the templates that teach them
        from distlab.grading.rules import install_builtin_rules

        install_builtin_rules()


TEMPLATE_CHECKS = hooks.TemplateChecks(lint=isolation.lint, guard=_guard)
RANK_HOOK = hooks.RankHook(enter=_enter_rank, leave=sandbox.leave_rank)  # leave: a refusal fails the rank


def attach() -> None:
    """In this process: every template ``load()`` imports is checked; every rank started gets the rank hook."""
    hooks.check_templates(TEMPLATE_CHECKS)
    hooks.add_rank_hook(RANK_HOOK)
