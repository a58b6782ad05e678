"""Every exercise has graded hints in its guideline, and no hint hands over the solution.

A phase's guidelines hold, per exercise, a collapsed block::

    <details><summary>Hints for TODO 1.2</summary>

    1. the idea (what has to happen, in words)
    2. the API (which calls, on what, in which order)
    3. the structure (the calls, their order, the shapes, the loop skeleton)
    </details>

The learner's CLI shows the numbered items one at a time. The last hint may name a call
with its arguments, but leaves the lines to the learner: a hint that quotes the solution
line by line turns the exercise into copying. Checked against the marked solution regions
(``# ### BEGIN SOLUTION x.y`` in ``solutions/``), the source the templates are made from:

* every region id has a hints block with at least two numbered hints;
* no hint quotes two consecutive solution lines (whitespace-normalised, comments dropped);
* no hint's code holds a contiguous run of the region's tokens longer than one call.
"""
from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((REPO / "solutions").glob("phase*/*.py"))
GUIDELINES = sorted(REPO.glob("phase*/*.md"))

BEGIN = re.compile(r"^\s*# ### BEGIN SOLUTION (?P<id>\d+\.\d+[a-z]?):")
END = re.compile(r"^\s*# ### END SOLUTION (?P<id>\d+\.\d+[a-z]?)\s*$")
SUMMARY = re.compile(r"<details><summary>Hints for TODO (?P<ids>[^<]+)</summary>")
ITEM = re.compile(r"^(?P<n>\d+)\. ")
# Tokens of code as a reader compares it: names, numbers, strings (either quote), operators.
TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|\"[^\"]*\"|'[^']*'|\*\*=?|//=?|->|[=!<>+\-*/%@&|^]=|<<|>>|\.\.\.|\S")

# A line with fewer tokens is boilerplate that any answer shares (`else:`, `return x`,
# `total += other`): quoting two of those hands over nothing.
MIN_LINE_TOKENS = 5
# The longest run of region tokens one hint may quote. One call with its arguments, e.g.
# `dist.all_gather(gathered, tensor.contiguous(), group=group)` (16 tokens), is the API a
# hint names; 20 tokens lets such a call through but not a call plus what surrounds it. For
# regions too short for that (a few lines), at most half the region's tokens: the other
# half is left to the learner.
MAX_RUN_TOKENS = 20
MAX_RUN_FRACTION = 0.5


def tokens(code: str) -> list[str]:
    return [t.replace("'", '"') for t in TOKEN.findall(code)]


@dataclass(frozen=True)
class Region:
    id: str
    where: str            # file:line of its BEGIN marker
    lines: tuple[tuple[str, ...], ...]  # its logical code lines, as tokens (comments dropped)

    @property
    def tokens(self) -> list[str]:
        return [t for line in self.lines for t in line]


def solution_regions() -> dict[str, Region]:
    """Every exercise region in ``solutions/``, by id."""
    found = {}
    for path in SOLUTIONS:
        text = path.read_text()
        spans, start = {}, None
        for lineno, line in enumerate(text.splitlines(), 1):
            if m := BEGIN.match(line):
                start = (m["id"], lineno)
            elif (m := END.match(line)) and start:
                spans[start[0]] = (start[1], lineno)
                start = None
        if not spans:
            continue
        logical: dict[str, list[list[str]]] = {rid: [[]] for rid in spans}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            rid = next((r for r, (lo, hi) in spans.items() if lo < tok.start[0] < hi), None)
            if rid is None:
                continue
            if tok.type == tokenize.NEWLINE and logical[rid][-1]:
                logical[rid].append([])
            elif tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
                logical[rid][-1].append(tok.string)
        for rid, lines in logical.items():
            rel = f"{path.relative_to(REPO)}:{spans[rid][0]}"
            # a trailing ':' is dropped: `for src in range(1, W)` in a hint quotes `for src in range(1, W):`
            code = tuple(tuple(t[:-1] if t[-1:] == [":"] else t) for line in lines if line
                         for t in [tokens(" ".join(line))])
            found[rid] = Region(rid, rel, code)
    return found


@dataclass(frozen=True)
class Hints:
    ids: tuple[str, ...]
    where: str                 # file:line of the block
    items: tuple[str, ...]     # the numbered hints' text, in order


def hint_blocks() -> dict[str, Hints]:
    """Every hints block in the guidelines, by each TODO id its summary names."""
    found = {}
    for path in GUIDELINES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not (m := SUMMARY.search(line)):
                continue
            body = []
            for line2 in lines[i + 1:]:
                if line2.strip() == "</details>":
                    break
                body.append(line2)
            items: list[list[str]] = []
            for line2 in body:
                if ITEM.match(line2):
                    items.append([ITEM.sub("", line2)])
                elif items:
                    items[-1].append(line2)
            ids = tuple(re.findall(r"\d+\.\d+[a-z]?", m["ids"]))
            block = Hints(ids, f"{path.relative_to(REPO)}:{i + 1}", tuple("\n".join(it) for it in items))
            for rid in ids:
                found[rid] = block
    return found


