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
The markers' grammar is ``distlab.regions``; the marks are ``distlab.noqa_marks``.

A learner's template is never overwritten silently: ``--write`` refuses a file in which
a TODO region holds code (anything but comments and the ``raise todo(...)``) or whose
TODO regions were removed, unless that file is named after ``--force``.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

from distlab.noqa_marks import _lint_marks, _with_marks
# The marker grammar (distlab/regions.py), importable from here (`from distlab.templates import TODO_BEGIN`).
from distlab.regions import (  # noqa: F401
    BEGIN, END, SUBST, TODO_BEGIN, TODO_END, MarkerError, Region, _region_names, _todo_ids, edited_regions, regions)

REPO = Path(__file__).resolve().parent.parent
COMMAND = "python -m distlab.templates --write"

TODO_IMPORT = "from distlab.todo import todo"


def template_path(solution: Path, repo: Path = REPO) -> Path:
    """``solutions/<phase>/<name>.py`` -> ``<phase>/template_<name>.py``."""
    rel = solution.resolve().relative_to(repo.resolve() / "solutions")
    return repo / rel.parent / f"template_{rel.name}"


def sources(repo: Path = REPO) -> list[Path]:
    """Every solution module of a phase that holds at least one exercise region."""
    return sorted(p for p in (repo / "solutions").glob("phase*/*.py")
                  if any(BEGIN.match(line) for line in p.read_text().splitlines()))


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
    rendered = "\n".join(header + _insert_todo_import(out)) + "\n"
    return _with_marks(rendered, _lint_marks(rendered, _region_names(text)))


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
