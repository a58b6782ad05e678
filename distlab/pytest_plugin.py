"""The grading switch and the per-exercise score.

``pytest --impl solutions`` (default) tests the reference solutions;
``pytest --impl templates`` tests the learner's templates; ``--student-dir DIR``
tests a copy elsewhere. The choice becomes environment variables, because ranks
started by run_distributed re-import modules and inherit the environment, not
pytest's options (see distlab/loader.py).

Tests name their exercise with ``@pytest.mark.exercise("1.4-1.5")`` (its id in distlab/course.toml); the
run ends with a score per exercise, and ``--results-json PATH`` writes it in
Gradescope's format (see distlab/grading/grade.py). A test that checks code a template
gives away ready-made (argument validation, ...) is marked ``scaffold``.

This is a plugin, loaded by ``-p distlab.pytest_plugin`` in pyproject.toml's addopts,
not a conftest.py: pytest then knows ``--student-dir`` takes a value before it looks
for test paths, so ``--student-dir /path`` (with a space) is not mistaken for a test
path, and a student's copy that ships its own tests/conftest.py cannot register the
options a second time. What grading adds (the rules, the sandbox, the verdict's process,
``--record-reference``) is distlab/grading/plugin.py's, loaded beside it.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

from distlab.loader import IMPL_ENV, IMPLS, STUDENT_DIR_ENV
from distlab.todo import LearnerTODO

os.environ.setdefault("DISTLAB_STRICT_P2P", "1")  # NCCL's p2p rules checked in every rank (distlab/p2p.py); =0 turns it off

REPO = Path(__file__).resolve().parent.parent
WEIGHTS = REPO / "grading" / "weights.toml"


def pytest_addoption(parser):
    group = parser.getgroup("distlab")
    group.addoption("--impl", choices=IMPLS, default="solutions",
                    help="test the reference solutions (default) or the learner's templates")
    group.addoption("--student-dir", default=None,
                    help="grade the copy of the repository in DIR instead of this one")
    group.addoption("--results-json", default=None,
                    help="write per-exercise scores (Gradescope format) to this path")
    group.addoption("--weights", default=str(WEIGHTS), help="points per exercise (TOML, [weights] table)")


def pytest_configure(config):
    inipath = Path(config.inipath).resolve() if config.inipath else None
    if inipath != REPO / "pyproject.toml":
        if inipath is not None and (inipath.parent / "distlab").is_dir() \
                and "--student-dir" not in config.invocation_params.args:
            # Another clone's `pip install -r requirements.txt` (its `-e .`) points the installed distlab there.
            raise pytest.UsageError(f"the installed distlab is {REPO}'s, not this checkout's ({inipath.parent}): "
                                    f"a `pip install -r requirements.txt` there re-pointed it. Run `pip install -e .` "
                                    f"here, or run pytest from {REPO}")
        # "--student-dir /copy" (space) makes pytest take /copy for a test path and read the
        # copy's pyproject.toml: the student's configuration would then drive the grading.
        raise pytest.UsageError(f"these tests run with {REPO / 'pyproject.toml'}, not {inipath}: write "
                                "--student-dir=DIR (with '='), and run pytest from the instructor's checkout")
    os.environ[IMPL_ENV] = config.getoption("--impl")
    student_dir = config.getoption("--student-dir")
    if student_dir:
        os.environ[STUDENT_DIR_ENV] = os.path.abspath(student_dir)
    else:
        os.environ.pop(STUDENT_DIR_ENV, None)
    # Every torchrun agent and worker a test starts dies with this pytest, even when pytest is
    # SIGKILLed or ended by pytest-timeout's thread method (os._exit): see distlab.procs.tie_to.
    # A pytest run by a test (the template checks) dies with the outer one, then ties its own jobs.
    from distlab.procs import TIE_ENV, tie_to

    tie_to(os.environ.get(TIE_ENV))
    os.environ[TIE_ENV] = str(os.getpid())
    config.addinivalue_line("markers", "exercise(name): the exercise a test grades")
    config.addinivalue_line("markers", "scaffold: checks code that templates provide ready-made")
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without enough GPUs)")
    config._distlab_results = OrderedDict()
    config._distlab_collected = {}  # nodeid -> exercise, graded tests collected (selected or deselected)
    config._distlab_deselected = set()  # nodeids of those left out by -k, -m, --deselect, ...


class _OneLine:
    """A failure report of one line, also shown in pytest's short summary (``-rf``)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.reprcrash = SimpleNamespace(message=text.splitlines()[0] if text else "", path="", lineno=0)

    def toterminal(self, tw) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


UNGRADED = "bench"


