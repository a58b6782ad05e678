"""In a grading run the verdict is pytest's process's: the learner's code ran in a jail, which sent data.

1. Before the first test, every exercise's tests ran in a jail (distlab/grading/jail.py): a private copy of
   the bench without the reference, an unprivileged identity, everything read-only but its scratch. Every
   comparison a test makes through distlab.testing (``assert_tensors_close`` and the helpers on it,
   ``assert_ranks_identical``; counts and byte totals through ``assert_equal``/``assert_at_most``) was
   recorded where it was made, in a rank or in the test's process: the actual value, the expected value,
   the tolerance, the test line. Each test's outcome came out as data (``torch.load(weights_only=True)``:
   tensors and plain values, nothing that runs code here).
2. A test that failed in the jail fails. A test that passed is run again on the reference, in a child of
   this process where no learner code runs (or its records are read from the cache, filled by
   ``pytest --record-reference`` when the autograder is built). :func:`compare` then asks, here: did the
   graded run make the same checks at the same lines, and is each actual value close to the reference
   run's expected value, its baseline, with the reference run's tolerance?
3. A test the graded run skipped where the reference ran it counts as failed (a skip is the bench's to
   make: no GPU here). A test whose reference run fails twice is left out of the score, said so, and never
   charged to the student.

What stays with the jail: assertions written as plain ``assert`` (timings, structure, peaks) ran where the
learner's code ran; only their outcome comes back.
"""
from __future__ import annotations

import functools
import hashlib
import io
import os
import shutil
import tempfile
import threading
import traceback
from pathlib import Path

import pytest

from distlab import outcome, role, testing
from distlab.loader import IMPL_ENV, STUDENT_DIR_ENV


def _die_when_parent_does(fd: int) -> None:
    os.read(fd, 1)  # EOF: the parent is gone (pytest-timeout's os._exit, SIGKILL): nothing reads the result
    os._exit(1)


def _child_body(item, impl: str | None = None) -> tuple:
    role.become(role.TEST_CHILD)  # the loader may load templates here
    if impl is not None:  # the reference run: this process and its ranks load the reference
        os.environ[IMPL_ENV] = impl
        os.environ.pop(STUDENT_DIR_ENV, None)
    testing.start_recording()  # every check this test makes, here and in its ranks, comes back
    try:
        import torch

        torch.set_num_threads(1)  # after fork, one thread: the parent's intra-op pool did not come along
        from multiprocessing import forkserver

        # The forkserver the parent started is not this process's child: no waitpid on it, just use it.
        forkserver._forkserver.ensure_running = lambda: None
        args = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
        item.obj(**args)
        return ("passed", testing.take_records())
    except pytest.skip.Exception as exc:
        return ("skipped", str(exc.msg))
    except BaseException as exc:  # everything goes back to the parent, never swallowed
        return outcome.failure(exc, getattr(exc, "rank_traceback", None) or traceback.format_exc())


def run_in_child(item) -> None:
    """The verdict on ``item``: its outcome from the jail (distlab/grading/jail.py), and where it passed,
    its recorded checks held here against the same test run on the reference (:func:`compare`)."""
    graded = getattr(item.config, "_jail_outcomes", {}).get(item.nodeid) or outcome.failure_text(
        "the test was not run in the grading jail")
    if graded[0] == "error":
        _raise(graded)
    reference = _cached(item)
    if reference is None:
        reference = reference_checks(item)  # skips (the bench's skip) or leaves the test out (the bench failed)
    if graded[0] == "skipped":
        raise AssertionError(f"the graded run skipped this test ({graded[1][:200]}) where the reference ran it: "
                             "a skip is the bench's to make (no GPU), so it counts as failed")
    compare(graded[1], reference)


def reference_checks(item) -> list[dict]:
    """The checks ``item`` records on the reference, run now in a forked child, and kept in the cache.

    The reference's own skip (no GPU here) skips the test. A reference run that fails is run once more
    (a busy machine); failing again, the test is left out of the score (skipped, saying why): a bench
    problem is never charged to the student."""
    folder = item.funcargs.get("tmp_path")
    before = _snapshot(folder)
    try:
        ran = _fork(item, impl="solutions")
        if ran[0] not in ("passed", "skipped"):
            _restore(folder, before)  # the second run starts from what the fixtures left, as the first did
            ran = _fork(item, impl="solutions")
    finally:
        if before is not None:
            shutil.rmtree(before, ignore_errors=True)
    if ran[0] == "skipped":  # on this machine the test cannot run (no GPU): nothing to compare
        _raise(ran)
    if ran[0] != "passed":
        pytest.skip(f"left out of the score: the same test on the reference failed twice ({str(ran[3])[:200]}), "
                    "so the graded run cannot be verified; a bench problem, not the submission's")
    path = _cache_path(item)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch.write_bytes(_dumps(ran[1]))
        os.replace(scratch, path)  # whole or absent: grading runs side by side share the cache
    except OSError:
        pass  # a read-only checkout: the next grading run runs the reference again
    return ran[1]


# The reference's checks depend on the tests, the reference and the bench only, not on the submission:
# kept per test under the instructor's checkout (root's alone once grading/gradescope/lockdown.sh ran;
# a learner's code may not write there, distlab/grading/sandbox.py), keyed by a digest of those files.
REPO = Path(__file__).resolve().parents[2]
CACHE_ENV = "DISTLAB_REFERENCE_CHECKS"  # another folder for it (default: .distlab/reference-checks)


