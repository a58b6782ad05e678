"""Inside a grading jail: each test's outcome, as data, for the grader outside (distlab/grading/jail.py).

Loaded by the jail's nested pytest (``-p distlab.grading.report``). Every check a test makes through
distlab.testing is recorded (in the test's process and in its ranks); after each test, its outcome goes to
``$DISTLAB_OUTCOMES/<i>.pt`` (``i``: the test's place in the node ids the jail was given) in torch's format,
made of tuples, strings, numbers and tensors only, so the grader reads it with ``weights_only=True``:

* ``("passed", records)``;
* ``("skipped", reason)``: the grader decides whether the skip was the bench's (distlab/grading/verdict.py);
* ``("error", module, qualname, message, traceback, is_todo)``.

Nothing here is trusted by the grader: learner code runs in this process and could write any file in
``out/``. What it cannot do is reach the reference, the grader's files or the grader's process.
"""
from __future__ import annotations

import io
import json
import os
import traceback

import pytest

from distlab import outcome, testing

OUT_ENV = "DISTLAB_OUTCOMES"


def pytest_configure(config):
    testing.start_recording()
    config._jail_order = {nodeid: i for i, nodeid in enumerate(json.loads(
        open(os.path.join(os.environ[OUT_ENV], "..", "nodeids.json")).read()))}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    testing.take_records()  # the next test's checks only


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    result = yield
    report = result.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _write(item, _message(report, call))


def _message(report, call) -> tuple:
    if report.passed:
        return ("passed", testing.take_records())
    if report.skipped:
        exc = call.excinfo.value if call.excinfo is not None else None
        return ("skipped", str(getattr(exc, "msg", "") or report.longrepr)[:1000])
    exc = call.excinfo.value if call.excinfo is not None else RuntimeError("failed")
    tb = getattr(exc, "rank_traceback", None) or "".join(traceback.format_exception(exc))[-6000:]
    return outcome.failure(exc, tb)


def _write(item, message: tuple) -> None:
    import torch

    index = item.config._jail_order.get(item.nodeid)
    if index is None:
        return
    buffer = io.BytesIO()
    try:
        torch.save(message, buffer)
    except Exception as exc:  # noqa: BLE001 - a record that does not save is the test's failure
        buffer = io.BytesIO()
        torch.save(outcome.failure_text(f"could not send the outcome: {exc}"), buffer)
    path = os.path.join(os.environ[OUT_ENV], f"{index}.pt")
    with open(path + ".tmp", "wb") as f:
        f.write(buffer.getvalue())
    os.replace(path + ".tmp", path)
