"""The course's manifest: one entry per graded exercise (distlab/course.toml), read by everything that names one.

An exercise is an id a learner types and tests mark (``@pytest.mark.exercise("1.4-1.5")``), a title, its
default points, the TODO regions it grades, the templates (lessons) holding them, the test files holding its
tests and its guideline section. The cockpit (distlab/cockpit), the grader (distlab/pytest_plugin.py's scores,
distlab/grading/grade.py) and the bug catalogue (distlab/bugs.py) read it here; grading/weights.toml, where
present, is the instructor's override of the points (keyed by id or by full name). The manifest lives in the
bench (distlab/), so a grading jail, which copies distlab/ but not grading/, still knows every exercise.

``python -m distlab dev check`` runs :func:`check`: the manifest against the tree, one line per problem.
Nothing here imports torch or pytest.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = Path(__file__).resolve().parent / "course.toml"
WEIGHTS = REPO / "grading" / "weights.toml"
_ID = re.compile(r"(\d+)\.(\d+)(?:-(\d+)\.(\d+))?$")
_FIELDS = ("id", "title", "points", "todos", "lessons", "tests", "guide")


def base(todo_id: str) -> str:
    """A TODO region's exercise id: regions 3.8a and 3.8b are both TODO 3.8."""
    return todo_id.rstrip("abcdefghijklmnopqrstuvwxyz")


def id_range(ident: str) -> list[str]:
    """The TODO ids a range covers: "1.1-1.3" -> 1.1, 1.2, 1.3; "3.4" -> 3.4. ValueError if not an id."""
    m = _ID.match(ident.strip())
    if not m or (m[3] and m[3] != m[1]):
        raise ValueError(f"{ident!r} is not an exercise id like 3.4 or 4.1-4.4 (one phase)")
    lo, hi = int(m[2]), int(m[4] or m[2])
    return [f"{m[1]}.{i}" for i in range(lo, hi + 1)]


@dataclass(frozen=True)
class Exercise:
    id: str  # "1.4-1.5": what a learner types, what tests mark
    title: str  # "distributed sampler"
    points: float  # default points; grading/weights.toml may override them
    todos: tuple[str, ...]  # its TODO regions: "1.4", "1.5"; "3.8a", "3.8b"
    lessons: tuple[str, ...]  # templates holding them, relative to the checkout
    tests: tuple[str, ...]  # test files holding its tests, relative to the checkout
    guide: str  # its guideline section: "phase1_data_parallel/guidelines.md#sharding-the-data"

    @property
    def name(self) -> str:
        """The full name the scores and the bug catalogue use: "1.4-1.5 distributed sampler"."""
        return f"{self.id} {self.title}"

    @property
    def key(self) -> str:
        return self.id

    @property
    def phase(self) -> int:
        return int(self.id.split(".")[0])

    @property
    def ids(self) -> list[str]:
        """The TODO ids it grades, in order: "1.1-1.3" -> 1.1, 1.2, 1.3."""
        return id_range(self.id)

    @property
    def weight(self) -> float:
        """Its points with the instructor's override (grading/weights.toml) where there is one."""
        return weights().get(self.name, self.points)


@lru_cache(maxsize=8)
def _load(path: Path) -> tuple[Exercise, ...]:
    entries = tomllib.loads(path.read_text()).get("exercise", [])
    out = []
    for n, e in enumerate(entries, 1):
        missing = [f for f in _FIELDS if f not in e]
        if missing:
            raise ValueError(f"{path}: exercise #{n} ({e.get('id', '?')}) lacks {', '.join(missing)}: "
                             "every entry has id, title, points, todos, lessons, tests, guide (CONTRIBUTING.md)")
        out.append(Exercise(e["id"], e["title"], float(e["points"]), tuple(e["todos"]), tuple(e["lessons"]),
                            tuple(e["tests"]), e["guide"]))
    return tuple(out)


def exercises(path: Path = MANIFEST) -> list[Exercise]:
    """Every graded exercise, in the course's order."""
    return list(_load(Path(path)))


