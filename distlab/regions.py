"""The exercise markers: regions of a solution (``# ### BEGIN SOLUTION``) and TODO regions of a template.

The grammar ``distlab.templates`` renders one into the other with (see its docstring): a solution's
regions (``regions``, ``MarkerError`` on bad markers), the names each region reads and binds, and a
template's TODO regions that hold a learner's code (``edited_regions``). The course's code imports
these names from ``distlab.templates``.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# ### BEGIN SOLUTION (?P<id>[0-9]+\.[0-9]+[a-z]?): "
                   r"(?P<title>.+?) \[(?P<where>[^\]]+)\]\s*$")
END = re.compile(r"^[ \t]*# ### END SOLUTION (?P<id>[0-9]+\.[0-9]+[a-z]?)\s*$")
SUBST = re.compile(r"^(?P<indent>[ \t]*)(?P<code>\S.*?)\s+# template: (?P<repl>.+?)\s*$")
TODO_BEGIN = re.compile(r"^[ \t]*# --- TODO (?P<id>\S+): .* ---\s*$")
TODO_END = re.compile(r"^[ \t]*# --- end TODO (?P<id>\S+) ---\s*$")


class MarkerError(ValueError):
    """A solution's exercise markers are malformed (unclosed, nested, mismatched ids)."""


@dataclass(frozen=True)
class Region:
    id: str
    title: str
    where: str


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


_NOQA = re.compile(r"\s*#\s*noqa\b.*$")


def _given_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a template outside its TODO regions: the code the course gave (the region
    markers kept, blank and comment lines left out: a learner's notes change nothing)."""
    out, inside = [], False
    for lineno, line in enumerate(text.splitlines(), 1):
        if TODO_BEGIN.match(line):
            inside = True
        elif TODO_END.match(line):
            inside = False
        elif inside or not line.strip() or line.strip().startswith("#"):
            continue
        out.append((lineno, _NOQA.sub("", line).rstrip()))  # the generator's lint marks follow the code
    return out


def _enclosing(text: str, lineno: int) -> str:
    """The innermost function (Class.method) around ``lineno`` of ``text``, or "module level"."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return f"line {lineno}"
    best, best_span = "module level", None

    def walk(node, prefix):
        nonlocal best, best_span
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lo = min([child.lineno] + [d.lineno for d in child.decorator_list])
                if lo <= lineno <= child.end_lineno and not isinstance(child, ast.ClassDef) and (
                        best_span is None or child.end_lineno - lo < best_span):
                    best, best_span = name, child.end_lineno - lo
                walk(child, f"{name}.")
    walk(tree, "")
    return best


def edited_outside_todos(template_text: str, stub_text: str) -> list[str]:
    """Where a learner's template differs from its generated stub outside the TODO regions, by function
    ("train_step", "Class.method", "module level"), in order: code the course gave that the learner edited."""
    import difflib

    mine, given = _given_lines(template_text), _given_lines(stub_text)
    where: list[str] = []
    matcher = difflib.SequenceMatcher(None, [l for _, l in mine], [l for _, l in given], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        # an inserted or changed line is placed in the learner's file; a deleted one in the stub
        name = (_enclosing(template_text, mine[i1][0]) if i1 < i2
                else _enclosing(stub_text, given[j1][0]))
        if name not in where:
            where.append(name)
    return where
