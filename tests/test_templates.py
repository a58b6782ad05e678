"""Templates are generated from the solutions, and untouched templates fail every test cleanly.

1. Every ``phaseN_*/template_<x>.py`` is exactly what ``python -m distlab.templates``
   generates from the marked regions of ``solutions/phaseN_*/<x>.py``: a fix to a
   solution reaches its template by regenerating, and a hand edit of a generated part
   fails here. The generator never overwrites a learner's work unless forced.
2. Templates import only torch and distlab; demos reach lesson code only through
   ``distlab.loader.load``, so ``IMPL=templates`` runs the learner's code.
   A linter (flake8's pyflakes checks) reports nothing on an untouched template.
3. Running a phase's tests with ``--impl templates`` on the untouched templates makes
   every test fail with ``LearnerTODO`` (not another error, not a hang), within
   seconds; tests marked ``scaffold`` check code the template gives away and pass.
4. Every demo (RUN_MODE) run on the untouched templates stops with the one TODO line.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlab import templates as gen

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = sorted(REPO.glob("phase*/template_*.py"))
PHASE_TESTS = sorted((REPO / "tests").glob("test_phase*.py"))
ENTRYPOINT = REPO / "entrypoint.sh"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_there_are_templates():
    assert TEMPLATES, "no phase*/template_*.py found"


def test_committed_templates_are_generated_from_the_solutions():
    problems = gen.check(REPO)
    assert not problems, "\n\n".join(problems)


SOLUTION = '''"""A lesson."""
from __future__ import annotations

import torch


def double(x: torch.Tensor) -> torch.Tensor:
    """Twice x."""
    y = torch.empty_like(x)
    # ### BEGIN SOLUTION 9.1: double it [guidelines.md#double]
    # Goal: y holds 2 * x.
    y.copy_(x * 2)  # the lesson
    # ### END SOLUTION 9.1
    return y
'''


@pytest.fixture
def mini_repo(tmp_path):
    (tmp_path / "solutions" / "phase9_x").mkdir(parents=True)
    (tmp_path / "phase9_x").mkdir()
    (tmp_path / "solutions" / "phase9_x" / "lesson.py").write_text(SOLUTION)
    return tmp_path


def test_generator_replaces_each_region_by_its_stub_and_a_todo(mini_repo):
    assert gen.main(["--repo", str(mini_repo), "--write"]) == 0
    text = (mini_repo / "phase9_x" / "template_lesson.py").read_text()
    assert "y.copy_(x * 2)" not in text and "# Goal: y holds 2 * x." in text
    assert 'raise todo("9.1 double it", "guidelines.md#double")' in text
    assert "from distlab.todo import todo" in text and "y = torch.empty_like(x)" in text
    ns = {}
    exec(compile(text, "template_lesson.py", "exec"), ns)
    with pytest.raises(NotImplementedError, match=r"TODO 9.1 double it"):
        ns["double"](__import__("torch").ones(2))
    assert gen.check(mini_repo) == []


def test_check_fails_on_a_hand_edit_of_a_generated_part(mini_repo):
    gen.main(["--repo", str(mini_repo), "--write"])
    template = mini_repo / "phase9_x" / "template_lesson.py"
    template.write_text(template.read_text().replace('"""Twice x."""', '"""Three times x."""'))
    problems = gen.check(mini_repo)
    assert len(problems) == 1 and "template_lesson.py differs" in problems[0] and gen.COMMAND in problems[0]
    assert gen.main(["--repo", str(mini_repo), "--check"]) == 1


def test_write_never_overwrites_a_learners_code_unless_forced(mini_repo):
    gen.main(["--repo", str(mini_repo), "--write"])
    template = mini_repo / "phase9_x" / "template_lesson.py"
    mine = template.read_text().replace('    raise todo("9.1 double it", "guidelines.md#double")\n',
                                        "    y.copy_(x + x)  # my answer\n")
    template.write_text(mine)
    solution = mini_repo / "solutions" / "phase9_x" / "lesson.py"
    solution.write_text(solution.read_text().replace('"""Twice x."""', '"""Twice x, in a new buffer."""'))
    written, refused = gen.write(mini_repo)
    assert written == [] and len(refused) == 1 and "TODO 9.1 hold your code" in refused[0]
    assert template.read_text() == mine
    written, refused = gen.write(mini_repo, force=("phase9_x/template_lesson.py",))
    assert written == ["phase9_x/template_lesson.py"] and "in a new buffer" in template.read_text()


def test_untouched_template_is_regenerated_when_its_solution_changes(mini_repo):
    gen.main(["--repo", str(mini_repo), "--write"])
    solution = mini_repo / "solutions" / "phase9_x" / "lesson.py"
    solution.write_text(solution.read_text().replace("# Goal: y holds 2 * x.", "# Goal: y holds x doubled."))
    assert gen.check(mini_repo) != []
    assert gen.write(mini_repo) == (["phase9_x/template_lesson.py"], [])
    assert "x doubled" in (mini_repo / "phase9_x" / "template_lesson.py").read_text()


@pytest.mark.parametrize("broken, message", [
    ("    # ### END SOLUTION 9.1\n", "never closed"),
    ("    # ### BEGIN SOLUTION 9.1: double it [guidelines.md#double]\n", "does not close"),
])
def test_malformed_markers_are_refused_with_their_line(mini_repo, broken, message):
    solution = mini_repo / "solutions" / "phase9_x" / "lesson.py"
    solution.write_text(solution.read_text().replace(broken, ""))
    with pytest.raises(gen.MarkerError, match=message):
        gen.render(solution, mini_repo)


def test_a_template_without_a_marked_solution_is_reported(mini_repo):
    (mini_repo / "phase9_x" / "template_orphan.py").write_text("x = 1\n")
    gen.main(["--repo", str(mini_repo), "--write"])
    assert any("template_orphan.py has no marked solution" in p for p in gen.check(mini_repo))


# --------------------------------------------------------------------------- linter
# flake8 restricted to F (pyflakes: unused imports and locals, undefined names, ...), the
# checks that point at mistakes; pycodestyle's layout rules (79-column lines) are not the
# house style. --isolated: no user or project configuration changes what is checked.
FLAKE8 = [sys.executable, "-m", "flake8", "--isolated", "--select", "F"]


def _flake8(*paths: Path, disable_noqa: bool = False) -> list[str]:
    proc = subprocess.run([*FLAKE8, *(["--disable-noqa"] if disable_noqa else []), *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "No module named flake8" not in proc.stderr, \
        "flake8 is missing: `pip install -r requirements.txt` (it pins the linter these tests run)"
    assert proc.returncode in (0, 1) and not proc.stderr.strip(), f"flake8 failed to run:\n{proc.stderr[-2000:]}"
    return proc.stdout.splitlines()


def test_a_linter_reports_nothing_on_the_generated_templates():
    """An untouched template lints clean: what its regions need is marked, nothing else is unused."""
    warnings = _flake8(*TEMPLATES)
    assert not warnings, (f"{len(warnings)} linter warnings on the templates (fix the solution, or the "
                          f"generator's marks in distlab/templates.py, then `{gen.COMMAND}`):\n" + "\n".join(warnings))


LINTED = '''"""A lesson whose scaffold holds names only its region uses or defines."""
from __future__ import annotations

import math

import torch

EPS = 0.0  # a module global: never reported unused, so never marked


def norm(x: torch.Tensor) -> torch.Tensor:
    """The Euclidean norm of x."""
    n = x.numel()
    squares = x * x
    # ### BEGIN SOLUTION 9.2: the norm [guidelines.md#norm]
    # Goal: total holds sqrt(sum of squares).
    total = torch.tensor(math.sqrt(float(squares.sum()) + EPS))
    # ### END SOLUTION 9.2
    assert n >= 0
    return total
'''


def test_generator_marks_exactly_what_a_linter_would_flag_for_a_missing_region(mini_repo):
    """An import and a local only the region reads, and a name only the region defines: each line
    says which TODO it serves, the linter is quiet, and each mark covers a warning (none extra)."""
    (mini_repo / "solutions" / "phase9_x" / "lesson.py").write_text(LINTED)
    assert gen.main(["--repo", str(mini_repo), "--write"]) == 0
    template = mini_repo / "phase9_x" / "template_lesson.py"
    text = template.read_text()
    assert "import math  # noqa: F401 (math: for TODO 9.2)" in text
    assert "squares = x * x  # noqa: F841 (squares: for TODO 9.2)" in text
    assert "return total  # noqa: F821 (total: set by TODO 9.2)" in text
    assert "n = x.numel()\n" in text, "n is read after the region: it needs no mark"
    assert _flake8(template) == []
    flagged = {int(w.split(":")[1]) for w in _flake8(template, disable_noqa=True)}
    marked = {i for i, line in enumerate(text.splitlines(), 1) if "# noqa: F" in line}
    assert flagged == marked, f"lines the linter flags with the marks ignored {sorted(flagged)}, lines marked {sorted(marked)}"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_template_imports_no_solution_and_no_other_template(template):
    bad = sorted(m for m in _imports(template)
                 if m.startswith("solutions") or ".template_" in m or m.startswith("phase"))
    assert not bad, f"{template} imports {bad}: templates may use distlab and torch only"


@pytest.fixture(scope="module")
def untouched_template_results(request, tmp_path_factory) -> dict:
    """One pytest run over every selected phase file with --impl=templates (one start-up, not one per file)."""
    files = sorted({item.callspec.params["test_file"] for item in request.session.items
                    if item.originalname == "test_untouched_templates_fail_with_learner_todo"})
    out = tmp_path_factory.mktemp("templates") / "results.json"
    cmd = [sys.executable, "-m", "pytest", *map(str, files), "--impl=templates", f"--results-json={out}",
           "-q", "-p", "no:cacheprovider", "--tb=no"]  # the results file has every message
    # Nested timeouts: each inner test keeps pyproject's 300 s (its run_distributed deadlines are
    # below it); the whole inner run gets 1100 s, below this module's first test's 1200 s.
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1100)
    assert out.is_file(), f"pytest wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    return json.loads(out.read_text())["per_test"]


# The first of these tests runs the module fixture (one nested pytest over every phase file,
# ~1-2 minutes on 2 quiet cores, several times that on a busy machine): its pytest-timeout covers it.
@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("test_file", PHASE_TESTS, ids=lambda p: p.name)
def test_untouched_templates_fail_with_learner_todo(test_file, untouched_template_results):
    per_test = {k: v for k, v in untouched_template_results.items() if k.split("::")[0].endswith(test_file.name)}
    assert per_test, f"no tests ran from {test_file.name}"
    problems = []
    for nodeid, r in per_test.items():
        if r["exercise"] == "bench":
            continue  # not graded: it checks the bench's given code (distlab.lessons), which templates keep
        if r["scaffold"]:
            if r["outcome"] != "passed":
                problems.append(f"{nodeid}: scaffold test should pass on templates, got {r['error_type']}: {r['message']}")
        elif r["outcome"] != "failed" or r["error_type"] != "LearnerTODO":
            problems.append(f"{nodeid}: expected LearnerTODO, got {r['outcome']} "
                            f"({r['error_type']}: {r['message'][:200]})")
        elif r["duration_s"] > 20:
            problems.append(f"{nodeid}: took {r['duration_s']} s to fail; a TODO must fail within seconds")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- demos
def entrypoint_modes() -> dict[str, str]:
    return dict(re.findall(r"^\s*\[(\w+)\]=([\w.]+)\s*$", ENTRYPOINT.read_text(), flags=re.M))


DEMOS = sorted(set(entrypoint_modes().values()))


@pytest.mark.parametrize("module", DEMOS)
def test_demo_reaches_lesson_code_only_through_the_loader(module):
    path = REPO / (module.replace(".", "/") + ".py")
    bad = sorted(m for m in _imports(path) if m.startswith(("solutions", "phase")) or ".template_" in m)
    assert not bad, f"{path.name} imports {bad}: demos get lesson code through distlab.loader.load, " \
                    "so that IMPL=templates runs the learner's code"
    assert "run_demo(main)" in path.read_text(), f"{path.name}: end with `run_demo(main)` under __main__"


def _run_demo_on_templates(module: str, err_path: str) -> None:
    """Child: run ``python -m module`` as rank 0 of 1 on the templates, stderr to a file."""
    import runpy

    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.environ["DISTLAB_IMPL"] = "templates"
    os.environ["OMP_NUM_THREADS"] = "1"  # two demos share the two cores
    torch_threads = __import__("torch").set_num_threads
    torch_threads(1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@pytest.mark.e2e
@pytest.mark.timeout(700)  # every demo, 2 at a time, each cut at 90 s, in one run with a 600 s deadline
def test_every_demo_stops_at_the_first_todo_on_untouched_templates(tmp_path):
    """``IMPL=templates RUN_MODE=<mode>``: exit code 3 and one line naming the TODO, no traceback.

    Each demo runs in a fresh process forked from one that has imported torch but run no
    op yet (fork is safe then), as ``python -m demos.<mode>`` would run without torchrun.
    """
    code = f"""
