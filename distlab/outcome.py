"""One result type between processes, and one way back to an exception.

A process that ran someone's code (a rank, a grading jail's test, the grader's reference child) reports
one of three tuples, made of plain values only:

* ``("ok", result, records)`` from a rank, ``("passed", records)`` from a test: it ran to the end
  (``records``: the checks it recorded, distlab/testing.py; None where nothing was recorded);
* ``("skipped", reason)`` from a test;
* ``("error", module, qualname, message, traceback, is_todo)``: :func:`failure` builds it, :func:`rebuild`
  turns it back into an exception in the process that reads it.

distlab/rank.py, distlab/spawn.py, distlab/grading/report.py, distlab/grading/jail.py and
distlab/grading/verdict.py all use these two functions.
"""
from __future__ import annotations

import builtins
import re
import traceback

from distlab.todo import LearnerTODO


class RankError(RuntimeError):
    """A process failed with an exception whose type is not rebuilt here (not a built-in one)."""


def failure(exc: BaseException, tb: str | None = None) -> tuple:
    """The report of ``exc`` (``tb``: its traceback as text, by default the one being handled)."""
    return ("error", type(exc).__module__, type(exc).__qualname__, str(exc),
            tb if tb is not None else traceback.format_exc(), isinstance(exc, LearnerTODO))


def failure_text(message: str, tb: str = "") -> tuple:
    """A report of a failure the reader names itself (a result that could not be sent, a refused file)."""
    return ("error", "builtins", "RuntimeError", message, tb, False)


def rebuild(message: tuple, rank: int | None = None) -> BaseException:
    """The exception an ``("error", ...)`` report stands for, with the rank leading its message once.

    A learner's unfinished TODO comes back as one line (``LearnerTODO``); a built-in exception as its own
    type; anything else as :class:`RankError` naming the type. The traceback rides along as
    ``exc.rank_traceback``, which distlab/pytest_plugin.py shows under the one-line message."""
    _, module, qualname, text, tb, is_todo = message
    lead = "" if rank is None or re.match(rf"rank {rank}\b", text) else f"rank {rank}: "
    if is_todo:
        return LearnerTODO(f"{lead}{text}")
    text = f"{lead}{text if text.strip() else qualname.rsplit('.', 1)[-1] + ' (no message)'}"
    exc_type = getattr(builtins, qualname, None) if module == "builtins" else None
    exc = None
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        try:
            exc = exc_type(text)
        except Exception:  # noqa: BLE001 - a built-in that wants other arguments
            exc = None
    if exc is None:
        exc = RankError(f"{module}.{qualname}: {text}")
    exc.rank_traceback = tb
    return exc
