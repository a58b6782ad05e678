"""Generate every learner template from its marked solution: one source per exercise.

    python -m distlab.templates            # say which templates are out of date (writes nothing)
    python -m distlab.templates --check    # CI: exit 1 if a committed template differs from its source
    python -m distlab.templates --write    # regenerate; refuses templates whose TODO regions you edited
    python -m distlab.templates --write --force phase1_data_parallel/template_collectives.py

The solution ``solutions/<phase>/<name>.py`` is the source of ``<phase>/template_<name>.py``.
An exercise region in the solution is delimited as in nbgrader (BEGIN/END SOLUTION),
with its id, title and guideline section::

    # ### BEGIN SOLUTION 1.1: all-reduce by reduce + broadcast [guidelines.md#all-reduce-three-ways]
    # Every rank ends with the sum of all ranks' tensors, in place.   <- the stub: the
    # Collective: every rank of `group` calls it.                       comment lines right
    if rank == 0:                                                        after BEGIN
        ...                                                           <- the solution
    # ### END SOLUTION 1.1

In the template the region becomes::

    # --- TODO 1.1: all-reduce by reduce + broadcast ---
    # Every rank ends with the sum of all ranks' tensors, in place.
    # Collective: every rank of `group` calls it.
    raise todo("1.1 all-reduce by reduce + broadcast", "guidelines.md#all-reduce-three-ways")
    # --- end TODO 1.1 ---

A line of the solution ending in ``# template: <line>`` becomes ``<line>`` (same
indentation) in the template: a solution may import an earlier solution where the
template uses the bench's built-in equivalent. Everything else is copied verbatim, so
a fix to a solution reaches its template the next time the generator runs.

Names given for a TODO are marked for linters. A template's scaffold keeps the imports
and locals that only its regions use, and reads names that only a region defines, so a
linter would flag them (an unused import, a local assigned but never used, an undefined
name). The generator appends ``# noqa: <code> (<name>: for TODO x.y)`` (or ``set by TODO
x.y``) to each such line: ``flake8 --select F`` and ``ruff`` stay quiet on an untouched
template, and the comment tells the learner which exercise the name is there for.

A learner's template is never overwritten silently: ``--write`` refuses a file in which
a TODO region holds code (anything but comments and the ``raise todo(...)``) or whose
TODO regions were removed, unless that file is named after ``--force``.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMAND = "python -m distlab.templates --write"

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# ### BEGIN SOLUTION (?P<id>[0-9]+\.[0-9]+[a-z]?): "
                   r"(?P<title>.+?) \[(?P<where>[^\]]+)\]\s*$")
END = re.compile(r"^[ \t]*# ### END SOLUTION (?P<id>[0-9]+\.[0-9]+[a-z]?)\s*$")
SUBST = re.compile(r"^(?P<indent>[ \t]*)(?P<code>\S.*?)\s+# template: (?P<repl>.+?)\s*$")
TODO_BEGIN = re.compile(r"^[ \t]*# --- TODO (?P<id>\S+): .* ---\s*$")
TODO_END = re.compile(r"^[ \t]*# --- end TODO (?P<id>\S+) ---\s*$")
TODO_IMPORT = "from distlab.todo import todo"


class MarkerError(ValueError):
    """A solution's exercise markers are malformed (unclosed, nested, mismatched ids)."""


@dataclass(frozen=True)
class Region:
    id: str
    title: str
    where: str


def template_path(solution: Path, repo: Path = REPO) -> Path:
    """``solutions/<phase>/<name>.py`` -> ``<phase>/template_<name>.py``."""
    rel = solution.resolve().relative_to(repo.resolve() / "solutions")
    return repo / rel.parent / f"template_{rel.name}"


def sources(repo: Path = REPO) -> list[Path]:
    """Every solution module of a phase that holds at least one exercise region."""
    return sorted(p for p in (repo / "solutions").glob("phase*/*.py")
                  if any(BEGIN.match(line) for line in p.read_text().splitlines()))


def regions(text: str, name: str = "<solution>") -> list[Region]:
    """The exercise regions of a solution, in order; raises MarkerError on bad markers."""
    found, open_region = [], None
    for lineno, line in enumerate(text.splitlines(), 1):
        if m := BEGIN.match(line):
            if open_region:
                raise MarkerError(f"{name}:{lineno}: BEGIN SOLUTION {m['id']} inside region {open_region.id}")
            open_region = Region(m["id"], m["title"], m["where"])
        elif m := END.match(line):
            if not open_region or m["id"] != open_region.id:
                expected = open_region.id if open_region else "none open"
                raise MarkerError(f"{name}:{lineno}: END SOLUTION {m['id']} does not close a region ({expected})")
            found.append(open_region)
            open_region = None
        elif "### BEGIN SOLUTION" in line or "### END SOLUTION" in line:
            raise MarkerError(f"{name}:{lineno}: malformed marker (expected "
                              f"'# ### BEGIN SOLUTION <id>: <title> [<guideline>#<anchor>]'): {line.strip()}")
    if open_region:
        raise MarkerError(f"{name}: region {open_region.id} is never closed with '# ### END SOLUTION {open_region.id}'")
    ids = [r.id for r in found]
    if dup := sorted({i for i in ids if ids.count(i) > 1}):
        raise MarkerError(f"{name}: exercise ids used twice: {dup}")
    return found


