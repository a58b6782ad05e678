"""The course as the cockpit sees it: exercises, their TODO regions, their tests, and the state file.

An exercise is a line of grading/weights.toml ("1.1-1.3 all-reduce three ways" = 3): its
points and the TODO ids it grades together. Its TODO regions are found in the learner's
templates (``root``: the learner's checkout, this repository by default); its tests are the
ones marked ``@pytest.mark.exercise("<name>")`` in this repository's tests/. Nothing here
imports torch or pytest: ``status``, ``next`` and ``hint`` answer at once.
"""
from __future__ import annotations

import json
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from distlab.templates import TODO_BEGIN, TODO_END, edited_regions

REPO = Path(__file__).resolve().parents[2]  # the checkout that holds the tests and the weights
STATE = Path(".distlab") / "state.json"  # in the learner's checkout, git-ignored
_ID = re.compile(r"(\d+)\.(\d+)(?:-(\d+)\.(\d+))?$")
_TODO_RAISE = re.compile(r'raise todo\("[^"]*", "(?P<where>[^"]+)"\)')


@dataclass(frozen=True)
class Exercise:
    name: str  # as in weights.toml and the tests' markers: "1.1-1.3 all-reduce three ways"
    weight: float

    @property
    def key(self) -> str:
        """The id a learner types: "1.1-1.3"."""
        return self.name.split()[0]

    @property
    def phase(self) -> int:
        return int(self.key.split(".")[0])

    @property
    def ids(self) -> list[str]:
        """The TODO ids it grades: "1.1-1.3" -> 1.1, 1.2, 1.3 (regions 3.8a and 3.8b belong to 3.8)."""
        m = _ID.match(self.key)
        if not m:
            raise ValueError(f"exercise {self.name!r} in weights.toml does not start with an id like 3.4 or 4.1-4.4")
        lo, hi = int(m[2]), int(m[4] or m[2])
        return [f"{m[1]}.{i}" for i in range(lo, hi + 1)]


@dataclass(frozen=True)
class Region:
    """One TODO region of a template, where the learner's checkout has it."""

    id: str  # "1.1", "3.8a"
    title: str
    path: Path  # relative to the learner's checkout
    line: int  # of its "# --- TODO" line
    where: str  # its guideline section, "phase1_data_parallel/guidelines.md#all-reduce-three-ways"

    @property
    def base(self) -> str:
        return self.id.rstrip("abcdefghijklmnopqrstuvwxyz")


def exercises(repo: Path = REPO) -> list[Exercise]:
    """Every graded exercise, in the order of weights.toml (the order of the course)."""
    table = tomllib.loads((repo / "grading" / "weights.toml").read_text())["weights"]
    return [Exercise(name, float(points)) for name, points in table.items()]


def find(ident: str, repo: Path = REPO) -> Exercise:
    """The exercise a learner means by ``ident``: its key ("1.1-1.3"), its name, or one TODO id in it
    ("1.2": the narrowest exercise that grades TODO 1.2, so "2.5" is "2.5 ...", not "2.3-2.5 ...")."""
    all_ = exercises(repo)
    ident = ident.strip()
    for ex in all_:
        if ident in (ex.key, ex.name):
            return ex
    base = ident.rstrip("abcdefghijklmnopqrstuvwxyz")
    holders = [ex for ex in all_ if base in ex.ids]
    if not holders:
        keys = ", ".join(ex.key for ex in all_[:6])
        raise ValueError(f"no exercise {ident!r}: use an id from `python -m distlab status` ({keys}, ...)")
    return min(holders, key=lambda ex: len(ex.ids))


def regions(root: Path) -> list[Region]:
    """Every TODO region in the learner's templates, file by file, top to bottom."""
    found = []
    for path in sorted(root.glob("phase*/template_*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if m := TODO_BEGIN.match(line):
                title = line.split(":", 1)[1].strip().rstrip("-").strip()
                where = ""
                for later in lines[i + 1:]:
                    if w := _TODO_RAISE.search(later):
                        where = f"{path.parent.name}/{w['where']}"
                        break
                    if TODO_END.match(later):
                        break
                found.append(Region(m["id"], title, path.relative_to(root), i + 1, where))
    return found


def regions_of(ex: Exercise, root: Path) -> list[Region]:
    return [r for r in regions(root) if r.base in ex.ids]


def edited(ex: Exercise, root: Path) -> bool:
    """Whether any of the exercise's regions holds the learner's code."""
    for path in {r.path for r in regions_of(ex, root)}:
        if set(edited_regions((root / path).read_text())) & {r.id for r in regions_of(ex, root)}:
            return True
    return False


def fingerprint(ex: Exercise, root: Path) -> list[list]:
    """Modification time and size of the exercise's template files: what ``watch`` polls."""
    paths = sorted({r.path for r in regions_of(ex, root)})
    return [[p.as_posix(), (root / p).stat().st_mtime_ns, (root / p).stat().st_size] for p in paths]


def test_files(ex: Exercise, repo: Path = REPO) -> list[Path]:
    """The test files that hold the exercise's tests (a text search: no import, no collection)."""
    marker = f'exercise("{ex.name}")'
    return [p for p in sorted((repo / "tests").glob("test_*.py")) if marker in p.read_text()]


def learner_root(start: Path | None = None) -> Path:
    """The learner's checkout: the nearest folder above ``start`` (the current one) with grading/weights.toml."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "grading" / "weights.toml").is_file() and any(folder.glob("phase*/template_*.py")):
            return folder
    return REPO


# --- the state file: last check per exercise, hints seen ----------------------------------------

def load_state(root: Path) -> dict:
    path = root / STATE
    if not path.is_file():
        return {"checks": {}, "hints": {}}
    state = json.loads(path.read_text())
    state.setdefault("checks", {})
    state.setdefault("hints", {})
    return state


def save_state(root: Path, state: dict) -> None:
    path = root / STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)  # a watch and a check at once never leave half a file


def record_check(root: Path, ex: Exercise, result: dict) -> None:
    state = load_state(root)
    state["checks"][ex.name] = dict(result, when=time.strftime("%Y-%m-%d %H:%M:%S"),
                                    fingerprint=fingerprint(ex, root))
    save_state(root, state)


def exercise_state(ex: Exercise, root: Path, state: dict) -> str:
    """untouched, edited (not checked since), failing, passing; "(changed since)" after an edit."""
    last = state["checks"].get(ex.name)
    if last is None:
        return "edited" if edited(ex, root) else "untouched"
    verdict = "passing" if last["passed"] == last["total"] and last["total"] and not last.get("partial") else "failing"
    if last.get("fingerprint") != fingerprint(ex, root):
        return f"{verdict} (edited since)"
    return verdict
