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


def run_demo(main: Callable[[], object]) -> None:
    """Run a demo's ``main()``; an unfinished TODO ends the process with one line and exit code 3.

    Demos run the learner's code under ``IMPL=templates``: a LearnerTODO is the
    expected way for such a run to stop, so it is printed as its message alone
    (``TODO 1.2 ...: not implemented yet (see ...)``), not as a traceback. Every other
    exception propagates unchanged. Use as the ``if __name__ == "__main__":`` line.
    """
    try:
        main()
    except LearnerTODO as exc:
        print(str(exc), file=sys.stderr, flush=True)
        sys.exit(TODO_EXIT_CODE)


def filter_launcher_output(lines: Iterable[str], out: TextIO) -> bool:
    """Copy torchrun's stderr to ``out``, keeping an unfinished TODO to one line.

    Every rank stops at the same TODO and prints the same line; torchrun then reports the
    exit code 3 of every rank with its own traceback. Here the TODO line is printed once,
    and what follows it is held back and dropped if it is only torchrun's report of those
    exit codes (any other failure is printed in full). Returns whether a TODO was seen.
    """
    seen: list[str] = []
    held: list[str] = []
    for line in lines:
        text = line.rstrip("\n")
        if re.match(r"TODO \S+ .*: not implemented yet \(see \S+\)$", text.strip()):
            if text.strip() not in seen:
                seen.append(text.strip())
                print(text.strip(), file=out, flush=True)
            continue
        if seen:
            held.append(line)
        else:
            out.write(line)
            out.flush()
    report = "".join(held)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", report)
    # A rank stopped by torchrun (SIGTERM, -15) after another stopped at the TODO is part of
    # the same stop; any other code is a real failure and its report is kept whole.
    only_todo_exits = str(TODO_EXIT_CODE) in codes and all(code in (str(TODO_EXIT_CODE), "-15") for code in codes)
    if held and not ((only_todo_exits or not codes) and ("ChildFailedError" in report or "closing signal" in report)):
        out.write(report)
    return bool(seen)

