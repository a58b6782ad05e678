"""What a graded template may do: static rules checked before it runs, and a guard on the bench after.

A template is graded by running it beside the tests, so a template that reaches for the
reference solutions, the bench's given copy of its own exercise, or the tests' comparisons
could score without implementing anything. Two checks here, called by distlab/loader.py through
the template checks distlab/grading/attach.py gives it:

1. :func:`lint` reads the template's source before a line of it runs. A template may import
   what its untouched version imports (rendered from the solution by distlab/templates.py)
   plus a few harmless modules (torch, math, dataclasses, typing, ...). From ``distlab`` it
   may import only the names its untouched version imports: that is the per-exercise rule
   (``template_tp_primitives.py`` may not take ``distlab.lessons.tp``'s ready-made regions, the
   trainer may not take ``distlab.lessons.sync``'s broadcast and all-reduce). Refused everywhere:
   the escape hatches (exec, eval, compile, __import__, open, globals, vars, getattr with a
   computed or dunder name, dunder attributes such as ``__code__``/``__globals__``/``__dict__``,
   frame attributes) and assignments to what it imported (``torch.equal = ...``). A hatch the
   untouched template itself uses (the monitoring template writes files with ``open``) stays
   allowed in that template only; the rank's audit hook (distlab/grading/sandbox.py) still applies.
2. :class:`BenchGuard` remembers the functions the verdicts depend on (torch's comparisons and
   collectives, distlab.testing's helpers, the test modules' functions) and, after a template
   was imported or a rank ran, puts back whatever changed and names it.
"""
from __future__ import annotations

import ast
import functools
import json
import sys
from pathlib import Path
from types import FunctionType, ModuleType

from distlab.grading import rules

REPO = Path(__file__).resolve().parents[2]

# Imports any template may use: computation and plain data, nothing that reaches files,
# processes, the interpreter's internals or other modules' globals.
SAFE_MODULES = {"__future__", "torch", "math", "dataclasses", "typing", "functools", "itertools", "collections",
                "copy", "numpy", "statistics", "random", "time", "contextlib", "warnings", "datetime", "re", "enum",
                "abc", "operator", "heapq", "bisect", "string", "numbers", "textwrap"}
# Never, even where the untouched template would allow it: interpreter internals and loaders.
NEVER_MODULES = {"sys", "builtins", "importlib", "gc", "inspect", "ctypes", "runpy", "subprocess", "imp", "types",
                 "marshal", "pickle", "code", "codeop", "pydoc", "tests", "solutions", "distlab.loader",
                 "torch.utils.cpp_extension", "_thread", "multiprocessing", "signal", "posix"}
HATCH_NAMES = {"exec", "eval", "compile", "__import__", "open", "globals", "locals", "vars", "breakpoint",
               "__builtins__", "__loader__", "__spec__", "__dict__"}
# Dunder attributes a lesson needs (methods called explicitly, names for messages); any other is refused.
PLAIN_DUNDERS = {"__init__", "__name__", "__enter__", "__exit__", "__len__", "__iter__", "__next__", "__call__",
                 "__repr__", "__post_init__", "__qualname__"}
# Methods that would let a template's objects rig a comparison ("equal to anything", a tensor subclass
# that answers torch.equal itself): defined only where the untouched template or its solution does.
RIGGING_DUNDERS = {"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__",
                   "__int__", "__float__", "__torch_function__", "__torch_dispatch__", "__getattribute__",
                   "__getattr__", "__del__", "__init_subclass__", "__instancecheck__", "__subclasscheck__",
                   "__set_name__", "__reduce__", "__reduce_ex__", "__class_getitem__", "__array__"}
# Attributes that lead out of the template: frames, and the modules other modules hold.
# A module another module imported is one attribute away (``torch.serialization.os``): the ones that
# reach file descriptors, processes and the interpreter are refused by name too (``os.write`` into the
# rank's result pipe and ``os._exit`` are no audit events, distlab/grading/sandbox.py cannot see them).
HATCH_ATTRS = {"f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame", "cr_frame", "ag_frame",
               "tb_frame", "tb_next", "sys", "builtins", "importlib", "gc", "inspect", "ctypes", "runpy",
               "subprocess", "loader", "modules", "solutions", "os", "posix", "_exit", "pickle", "_pickle", "io",
               "_io", "socket", "shutil", "multiprocessing", "threading", "_thread", "signal", "mmap", "fcntl",
               "resource", "tempfile", "marshal", "attrgetter", "methodcaller"}
