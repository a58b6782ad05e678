"""Where a layer above the bench plugs in, without the bench importing it.

The bench alone runs a rank's code and imports a template as written. distlab/grading/ fills these in
when it is active (its pytest plugin, distlab/grading/attach.py):

* rank hooks, run in every rank ``run_distributed`` starts, around the caller's code (distlab/rank.py):
  they are sent to the rank with its work, so they are module-level functions (pickled by name);
* template checks, around a template's import by ``load()`` (distlab/loader.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class RankHook:
    """``enter(*scratch)`` at a rank's start, before the caller's code (``scratch``: the run's own files the
    rank needs, its store and doctor records); ``leave(message) -> message`` at its end, where it may turn
    the rank's result into a failure."""

    enter: Callable[..., None]
    leave: Callable[[tuple], tuple]


@dataclass(frozen=True)
class TemplateChecks:
    """``lint(path, phase, name)``: reasons not to run the template at ``path``, read from its source before
    a line of it runs. ``guard()``: called right before the import; what it returns is called right after
    it and names what the import changed in the bench (having put it back)."""

    lint: Callable[[Path, str, str], list[str]]
    guard: Callable[[], Callable[[], list[str]]]


_rank_hooks: list[RankHook] = []
_template_checks: TemplateChecks | None = None


def add_rank_hook(hook: RankHook) -> None:
    """Run ``hook`` in every rank this process starts from now on (once, however often it is added)."""
    if hook not in _rank_hooks:
        _rank_hooks.append(hook)


def rank_hooks() -> tuple[RankHook, ...]:
    return tuple(_rank_hooks)


def set_rank_hooks(hooks: tuple[RankHook, ...]) -> None:
    """A rank's own: the hooks it was started with, for the worlds it starts in turn."""
    _rank_hooks[:] = hooks


def check_templates(checks: TemplateChecks | None) -> None:
    """Check every template this process loads from now on with ``checks`` (None: no more)."""
    global _template_checks
    _template_checks = checks


def template_checks() -> TemplateChecks | None:
    return _template_checks
