"""How a template marks unfinished work.

A template's TODO region ends in ``raise todo("3.1 ring reduce-scatter",
"guidelines.md#ring-all-reduce")``. The exception names the exercise and the
guideline section, so a learner running the tests sees one line per unfinished
exercise instead of a traceback, and the grader can tell "not done yet" apart from
"done but wrong".
"""
from __future__ import annotations

import os
import re
import sys
from typing import Callable, Iterable, TextIO


class LearnerTODO(NotImplementedError):
    """Raised by template code the learner has not written yet."""


def todo(what: str, where: str) -> LearnerTODO:
    """Build the exception a template raises at the end of an unfinished TODO region.

    Args:
        what: the exercise id and a few words, e.g. ``"1.2 all-gather then sum"``.
        where: the guideline section, e.g. ``"guidelines.md#all-reduce-three-ways"``;
            a bare ``guidelines.md`` is resolved against the calling template's folder.
    """
    caller = sys._getframe(1).f_globals.get("__file__")
    if caller and where.startswith("guidelines"):
        where = f"{os.path.basename(os.path.dirname(caller))}/{where}"
    return LearnerTODO(f"TODO {what}: not implemented yet (see {where})")


TODO_EXIT_CODE = 3
HANG_EXIT_CODE = 75  # a rank the hang doctor's watchdog ended (EX_TEMPFAIL): the job hung, the doctor said why
FAILED_ON = "failed on rank"  # summarize_failure's first line: "demos.pipeline failed on rank 1 (exit code 1): ..."


# Errors whose message says what to change: one line, no traceback (a torchrun rank records only the
# class name, so they are known by name). ValueError's subclasses among them: a resume that does not fit,
# --fresh in a folder that is not the course's; and another run holding the checkpoint directory.
ONE_LINE_ERRORS = ("ValueError", "LearnerTODO", "ResumeRefused", "ForeignEntriesError", "CheckpointDirectoryError")


def run_demo(main: Callable[[], object]) -> None:
    """Run a demo's ``main()``: an unfinished TODO ends it with one line, any other error with one report.

    Demos run the learner's code under ``IMPL=templates``: a LearnerTODO is the
    expected way for such a run to stop, so it is printed as its message alone
    (``TODO 1.2 ...: not implemented yet (see ...)``) with exit code 3, not as a traceback.
    Use as the ``if __name__ == "__main__":`` line.

    Any other exception is recorded by torch's ``@record`` (``main`` runs wrapped in it):
    under torchrun the rank writes it to its error file and exits with code 1 without
    printing, so the launcher reports it once, with the failing rank, instead of every
    rank printing the same traceback (plain torchrun: its "Root Cause" block;
    ``python -m distlab.launch`` and ``entrypoint.sh``: ``summarize_failure``'s few lines).
    Without torchrun a ValueError (the demos' message for a flag that cannot work), or another of
    ``ONE_LINE_ERRORS``, is printed as one line with exit code 1; anything else propagates with its traceback.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(main)()
    except LearnerTODO as exc:
        # One write for the line and its newline: torchrun runs workers with ``python -u``, where
        # print() writes them apart and two ranks' lines interleave ("TODO ...TODO ...\n\n").
        sys.stderr.write(f"{exc}\n")
        sys.stderr.flush()
        sys.exit(TODO_EXIT_CODE)
    except Exception as exc:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            sys.exit(1)  # recorded in the error file: torchrun's report carries it
        if isinstance(exc, ValueError) or type(exc).__name__ in ONE_LINE_ERRORS:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            sys.exit(1)
        raise


def summarize_failure(error) -> str:
    """torchrun's ChildFailedError in a few lines: the first failure's rank and error, once.

    One of ``ONE_LINE_ERRORS`` (a ValueError, a LearnerTODO, ...) is one line (it says what to change); another
    exception comes with the traceback its rank recorded; a rank that recorded nothing (one
    killed by a signal, or ended by the hang doctor) with its exit code. The other failed
    ranks follow in one line, without their errors repeated.
    """
    root_rank, root = error.get_first_failure()

    def recorded(failure) -> tuple[str, str]:
        """(the recorded "Type: message", its traceback); empty without an error file."""
        message = failure.message
        if isinstance(message, dict):
            return (str(message.get("message", "")).strip(),
                    str(message.get("extraInfo", {}).get("py_callstack", "")).strip())
        return (str(message), "") if os.path.isfile(failure.error_file) else ("", "")  # else torch's own words

    def code(failure) -> str:
        return f"exit code {failure.exitcode}" + (f", {failure.signal_name()}" if failure.exitcode < 0 else "")

    text, stack = recorded(root)
    if not text and root.exitcode == HANG_EXIT_CODE:
        # The rank that fired is one that waited, not the one to blame: the doctor's report says who.
        text = ("ended by the hang doctor's watchdog: its report above (\"distlab hang doctor ...\") names "
                "the rank to blame")
    lines = [f"{error.name} {FAILED_ON} {root_rank} ({code(root)}): "
             + (text or "no error recorded: see the output above")]
    if stack and not text.startswith(tuple(f"{name}:" for name in ONE_LINE_ERRORS)):
        lines += ["  " + row for row in stack.splitlines()]
    others = sorted(rank for rank in error.failures if rank != root_rank)
    same = [rank for rank in others if text and recorded(error.failures[rank])[0] == text]
    notes = [f"rank(s) {', '.join(map(str, same))} with the same error"] if same else []
    for rank in others:
        if rank not in same:
            other = recorded(error.failures[rank])[0]
            notes.append(f"rank {rank} ({code(error.failures[rank])})"
                         + (f": {other.splitlines()[0]}" if other else ""))
    if notes:
        lines.append(f"  and {'; '.join(notes)}")
    return "\n".join(lines)


def filter_launcher_output(lines: Iterable[str], out: TextIO) -> bool:
    """Copy torchrun's stderr to ``out``, keeping an unfinished TODO to one line.

    Every rank stops at the same TODO and prints the same line; torchrun then reports the
    exit code 3 of every rank (its own traceback, or ``summarize_failure``'s lines). Here the
    TODO line is printed once, and what follows it is held back and dropped if it is only
    torchrun's report of those exit codes (any other failure is printed in full). Returns
    whether a TODO was seen.
    """
    seen: list[str] = []
    held: list[str] = []
    for line in lines:
        text = line.rstrip("\n")
        # Each TODO line once, also where ranks' lines were glued together (another program's workers)
        todos = re.findall(r"TODO \S+ .*?: not implemented yet \(see \S+?\)", text)
        if todos and not re.sub(r"TODO \S+ .*?: not implemented yet \(see \S+?\)", "", text).strip():
            for todo_line in todos:
                if todo_line not in seen:
                    seen.append(todo_line)
                    print(todo_line, file=out, flush=True)
            continue
        if seen:
            held.append(line)
        else:
            out.write(line)
            out.flush()
    report = "".join(held)
    codes = re.findall(r"exit ?code\s*:?\s*(-?\d+)", report)
    # A rank stopped by torchrun (SIGTERM, -15) after another stopped at the TODO is part of
    # the same stop; any other code is a real failure and its report is kept whole.
    only_todo_exits = str(TODO_EXIT_CODE) in codes and all(code in (str(TODO_EXIT_CODE), "-15") for code in codes)
    launcher_report = any(marker in report for marker in ("ChildFailedError", "closing signal", FAILED_ON))
    if held and not ((only_todo_exits or not codes) and launcher_report):
        out.write(report)
    return bool(seen)