# The attribute functions: called directly with a constant name, never handed around (``g = getattr``).
ATTR_FUNCTIONS = ("getattr", "setattr", "delattr", "hasattr")


# The bench's given copies of taught functions: a later exercise gets them from distlab, and the
# exercise that teaches them may never import them (whatever its untouched template says).
BENCH_COPIES = {
    "checkpoint": {"distlab.lessons.ckpt_files": {"given"}},
    "trainer": {"distlab.lessons.sync": {"broadcast_module", "broadcast_tensors", "allreduce_gradients", "average_buffers"}},
    "tp_primitives": {"distlab.lessons.tp": {"copy_to_region", "reduce_from_region", "gather_from_region",
                                     "scatter_to_region", "_CopyToRegion", "_ReduceFromRegion",
                                     "_GatherFromRegion", "_ScatterToRegion"}},
}


def _module_of(node: ast.AST) -> list[tuple[str, str | None]]:
    """(module, name) pairs an import node brings in; name None for ``import x``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [((node.module or ""), a.name) for a in node.names]
    return []


def _findings(tree: ast.AST) -> tuple[set[tuple], list[tuple[int, tuple, str]]]:
    """(imports, uses of hatches): imports as (module, name); each hatch as (line, key, text)."""
    imports, hatches = set(), []
    imported_names = set()
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    never_tops = {m.split(".")[0] for m in NEVER_MODULES}
    for node in ast.walk(tree):
        for module, name in _module_of(node):
            imports.add((module, name))
            if name == "*":
                hatches.append((node.lineno, ("star import", module), f"`from {module} import *`"))
            elif name in HATCH_ATTRS or name in HATCH_NAMES or name in never_tops or \
                    (name or "").startswith("__") or name in ATTR_FUNCTIONS:
                # `from torch.serialization import os`, `from typing import sys`: a module another module holds
                hatches.append((node.lineno, ("import of", name), f"`from {module} import {name}`"))
            alias = next(a.asname or (a.name if name else a.name.split(".")[0]) for a in node.names
                         if a.name == (name or module))
            imported_names.add(alias)
        if isinstance(node, ast.Name) and node.id in ATTR_FUNCTIONS and id(node) not in called:
            hatches.append((node.lineno, ("handed around", node.id),
                            f"`{node.id}` other than called with a constant name (an alias of it)"))
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        defined = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
            node.id if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) else None
        if defined in RIGGING_DUNDERS:
            hatches.append((line, ("defines", defined), f"a `{defined}` method (it could rig a comparison)"))
        if isinstance(node, ast.Name) and node.id in HATCH_NAMES:
            hatches.append((line, ("name", node.id), f"`{node.id}`"))
        elif isinstance(node, ast.Attribute):
            dunder = node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in PLAIN_DUNDERS
            if dunder or node.attr in HATCH_ATTRS:
                hatches.append((line, ("attribute", node.attr), f"the attribute `.{node.attr}`"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2:
            attr = node.args[1]
            if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
                hatches.append((line, ("computed attribute", node.func.id), f"`{node.func.id}` with a computed name"))
            elif attr.value.startswith("__") or attr.value in HATCH_ATTRS:
                hatches.append((line, ("attribute", attr.value), f"`{node.func.id}(..., {attr.value!r})`"))
            if node.func.id in ("setattr", "delattr") and _root(node.args[0]) in imported_names:
                hatches.append((line, ("patch", _root(node.args[0])),
                                f"`{node.func.id}` on `{_root(node.args[0])}`, which it imported"))
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):  # tuple targets too: `torch.equal, x = ...`
                if isinstance(sub, (ast.Attribute, ast.Subscript)) and _root(sub) in imported_names:
                    hatches.append((line, ("patch", _root(sub)),
                                    f"an assignment to `{ast.unparse(sub)}` (a template may not change what it imports)"))
    return imports, hatches + _builtin_references(tree)


# --------------------------------------------------------------------------- torch's own implementation
_ALL_NAMES = rules.BACKDOORS.union(*(r.names for r in rules.RULES))
_ALL_PATHS = tuple(p for r in rules.RULES for p in r.paths)


def _dotted(node: ast.AST, aliases: dict[str, str]) -> tuple[str | None, list[str]]:
    """(the chain's dotted path with its root resolved through ``aliases``, or None; every name along it):
    ``d.nn.functional`` after ``import torch.distributed as d`` is torch.distributed.nn.functional."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTR_FUNCTIONS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            parts.append(node.args[1].value)  # getattr(dist, "all_reduce")
            node = node.args[0]
        else:
            break
    parts.reverse()
    root = aliases.get(node.id) if isinstance(node, ast.Name) else None
    return (".".join([root, *parts]) if root else None), parts


def _builtin_references(tree: ast.AST) -> list[tuple[int, tuple, str]]:
    """Every place the template names torch's implementation of an exercise (distlab/grading/rules.py), as
    hatches keyed ("builtin", name) and ("builtin path", prefix); :func:`lint` keeps those of its exercise."""
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                found.append((node.lineno, a.name, a.name.split(".")))
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                found.append((node.lineno, f"{node.module}.{a.name}", [*node.module.split("."), a.name]))
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name)]
    for _ in range(3):  # `a = torch.distributed; b = a.nn`: aliases of aliases, in any order
        for n in assigns:
            path, _parts = _dotted(n.value, aliases)
            if path:
                aliases[n.targets[0].id] = path
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                               and node.func.id in ATTR_FUNCTIONS):
            path, parts = _dotted(node, aliases)
            if parts:
                found.append((node.lineno, path, parts))
    hatches = []
    for line, path, parts in found:
        for name in set(parts) & _ALL_NAMES:
            hatches.append((line, ("builtin", name), f"`{name}`"))
        for prefix in _ALL_PATHS:
            if path and (path == prefix or path.startswith(prefix + ".")):
                hatches.append((line, ("builtin path", prefix), f"`{path}`"))
    return hatches


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


