"""The suite in the Python a user has: a venv or not, a second clone, root or an unprivileged user.

The tests that build a Python environment of their own (the SLURM stand-ins, the SLURM and Terraform
startup of the cluster tier, the locked-down grading bundle) go through tests/python_env.py, whose
environments see this interpreter's packages however it was installed. ``.ci/run``'s venv tier runs them
(marked ``venv``) once more from a venv it makes, and as an unprivileged user where the machine allows.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from python_env import make_venv

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.venv


def test_a_venv_the_tests_make_imports_this_environments_torch(tmp_path):
    """``--system-site-packages`` alone, from a venv, sees the base interpreter's packages (no torch there)."""
    venv = make_venv(tmp_path / "venv")
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys, torch; print(sys.prefix, torch.__file__)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, f"the venv made from {sys.executable} has no torch: {probe.stderr[-1500:]}"
    prefix, where = probe.stdout.split()
    assert Path(prefix) == venv, f"{venv}/bin/python runs as {prefix}: not a venv"
    assert Path(where).resolve() == Path(torch.__file__).resolve(), f"the venv imports {where}, not {torch.__file__}"


def test_a_checkout_whose_installed_distlab_is_another_clones_says_so(tmp_path):
    """A second clone's ``pip install -r requirements.txt`` (``-e .``) re-points the installed distlab; pytest
    in the first clone (the ``pytest`` command: the checkout itself is not on sys.path) then says what happened."""
    clone = tmp_path / "clone"
    (clone / "tests").mkdir(parents=True)
    (clone / "distlab").mkdir()
    (clone / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (clone / "tests" / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    runner = tmp_path / "pytest_command.py"  # like the console script: its own folder first on sys.path, not cwd
    runner.write_text("import sys\nimport pytest\nsys.exit(pytest.main())\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # distlab from REPO: the install another clone points to
    proc = subprocess.run([sys.executable, str(runner), "-p", "no:cacheprovider", "tests"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert f"the installed distlab is {REPO}'s, not this checkout's ({clone.resolve()})" in out, out[-2000:]
    assert "Run `pip install -e .` here, or run pytest from" in out, out[-2000:]
    assert "--student-dir" not in out, f"nothing to do with --student-dir:\n{out[-2000:]}"
