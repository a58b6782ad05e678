"""Every timeout nests inside the one around it: a run's deadline < its test's pytest-timeout < CI's.

A timeout that is longer than the one around it never fires: the outer one kills the test
first, without the inner one's message (which rank, which op). ``test_templates``'s module
fixture once gave its nested pytest 1500 s under pyproject's 300 s cap, and under load all 10
tests that share it errored with pytest-timeout's bare stack dump instead.

The check reads the test files: every literal ``timeout=`` / ``timeout_s=`` a test, a fixture or
a helper passes (``run_distributed``, ``subprocess.run``, ``Popen.wait``, ``_wait_for``, ...)
must be below the pytest-timeout of every test it runs in: the test's ``@pytest.mark.timeout``,
or the module's ``pytestmark``, or pyproject's ``timeout``. A fixture runs in the tests that
request it; a helper (any other function) in any test of its module. CI's own limit (90
minutes for install, suite and tour) is far above any single test's.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = sorted(Path(__file__).parent.glob("test_*.py"))
DEFAULT = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
CI_LIMIT_S = 90 * 60
MARGIN_S = 10  # the inner timeout's own report (the doctor's table, a nested run's results) needs time to arrive


def _timeout_marker(decorators) -> float | None:
    for d in decorators:
        if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "timeout"
                and d.args and isinstance(d.args[0], ast.Constant)):
            return float(d.args[0].value)
    return None


def _is_fixture(fn) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def _literal_timeouts(fn) -> list[tuple[int, str, float]]:
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("timeout", "timeout_s") and isinstance(kw.value, ast.Constant) \
                        and isinstance(kw.value.value, (int, float)):
                    out.append((node.lineno, ast.unparse(node.func), float(kw.value.value)))
    return out


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    module_limit = DEFAULT
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            module_limit = _timeout_marker(values) or module_limit
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    tests = {f.name: (_timeout_marker(f.decorator_list) or module_limit, {a.arg for a in f.args.args})
             for f in functions if f.name.startswith("test_")}
    problems = []
    for fn in functions:
        if fn.name in tests:
            limit = tests[fn.name][0]
        elif _is_fixture(fn):
            users = [lim for lim, args in tests.values() if fn.name in args]
            limit = min(users, default=module_limit)
        else:
            limit = max([lim for lim, _ in tests.values()], default=module_limit)
        if limit >= CI_LIMIT_S:
            problems.append(f"{path.name}::{fn.name}: pytest-timeout {limit:g} s is not below CI's {CI_LIMIT_S} s")
        for line, call, value in _literal_timeouts(fn):
            if value > limit - MARGIN_S:
                problems.append(f"{path.name}:{line} {fn.name}: {call}(timeout={value:g}) does not fit inside the "
                                f"test's pytest-timeout of {limit:g} s (with {MARGIN_S} s to report): lower it, or "
                                f"mark the test @pytest.mark.timeout(N) with a reason")
    return problems


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_every_timeout_nests_inside_its_tests_pytest_timeout(path):
    problems = _violations(path)
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_timeout_that_does_not_nest(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import pytest, subprocess\n\n@pytest.fixture(scope='module')\ndef nested():\n"
                   "    return subprocess.run(['true'], timeout=1500)\n\ndef test_a(nested):\n    pass\n")
    assert _violations(bad) and "timeout=1500" in _violations(bad)[0]
