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


# A backend's own words (gloo's, NCCL's) for a learner's mistake, and the course's: the first match wins.
# The translations avoid "connection", "closed", "peer", "timeout" (distlab/spawn.py's marks of an error
# that only follows another rank's) unless the backend's error is one of those.
_BACKEND = (
    (re.compile(r"Pair is not connected|state_ >= CONNECTED"),
     "a message was addressed to a rank outside this group (a global rank used where the group's rank was due, "
     "or the reverse?): use dist.get_rank(group), and dist.get_global_rank(group, r) for src/dst"),
    (re.compile(r"[Ii]nvalid (?:source |destination |global |group )?rank|rank \d+ is (?:out of range|invalid)"),
     "a src/dst outside the group's ranks was addressed (>= W, negative, or a rank of another group?)"),
    (re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)"),
     "sender and receiver disagree on the message size ({0} bytes arrived for a {1}-byte buffer): an off-by-one "
     "chunk index, or the uneven last chunk ignored?"),
    (re.compile(r"Connection (?:closed|reset) by peer"),
     "another rank's process ended mid-collective (the peer failed first: see its error; or it returned "
     "without joining a collective the others called)"),
)


def backend_cause(text: str) -> str | None:
    """The course's line for a backend error in ``text`` ("Pair is not connected" -> a rank outside the
    group was addressed), or None when it holds none of the known ones."""
    for pattern, line in _BACKEND:
        if m := pattern.search(text):
            return line.format(*m.groups())
    return None


_REGEX_MISS = re.compile(r"Regex pattern did not match\.[ \t]*\n\s*(?:Expected regex|Regex): (?P<pattern>.*?)\n"
                         r"\s*(?:Actual message|Input): (?P<message>.*)", re.S)


def one_line(text: str) -> str:
    """``text`` with a multi-line message whose first line names no cause folded into that line: pytest's
    ``pytest.raises(match=...)`` miss says "Regex pattern did not match." and only then the pattern and the
    message."""
    if m := _REGEX_MISS.search(text):
        message = " ".join(m["message"].split())[:300]
        return (text[:m.start()] + f"the error's message does not match the test's pattern: expected a match for "
                f"{m['pattern'].strip()}, got {message}")
    return text


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
    text = one_line(text)
    if (cause := backend_cause(text)) and cause not in text:
        first, _, rest = text.partition("\n")
        text = f"{cause} (the backend said: {first[:200]})" + (f"\n{rest}" if rest else "")
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
