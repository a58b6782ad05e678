"""The one seam between the tests and the code under test.

``load("phase1_data_parallel", "collectives")`` returns either the reference
solution (``solutions/phase1_data_parallel/collectives.py``) or the learner's
template (``phase1_data_parallel/template_collectives.py``), from this repository
or from a student's copy elsewhere. The choice travels in environment variables
(set by ``pytest --impl ... --student-dir ...`` in distlab/pytest_plugin.py) because
spawned ranks re-import modules and inherit the environment, not pytest's options.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

from distlab import hooks, role

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


_CHECKED: set[str] = set()  # templates of this checkout that passed the integrity check


class IntegrityError(ImportError):
    """A template reaches for the reference solutions instead of implementing the exercise."""


def _forbidden_imports(path: Path) -> list[str]:
    """Names of ``solutions`` modules (or other templates) a file imports, statically or by string."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                re.fullmatch(r"(solutions|phase\d\w*)([./]\w+)*(\.py)?", node.value.strip()):
            names = [node.value.strip()]  # importlib.import_module("solutions..."), __import__, runpy
        found += [n for n in names if n.split(".")[0] == "solutions" or n.startswith("solutions/")
                  or ".template_" in n or "/template_" in n]
    return found


def _check_integrity(module: ModuleType, path: Path) -> None:
    """Refuse a template that imports reference solutions or other templates.

    Checked twice: the source (imports, and module names as strings for importlib tricks),
    and, after import, every function and class it holds (``from solutions.x import *``
    leaves objects whose ``__module__`` is ``solutions.x``, however the import was spelled).
    """
    where = f"{path.parent.name}/{path.name}"
    if bad := _forbidden_imports(path):
        raise IntegrityError(f"{where} imports {sorted(set(bad))}: a template may use torch and distlab only "
                             "(the exercise scores 0 until it implements the TODO itself)")
    for name, obj in vars(module).items():
        owner = getattr(obj, "__module__", None) or ""
        if isinstance(obj, ModuleType):
            owner = obj.__name__
        if owner != module.__name__ and (owner.split(".")[0] == "solutions" or ".template_" in owner):
            raise IntegrityError(f"{where}: `{name}` comes from {owner}: a template may use torch and distlab "
                                 "only (the exercise scores 0 until it implements the TODO itself)")


REFUSED = "the exercise scores 0 until the template implements its TODOs itself"


def _refuse_unless_clean(path: Path, phase: str, name: str) -> None:
    """The static rules (distlab/grading/isolation.py in a graded run), before a line of the template runs."""
    checks = hooks.template_checks()
    if checks is not None and (problems := checks.lint(path, phase, name)):
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise IntegrityError(f"{problems[0]}{more}: {REFUSED}")


def _exec_guarded(run, rel: str) -> None:
    """Run the template's import (``run``); then refuse it if it changed the bench or imported a solution.

    What it changed is put back first: a template graded in the same process as other exercises
    must not leave its patch behind for them.
    """
    checks = hooks.template_checks()
    after = checks.guard() if checks is not None else list  # list(): nothing changed
    before = set(sys.modules)
    run()
    changed = after()
    reached = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("solutions", "tests"))
    if changed:
        raise IntegrityError(f"{rel} changed the bench's {', '.join(changed)} when imported: {REFUSED}")
    if reached:
        raise IntegrityError(f"{rel} imported {reached}: {REFUSED}")


def load(phase: str, name: str, impl: str | None = None) -> ModuleType:
    """Import the implementation of ``phase``/``name`` that the run is grading.

    ``impl=None``: the graded implementation (``DISTLAB_IMPL``), from the student's copy when
    ``DISTLAB_STUDENT_DIR`` is set. ``impl="solutions"`` asked explicitly: the reference,
    always from this checkout, for tests that need a building block graded elsewhere.
    A template that imports the solutions raises IntegrityError.
    """
    explicit = impl is not None
    impl = impl or current_impl()
    if impl == "templates" and role.current() == role.GRADER:
        raise RuntimeError("a template loaded in pytest's own process of a graded run: the verdicts must come "
                           "from a process that never ran learner code (see distlab/grading/verdict.py)")
    dotted, rel = module_path(phase, name, impl)
    student_dir = None if explicit else os.environ.get(STUDENT_DIR_ENV)
    if not student_dir:
        if impl == "templates" and dotted not in sys.modules:
            path = Path(__file__).resolve().parent.parent / rel
            _refuse_unless_clean(path, phase, name)
            try:
                _exec_guarded(lambda: importlib.import_module(dotted), rel)
            except BaseException:
                sys.modules.pop(dotted, None)  # the next load raises again
                raise
        module = importlib.import_module(dotted)
        if impl == "templates" and dotted not in _CHECKED:
            # Once, as imported: a test may later patch a reference helper into the module.
            _check_integrity(module, Path(module.__file__))
            _CHECKED.add(dotted)
        return module
    path = Path(student_dir) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --student-dir must point at a copy of the repository")
    key = f"_student.{dotted}"
    if key in sys.modules:
        return sys.modules[key]
    if impl == "templates" and (bad := _forbidden_imports(path)):
        raise IntegrityError(f"{rel} imports {sorted(set(bad))}: a template may use torch and distlab only "
                             "(the exercise scores 0 until it implements the TODO itself)")
    if impl == "templates":
        _refuse_unless_clean(path, phase, name)
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        if impl == "templates":
            _exec_guarded(lambda: spec.loader.exec_module(module), rel)
        else:
            spec.loader.exec_module(module)
        if impl == "templates":
            _check_integrity(module, path)
    except BaseException:
        del sys.modules[key]  # the next load raises again instead of returning a half-imported module
        raise
    return module