def _exercise(item) -> str:
    from distlab.manifest import canonical

    marker = item.get_closest_marker("exercise")
    return canonical(marker.args[0]) if marker else UNGRADED  # by id ("1.4-1.5") or full name: the full name


def _first_line(excinfo) -> str:
    """The first non-empty line of the exception, or its type: an empty message must not crash grading."""
    from distlab.outcome import one_line  # pytest.raises(match=)'s miss: the pattern and the message

    lines = [line for line in one_line(str(excinfo.value)).splitlines() if line.strip()]
    return lines[0] if lines else f"{excinfo.type.__name__} (no message)"


def _note_collected(items) -> None:
    for item in items:
        if item.get_closest_marker("scaffold") is None:
            item.config._distlab_collected[item.nodeid] = _exercise(item)


def pytest_deselected(items):
    # -k, -m, --deselect, DISTLAB_EXERCISES: an exercise with some of its tests left out is scored partial.
    _note_collected(items)
    if items:
        items[0].config._distlab_deselected.update(item.nodeid for item in items)


def pytest_collection_finish(session):
    _note_collected(session.items)
    if session.items and not session.config.option.collectonly:
        start_forkserver()  # beside the first test's set-up; its timer waits for it (pytest_timeout_set_timer)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(LearnerTODO):
        # One line: which TODO, which guideline section. The traceback adds nothing.
        report.longrepr = _OneLine(str(call.excinfo.value))
    elif call.excinfo is not None and getattr(call.excinfo.value, "rank_traceback", None):
        # A rank failed: its message once, then its own frames (not the launcher's).
        exc = call.excinfo.value
        report.longrepr = _OneLine(f"{type(exc).__name__}: {exc}\n{exc.rank_traceback}")
    if report.when == "call" or (report.when == "setup" and not report.passed):
        error_type = call.excinfo.type.__name__ if call.excinfo is not None else None
        message = ""
        if report.failed:
            message = _first_line(call.excinfo) if call.excinfo else "failed"
            if call.excinfo is not None and not call.excinfo.errisinstance(LearnerTODO) \
                    and os.environ.get(IMPL_ENV) == "templates" and _exercise(item) != UNGRADED:
                from distlab.bugs import outside_edit_note  # given code edited: that leads the message

                if note := outside_edit_note(_exercise(item), os.environ.get(STUDENT_DIR_ENV) or REPO):
                    message, report.longrepr = f"{note}: {message}", _OneLine(f"{note}\n{report.longrepr}")
        item.config._distlab_results[item.nodeid] = {
            "exercise": _exercise(item), "outcome": report.outcome,
            "error_type": error_type, "message": message[:500],
            "scaffold": item.get_closest_marker("scaffold") is not None,
            "duration_s": round(report.duration, 3),
        }


def load_weights(path: str | Path = WEIGHTS) -> dict[str, float]:
    """Exercise name -> points: distlab/course.toml's, overridden by grading/weights.toml (the instructor's, by id)."""
    from distlab.manifest import weights

    return weights(path)


def exercise_scores(results: dict, weights: dict[str, float] | None = None, collected: dict[str, str] | None = None,
                    deselected: set[str] = frozenset()) -> "OrderedDict[str, dict]":
    """Per exercise: tests passed/run (scaffold tests excluded), points = weight * passed / run.

    ``collected`` (nodeid -> exercise: every graded test collected, deselected ones included) adds
    ``expected`` (its tests, less those skipped here) and ``partial``: fewer of them ran (``-k``, ``-x``),
    so ``points`` scores only the tests that ran, not the exercise; ``selected``: those not ``deselected``.
    """
    weights = load_weights() if weights is None else weights
    scores: OrderedDict[str, dict] = OrderedDict()
    for nodeid, r in results.items():
        if r["outcome"] == "skipped" or r.get("scaffold"):
            continue
        s = scores.setdefault(r["exercise"], {"passed": 0, "total": 0, "failures": [], "seconds": 0.0})
        s["total"] += 1
        s["seconds"] += r.get("duration_s", 0.0)
        if r["outcome"] == "passed":
            s["passed"] += 1
        else:
            s["failures"].append(f"{nodeid}: {r['message']}")
    for name, s in scores.items():
        # Tests with no exercise marker check the bench itself: listed, never graded.
        s["weight"] = 0.0 if name == UNGRADED else weights.get(name, 1.0)
        s["points"] = round(s["weight"] * s["passed"] / s["total"], 2)
        skipped = sum(1 for n, r in results.items() if r["exercise"] == name and r["outcome"] == "skipped")
        s["expected"] = max(s["total"], sum(1 for e in (collected or {}).values() if e == name) - skipped)
        s["partial"] = s["total"] < s["expected"]
        s["selected"] = s["expected"] - sum(1 for n in deselected if (collected or {}).get(n) == name)
    return scores