def _insert_todo_import(lines: list[str]) -> list[str]:
    """Add ``from distlab.todo import todo`` after the module's last top-level import."""
    tree = ast.parse("\n".join(lines))
    last = None
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
    if last is None:
        raise MarkerError("a solution with exercise regions must have top-level imports")
    return lines[:last] + [TODO_IMPORT] + lines[last:]


def _region_names(text: str) -> dict[str, tuple[set[str], set[str]]]:
    """Per region id of a solution: (names the region reads, names it binds)."""
    spans, start = {}, None
    for lineno, line in enumerate(text.splitlines(), 1):
        if m := BEGIN.match(line):
            start = lineno
        elif (m := END.match(line)) and start is not None:
            spans[m["id"]] = (start, lineno)
            start = None
    names = {rid: (set(), set()) for rid in spans}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name):
            for rid, (lo, hi) in spans.items():
                if lo < node.lineno < hi:
                    names[rid][isinstance(node.ctx, (ast.Store, ast.Del))].add(node.id)
    return names


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


def render(solution: Path, repo: Path = REPO) -> str:
    """The template text generated from ``solution``."""
    text = solution.read_text()
    rel = solution.resolve().relative_to(repo.resolve()).as_posix()
    regions(text, rel)  # validates the markers
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = BEGIN.match(line)
        if not m:
            s = SUBST.match(line)
            out.append(f"{s['indent']}{s['repl']}" if s else line)
            i += 1
            continue
        indent, rid, title, where = m["indent"], m["id"], m["title"], m["where"]
        out.append(f"{indent}# --- TODO {rid}: {title} ---")
        i += 1
        while i < len(lines) and lines[i].strip().startswith("#") and not END.match(lines[i]):
            out.append(lines[i])  # the stub: what to compute and the contract
            i += 1
        out.append(f'{indent}raise todo("{rid} {title}", "{where}")')
        while not END.match(lines[i]):
            i += 1
        out.append(f"{indent}# --- end TODO {rid} ---")
        i += 1
    header = [f"# Generated from {rel} by `{COMMAND}`.",
              "# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`."]
    rendered = "\n".join(header + _insert_todo_import(out)) + "\n"
    return _with_marks(rendered, _lint_marks(rendered, _region_names(text)))


def edited_regions(template_text: str) -> list[str]:
    """Ids of the TODO regions of a template that hold code (a learner's work)."""
    edited, current = [], None
    for line in template_text.splitlines():
        if m := TODO_BEGIN.match(line):
            current = m["id"]
        elif TODO_END.match(line):
            current = None
        elif current is not None:
            s = line.strip()
            if s and not s.startswith("#") and not s.startswith("raise todo(") and current not in edited:
                edited.append(current)
    return edited


def _todo_ids(text: str) -> list[str]:
    return [m["id"] for line in text.splitlines() if (m := TODO_BEGIN.match(line))]


def check(repo: Path = REPO) -> list[str]:
    """One message per template that differs from what its solution generates (or has no source)."""
    problems = []
    expected = {template_path(s, repo): s for s in sources(repo)}
    for template, solution in expected.items():
        rel = template.relative_to(repo).as_posix()
        want = render(solution, repo)
        have = template.read_text() if template.is_file() else None
        if have is None:
            problems.append(f"{rel} is missing: run `{COMMAND}`")
        elif have != want:
            diff = difflib.unified_diff(want.splitlines(), have.splitlines(), "generated", rel, n=1, lineterm="")
            shown = "\n".join(list(diff)[:30])
            problems.append(f"{rel} differs from what {solution.relative_to(repo).as_posix()} generates; "
                            f"edit the solution, then run `{COMMAND}`:\n{shown}")
    for template in sorted(repo.glob("phase*/template_*.py")):
        if template not in expected:
            problems.append(f"{template.relative_to(repo).as_posix()} has no marked solution at "
                            f"solutions/{template.parent.name}/{template.name.removeprefix('template_')}")
    return problems


def write(repo: Path = REPO, force: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Regenerate templates; return (written, refused). Named ``force`` paths are overwritten anyway."""
    forced = {(repo / f).resolve() for f in force}
    written, refused = [], []
    for solution in sources(repo):
        template = template_path(solution, repo)
        rel = template.relative_to(repo).as_posix()
        want = render(solution, repo)
        if template.is_file():
            have = template.read_text()
            if have == want:
                continue
            edited = edited_regions(have)
            missing = sorted(set(_todo_ids(want)) - set(_todo_ids(have)))
            if (edited or missing) and template.resolve() not in forced:
                why = f"TODO {', '.join(edited)} hold your code" if edited else f"TODO {', '.join(missing)} were removed"
                refused.append(f"{rel}: not overwritten ({why}); `{COMMAND} --force {rel}` replaces it")
                continue
        template.write_text(want)
        written.append(rel)
    return written, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any template differs from its solution")
    parser.add_argument("--write", action="store_true", help="regenerate the templates that are out of date")
    parser.add_argument("--force", nargs="*", default=None, metavar="TEMPLATE",
                        help="with --write: overwrite these templates even if their TODO regions hold code")
    parser.add_argument("--repo", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    if args.force is not None and not args.write:
        parser.error("--force goes with --write")
    if args.write:
        written, refused = write(repo, tuple(args.force or ()))
        for rel in written:
            print(f"wrote {rel}")
        for msg in refused:
            print(msg, file=sys.stderr)
        if not written and not refused:
            print("every template is up to date")
        return 1 if refused else 0
    problems = check(repo)
    for msg in problems:
        print(msg, file=sys.stderr)
    if not problems:
        print(f"{len(sources(repo))} templates match their solutions")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
