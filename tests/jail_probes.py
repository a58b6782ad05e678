"""Probes of the grading jail's walls, run INSIDE a jail by tests/test_jail.py (not collected by the suite:
the name does not match test_*.py). Each probe tries what a submission would, and passes only where the
wall held. What to probe comes in the environment (DISTLAB_PROBE_*), set by the test outside."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch


def _paths(name: str) -> list[str]:
    return json.loads(os.environ.get(name, "[]"))


def test_the_checkout_the_reference_and_the_cache_are_out_of_sight():
    for path in _paths("DISTLAB_PROBE_HIDDEN"):
        for spelling in (path, f"/proc/1/root{path}", f"/proc/self/cwd/../../../..{path}", "/" + path):
            assert not os.path.exists(spelling), f"{spelling} is visible from the jail"
    # The reference: only the building blocks graded tests still take from it (jail.BUILDING_BLOCKS)
    present = sorted(str(p.relative_to("solutions").with_suffix("")) for p in Path("solutions").rglob("*.py")
                     if p.name != "__init__.py")
    assert present == sorted(_paths("DISTLAB_PROBE_BUILDING_BLOCKS")), present
    # ... and of them, nothing of the reference of the jail's own exercise (jail.reference_for)
    own = set(_paths("DISTLAB_PROBE_OWN_REGION_LINES"))
    for path in Path("solutions").rglob("*.py"):
        shown = own & {line.strip() for line in path.read_text().splitlines()}
        assert not shown, f"{path} shows the jail's own exercise's reference: {sorted(shown)[:2]}"
    for name in ("solutions.phase1_data_parallel", "solutions.phase5_large_models"):
        try:
            assert importlib.util.find_spec(name) is None, f"{name} is importable from the jail"
        except ModuleNotFoundError:
            pass


def test_nothing_outside_the_scratch_is_writable():
    # torch writes files from C++ (no audit hook sees it): the file system itself must refuse.
    for folder in [os.getcwd(), os.path.join(os.getcwd(), "tests"), *_paths("DISTLAB_PROBE_WRITABLE_HOST")]:
        target = os.path.join(folder, "conftest_planted.py")
        with pytest.raises(RuntimeError):
            torch.from_file(target, shared=True, size=16, dtype=torch.uint8)
        with pytest.raises(OSError):
            open(target, "w").close()
    scratch = os.path.join(os.environ["HOME"], "mine.bin")  # its own scratch: writable
    torch.from_file(scratch, shared=True, size=16, dtype=torch.uint8)[0] = 1


def test_it_runs_without_privileges():
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    assert int(status["CapEff"].strip(), 16) == 0, status["CapEff"]
    assert int(status["CapBnd"].strip(), 16) == 0 or os.geteuid() != 0, status["CapBnd"]
    assert status["NoNewPrivs"].strip() == "1"
    expected = os.environ.get("DISTLAB_PROBE_UID")
    if expected:
        assert os.geteuid() == int(expected) and os.getuid() == int(expected)


def test_its_processes_see_only_the_jail():
    # A PID namespace of its own: PID 1 is the jail's first process (it ends everything when it ends),
    # and no process of the host is in sight to signal or to read.
    assert "jail_enter" in open("/proc/1/cmdline").read()
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    cmdlines = [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in pids]
    assert not [c for c in cmdlines if "DISTLAB_PROBE_MARK_OUTSIDE" in c], cmdlines


def test_the_graders_environment_stays_outside():
    assert "DISTLAB_PROBE_SECRET_OUTSIDE" not in os.environ