@functools.lru_cache(maxsize=1)
def _bench_digest() -> str:
    root = REPO
    digest = hashlib.sha256()
    for folder in ("distlab", "solutions", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _cache_path(item) -> Path:
    folder = Path(os.environ.get(CACHE_ENV) or REPO / ".distlab" / "reference-checks")
    key = hashlib.sha256(item.nodeid.encode() + b"\0" + Path(item.path).read_bytes()).hexdigest()[:24]
    return folder / _bench_digest() / f"{key}.pt"


def _cached(item) -> list[dict] | None:
    """The reference's recorded checks for ``item``, or None: none kept, or a file that does not read
    (a disk that filled up, another torch): the reference then runs again and the file is rewritten."""
    try:
        return _loads(_cache_path(item).read_bytes())
    except Exception:
        return None


def _snapshot(folder) -> str | None:
    """A copy of the test's tmp_path as its fixtures left it (they may have written data there)."""
    if folder is None or not os.path.isdir(folder):
        return None
    copy = tempfile.mkdtemp(prefix="distlab-verdict-")
    shutil.copytree(folder, os.path.join(copy, "tmp"), symlinks=True)
    return copy


def _restore(folder, copy: str | None) -> None:
    if copy is None:
        return
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(os.path.join(copy, "tmp"), folder, symlinks=True)


def compare(graded: list[dict], reference: list[dict]) -> None:
    """The verdict, made here, in a process that never ran learner code.

    ``graded``: the checks the graded test recorded (its ranks' and its own, in order: distlab/testing.py),
    each an actual value, an expected one and a tolerance. ``reference``: the same test's checks on the
    reference, where no learner code ran. The two runs must make the same checks at the same places; each
    actual value must then be close to the reference run's expected value (its baseline, computed where the
    learner's code could not touch it), with the reference run's tolerance. A check whose expected value
    is the learner's own result too (``baseline=False``) is checked as recorded.
    """
    import torch

    def where(r: dict) -> str:
        return f"{r['site']}" + (f" in rank {r['rank']}" if r["rank"] is not None else "")

    for i, (g, r) in enumerate(zip(graded, reference)):
        if (g["site"], g["rank"]) != (r["site"], r["rank"]):
            raise AssertionError(f"check {i + 1}: the graded run checked at {where(g)} where the reference run "
                                 f"checked at {where(r)}: its ranks skipped or added checks (the test did not run "
                                 "as written)")
    if len(graded) != len(reference):
        raise AssertionError(f"the graded run made {len(graded)} checks, the same test on the reference "
                             f"{len(reference)}: its ranks skipped or added checks (the test did not run as written)")
    for g, r in zip(graded, reference):
        expected = r["expected"] if r["baseline"] else g["expected"]
        kind = r.get("kind", "close")
        if kind != g.get("kind", "close"):
            raise AssertionError(f"{r['what']} ({where(r)}): a {g.get('kind', 'close')} check reported for a {kind} one")
        if kind in ("equal", "at_most"):
            held = g["actual"] == expected if kind == "equal" else g["actual"] <= expected
            if not held:
                relation = "==" if kind == "equal" else "<="
                raise AssertionError(f"{g['what']} ({where(r)}): {g['actual']!r} reported, {relation} {expected!r} "
                                     "expected, found by the grader's process although the rank reported a pass")
            continue
        actual, rtol, atol = g["actual"], r["rtol"], r["atol"]
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise AssertionError(f"{r['what']} ({where(r)}): {tuple(actual.shape)} {actual.dtype} reported, "
                                 f"{tuple(expected.shape)} {expected.dtype} expected (checked by the grader's process)")
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError:
            raise AssertionError(f"{r['what']} ({where(r)}): max abs diff {testing.max_abs_diff(actual, expected):.3e} "
                                 f"(rtol={rtol}, atol={atol}){testing.diagnose(actual, expected)}, found by the grader's "
                                 "process although the rank reported a pass") from None


def _fork(item, impl: str | None = None) -> tuple:
    """The test body in a forked child (the graded implementation, or ``impl``); its outcome message."""
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
        message = _child_body(item, impl)
        try:
            payload = _dumps(message)
        except Exception as exc:
            payload = _dumps(outcome.failure_text(f"could not send the outcome: {exc}"))
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
    try:
        return _loads(payload)
    except Exception as exc:
        raise RuntimeError(f"the test's process sent an outcome the grader does not read: {str(exc)[:200]}") from None


# Between processes and in the cache: torch's format, read back with weights_only=True, which rebuilds
# tensors and plain values (tuples, lists, dicts, sets, strings, numbers) and nothing else. Unpickling
# what a process that ran learner code wrote could run code of its choosing in this one.
def _dumps(obj) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(payload: bytes):
    import torch

    return torch.load(io.BytesIO(payload), weights_only=True)


def _raise(message: tuple) -> None:
    if message[0] == "passed":
        return
    if message[0] == "skipped":
        pytest.skip(message[1])
    raise outcome.rebuild(message)  # the one rebuild (distlab/outcome.py)
