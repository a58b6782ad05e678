"""Every graded value check is recorded: no plain ``assert`` on tensors in a graded test.

A grading run compares what the ranks report against the reference run's checks in a process that never
ran learner code (distlab/grading/verdict.py); only checks made through distlab.testing's helpers
(assert_tensors_close, assert_equal, assert_at_most, ...) are reported. A plain ``assert torch.equal(mine,
expected)`` is decided in the process that ran the learner's code, where a submission can patch what it
calls. Read from the source: every function an exercise-marked test reaches (itself, its workers and
helpers in the same module, by name) in the phase test files.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Value functions and methods whose result, asserted plainly, is a tensor comparison.
TORCH_VALUE_FUNCTIONS = {"equal", "allclose", "isclose", "isfinite", "isnan", "isinf", "all", "any", "eq", "ne",
                         "count_nonzero"}
TENSOR_VALUE_METHODS = TORCH_VALUE_FUNCTIONS | {"item", "tolist", "sum", "max", "min", "abs", "norm", "mean"}
# Comparisons that raise without a record (distlab.testing.assert_tensors_close calls them after recording).
UNRECORDED = {"torch.testing.assert_close", "torch.testing.assert_allclose", "testing.assert_close"}


def _exercise_marked(fn: ast.FunctionDef) -> bool:
    return any("mark.exercise" in ast.unparse(d) for d in fn.decorator_list)


def _tensor_check(expr: ast.AST) -> str | None:
    """The first tensor comparison inside an assert's condition, as source, or None."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            root = node.func.value
            while isinstance(root, ast.Attribute):
                root = root.value
            is_torch = isinstance(root, ast.Name) and root.id == "torch"
            if (is_torch and node.func.attr in TORCH_VALUE_FUNCTIONS) or \
                    (not is_torch and node.func.attr in TENSOR_VALUE_METHODS):
                return ast.unparse(node)
    return None


def plain_tensor_asserts(source: str, filename: str = "?") -> list[str]:
    """``file:line: function: check`` for every plain assert on tensors reached from an exercise-marked test."""
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached, todo = set(), [f for f in functions.values() if _exercise_marked(f)]
    while todo:
        fn = todo.pop()
        if fn.name in reached:
            continue
        reached.add(fn.name)
        todo += [functions[n.id] for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in functions]
    found = []
    for name in sorted(reached):
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Assert) and (check := _tensor_check(node.test)):
                found.append(f"{filename}:{node.lineno}: {name}: assert {check}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in UNRECORDED:
                found.append(f"{filename}:{node.lineno}: {name}: {ast.unparse(node.func)}(...)")
    return found


def test_graded_tests_check_tensors_only_through_recorded_helpers():
    found = []
    for path in sorted(TESTS.glob("test_phase*.py")):
        found += plain_tensor_asserts(path.read_text(), path.name)
    assert not found, ("plain asserts on tensors in graded tests (use distlab.testing's assert_tensors_close, "
                       "assert_equal, ... so the grader's process checks them):\n" + "\n".join(found))


SAMPLE = '''
import pytest, torch
from distlab.testing import assert_tensors_close


def _worker(rank, world_size):
    mine = torch.ones(2)
    assert torch.equal(mine, torch.ones(2)), "plain"
    assert mine.allclose(torch.ones(2))
    assert_tensors_close(mine, torch.ones(2), "recorded", rtol=0, atol=0)
    assert mine.shape == (2,)  # a shape: a plain value, not a tensor comparison
    torch.testing.assert_close(mine, torch.ones(2))


def _unreached():
    assert torch.equal(torch.ones(1), torch.ones(1))


@pytest.mark.exercise("3.2")
def test_x():
    run_distributed(_worker, 2)
'''


def test_the_scan_finds_plain_tensor_asserts_in_workers_of_marked_tests():
    assert plain_tensor_asserts(SAMPLE, "t.py") == [
        "t.py:8: _worker: assert torch.equal(mine, torch.ones(2))",
        "t.py:9: _worker: assert mine.allclose(torch.ones(2))",
        "t.py:12: _worker: torch.testing.assert_close(...)"]