# In a grading jail (distlab/grading/jail.py) the solutions are not there: their allowances come as data.
ALLOWANCES = "template-allowances.json"


def all_allowances() -> dict[str, list]:
    """Every template's allowances, as JSON-able data, for a copy of the bench without the solutions."""
    out = {}
    for solution in sorted((REPO / "solutions").glob("phase*/*.py")):
        if (REPO / solution.parent.name / f"template_{solution.name}").is_file():
            imports, hatches = untouched_allowance(solution.parent.name, solution.stem)
            out[f"{solution.parent.name}/{solution.stem}"] = [sorted(map(list, imports), key=str),
                                                               sorted(map(list, hatches), key=str)]
    return out


@functools.lru_cache(maxsize=None)
def untouched_allowance(phase: str, name: str) -> tuple[frozenset, frozenset]:
    """(imports, hatch keys) of the untouched template (rendered from this checkout's solution) and of
    the solution itself (a finished exercise may do what the reference does), less the solutions' imports."""
    from distlab.templates import render

    solution = REPO / "solutions" / phase / f"{name}.py"
    if (REPO / ALLOWANCES).is_file():  # a jail: its few solutions lack their exercise's regions (jail.reference_for)
        imports, hatches = json.loads((REPO / ALLOWANCES).read_text())[f"{phase}/{name}"]
        return frozenset(tuple(i) for i in imports), frozenset(tuple(h) for h in hatches)
    imports, hatches = _findings(ast.parse(render(solution)))
    more_imports, more_hatches = _findings(ast.parse(solution.read_text()))
    imports |= {(m, n) for m, n in more_imports if m.split(".")[0] != "solutions"}
    return frozenset(imports), frozenset(key for _, key, _ in hatches + more_hatches)


