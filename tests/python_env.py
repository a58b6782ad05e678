"""Python environments the tests build: each one sees this interpreter's packages, however it was installed.

``python -m venv --system-site-packages`` sees the *base* interpreter's site-packages. Run from a root
Python without a venv (CI), that is this environment; run from a venv made as the README says, it is the
Python the venv was made from, which has no torch. A venv made here adds this environment's site
directories through a ``.pth`` file (``site.addsitedir``, so their own ``.pth`` files, an editable
install's included, are read as they are here), after the venv's own and before the base's.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

PTH_NAME = "distlab-tests-parent-env.pth"


def interpreter_dirs() -> list[str]:
    """The directories this interpreter runs from: the base installation's and the venv's, the outermost of each."""
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs))


def site_dirs() -> list[str]:
    """This environment's site directories, in the order this interpreter searches them."""
    known = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    real = {os.path.realpath(d) for d in known}
    return [d for d in dict.fromkeys(sys.path) if d and os.path.realpath(d) in real and os.path.isdir(d)]


def pth_text() -> str:
    """A ``.pth`` file's text that adds this environment's site directories to another interpreter's path."""
    return "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs())


def make_venv(path: Path, pip: bool = False) -> Path:
    """A venv at ``path`` whose python imports what this one imports (torch included), venv or not.

    Without ``pip`` it has none of its own (``--without-pip``): a second or so instead of ten.
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", *([] if pip else ["--without-pip"]),
                    str(path)], check=True, capture_output=True, timeout=120)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([str(path / "bin" / "python"), "-c", where], check=True, capture_output=True, text=True,
                             timeout=60).stdout.strip()
    (Path(purelib) / PTH_NAME).write_text(pth_text())
    return path
