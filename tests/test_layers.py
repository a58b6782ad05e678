"""The import graph of distlab/, read from the source: no cycle, and grading sits above the bench.

Every import counts, wherever it is written (a module's top, inside a function), absolute or relative,
and so does a module named by a string literal to ``importlib.import_module`` or ``__import__``. The
bench (distlab/ outside distlab/grading/) never imports distlab.grading: where it needs grading at run
time it offers hooks (distlab/hooks.py) that distlab/grading/attach.py fills in.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GRADING = "distlab.grading"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, name: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of everything the module ``name`` imports; ``from a import b`` gives ``a.b``,
    which :func:`_resolve` turns into ``a`` where ``b`` is not a module."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                found.append((node.args[0].value, node.lineno))
    return found


def _resolve(dotted: str, modules: set[str]) -> str | None:
    """The distlab module a dotted import name lands in (the longest prefix that is one), or None."""
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, for every module of the ``distlab`` package under ``root``."""
    paths = {_module_name(p, root): p for p in sorted((root / "distlab").rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        edges = {}
        for dotted, line in _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py"):
            target = _resolve(dotted, set(paths))
            if target is not None and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def bench_imports_of_grading(graph: dict[str, dict[str, int]]) -> list[str]:
    def in_grading(m: str) -> bool:
        return m == GRADING or m.startswith(GRADING + ".")

    return [f"{m.replace('.', '/')}.py:{line} imports {t}" for m, edges in sorted(graph.items()) if not in_grading(m)
            for t, line in sorted(edges.items()) if in_grading(t)]


def test_distlab_has_no_import_cycle():
    found = cycles(import_graph(REPO))
    assert not found, "import cycles in distlab/ (counting imports inside functions): " + "; ".join(
        " -> ".join(c) for c in found)


def test_no_bench_module_imports_grading():
    graph = import_graph(REPO)
    assert any(m.startswith(GRADING + ".") for m in graph), "distlab/grading/ holds no module: the check sees nothing"
    bad = bench_imports_of_grading(graph)
    assert not bad, "the bench imports grading (it should offer a hook in distlab/hooks.py instead):\n" + "\n".join(bad)


def test_the_check_sees_deferred_relative_and_string_imports(tmp_path):
    """The reader itself: an import inside a function, a relative one, and import_module's literal all count."""
    pkg = tmp_path / "distlab"
    (pkg / "grading").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "grading" / "__init__.py").write_text("")
    (pkg / "grading" / "verdict.py").write_text("from ..a import x\n")
    (pkg / "a.py").write_text("def f():\n    from .b import y\n")
    (pkg / "b.py").write_text("import importlib\n\ndef g():\n    importlib.import_module('distlab.a')\n")
    (pkg / "c.py").write_text("def h():\n    from distlab.grading import verdict\n")
    graph = import_graph(tmp_path)
    assert graph["distlab.grading.verdict"] == {"distlab.a": 1}
    assert cycles(graph) == [["distlab.a", "distlab.b"]]
    assert bench_imports_of_grading(graph) == ["distlab/c.py:2 imports distlab.grading.verdict"]


def test_names_that_left_launch_still_import_from_it():
    """``run_distributed`` moved from distlab.launch to distlab.spawn: the old import keeps working (issue 33)."""
    import distlab.spawn as spawn
    from distlab.launch import RankError, run_distributed
    assert (run_distributed, RankError) == (spawn.run_distributed, spawn.RankError)
    assert "distlab.launch" not in import_graph(REPO)["distlab.spawn"], "spawn imports launch: a cycle"


MAX_LINES = 400  # issue 31: a module of the bench reads top to bottom; past this it holds more than one job


def long_modules(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``distlab/<module>.py: N lines`` for every module of the package (subpackages too) over ``limit`` lines."""
    found = []
    for path in sorted((root / "distlab").rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root).as_posix()}: {lines} lines")
    return found


def test_no_distlab_module_is_over_400_lines():
    """No module of distlab/ is over 400 lines: split a longer one by job (p2p.py: the lesson API, the
    strict checker, the size check), re-exporting what callers import from the old module."""
    long = long_modules(REPO)
    assert not long, f"distlab modules over {MAX_LINES} lines (split each by job):\n" + "\n".join(long)


def test_the_line_check_sees_a_long_module(tmp_path):
    (tmp_path / "distlab" / "lessons").mkdir(parents=True)
    (tmp_path / "distlab" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "distlab" / "lessons" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path) == [f"distlab/lessons/long.py: {MAX_LINES + 1} lines"]