def lookup(marker: str, path: Path = MANIFEST) -> Exercise | None:
    """The exercise a marker or a learner names by id ("1.4-1.5") or by full name; None if none."""
    marker = marker.strip()
    return next((ex for ex in exercises(path) if marker in (ex.id, ex.name)), None)


def canonical(marker: str) -> str:
    """The full name of the exercise a test marks (by id or full name); an unknown marker as it is."""
    ex = lookup(marker)
    return ex.name if ex else marker


def weights(override: str | Path | None = WEIGHTS, path: Path = MANIFEST) -> dict[str, float]:
    """Full name -> points: the manifest's, overridden by ``override`` ([weights], keyed by id or full name).

    A missing override file (a grading jail, a learner's checkout without grading/) leaves the manifest's points.
    """
    table = {ex.name: ex.points for ex in exercises(path)}
    if override is not None and Path(override).is_file():
        stat = Path(override).stat()
        for key, value in _override(str(override), stat.st_mtime_ns, stat.st_size).items():
            table[canonical(key)] = value
    return table


@lru_cache(maxsize=8)
def _override(path: str, mtime_ns: int, size: int) -> dict[str, float]:
    """grading/weights.toml's [weights], read once per version of the file (``status`` asks per exercise)."""
    return {k: float(v) for k, v in tomllib.loads(Path(path).read_text()).get("weights", {}).items()}


# --- python -m distlab dev check: the manifest against the tree --------------------------------------

