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
