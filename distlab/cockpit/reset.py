"""``reset``: put TODO regions of the learner's template back to their stubs, keeping the rest.

The stub is what distlab.templates generates from the solution today; only the lines from the
region's ``# --- TODO`` line to its ``# --- end TODO`` line change. The learner's old region is
kept in ``.distlab/reset/<template>.<id>.<time>.py`` first.
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
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = root / STATE.parent / "reset" / f"{region.path.name}.{region.id}.{stamp}.py"
    n = 1
    while kept.exists():  # two resets within a second: keep both
        n += 1
        kept = kept.with_name(f"{region.path.name}.{region.id}.{stamp}-{n}.py")
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text("".join(lines[t0:t1 + 1]))
    lines[t0:t1 + 1] = [l + "\n" for l in stub_lines[s0:s1 + 1]]
    path.write_text("".join(lines))
    return kept