def code_spans(hint: str) -> list[list[str]]:
    """The code a hint quotes (fenced blocks and `inline` spans), each as tokens."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", hint, flags=re.S)
    rest = re.sub(r"```.*?```", " ", hint, flags=re.S)
    inline = re.findall(r"``(.+?)``|`([^`]+)`", rest, flags=re.S)
    return [tokens(c) for c in fenced] + [tokens(a or b) for a, b in inline]


def contains(seq: list[str], part: tuple[str, ...]) -> bool:
    n = len(part)
    return any(tuple(seq[i:i + n]) == part for i in range(len(seq) - n + 1))


def quoted_line_pairs(region: Region, hint: str) -> list[tuple[str, str]]:
    """Consecutive non-trivial solution lines that a hint both quotes."""
    spans = code_spans(hint)
    lines = [line for line in region.lines if len(line) >= MIN_LINE_TOKENS]
    quoted = [any(contains(s, line) for s in spans) for line in lines]
    return [(" ".join(a), " ".join(b)) for a, b, qa, qb in zip(lines, lines[1:], quoted, quoted[1:]) if qa and qb]


def longest_run(region: Region, hint: str) -> list[str]:
    """The longest contiguous run of the region's tokens found in one code span of the hint."""
    ref, best = region.tokens, []
    for span in code_spans(hint):
        # longest common substring, by dynamic programming over (span, region) positions
        prev = [0] * (len(ref) + 1)
        for i, tok in enumerate(span):
            cur = [0] * (len(ref) + 1)
            for j, r in enumerate(ref):
                if tok == r:
                    cur[j + 1] = prev[j] + 1
                    if cur[j + 1] > len(best):
                        best = span[i - cur[j + 1] + 1:i + 1]
            prev = cur
    return best


def run_limit(region: Region) -> int:
    return min(MAX_RUN_TOKENS, max(1, int(MAX_RUN_FRACTION * len(region.tokens))))


REGIONS = solution_regions()
HINTS = hint_blocks()


def hints_for(rid: str) -> Hints | None:
    """The block for TODO ``rid``: its own, or its exercise's (``2.15`` serves 2.15a-2.15d)."""
    return HINTS.get(rid) or HINTS.get(rid.rstrip("abcdefghijklmnopqrstuvwxyz"))


def test_solutions_have_regions_and_guidelines_have_hints():
    assert len(REGIONS) > 50 and len(HINTS) > 50, f"found {len(REGIONS)} regions and {len(HINTS)} hinted TODOs"


@pytest.mark.parametrize("rid", sorted(REGIONS), ids=str)
def test_every_exercise_has_graded_hints(rid):
    block = hints_for(rid)
    assert block, (f"TODO {rid} ({REGIONS[rid].where}) has no hints: add "
                   f"'<details><summary>Hints for TODO {rid}</summary>' with numbered hints to its guideline")
    assert len(block.items) >= 2, (f"TODO {rid}: {len(block.items)} hint(s) at {block.where}; give at least two, "
                                   "from the idea to the structure of the code")


@pytest.mark.parametrize("rid", sorted(REGIONS), ids=str)
def test_no_hint_reproduces_the_solution(rid):
    region, block = REGIONS[rid], hints_for(rid)
    if block is None:
        pytest.skip("no hints block (test_every_exercise_has_graded_hints says so)")
    problems = []
    for n, hint in enumerate(block.items, 1):
        for a, b in quoted_line_pairs(region, hint):
            problems.append(f"hint {n} quotes two consecutive solution lines: `{a}` / `{b}`")
        run = longest_run(region, hint)
        if len(run) > run_limit(region):
            problems.append(f"hint {n} quotes {len(run)} consecutive tokens of the solution's {len(region.tokens)} "
                            f"(at most {run_limit(region)}): `{' '.join(run)}`")
    assert not problems, (f"TODO {rid}'s hints at {block.where} give away {region.where}; say the structure "
                          "(calls, order, shapes) and leave the lines to the learner:\n" + "\n".join(problems))


def test_hint_blocks_name_only_existing_exercises():
    exercises = set(REGIONS) | {rid.rstrip("abcdefghijklmnopqrstuvwxyz") for rid in REGIONS}
    stray = sorted(set(HINTS) - exercises)
    assert not stray, f"hints for TODOs that no solution region has: {stray} ({[HINTS[s].where for s in stray]})"
