"""A graded rank's guard: teaching messages about what the learner's code may not do while it runs.

The walls are the operating system's (distlab/grading/jail.py: in a grading run learner code runs in a
jail that cannot reach the reference, the grader's files or the verdict). What is here names a mistake
early, in the learner's own run too. The static rules (distlab/grading/isolation.py) read a template
before it runs; this is the layer behind them, in every rank of a graded run (``--impl templates``), installed at rank start by the
rank hook (distlab/grading/attach.py, run by distlab/rank.py), before the test module loads the template:

* a Python audit hook (PEP 578, ``sys.addaudithook``: it cannot be removed) refuses, while the
  learner's code is on the stack, to open the reference solutions, the tests or the grading
  files, to write anywhere in the instructor's checkout, to import ``solutions`` or the tests,
  to reach frames or the garbage collector, to patch a function's code or a class, to load C
  libraries, to start processes or to change the environment (``DISTLAB_IMPL=solutions``);
* the verdict functions (torch's comparisons, distlab.testing, the test module) are checked
  when the rank's work is done (:class:`distlab.grading.isolation.BenchGuard`): a patch fails the rank.

A refusal raises inside the learner's code and is remembered: the rank fails with it even if
the learner's code catches the exception.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

from distlab import outcome
from distlab.grading.isolation import BenchGuard
from distlab.loader import IMPL_ENV, STUDENT_DIR_ENV

REPO = Path(__file__).resolve().parents[2]
_PROTECTED = tuple(str(REPO / d) + os.sep for d in ("solutions", "tests", "grading"))
# Events refused whenever learner code is anywhere on the stack (the bench it calls included).
_ANYWHERE = ("ctypes.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
             "os.forkpty", "os.kill", "os.killpg", "os.putenv", "os.unsetenv", "pty.spawn",
             "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.addaudithook")
# Events that change files: refused on the instructor's checkout only (the checkpoint lessons replace,
# prune and remove their own files, which is the lesson).
_FILE_CHANGES = ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.chmod", "os.chown", "os.truncate",
                 "os.link", "os.symlink", "shutil.copyfile", "shutil.move")
# Events refused when the learner's own line makes them (dataclasses and torch exec code on its behalf).
_DIRECT = ("exec", "compile", "sys._getframe", "object.__setattr__", "object.__delattr__", "object.__getattr__",
           "builtins.input", "marshal.loads", "code.__new__", "function.__new__")

_state = threading.local()
_learner_roots: tuple[str, ...] = ()
violations: list[str] = []
_guard = None


def _is_learner(filename: str) -> bool:
    return filename.startswith(_learner_roots) and os.path.basename(filename).startswith("template_")


def _learner_on_stack(direct_only: bool) -> str | None:
    frame = sys._getframe(3)  # 0: here, 1: _refusal, 2: the hook, 3: the code that caused the event
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_learner(filename):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        if direct_only or filename.startswith("<frozen importlib"):
            # Past an import boundary the code is a library's module body (torch sets environment
            # variables as it imports), run because the learner imported it, not the learner's own act.
            return None
        frame = frame.f_back
    return None


def _resolve(path, dir_fd=None) -> str | None:
    """An absolute path for an event's ``path`` (relative to ``dir_fd`` when given, as rmtree does it)."""
    if not isinstance(path, (str, bytes)):
        return None
    path = os.fsdecode(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    try:
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
    except OSError:
        return None
    return os.path.normpath(os.path.join(base, path))


def _changed_paths(event: str, args: tuple) -> list[str]:
    if event in ("os.rename", "os.link", "os.symlink"):  # (src, dst, src_dir_fd, dst_dir_fd)
        pairs = [(args[0], args[2] if len(args) > 2 else None), (args[1], args[3] if len(args) > 3 else None)]
    elif event in ("shutil.copyfile", "shutil.move"):
        pairs = [(args[0], None), (args[1], None)]
    elif event == "os.truncate":
        pairs = [(args[0], None)]
    else:  # remove, rmdir, rmtree, chmod, chown: the dir_fd comes last
        pairs = [(args[0], args[-1] if len(args) > 1 else None)]
    return [p for p in (_resolve(path, fd) for path, fd in pairs) if p]


def _refusal(event: str, args: tuple) -> str | None:
    if event == "open":
        path, mode = args[0], args[1] if len(args) > 1 else "r"
        if isinstance(path, int) and not isinstance(path, bool):  # os.fdopen, open(fd): a pipe the bench holds
            return f"open file descriptor {path}" if _learner_on_stack(False) else None
        if not isinstance(path, (str, bytes)):
            return None
        if re.match(r"/(proc/[^/]+|dev)/fd/", os.fsdecode(path)):  # the same pipes, by their /proc name
            return f"open {os.fsdecode(path)!r}" if _learner_on_stack(False) else None
        if not os.path.isabs(os.fsdecode(path)) and not _learner_on_stack(True):
            return None  # relative to a directory fd (the event does not say which): the stdlib's, not the learner's
        path = _resolve(path) or ""
        writes = isinstance(mode, str) and any(c in mode for c in "wax+")
        if path.startswith(_PROTECTED) or (writes and path.startswith(str(REPO) + os.sep)):
            return f"open {path!r} ({mode})" if _learner_on_stack(False) else None
        return None
    if event == "import":
        name = str(args[0])
        if name.split(".")[0] in ("solutions", "tests") or name.startswith("test_") or name == "distlab.loader":
            return f"import {name}" if _learner_on_stack(False) else None
        return None
    if event in _FILE_CHANGES:
        paths = _changed_paths(event, args)
        if any(p.startswith(str(REPO) + os.sep) for p in paths):
            return f"{event} {paths[0]!r}" if _learner_on_stack(False) else None
        return None
    if event.startswith(_ANYWHERE):
        return event if _learner_on_stack(False) else None
    if event in _DIRECT:
        return event if _learner_on_stack(True) else None
    return None


def _hook(event: str, args: tuple) -> None:
    if getattr(_state, "busy", False):
        return  # our own sys._getframe
    _state.busy = True
    try:
        why = _refusal(event, args)
    finally:
        _state.busy = False
    if why:
        message = f"graded code may not {why} (refused by the grader's sandbox: the exercise scores 0)"
        violations.append(message)
        raise PermissionError(message)


def graded() -> bool:
    """True in a run that grades templates (``--impl templates``)."""
    return os.environ.get(IMPL_ENV) == "templates"


def install_hook() -> None:
    """The audit hook, in this process for good (a graded rank, or the pytest process of a graded run,
    where single-process tests load templates)."""
    global _learner_roots
    if _learner_roots:
        return
    roots = [str(REPO) + os.sep]
    if os.environ.get(STUDENT_DIR_ENV):
        roots.append(os.path.abspath(os.environ[STUDENT_DIR_ENV]) + os.sep)
    _learner_roots = tuple(roots)
    sys.addaudithook(_hook)


def enter_rank(*scratch: str) -> None:
    """At a rank's start, before any learner code: the audit hook, and the bench's verdict functions
    remembered (``scratch``: the run's own files; the jail, not this hook, keeps the rank to them)."""
    global _guard
    if not graded():
        return
    _guard = BenchGuard()
    install_hook()


def leave_rank(message: tuple) -> tuple:
    """At a rank's end: its result, or the first refusal / bench change if the learner's code caused one."""
    if _guard is None:
        return message
    changed = _guard.restore()
    why = violations[0] if violations else (
        f"graded code changed the bench's {', '.join(changed)} (the exercise scores 0)" if changed else None)
    if why is None:
        return message
    return outcome.failure(PermissionError(why), "")
