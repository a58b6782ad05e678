"""The ``# noqa`` marks of a generated template: names its scaffold keeps only for a TODO region.

An untouched template misses its regions' code, so a linter would flag what only a region uses:
an unused import (F401), a local assigned but never read (F841), a name only a region defines
(F821). ``_lint_marks`` finds those lines and ``_with_marks`` appends ``# noqa: <code> (<name>: for
TODO x.y)`` (or ``set by TODO x.y``) to each, so ``flake8 --select F`` and ``ruff`` stay quiet and
the learner reads which exercise the name is there for. Used by ``distlab.templates.render``.
"""
from __future__ import annotations

import ast
import builtins
import re

from distlab.regions import TODO_BEGIN


Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.Module


def _bound(scope: Scope) -> dict[str, list[tuple[int, str]]]:
    """Names bound directly in ``scope`` (not in a nested function): {name: [(line, kind)]},
    kind "import", "assign" (what a linter reports when never read) or "other" (a loop
    variable, a parameter, a def: never reported)."""
    found: dict[str, list[tuple[int, str]]] = {}

    def bind(name: str, lineno: int, kind: str = "other") -> None:
        found.setdefault(name, []).append((lineno, kind))

    if not isinstance(scope, ast.Module):
        for a in [*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs,
                  scope.args.vararg, scope.args.kwarg]:
            if a is not None:
                bind(a.arg, a.lineno)
    assigned = set()
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.withitem)):
            targets = getattr(node, "targets", None) or [getattr(node, "target", None) or node.optional_vars]
            for t in targets:
                # a, b = f() unpacks without being reported; a, b = f(), g() is two assignments
                if isinstance(t, ast.Name) or isinstance(getattr(node, "value", None), (ast.Tuple, ast.List)):
                    assigned |= {id(n) for n in ast.walk(t)}
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bind(node.id, node.lineno, "assign" if id(node) in assigned else "other")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bind((alias.asname or alias.name).split(".")[0], node.lineno, "import")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, node.lineno)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bind(node.name, node.lineno)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                bind(name, node.lineno)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
        elif not isinstance(node, ast.Lambda):
            todo.extend([*node.decorator_list, *getattr(node, "bases", [])])
    return found


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope``, not descending into the bodies of nested functions."""
    for node in ast.iter_child_nodes(scope):
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _own_nodes(node)


def _loads(scope: ast.AST) -> set[str]:
    """Names ``scope`` reads, its nested functions included unless they bind the name themselves."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found |= _loads(node) - set(_bound(node))
            if not isinstance(node, ast.Lambda):
                found |= set().union(*(_loads(d) for d in node.decorator_list))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found.add(node.id)
        else:
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)  # x += 1 reads x
            found |= _loads(node)
    return found


def _lint_marks(text: str, names: dict[str, tuple[set[str], set[str]]]) -> dict[int, list[tuple[str, str, str]]]:
    """Lines of a rendered template a linter would flag because a region is missing.

    Returns {line number: [(code, name, "for TODO x.y" or "set by TODO x.y")]} for: an
    import only a region uses (F401), a local only a region reads (F841), and a name only a
    region binds, read after it (F821). A region belongs to the innermost function holding
    its ``# --- TODO`` marker (module imports serve them all); anything else a linter finds
    is a real mistake and left alone.
    """
    tree = ast.parse(text)
    lines = text.splitlines()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]

    def span(scope: Scope) -> tuple[int, int]:
        return (1, len(lines)) if scope is tree else (scope.lineno, scope.end_lineno)

    def within(inner: Scope, outer: Scope) -> bool:
        return span(outer)[0] <= span(inner)[0] and span(inner)[1] <= span(outer)[1]

    def innermost(lineno: int) -> Scope:
        holding = [f for f in functions if span(f)[0] <= lineno <= span(f)[1]]
        return min(holding, key=lambda f: span(f)[1] - span(f)[0], default=tree)

    owner = {m["id"]: innermost(lineno) for lineno, line in enumerate(lines, 1) if (m := TODO_BEGIN.match(line))}
    builtin_names = set(dir(builtins)) | {"__file__", "__name__", "__doc__"}
    marks: dict[int, list[tuple[str, str, str]]] = {}

    def users(scope: Scope, name: str, stored: bool) -> list[str]:
        return [rid for rid, where in owner.items()
                if (scope is tree or where is scope) and name in names.get(rid, (set(), set()))[stored]]

    for scope in [tree, *functions]:
        loads = _loads(scope)
        params = set() if scope is tree else {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        bound = _bound(scope)
        for name, where in bound.items():
            if name in loads or name in params or not (ids := users(scope, name, stored=False)):
                continue
            for lineno, kind in where:
                if kind == "import" or (kind == "assign" and scope is not tree):  # module globals are never "unused"
                    _add(marks, lineno, ("F401" if kind == "import" else "F841", name, f"for TODO {', '.join(ids)}"))
        if scope is tree:
            continue
        visible = builtin_names.union(bound, *(_bound(s) for s in [tree, *functions] if s is not scope and within(scope, s)))
        for node in _own_nodes(scope):  # a nested function is checked as its own scope
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in visible:
                if ids := users(scope, node.id, stored=True):
                    _add(marks, node.lineno, ("F821", node.id, f"set by TODO {', '.join(ids)}"))
    return marks


def _add(marks: dict[int, list[tuple[str, str, str]]], lineno: int, mark: tuple[str, str, str]) -> None:
    if mark not in marks.setdefault(lineno, []):
        marks[lineno].append(mark)


def _with_marks(text: str, marks: dict[int, list[tuple[str, str, str]]]) -> str:
    lines = text.splitlines()
    for lineno, found in marks.items():
        codes = sorted({code for code, _, _ in found})
        whys: dict[str, list[str]] = {}
        at = {name: m.start() if (m := re.search(rf"\b{name}\b", lines[lineno - 1])) else 0 for _, name, _ in found}
        for _, name, why in sorted(found, key=lambda f: at[f[1]]):  # names in the order the line has them
            whys.setdefault(why, []).append(name)
        said = "; ".join(f"{', '.join(ns)}: {why}" for why, ns in whys.items())
        lines[lineno - 1] += f"  # noqa: {', '.join(codes)} ({said})"
    return "\n".join(lines) + "\n"
