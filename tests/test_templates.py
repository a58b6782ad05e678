"""Templates mirror solutions, and untouched templates fail every test cleanly.

1. Every public name of every ``phaseN_*/template_<x>.py`` exists in
   ``solutions/phaseN_*/<x>.py`` with the same signature (methods of public classes
   included), so a learner's finished template drops in where the solution was.
2. Running a phase's tests with ``--impl templates`` on the untouched templates makes
   every test fail with ``LearnerTODO`` (not another error, not a hang), within
   seconds; tests marked ``scaffold`` check code the template gives away and pass.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = sorted(REPO.glob("phase*/template_*.py"))
PHASE_TESTS = sorted((REPO / "tests").glob("test_phase*.py"))


def _public_api(module) -> dict[str, str]:
    """name -> signature text, for functions and classes defined in ``module`` (and public methods)."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            api[name] = str(inspect.signature(obj))
        elif inspect.isclass(obj):
            api[name] = "class"
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__call__"):
                    continue
                if inspect.isfunction(member):
                    api[f"{name}.{attr}"] = str(inspect.signature(member))
    return api


def _module_names(module) -> set[str]:
    """Names defined at module level (functions, classes, constants), imports excluded."""
    return {name for name, obj in vars(module).items()
            if not name.startswith("__") and not inspect.ismodule(obj)
            and getattr(obj, "__module__", module.__name__) == module.__name__}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_there_are_templates():
    assert TEMPLATES, "no phase*/template_*.py found"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_template_api_matches_solution(template):
    solution = REPO / "solutions" / template.parent.name / template.name.removeprefix("template_")
    assert solution.is_file(), f"{template} has no solution at {solution}"
    tmod = importlib.import_module(f"{template.parent.name}.{template.stem}")
    smod = importlib.import_module(f"solutions.{template.parent.name}.{solution.stem}")
    t_api, s_api = _public_api(tmod), _public_api(smod)
    missing = sorted(set(t_api) - set(s_api))
    assert not missing, f"{template.name}: public names missing from the solution: {missing}"
    for name, sig in t_api.items():
        assert s_api[name] == sig, f"{template.name}: {name}{sig} != solution's {name}{s_api[name]}"
    extra = sorted(set(s_api) - set(t_api))
    assert not extra, f"{solution.name}: public names missing from the template: {extra}"
    # Scaffolding too: a private helper or constant the solution defines (a message tag,
    # a window size) must be given to the learner, not left for them to guess.
    missing_private = sorted(_module_names(smod) - _module_names(tmod))
    assert not missing_private, f"{template.name}: the solution's {missing_private} are missing from the template"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_template_imports_no_solution_and_no_other_template(template):
    bad = sorted(m for m in _imports(template)
                 if m.startswith("solutions") or ".template_" in m or m.startswith("phase"))
    assert not bad, f"{template} imports {bad}: templates may use distlab and torch only"


@pytest.mark.parametrize("test_file", PHASE_TESTS, ids=lambda p: p.name)
def test_untouched_templates_fail_with_learner_todo(test_file, tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "pytest", str(test_file), "--impl=templates", f"--results-json={out}",
           "-q", "-p", "no:cacheprovider", "--timeout=60"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.is_file(), f"pytest wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    per_test = json.loads(out.read_text())["per_test"]
    assert per_test, f"no tests ran from {test_file.name}"
    problems = []
    for nodeid, r in per_test.items():
        if r["scaffold"]:
            if r["outcome"] != "passed":
                problems.append(f"{nodeid}: scaffold test should pass on templates, got {r['error_type']}: {r['message']}")
        elif r["outcome"] != "failed" or r["error_type"] != "LearnerTODO":
            problems.append(f"{nodeid}: expected LearnerTODO, got {r['outcome']} "
                            f"({r['error_type']}: {r['message'][:200]})")
        elif r["duration_s"] > 20:
            problems.append(f"{nodeid}: took {r['duration_s']} s to fail; a TODO must fail within seconds")
    assert not problems, "\n".join(problems)
