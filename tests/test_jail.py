"""The grading jail's walls (distlab/grading/jail.py), each probed from inside a real jail, and what comes
out of it read as data. The probes are tests/jail_probes.py; one jail runs them all (about 10 s)."""
from __future__ import annotations

import json
import os
import pickle
import pwd
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from distlab.grading import jail

REPO = Path(__file__).resolve().parent.parent
PROBES = ["test_the_checkout_the_reference_and_the_cache_are_out_of_sight", "test_nothing_outside_the_scratch_is_writable",
          "test_it_runs_without_privileges", "test_its_processes_see_only_the_jail",
          "test_the_graders_environment_stays_outside"]


@pytest.fixture
def host_folder():
    """A folder of the host anyone may write to, outside every path the jail covers (/tmp is covered)."""
    if os.geteuid() != 0:
        yield None
        return
    folder = Path("/opt") / f"distlab-probe-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


OWN_EXERCISE = "3.15-3.18 ZeRO, the probes' exercise"  # its regions live in two building blocks (zero, fsdp)


def _own_region_lines(ids: set[str]) -> list[str]:
    """The code lines of the building blocks' regions of ``ids`` that appear nowhere else in those files."""
    from distlab.regions import BEGIN, END

    own, other = set(), set()
    for block in jail.BUILDING_BLOCKS:
        inside = None
        for line in (REPO / "solutions" / f"{block}.py").read_text().splitlines():
            if m := BEGIN.match(line):
                inside = m["id"].rstrip("abcdefghijklmnopqrstuvwxyz")
            elif END.match(line):
                inside = None
            else:
                (own if inside in ids else other).add(line.strip())
    return sorted(line for line in own - other if len(line) > 20 and not line.startswith("#"))


@pytest.mark.venv  # .ci/venv_tier: again from a venv in /tmp (kept inside the jail) and as a user (a user namespace)
def test_every_wall_holds_from_inside(tmp_path, monkeypatch, host_folder):
    student = tmp_path / "student"
    (student / "phase1_data_parallel").mkdir(parents=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "checks.pt").write_bytes(b"recorded answers")
    monkeypatch.setenv("DISTLAB_REFERENCE_CHECKS", str(cache))
    monkeypatch.setenv("DISTLAB_PROBE_SECRET_OUTSIDE", "a token")
    hidden = [str(REPO / "solutions" / "phase1_data_parallel" / "collectives.py"), str(REPO / "grading" / "weights.toml"),
              str(REPO / "tests" / "test_phase1.py"), str(cache / "checks.pt"), str(student)]
    own = _own_region_lines(jail.exercise_ids(OWN_EXERCISE))
    assert len(own) >= 10, own  # the probe has something to look for in zero.py and fsdp.py
    env = {"DISTLAB_PROBE_HIDDEN": json.dumps(hidden), "DISTLAB_PROBE_BUILDING_BLOCKS": json.dumps(jail.BUILDING_BLOCKS),
           "DISTLAB_PROBE_OWN_REGION_LINES": json.dumps(own),
           "DISTLAB_PROBE_WRITABLE_HOST": json.dumps([str(host_folder)] if host_folder else []),
           "DISTLAB_PROBE_UID": str(pwd.getpwnam("nobody").pw_uid) if os.geteuid() == 0 else ""}
    cell = jail.Jail(student)
    try:
        outcomes = cell.run([f"tests/jail_probes.py::{name}" for name in PROBES], 240, log=lambda line: None, env=env,
                            exercise=OWN_EXERCISE)
    finally:
        cell.close()
    failed = {name: o[3] for name, o in outcomes.items() if o[0] != "passed"}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    if host_folder:
        assert not list(host_folder.iterdir()), "the jail wrote to the host"
    assert not (REPO / "tests" / "conftest_planted.py").exists()


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/distlab-outcome-ran-code",))


