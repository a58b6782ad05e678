"""``reset``: put TODO regions of the learner's template back to their stubs, keeping the rest.

The stub is what distlab.templates generates from the solution today; only the lines from the
region's ``# --- TODO`` line to its ``# --- end TODO`` line change. The learner's old region is
kept in ``.distlab/reset/<template>.<id>.<time>.py`` first; ``restore`` puts the latest one kept back
(keeping what it replaces the same way: a second restore undoes the first).
"""
from __future__ import annotations

import time
from pathlib import Path

from distlab import templates
from distlab.cockpit.course import REPO, STATE, Region


def _span(lines: list[str], rid: str, what: str) -> tuple[int, int]:
    """Indices of the region's first and last line in ``lines``."""
    start = next((i for i, l in enumerate(lines) if (m := templates.TODO_BEGIN.match(l)) and m["id"] == rid), None)
    end = next((i for i, l in enumerate(lines) if (m := templates.TODO_END.match(l)) and m["id"] == rid), None)
    if start is None or end is None or end < start:
        raise ValueError(f"{what} has lost the '# --- TODO {rid}: ... ---' or '# --- end TODO {rid} ---' line: put it "
                         f"back around your code, or regenerate the whole file with "
                         f"`python -m distlab.templates --write --force {what}` (your code there is lost)")
    return start, end


def reset(region: Region, root: Path, repo: Path = REPO) -> Path:
    """Restore ``region`` in the learner's template to its stub; return where the old region was kept."""
    path = root / region.path
    solution = repo / "solutions" / region.path.parent / region.path.name.removeprefix("template_")
    stub_lines = templates.render(solution, repo).splitlines()
    s0, s1 = _span(stub_lines, region.id, f"the template generated from {solution.relative_to(repo)}")
    lines = path.read_text().splitlines(keepends=True)
    t0, t1 = _span([l.rstrip("\n") for l in lines], region.id, region.path.as_posix())
    kept = _keep(region, root, "".join(lines[t0:t1 + 1]))
    lines[t0:t1 + 1] = [l + "\n" for l in stub_lines[s0:s1 + 1]]
    path.write_text("".join(lines))
    return kept


def _keep(region: Region, root: Path, text: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = root / STATE.parent / "reset" / f"{region.path.name}.{region.id}.{stamp}.py"
    n = 1
    while kept.exists():  # two resets within a second: keep both
        n += 1
        kept = kept.with_name(f"{region.path.name}.{region.id}.{stamp}-{n}.py")
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(text)
    return kept


def kept_versions(region: Region, root: Path) -> list[Path]:
    """The region's kept versions, oldest first (by the time in their names, then their counter)."""
    def order(p: Path) -> tuple[str, int]:
        parts = p.name[len(f"{region.path.name}.{region.id}."):-len(".py")].split("-")  # 20261128-100145[-2]
        return "".join(parts[:2]), int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 1

    folder = root / STATE.parent / "reset"
    return sorted(folder.glob(f"{region.path.name}.{region.id}.*.py"), key=order)


def restore(region: Region, root: Path) -> tuple[Path, Path]:
    """Put the latest kept version of ``region`` back in the learner's template, keeping what it replaces.

    Returns (the version restored, where the replaced region was kept).
    """
    versions = kept_versions(region, root)
    if not versions:
        raise ValueError(f"nothing kept for TODO {region.id} in {STATE.parent / 'reset'}: only code that "
                         "`python -m distlab reset` replaced can be restored")
    latest = versions[-1]
    new = latest.read_text().splitlines(keepends=True)
    if not new or not templates.TODO_BEGIN.match(new[0].rstrip("\n")) or not templates.TODO_END.match(new[-1].rstrip("\n")):
        raise ValueError(f"{latest.relative_to(root)} is not a whole TODO {region.id} region: copy from it by hand")
    path = root / region.path
    lines = path.read_text().splitlines(keepends=True)
    t0, t1 = _span([l.rstrip("\n") for l in lines], region.id, region.path.as_posix())
    replaced = _keep(region, root, "".join(lines[t0:t1 + 1]))
    latest.unlink()  # back in place; what it replaced is now the latest kept, so a second restore undoes this one
    lines[t0:t1 + 1] = new
    path.write_text("".join(lines))
    return latest, replaced