import multiprocessing as mp, sys, json
sys.path.insert(0, {str(REPO)!r})
sys.path.insert(0, {str(REPO / "tests")!r})
import torch, torch.distributed  # noqa: F401  (imported once, before any fork)
from test_templates import _run_demo_on_templates
ctx = mp.get_context("fork")
out = {{}}
import time
pending, running = list({DEMOS!r}), {{}}
while pending or running:
    while pending and len(running) < 2:  # two at a time: one per core
        module = pending.pop(0)
        p = ctx.Process(target=_run_demo_on_templates, args=(module, {str(tmp_path)!r} + "/" + module + ".txt"))
        p.start()
        running[module] = (p, time.monotonic())
    for module, (p, start) in list(running.items()):
        if p.exitcode is None and time.monotonic() - start > 90:
            p.kill()
        if p.exitcode is not None or not p.is_alive():
            p.join()
            out[module] = [p.exitcode, open({str(tmp_path)!r} + "/" + module + ".txt").read()]
            del running[module]
    time.sleep(0.02)
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = []
    for module, (rc, output) in results.items():
        lines = [line for line in output.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        if rc != 3 or not re.match(r"TODO \S+ .*: not implemented yet \(see \S+\)$", last) or "Traceback" in output:
            problems.append(f"{module}: exit {rc}, last line {last!r}\n{output[-1500:]}")
    assert not problems, "\n\n".join(problems)


LESSONS = sorted(p for p in (REPO / "solutions").glob("phase*/*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_lesson_module_is_short_and_holds_no_demo(lesson):
    """A lesson reads top to bottom: under 300 lines, no argparse, printing or plotting (those live in demos/)."""
    lines = len(lesson.read_text().splitlines())
    assert lines < 300, f"{lesson.name} has {lines} lines: split it or move demo code to demos/"
    tree = ast.parse(lesson.read_text())
    demo_imports = sorted(m for m in _imports(lesson) if m.split(".")[0] in ("argparse", "matplotlib", "tqdm")
                          or m == "distlab.plots")
    prints = [n.lineno for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]
    assert not demo_imports and not prints, \
        f"{lesson.name}: demo code in a lesson (imports {demo_imports}, print at lines {prints}): move it to demos/"
