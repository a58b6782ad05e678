"""The course as the cockpit sees it: exercises, their TODO regions, their tests, and the state file.

An exercise is an entry of the course's manifest (distlab/course.toml, read by distlab/manifest.py): its
id ("1.1-1.3"), title, points, TODO regions, lessons, test files and guideline section. Its TODO regions
are found in the learner's templates (``root``: the learner's checkout, this repository by default); its
tests are in this repository's tests/. Nothing here imports torch or pytest: ``status``, ``next`` and
``hint`` answer at once.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from distlab import manifest
from distlab.manifest import Exercise, base
from distlab.templates import TODO_BEGIN, TODO_END, edited_regions

REPO = Path(__file__).resolve().parents[2]  # the checkout that holds the tests and the manifest
STATE = Path(".distlab") / "state.json"  # in the learner's checkout, git-ignored
_TODO_RAISE = re.compile(r'raise todo\("[^"]*", "(?P<where>[^"]+)"\)')


@dataclass(frozen=True)
class Region:
    """One TODO region of a template, where the learner's checkout has it."""

    id: str  # "1.1", "3.8a"
    title: str
    path: Path  # relative to the learner's checkout
    line: int  # of its "# --- TODO" line
    where: str  # its guideline section, from the stub's raise (empty once the learner's code replaced it)

    @property
    def base(self) -> str:
        return base(self.id)


def exercises(repo: Path = REPO) -> list[Exercise]:
    """Every graded exercise, in the manifest's order (the order of the course)."""
    return manifest.exercises()


def _narrowest(todo: str, all_: list[Exercise]) -> Exercise | None:
    holders = [ex for ex in all_ if base(todo) in ex.ids]
    return min(holders, key=lambda ex: len(ex.ids)) if holders else None


def _unknown(ident: str, all_: list[Exercise]) -> ValueError:
    keys = ", ".join(ex.key for ex in all_[:6])
    return ValueError(f"no exercise {ident!r}: use an id from `python -m distlab status` ({keys}, ...)")


def find(ident: str, repo: Path = REPO) -> Exercise:
    """The exercise a learner means by ``ident``: its id ("1.1-1.3"), its name, or one TODO id in it
    ("1.2": the narrowest exercise that grades TODO 1.2, so "2.5" is "2.5 ...", not "2.3-2.5 ...")."""
    all_ = exercises(repo)
    ident = ident.strip()
    if ex := manifest.lookup(ident):
        return ex
    if (ex := _narrowest(ident, all_)) is None:
        raise _unknown(ident, all_)
    return ex


def select(ident: str, repo: Path = REPO) -> list[Exercise]:
    """What ``check`` runs for ``ident``: an exercise (by id, name or TODO id, as ``find``), or for a range
    that is no exercise ("3.1-3.3") every exercise inside it, in the course's order; failing that, the
    narrowest exercise that holds the whole range ("1.1-1.2": 1.1-1.3)."""
    all_ = exercises(repo)
    ident = ident.strip()
    if manifest.lookup(ident) or "-" not in ident:
        return [find(ident, repo)]
    try:
        ids = manifest.id_range(ident)
    except ValueError:
        raise _unknown(ident, all_) from None
    inside = [ex for ex in all_ if set(ex.ids) <= set(ids)]
    if inside:
        return inside
    around = [ex for ex in all_ if set(ids) <= set(ex.ids)]
    if not around:
        raise _unknown(ident, all_)
    return [min(around, key=lambda ex: len(ex.ids))]


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


def _region_lines(text: str, rid: str) -> str:
    out, inside = [], False
    for line in text.splitlines():
        if (m := TODO_BEGIN.match(line)) and m["id"] == rid:
            inside = True
        if inside:
            out.append(line)
            if (m := TODO_END.match(line)) and m["id"] == rid:
                break
    return "\n".join(out)


def fingerprint(ex: Exercise, root: Path) -> list[list[str]]:
    """The exercise's TODO regions as they are now ([file, id, digest of its lines] each): what ``status``
    compares with the last check's and ``watch`` polls. Regions, not files: editing 3.4 leaves 3.1-3.3's alone."""
    out, texts = [], {}
    for r in regions_of(ex, root):
        text = texts.setdefault(r.path, (root / r.path).read_text())
        out.append([r.path.as_posix(), r.id, hashlib.sha1(_region_lines(text, r.id).encode()).hexdigest()[:16]])
    return out


def test_files(ex: Exercise, repo: Path = REPO) -> list[Path]:
    """The test files that hold the exercise's tests (the manifest's list; no import, no collection)."""
    return [repo / t for t in ex.tests if (repo / t).is_file()]


def learner_root(start: Path | None = None) -> Path:
    """The learner's checkout: the nearest folder above ``start`` (the current one) with templates and a bench."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "distlab" / "course.toml").is_file() and any(folder.glob("phase*/template_*.py")):
            return folder
    return REPO


# --- the state file: last check per exercise, hints seen ----------------------------------------

def load_state(root: Path) -> dict:
    path = root / STATE
    if not path.is_file():
        return {"checks": {}, "hints": {}}
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:  # a crash mid-write of an older version, an editor: one line, not a traceback
        raise ValueError(f"{path} is corrupt ({exc}): delete it (it only remembers your last checks and the hints "
                         "you saw; the next check records again)") from None
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


def what_next(root: Path) -> Exercise | None:
    """The exercise to work on: the smallest one holding the first unfinished TODO, in the course's order.

    Rows overlap (2.3-2.4, 2.3-2.5, 2.5): walking the course, the first exercise not passing is next
    unless one of its TODOs belongs to a smaller exercise not passing yet, which comes first; so a
    composite (2.3-2.5) is next once each of its TODOs passes in its own exercise.
    """
    state, all_, known = load_state(root), exercises(), {}

    def passing(ex: Exercise) -> bool:
        if ex.name not in known:
            known[ex.name] = exercise_state(ex, root, state) == "passing"
        return known[ex.name]

    for ex in all_:
        if passing(ex):
            continue
        for todo in ex.ids:
            smallest = _narrowest(todo, all_)
            if smallest is not ex and not passing(smallest):
                return smallest
        return ex
    return None