def score_line(name: str, s: dict) -> str:
    """One exercise's line in the summary; a partial one never shows its points as the exercise's."""
    # A TODO's own stub (distlab.todo: "TODO 1.6 ...: not implemented yet"), not a diagnosis that names one
    todos = sorted(set(re.findall(r"TODO (\d+\.\d+[a-z]?)\b[^\n]*?: not implemented yet", "\n".join(s["failures"]))))
    note = f"  <- unfinished: TODO {', '.join(todos)}" if todos else ""
    if name == UNGRADED:
        points = "  (not graded)"
    elif s.get("partial"):
        how = "selected" if s["selected"] == s["total"] else "run"  # -k; or -x, a crash, ...
        points = f"  partial ({s['total']} of {s['expected']} tests {how}): {s['points']:.2f}/{s['weight']:g} on these only"
    else:
        points = f"  {s['points']:>5.2f}/{s['weight']:g} points"
    return f"{name:<45} {s['passed']:>3}/{s['total']:<3} tests{points}{note}"


def gradescope_results(scores: "OrderedDict[str, dict]", results: dict, seconds: float) -> dict:
    """Gradescope's results.json: one test per exercise, visible, with its failures as output."""
    def output(s: dict) -> str:
        text = "\n".join(s["failures"]) or f"all {s['total']} tests passed"
        if s.get("partial"):
            text = f"partial: {s['total']} of {s['expected']} tests run; the score counts these only\n{text}"
        return text

    tests = [{"name": name, "score": s["points"], "max_score": s["weight"], "visibility": "visible",
              "execution_time": round(s["seconds"], 1), "output": output(s), "partial": bool(s.get("partial"))}
             for name, s in scores.items() if name != UNGRADED]
    return {"score": round(sum(t["score"] for t in tests), 2), "max_score": sum(t["max_score"] for t in tests),
            "execution_time": round(seconds, 1), "visibility": "visible", "stdout_visibility": "visible",
            "partial": any(t["partial"] for t in tests), "tests": tests, "per_test": results}


def pytest_sessionstart(session):
    session.config._distlab_start = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = config._distlab_results
    if not results:
        return
    scores = exercise_scores(results, load_weights(config.getoption("--weights")), config._distlab_collected,
                             config._distlab_deselected)
    tr = terminalreporter
    tr.section(f"score per exercise (--impl {config.getoption('--impl')})")
    for name, s in scores.items():
        tr.write_line(score_line(name, s))
    path = config.getoption("--results-json")
    if path:
        seconds = time.monotonic() - getattr(config, "_distlab_start", time.monotonic())
        with open(path, "w") as f:
            json.dump(gradescope_results(scores, results, seconds), f, indent=2)
        tr.write_line(f"wrote {path}")


# The launcher's forkserver imports torch (and the rest of spawn._context's preload) once per session: ~1.5 s on an
# idle laptop, over 300 s beside 8 busy processes on 2 cores (commit 7944a7c). That start is the session's, not the
# first distributed test's: it begins when collection ends, and the first timer is armed once it answers.
FORKSERVER = {"started": False, "ready_s": None}  # ready_s: seconds the first test's timer waited for it


def _ready() -> None:
    """A forkserver child that does nothing: its start means the server has imported its preload."""


def start_forkserver() -> None:
    """Start the launcher's forkserver (distlab.spawn), in the background, if this session imported the launcher."""
    if FORKSERVER["started"] or "distlab.spawn" not in sys.modules:
        return
    from multiprocessing import forkserver

    FORKSERVER["started"] = True
    sys.modules["distlab.spawn"]._context()  # its preload list, and its helpers stopped at exit
    forkserver._forkserver.ensure_running()  # the instance: a warm check's child replaces it (cockpit/warm.py)


def wait_for_forkserver() -> None:
    """Block until the forkserver started by ``start_forkserver`` answers (once): before a test's timer is armed,
    so that a busy machine's slow import of torch counts against no test's pytest-timeout."""
    if not FORKSERVER["started"] or FORKSERVER["ready_s"] is not None:
        return
    start = time.monotonic()
    try:
        child = sys.modules["distlab.spawn"]._context().Process(target=_ready, daemon=True)
        child.start()  # returns once the server has accepted: after its preload
        child.join()
    except Exception:  # a server that cannot start: the first run_distributed says why, within its test
        pass
    FORKSERVER["ready_s"] = time.monotonic() - start


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's limit times DISTLAB_TIMEOUT_SCALE, and when it fires for run_distributed (distlab/doctor_watch.py);
    armed after the launcher's forkserver is up (its first start is the session's, not this test's)."""
    from distlab.doctor_watch import set_test_timer

    wait_for_forkserver()
    return set_test_timer(item, settings)
