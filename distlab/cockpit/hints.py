"""Hints, one at a time, from the guidelines' collapsed blocks.

Each TODO's hints are a ``<details><summary>Hints for TODO 1.1</summary>`` block in its phase's
guidelines, from gentle to explicit: a numbered list (each item, with its continuation lines, is
one hint) or paragraphs. An exercise's hints are those of its TODO ids in order; the state file
remembers how many the learner has seen.
"""
from __future__ import annotations

import re
from pathlib import Path

from distlab.cockpit.course import REPO, Exercise

_BLOCK = re.compile(r"<details><summary>Hints for TODO (?P<summary>[^<]*)</summary>(?P<body>.*?)</details>", re.S)
_ITEM = re.compile(r"^\d+\.\s")


def _items(body: str) -> list[str]:
    """A numbered item and its indented continuation lines, or a paragraph: one hint each."""
    hints: list[list[str]] = []
    new = True
    for line in body.strip("\n").splitlines():
        if not line.strip():
            new = True
            continue
        if _ITEM.match(line) or new:
            hints.append([])
        hints[-1].append(line.rstrip())
        new = False
    return ["\n".join(h) for h in hints]


def hints(ex: Exercise, root: Path) -> list[tuple[str, str]]:
    """``(TODO id, hint text)`` for every hint of the exercise, in the order to show them."""
    phase = next(iter(root.glob(f"phase{ex.phase}_*")), None) or next(REPO.glob(f"phase{ex.phase}_*"))
    found: dict[str, list[tuple[str, str]]] = {}
    for guide in sorted(phase.glob("guidelines*.md")):
        for m in _BLOCK.finditer(guide.read_text()):
            # "1.1", or "3.8a (server) and 3.8b (worker push)": the block serves every id it names
            ids = re.findall(r"\d+\.\d+[a-z]?", m["summary"])
            for base in {i.rstrip("abcdefghijklmnopqrstuvwxyz") for i in ids}:
                if base in ex.ids:
                    found.setdefault(base, []).extend((ids[0], h) for h in _items(m["body"]))
    return [h for i in ex.ids for h in found.get(i, [])]


_DETAILS = re.compile(r"<details>.*?</details>\n?", re.S)
_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


def section(ex: Exercise, root: Path) -> str:
    """The exercise's guideline section (the manifest's anchor, to the next heading as high), hints left out:
    in a terminal a ``<details>`` block is not collapsed, so every hint would show at once."""
    from distlab.manifest import _slug

    file, _, anchor = ex.guide.partition("#")
    path = root / file if (root / file).is_file() else REPO / file
    lines, out, level, fenced = path.read_text().splitlines(), [], None, False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if level is None:
            if m and _slug(m[2]) == anchor:
                level = len(m[1])
                out.append(line)
            continue
        if m and len(m[1]) <= level:
            break
        out.append(line)
    if level is None:
        raise ValueError(f"{file} has no section #{anchor} (the manifest's guide for {ex.id}): read {file} itself")
    text = "\n".join(out).strip("\n") + "\n"
    hidden = len(_DETAILS.findall(text))
    text = re.sub(r"\n{3,}", "\n\n", _DETAILS.sub("", text)).rstrip("\n")
    if hidden:
        text += f"\n\n(hints left out: `python -m distlab hint {ex.key}` shows them one at a time)"
    return text + f"\n\n({path.relative_to(root if path.is_relative_to(root) else REPO).as_posix()}#{anchor})"