def _import_allowed(module: str, name: str | None, allowed: frozenset) -> bool:
    top = module.split(".")[0]
    if any(module == m or module.startswith(m + ".") for m in NEVER_MODULES) or \
            (module == "distlab" and name in ("loader", "load")):
        return (module, name) in allowed
    if top == "distlab":
        return (module, name) in allowed or (module, name) == ("distlab.todo", "todo")
    return top in SAFE_MODULES or (module, name) in allowed or any(m == module for m, _ in allowed)


def lint(path: Path, phase: str, name: str) -> list[str]:
    """Reasons the template at ``path`` may not be graded (empty: it may)."""
    where = f"{phase}/template_{name}.py"
    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError as exc:
        return [f"{where}:{exc.lineno}: syntax error: {exc.msg}"]
    allowed_imports, allowed_hatches = untouched_allowance(phase, name)
    imports, hatches = _findings(tree)
    problems = []
    own_copies = BENCH_COPIES.get(name, {})
    for module, item in sorted(imports, key=str):
        if item in own_copies.get(module, ()) or (item is None and module in own_copies) or \
                (module == "distlab" and item in {m.split(".")[1] for m in own_copies}):
            problems.append(f"{where}: `from {module} import {item}` is the bench's copy of this exercise: "
                            "implement it here instead")
        elif not _import_allowed(module, item, allowed_imports):
            what = f"from {module} import {item}" if item else f"import {module}"
            problems.append(f"{where}: `{what}` is not allowed here (the untouched template does not import it; "
                            "an exercise may not use the bench's given copy of itself)")
    refused_names, refused_paths = rules.static_names(phase, name)
    rule = rules.rule_for(phase, name)
    for line, key, text in sorted(hatches):
        if key in allowed_hatches:
            continue
        if key[0] in ("builtin", "builtin path"):
            if key[1] in refused_names or key[1] in refused_paths:
                why = rule.line(f"{text}, torch's own") if rule else \
                    f"the layer under torch.distributed's functions is not for templates (refused: {text})"
                problems.append(f"{where}:{line}: {why}")
            continue
        problems.append(f"{where}:{line}: {text} is not allowed in a template")
    return problems


# --------------------------------------------------------------------------- the guard after it ran
def _guarded() -> list[tuple[object, str, object]]:
    """(owner, attribute, value) for every function a verdict depends on, as they are now."""
    import torch

    from distlab import testing

    owners: list[tuple[object, list[str]]] = [
        (torch, ["equal", "allclose", "isclose", "testing"]), (torch.testing, ["assert_close"]),
        (torch.Tensor, ["__eq__", "__ne__", "equal", "allclose", "tolist", "item", "__bool__", "all", "any"]),
        # Not torch.distributed's functions: distlab.comm.CommLedger wraps them for the bench itself, and a
        # faked collective cannot pass a test (each rank's single-process baseline uses none).
    ]
    mods = [testing] + [m for n, m in list(sys.modules.items())
                        if isinstance(m, ModuleType) and (n.startswith("test_") or n.startswith("tests."))]
    for m in mods:
        owners.append((m, [k for k, v in vars(m).items() if isinstance(v, (FunctionType, type))]))
    return [(o, a, _current(o, a)) for o, names in owners for a in names]


_MISSING = object()


def _current(owner: object, attr: str) -> object:
    # A class's own entry, not an inherited one: torch.Tensor.__eq__ lives on its C base class.
    return owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)


class BenchGuard:
    """Snapshot the bench's verdict functions; :meth:`restore` puts changes back and names them."""

    def __init__(self) -> None:
        self.values = _guarded()
        self.codes = {id(v): (v, v.__code__) for _, _, v in self.values if isinstance(v, FunctionType)}

    def restore(self) -> list[str]:
        changed = []
        for owner, attr, value in self.values:
            if _current(owner, attr) is not value:
                if value is _MISSING:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, value)
                changed.append(f"{getattr(owner, '__name__', owner)}.{attr}")
        for fn, code in self.codes.values():
            if fn.__code__ is not code:
                fn.__code__ = code
                changed.append(f"{fn.__module__}.{fn.__qualname__}.__code__")
        return changed
