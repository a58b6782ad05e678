"""The one seam between the tests and the code under test.

``load("phase1_data_parallel", "collectives")`` returns either the reference
solution (``solutions/phase1_data_parallel/collectives.py``) or the learner's
template (``phase1_data_parallel/template_collectives.py``), from this repository
or from a student's copy elsewhere. The choice travels in environment variables
(set by ``pytest --impl ... --student-dir ...`` in tests/conftest.py) because
spawned ranks re-import modules and inherit the environment, not pytest's options.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

IMPL_ENV = "DISTLAB_IMPL"
STUDENT_DIR_ENV = "DISTLAB_STUDENT_DIR"
IMPLS = ("solutions", "templates")


def current_impl() -> str:
    impl = os.environ.get(IMPL_ENV, "solutions")
    if impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r}: expected one of {IMPLS}")
    return impl


def module_path(phase: str, name: str, impl: str | None = None) -> tuple[str, str]:
    """Return (dotted module name, path relative to the repository root)."""
    impl = impl or current_impl()
    if impl == "solutions":
        return f"solutions.{phase}.{name}", f"solutions/{phase}/{name}.py"
    return f"{phase}.template_{name}", f"{phase}/template_{name}.py"


def load(phase: str, name: str, impl: str | None = None) -> ModuleType:
    """Import the implementation of ``phase``/``name`` that the run is grading."""
    dotted, rel = module_path(phase, name, impl)
    student_dir = os.environ.get(STUDENT_DIR_ENV)
    if not student_dir:
        return importlib.import_module(dotted)
    path = Path(student_dir) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --student-dir must point at a copy of the repository")
    key = f"_student.{dotted}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