_MARKER = re.compile(r'mark\.exercise\(\s*"([^"]+)"')
_HINTS = re.compile(r"<summary>Hints for TODO ([^<]*)</summary>")
_ANCHOR = re.compile(r'^#+\s+(.*?)\s*$|<a (?:name|id)="([^"]+)"', re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {_slug(m[1]) if m[1] is not None else m[2] for m in _ANCHOR.finditer(markdown)}


def solution_todos(repo: Path = REPO) -> dict[str, str]:
    """TODO region id -> the template (relative path) it belongs to, from the solutions' BEGIN markers."""
    from distlab.regions import BEGIN

    found = {}
    for sol in sorted(repo.glob("solutions/phase*/*.py")):
        template = f"{sol.parent.name}/template_{sol.name}"
        for line in sol.read_text().splitlines():
            if m := BEGIN.match(line):
                found[m["id"]] = template
    return found


def check(repo: Path = REPO, path: Path = MANIFEST) -> list[str]:
    """Every way the manifest disagrees with the tree: one line each, saying what to change (empty: none)."""
    try:
        exs = exercises(path)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        return [f"{path}: {exc}"]
    where = path.relative_to(repo) if path.is_relative_to(repo) else path
    problems = []
    seen_ids: set[str] = set()
    for ex in exs:
        try:
            ids = ex.ids
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if ex.id in seen_ids:
            problems.append(f"{where}: exercise {ex.id} is listed twice: keep one entry")
        seen_ids.add(ex.id)
        for t in ex.todos:
            if base(t) not in ids:
                problems.append(f"{where}: {ex.id} lists TODO {t}, outside its range {ex.id}: fix its todos or its id")
    todos = solution_todos(repo)
    owners: dict[str, list[Exercise]] = {}
    for ex in exs:
        for t in ex.todos:
            owners.setdefault(t, []).append(ex)
    for t, template in todos.items():
        holders = owners.get(t, [])
        if not holders:
            problems.append(f"{where}: TODO {t} ({template}) belongs to no exercise: add it to one entry's todos")
        elif len(holders) > 1:
            # One exercise grades it; the others containing it are composites (their range is wider).
            narrowest = min(len(h.ids) for h in holders)
            if sum(len(h.ids) == narrowest for h in holders) > 1:
                problems.append(f"{where}: TODO {t} belongs to {', '.join(h.id for h in holders)} equally: "
                                "one exercise grades it, the others must be wider composites")
        if holders and not any(template in h.lessons for h in holders):
            problems.append(f"{where}: TODO {t} is in {template}, which no exercise holding it lists in lessons")
    for t, holders in owners.items():
        if t not in todos:
            problems.append(f"{where}: {holders[0].id} lists TODO {t}, which no solution region "
                            "('# ### BEGIN SOLUTION {t}: ...') has: add the region or drop the id")
    for ex in exs:
        for lesson in ex.lessons:
            if not (repo / lesson).is_file():
                problems.append(f"{where}: {ex.id}'s lesson {lesson} does not exist: "
                                "run `python -m distlab.templates --write`, or fix the path")
        file, _, anchor = ex.guide.partition("#")
        guide = repo / file
        if not guide.is_file():
            problems.append(f"{where}: {ex.id}'s guide {file} does not exist")
        else:
            text = guide.read_text()
            if anchor and anchor not in anchors(text):
                problems.append(f"{where}: {ex.id}'s guide anchor #{anchor} is no heading of {file}: "
                                "fix the anchor or add the section")
        if not ex.tests:
            problems.append(f"{where}: {ex.id} lists no test files: add the files of its marked tests")
        for test in ex.tests:
            file = repo / test
            if not file.is_file():
                problems.append(f"{where}: {ex.id}'s test file {test} does not exist")
            elif not any(m in (ex.id, ex.name) for m in _MARKER.findall(file.read_text())):
                problems.append(f"{test}: no test marked @pytest.mark.exercise(\"{ex.id}\"): mark its tests or drop "
                                f"the file from {ex.id}'s tests")
    hinted: dict[str, set[str]] = {}
    for t, template in todos.items():
        folder = repo / template.split("/")[0]
        if folder.name not in hinted:
            text = "\n".join(g.read_text() for g in sorted(folder.glob("guidelines*.md")))
            hinted[folder.name] = {base(i) for m in _HINTS.finditer(text) for i in re.findall(r"\d+\.\d+[a-z]?", m[1])}
        if base(t) not in hinted[folder.name]:
            problems.append(f"{folder.name}: no '<summary>Hints for TODO {base(t)}</summary>' block in its "
                            "guidelines*.md: add one (gentle to explicit)")
    known = {m for ex in exs for m in (ex.id, ex.name)}
    for file in sorted(repo.glob("tests/test_phase*.py")):
        for marker in sorted(set(_MARKER.findall(file.read_text())) - known):
            problems.append(f"{file.relative_to(repo)}: marker exercise(\"{marker}\") names no exercise of {where}: "
                            "use an id from it, or add an entry")
    listed = {(t, ex.id) for ex in exs for t in ex.tests}
    for file in sorted(repo.glob("tests/test_*.py")):
        rel = file.relative_to(repo).as_posix()
        for marker in set(_MARKER.findall(file.read_text())):
            ex = lookup(marker, path)
            if ex and (rel, ex.id) not in listed:
                problems.append(f"{where}: {rel} marks tests of {ex.id} but is not in its tests: add it")
    if (repo / "grading" / "weights.toml").is_file():
        table = tomllib.loads((repo / "grading" / "weights.toml").read_text()).get("weights", {})
        for key in table:
            if lookup(key, path) is None:
                problems.append(f"grading/weights.toml: {key!r} names no exercise of {where}: use its id")
    return list(dict.fromkeys(problems))


def rewrite_markers(text: str) -> str:
    """``text`` with each ``mark.exercise("<full name>")`` of a manifest exercise written as its id."""
    def by_id(m: re.Match) -> str:
        ex = lookup(m[2])
        return f"{m[1]}{ex.id if ex else m[2]}{m[3]}"

    return re.sub(r'(mark\.exercise\(\s*")([^"]+)(")', by_id, text)


if __name__ == "__main__":
    import sys

    # python -m distlab.manifest --rewrite-markers tests/test_*.py: the markers by id (run once, at integration)
    if len(sys.argv) < 3 or sys.argv[1] != "--rewrite-markers":
        raise SystemExit("usage: python -m distlab.manifest --rewrite-markers FILE...")
    for name in sys.argv[2:]:
        file = Path(name)
        old = file.read_text()
        if (new := rewrite_markers(old)) != old:
            file.write_text(new)
            print(f"{file}: markers by id")