def test_an_outcome_is_read_as_data_never_unpickled(tmp_path):
    """A test in the jail could write any bytes as its outcome: a pickle that runs code, a link to a file of
    the grader's, a huge file. Each is refused as a failure; none runs code or passes."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "0.pt").write_bytes(pickle.dumps(("passed", [_RunsCode()])))
    os.symlink("/etc/hostname", out / "1.pt")
    torch.save(("passed", "not a list of checks"), out / "2.pt")
    torch.save(("passed", []), out / "3.pt")
    outcomes = jail.read_outcomes(out, ["a", "b", "c", "d", "e"])
    assert not os.path.exists("/tmp/distlab-outcome-ran-code")
    assert outcomes["a"][0] == outcomes["c"][0] == "error" and "refused" in outcomes["a"][3], outcomes
    assert "b" not in outcomes and "e" not in outcomes  # a link is not followed; nothing written: no outcome
    assert outcomes["d"] == ("passed", [])


def test_a_missing_jail_is_said_and_nothing_graded(monkeypatch):
    monkeypatch.setattr(jail.shutil, "which", lambda name: None)
    with pytest.raises(jail.JailUnavailable, match="nothing is graded"):
        jail.identity()


# --------------------------------------------------------------------------- the verdict on what came out
class _Item:
    """What the verdict reads of a pytest item: its node id, its outcome from the jail, its fixtures."""

    def __init__(self, outcome: tuple) -> None:
        self.nodeid, self.funcargs = "tests/test_x.py::test_x", {}
        self.config = type("Config", (), {"_jail_outcomes": {self.nodeid: outcome}})()


def _reference_runs(monkeypatch, *outcomes) -> list:
    from distlab.grading import verdict

    runs = list(outcomes)
    calls = []
    monkeypatch.setattr(verdict, "_cached", lambda item: None)
    monkeypatch.setattr(verdict, "_cache_path", lambda item: Path("/nonexistent/x/y.pt"))
    monkeypatch.setattr(verdict, "_fork", lambda item, impl=None: calls.append(impl) or runs.pop(0))
    return calls


def _verdict(outcome: tuple) -> str:
    """The verdict as a word and its reason (a skip caught here: it would otherwise skip this test itself)."""
    from distlab.grading import verdict

    try:
        verdict.run_in_child(_Item(outcome))
    except pytest.skip.Exception as exc:
        return f"skipped: {exc.msg}"
    except AssertionError as exc:
        return f"failed: {exc}"
    return "passed"


def test_a_skip_in_the_graded_run_counts_as_failed(monkeypatch):
    """A learner's `pytest.skip()` removed the test from the exercise's denominator: it now fails, unless
    the reference run skips too (the bench's own skip: no GPU here)."""
    _reference_runs(monkeypatch, ("passed", []))
    assert _verdict(("skipped", "not today")).startswith("failed: the graded run skipped this test (not today)")
    _reference_runs(monkeypatch, ("skipped", "needs 2 GPUs"))
    assert _verdict(("skipped", "needs 2 GPUs")) == "skipped: needs 2 GPUs"


def test_a_reference_run_that_fails_is_run_again_then_left_out_never_charged(monkeypatch):
    timeout = ("error", "builtins", "TimeoutError", "ranks [1] did not finish within 60 s", "", False)
    calls = _reference_runs(monkeypatch, timeout, ("passed", []))
    assert _verdict(("passed", [])) == "passed"  # the second reference run passed: the graded run is verified
    assert calls == ["solutions", "solutions"]
    _reference_runs(monkeypatch, timeout, timeout)
    assert _verdict(("passed", [])).startswith("skipped: left out of the score: the same test on the reference failed twice")


def test_one_result_type_and_one_rebuild():
    """Reports of a failure are built by distlab/outcome.py's failure() and turned back into exceptions by its
    rebuild() alone (there were five builders and two rebuilds, which drifted apart)."""
    built, rebuilt = [], []
    for path in sorted((REPO / "distlab").rglob("*.py")):
        text = path.read_text()
        if path.name == "outcome.py":
            continue
        if '("error", "' in text or "('error', '" in text:
            built.append(str(path.relative_to(REPO)))
        if "getattr(builtins, qualname" in text:
            rebuilt.append(str(path.relative_to(REPO)))
    assert not built and not rebuilt, f"failure reports built outside distlab/outcome.py: {built}; rebuilt: {rebuilt}"
