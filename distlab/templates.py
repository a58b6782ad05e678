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

A learner's template is never overwritten silently: ``--write`` refuses a file in which
a TODO region holds code (anything but comments and the ``raise todo(...)``) or whose
TODO regions were removed, unless that file is named after ``--force``.
"""
from __future__ import annotations

import argparse
import ast
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
    return "\n".join(header + _insert_todo_import(out)) + "\n"


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
