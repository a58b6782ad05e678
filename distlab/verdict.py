"""In a graded run, each graded test's body runs in a forked child; pytest's process only reads its outcome.

The learner's code is loaded where the test body runs. Tests whose ranks load it already keep it
out of pytest's process (distlab/spawn.py), but single-process tests (the sampler, the checkpoint
file format, ...) would load it into pytest itself: a patch made there would outlive the test and
reach every exercise graded after it, and the verdicts would be written by a process that ran the
learner's code. Here the body runs in a child forked for the test (fixtures were set up by pytest
first, so tmp_path and monkeypatch work as usual); the child sends back one message (passed, skipped,
or the exception's type, message and rank traceback) and exits; pytest raises it again from that
message. The parent never imports a template: ``load()`` in it refuses to (distlab/loader.py).
"""
from __future__ import annotations

import os
import pickle
import threading
import traceback

import pytest

from distlab.todo import LearnerTODO

IN_CHILD = False  # True in a test's child: the loader may load templates here
PARENT = False  # True in pytest's process of a graded run: the loader refuses templates there


def _die_when_parent_does(fd: int) -> None:
    os.read(fd, 1)  # EOF: the parent is gone (pytest-timeout's os._exit, SIGKILL): nothing reads the result
    os._exit(1)


def _child_body(item) -> tuple:
    global IN_CHILD
    IN_CHILD = True
    try:
        import torch

        torch.set_num_threads(1)  # after fork, one thread: the parent's intra-op pool did not come along
        from multiprocessing import forkserver

        # The forkserver the parent started is not this process's child: no waitpid on it, just use it.
        forkserver._forkserver.ensure_running = lambda: None
        args = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
        item.obj(**args)
        return ("passed",)
    except pytest.skip.Exception as exc:
        return ("skipped", str(exc.msg))
    except BaseException as exc:  # everything goes back to the parent, never swallowed
        return ("error", type(exc).__module__, type(exc).__qualname__, str(exc),
                getattr(exc, "rank_traceback", None) or traceback.format_exc(), isinstance(exc, LearnerTODO))


def run_in_child(item) -> None:
    """Run ``item``'s test function in a forked child and raise (or return) as it did."""
    from multiprocessing import forkserver, resource_tracker

    from distlab.spawn import _context

    _context()
    forkserver.ensure_running()  # once, in the parent: every test's ranks then come from it
    resource_tracker.ensure_running()
    out_r, out_w = os.pipe()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(out_r)
        os.close(alive_w)
        threading.Thread(target=_die_when_parent_does, args=(alive_r,), daemon=True).start()
        message = _child_body(item)
        try:
            payload = pickle.dumps(message)
        except Exception as exc:
            payload = pickle.dumps(("error", "builtins", "RuntimeError", f"could not send the outcome: {exc}", "", False))
        with os.fdopen(out_w, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(out_w)
    os.close(alive_r)
    try:
        with os.fdopen(out_r, "rb") as f:
            payload = f.read()
    finally:
        try:
            os.kill(pid, 9)  # done or interrupted: the child has nothing left to do
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os.close(alive_w)
    if not payload:
        raise RuntimeError("the test's process died without an outcome (killed, or it exited early)")
    _raise(pickle.loads(payload))


def _raise(message: tuple) -> None:
    import builtins

    if message[0] == "passed":
        return
    if message[0] == "skipped":
        pytest.skip(message[1])
    _, module, qualname, text, tb, is_todo = message
    if is_todo:
        raise LearnerTODO(text)
    exc_type = getattr(builtins, qualname, None) if module == "builtins" else None
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        try:
            exc = exc_type(text)
        except Exception:
            exc = RuntimeError(f"{qualname}: {text}")
    else:
        exc = RuntimeError(f"{module}.{qualname}: {text}")
    exc.rank_traceback = tb
    raise exc
