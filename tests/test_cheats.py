"""The cheat catalogue: a determined student's submissions, graded as Gradescope grades them.

Each folder of tests/cheats/ is one cheat (its docstring says what it tries), a template file
that scores without implementing its exercise if nothing stops it. Every one goes through
grading/gradescope/run_autograder, from the autograder bundle unpacked in a scratch folder (so
the reference and the tests sit beside the submission, as on Gradescope, and a cheat that
writes files can only spoil the scratch copy), and must score 0 for its exercise with a
one-line reason. Cheats on different template files share a grading run (four per run), three runs go side by
side, and each exercise runs one cheap test (-k): the reason is what is checked, not the whole exercise.
Every round is graded a second time through an instructor's own command, ``pytest --impl templates
--student-dir=...`` run from the unpacked bundle (the local path): 0 again, for the same reason, and the bundle
as it was. What stops each one is in README.md's grading section.

The tests that grade whole submissions (the catalogue, the locked-down bundle, untouched, honest
and duplicate uploads, a rank's reported pass checked by the grader's process: about a minute of
grading runs) form the catalogue tier: marked
``catalogue`` and skipped unless DISTLAB_CATALOGUE=1, which ``.ci/run`` sets for its own run after
the main suite, timed apart as the cluster tier is. The rules, the import guard and the verdict's
process run in the main suite.

    DISTLAB_CATALOGUE=1 python -m pytest -m catalogue tests/test_cheats.py
"""
from __future__ import annotations

import json
import os
import pickle
import re
import select
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from distlab import manifest
from distlab.procs import Deadline, kill_process_tree, marked_environ
from python_env import interpreter_dirs

REPO = Path(__file__).resolve().parent.parent
CHEATS = REPO / "tests" / "cheats"
CATALOGUE_ENV = "DISTLAB_CATALOGUE"
catalogue = pytest.mark.catalogue
only_in_the_tier = pytest.mark.skipif(
    os.environ.get(CATALOGUE_ENV) != "1",
    reason=f"the catalogue tier grades whole submissions through run_autograder (about a minute): run it with "
           f"{CATALOGUE_ENV}=1 python -m pytest -m catalogue tests/test_cheats.py (.ci/run does, after the main suite)")

# Template file -> (exercise, the one test run for it).
GRADED = {
    "template_collectives.py": ("1.1-1.3 all-reduce three ways",
                                "allreduce_matches_builtin_and_single_process and 2-allreduce_allgather_sum"),
    "template_data_loader.py": ("1.4-1.5 distributed sampler", "sampler_shards_are_disjoint"),
    "template_trainer.py": ("1.6-1.8 naive data parallel", "naive_dp_matches_single_process and 2-1.7-mlp"),
    "template_tp_primitives.py": ("2.15-2.16 tensor-parallel conjugate functions",
                                  "tp_primitives_match_single_process and not 3 and not 4"),
    "template_ring_allreduce.py": ("3.1 ring reduce-scatter", "ring_reduce_scatter_matches_builtin_and_single_process and 2"),
    "template_compression.py": ("4.8 fp16/bf16 compression", "cast_hooks_match_float64_mean and 2"),
    "template_checkpoint.py": ("4.1 atomic checksummed save", "save_file_roundtrip_matches_torch_save"),
    "template_moe_primitives.py": ("5.5 differentiable all-to-all",
                                   "all_to_all_uneven_matches_hand_computed_blocks_and_transpose and 2"),
}
# Each run grades one cheat per template file; the reason names the defence that stopped it.
ROUNDS = [
    {"lazy_import_inside_function": "solutions.phase1_data_parallel",
     "builtins_via_sys_modules": "`import sys` is not allowed",
     "bench_copy_distlab_sync": "`from distlab.lessons.sync import allreduce_gradients` is the bench's copy of this exercise",
     "bench_copy_distlab_tp": "`from distlab.lessons.tp import copy_to_region` is the bench's copy of this exercise"},
    {"builtins_via_getattr": "`import builtins` is not allowed",
     "gc_search_for_reference": "`import gc` is not allowed",
     "exec_compile_open_reference": "`compile` is not allowed",
     "runpy_run_path": "`import runpy` is not allowed"},
    {"harness_load_solutions": "`from distlab.loader import load` is not allowed",
     "read_test_file": "`open` is not allowed",
     "patch_assert_tensors_close_code": "`from distlab import testing` is not allowed",
     "patch_torch_equal": "an assignment to `torch.equal`"},
    {"patch_test_module_helpers": "`import sys` is not allowed",
     "carry_over_patch_at_import": "changed the bench's torch.testing.assert_close when imported",
     "inspect_stack_caller_locals": "`import inspect` is not allowed",
     "ctypes_memory": "`import ctypes` is not allowed"},
    {"runtime_patch_in_rank": "graded code changed the bench's torch.equal",
     "rigged_eq": "a `__eq__` method (it could rig a comparison)",
     "write_reference_file": "`open` is not allowed",
     "environ_impl_solutions": "`import os` is not allowed"},
    {"forge_result_pipe": "the attribute `.os` is not allowed"},
    # torch's own implementation accepted as the learner's (distlab/grading/rules.py): refused by the static
    # rules with the exercise's line, and the last one, which they do not see, where it runs.
    {"torch_c10d_all_reduce": "1.1-1.3 all-reduce three ways teaches all-reduce",
     "torch_distributed_sampler": "1.4-1.5 distributed sampler teaches the distributed sampler",
     "torch_process_group_allreduce": "3.1-3.4 ring reduce-scatter, all-gather and all-reduce teaches the ring",
     "torch_fp16_hook": "4.8-4.10 gradient compression teaches compression hooks",
     "torch_nn_all_to_all": "(refused: torch's distributed/nn/functional.py, called from template_moe_primitives.py:"},
    # The operating system's walls (distlab/grading/jail.py): lint-clean cheats that write from C++ into the
    # checkout, or forge the jail's outcome files; the checkout is out of sight and read-only, an outcome is data.
    {"plant_conftest_from_cpp": "unable to open file <tests/conftest.py> in read-write mode",
     "forge_outcome_files": "max abs diff",
     "read_reference_by_path_spelling": "unable to open file <solutions/phase1_data_parallel/trainer.py> in read-only mode: No such file or directory",
     "import_own_reference_in_jail": "TODO 4.1: its reference is not in the grading jail of its own exercise"},
]


APPENDED = "# Appended to the untouched template"  # a cheat that is the template plus its own lines


def cheat_file(name: str, into: Path | None = None) -> Path:
    """The cheat's upload; one that starts with APPENDED is written whole into ``into`` (the untouched
    template as generated now, then the cheat's lines), so it never drifts from the template."""
    (path,) = (CHEATS / name).glob("template_*.py")
    if into is None or not path.read_text().startswith(APPENDED):
        return path
    (template,) = REPO.glob(f"phase*/{path.name}")
    whole = into / name / path.name
    whole.parent.mkdir(parents=True, exist_ok=True)
    whole.write_text(f"{template.read_text()}\n\n{path.read_text()}")
    return whole


def test_every_cheat_is_graded_in_a_round():
    folders = {p.name for p in CHEATS.iterdir() if p.is_dir()}
    in_rounds = [name for r in ROUNDS for name in r]
    assert sorted(in_rounds) == sorted(folders), "each folder of tests/cheats/ must be in exactly one round"
    for r in ROUNDS:
        files = [cheat_file(name).name for name in r]
        assert len(files) == len(set(files)), f"one cheat per template file in a run: {files}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The autograder bundle, unpacked: the instructor's checkout as Gradescope holds it."""
    from distlab.grading.grade import autograder_zip

    where = tmp_path_factory.mktemp("autograder")
    with zipfile.ZipFile(autograder_zip(where / "autograder.zip")) as z:
        z.extractall(where / "source")
    SNAPSHOT.update(_digests(where / "source"))
    return where / "source"


SNAPSHOT: dict[str, str] = {}  # the unpacked bundle's files before any grading run: path -> sha256


def _digests(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def changed_files(source: Path) -> list[str]:
    """Files of the bundle a grading run changed or added, but for what the grader itself keeps: the
    reference's recorded checks and the lint's allowances (new files under .distlab/reference-checks/)."""
    now = _digests(source)
    changed = [p for p, digest in SNAPSHOT.items() if now.get(p) != digest]
    added = [p for p in now if p not in SNAPSHOT and not p.startswith(".distlab/reference-checks/")
             and "__pycache__" not in p]
    return changed + added


def nobody_runs_python() -> bool:
    """Whether ``nobody`` can run this interpreter (not where it lives under /root): the locked-down run
    then drops ranks to it, as on Gradescope, where the venv is /autograder/venv."""
    probe = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", "import torch.utils.serialization"],
                           capture_output=True)
    return probe.returncode == 0


def start_autograder(source: Path, root: Path, files: dict[str, Path], exercises: list[str], k: str,
                     prefix: tuple[str, ...] = ()):
    """Gradescope's entry point, dry-run on a submission of ``files`` (name in the upload -> file), started
    (under ``prefix``, a command that runs the rest)."""
    for rel, path in files.items():
        (root / "submission" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / "submission" / rel)
    args = " ".join(f"'{e}'" for e in exercises)
    env = {**os.environ, "AUTOGRADER": str(root), "SOURCE": str(source), "PYTHON": sys.executable,
           "GRADE_ARGS": f"--exercises {args} -- -k '{k}'"}
    return subprocess.Popen([*prefix, "bash", str(source / "run_autograder")], env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


AUTOGRADER_S = 240  # one run_autograder run; scaled, and longer while it progresses on a busy machine (Deadline)


def finish_autograder(proc: subprocess.Popen, root: Path) -> dict:
    deadline = Deadline([proc.pid], AUTOGRADER_S)
    try:
        while True:
            try:  # communicate again after its timeout loses no output (the pipe keeps being read)
                out, _ = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                over = deadline.passed()
                assert over is None, f"run_autograder ended: {over or f'not finished within {deadline.timeout_s:g} s'}"
    finally:
        proc.kill()  # nothing left if it ran over: its pytest and ranks die with it (distlab.procs.tie_to)
        proc.wait()
    assert proc.returncode == 0, out[-3000:]
    results = json.loads((root / "results" / "results.json").read_text())
    results["stdout"] = out
    return results


def run_autograder(source: Path, root: Path, files: dict[str, Path], exercises: list[str], k: str,
                   prefix: tuple[str, ...] = ()) -> dict:
    return finish_autograder(start_autograder(source, root, files, exercises, k, prefix), root)


# Gradescope's venv is /autograder/venv, which the rank user can read; here Python may live where others
# cannot enter (pyenv under /root, 0700; a venv in a user's home, 0700; or a venv elsewhere whose base
# interpreter is there). In a mount namespace of its own, the grading run sees each such directory as an
# empty tmpfs, readable by all, holding only the interpreter's trees, as /autograder/venv is (the host's
# directories are unchanged).
def _closed_above(tree: Path) -> Path | None:
    """The topmost directory above ``tree`` that others (the rank user) cannot enter, or None."""
    return next((d for d in reversed(tree.parents) if not d.stat().st_mode & 0o001), None)


def python_readable_by_all(spare: Path) -> tuple[str, ...]:
    """A command prefix under which ``nobody`` can run this interpreter, or () where it already can."""
    if nobody_runs_python():
        return ()
    trees = [Path(d) for d in interpreter_dirs()]
    closed = {tree: _closed_above(tree) for tree in trees}
    closed = {tree: above for tree, above in closed.items() if above is not None}
    assert closed, f"nobody cannot run {sys.executable}, yet every directory above {trees} lets others in: " \
                   "its own files are not readable by all (as /autograder/venv is)"
    script = ["set -e"]
    for i, tree in enumerate(closed):  # each tree kept aside, each closed directory emptied, each tree back
        (spare / str(i)).mkdir(parents=True, exist_ok=True)
        script.append(f"mount --bind {shlex.quote(str(tree))} {shlex.quote(str(spare / str(i)))}")
    script += [f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(str(d))}" for d in dict.fromkeys(closed.values())]
    for i, tree in enumerate(closed):
        script += [f"mkdir -p {shlex.quote(str(tree))}",
                   f"mount --bind {shlex.quote(str(spare / str(i)))} {shlex.quote(str(tree))}"]
    script.append('exec "$@"')
    return ("unshare", "--mount", "--propagation", "private", "bash", "-c", "\n".join(script), "as-on-gradescope")


AT_ONCE = 3  # grading runs side by side: each is mostly one busy core (imports, one small world)


@pytest.fixture(scope="module")
def round_results(source, tmp_path_factory) -> list[dict]:
    """Every round graded, AT_ONCE at a time (the catalogue's cost is these runs)."""
    results, running = [None] * len(ROUNDS), []
    for i, round_ in enumerate(ROUNDS):
        root = tmp_path_factory.mktemp(f"round{i}")
        files = {f"{name}/{cheat_file(name).name}": cheat_file(name, root / "cheats") for name in round_}
        graded = [GRADED[cheat_file(name).name] for name in round_]
        running.append((i, root, start_autograder(source, root, files, [e for e, _ in graded],
                                                  " or ".join(f"({k})" for _, k in graded))))
        if len(running) == AT_ONCE or i == len(ROUNDS) - 1:
            for j, root_j, proc in running:
                results[j] = finish_autograder(proc, root_j)
            running = []
    return results


@catalogue
@only_in_the_tier
@pytest.mark.timeout(400)  # the first one grades every round
@pytest.mark.parametrize("round_", range(len(ROUNDS)), ids=lambda i: "+".join(ROUNDS[i]))
def test_each_cheat_scores_zero_with_its_reason(round_, round_results, source):
    by_name = {t["name"]: t for t in round_results[round_]["tests"]}
    for name, reason in ROUNDS[round_].items():
        test = by_name[GRADED[cheat_file(name).name][0]]
        assert test["score"] == 0, f"cheat {name} scored {test['score']}: {test['output']}"
        assert reason in test["output"], f"cheat {name}: expected {reason!r} in the reason, got {test['output']!r}"
    written = source / "tests" / "test_phase1.py"
    assert "_worker_naive_dp(*args" not in written.read_text(), "a template wrote to the tests"
    assert "def pytest_runtest_makereport(item, call):\n    yield" not in (source / "tests" / "conftest.py").read_text()
    assert "= 99" not in (source / "grading" / "weights.toml").read_text(), "a template rewrote the weights"
    assert not changed_files(source), f"the checkout changed: {changed_files(source)}"


# One round's grading run on the local path: a jail per exercise, one test each (in the CI the Gradescope path
# grades the same rounds in about 240 s for three runs side by side); scaled by DISTLAB_TIMEOUT_SCALE, and
# longer while it still progresses on a busy machine (distlab.procs.Deadline), up to the test's own timeout.
LOCAL_RUN_S = 300


def start_local(source: Path, root: Path, round_: dict, marker: str) -> subprocess.Popen:
    """A round's cheats through an instructor's own command (pytest --impl templates --student-dir=...), run
    from the unpacked bundle on a copy that holds them; started, its output to ``root/output.txt``."""
    copy = root / "copy"
    for name in round_:
        path = cheat_file(name, root / "cheats")
        (template,) = REPO.glob(f"phase*/{path.name}")
        (copy / template.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy / template.parent.name / path.name)
    graded = [GRADED[cheat_file(name).name] for name in round_]
    # The exercises' test files (the manifest's), but this one: its -k matches none of its tests, and collecting
    # it would only cost the nested run its imports.
    files = sorted({f for exercise, _ in graded for f in manifest.lookup(exercise).tests} - {"tests/test_cheats.py"})
    with open(root / "output.txt", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
                                 "-k", " or ".join(f"({k})" for _, k in graded), "--impl=templates",
                                 f"--student-dir={copy}", f"--results-json={root / 'results.json'}"],
                                cwd=source, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=marked_environ(marker))


def read_local(root: Path, note: str = "") -> tuple[dict, str]:
    """A finished run's scores by exercise (none if it wrote no results) and its output."""
    path = root / "results.json"
    tests = json.loads(path.read_text())["tests"] if path.is_file() else []
    return {t["name"]: t for t in tests}, (root / "output.txt").read_text() + note


@pytest.fixture(scope="module")
def local_results(source, tmp_path_factory) -> list[tuple[dict, str]]:
    """Every round graded on the local path, AT_ONCE side by side, the next one started as soon as one ends
    (the round with most exercises first): (scores by exercise, pytest's output) per round."""
    order = sorted(range(len(ROUNDS)), key=lambda i: -len(ROUNDS[i]))
    results, running, marker = [None] * len(ROUNDS), {}, f"cheats-local-{os.getpid()}"
    try:
        while order or running:
            while order and len(running) < AT_ONCE:
                i = order.pop(0)
                root = tmp_path_factory.mktemp(f"local{i}")
                proc = start_local(source, root, ROUNDS[i], marker)
                running[i] = (root, proc, os.pidfd_open(proc.pid), Deadline([proc.pid], LOCAL_RUN_S))
            # Wakes when a run ends; else every 0.5 s, as often as a Deadline looks at a run past its time.
            ended, _, _ = select.select([fd for _, _, fd, _ in running.values()], [], [], 0.5)
            for i, (root, proc, fd, deadline) in list(running.items()):
                over = None if fd in ended else deadline.passed()
                if fd in ended or over is not None:
                    kill_process_tree(proc.pid)  # before it is reaped (its pid still ours): a stopped run's jails, ranks
                    proc.wait()
                    os.close(fd)
                    del running[i]
                    results[i] = read_local(root, "" if fd in ended else
                                            f"\n(ended: {over or f'not finished within {deadline.timeout_s:g} s'})")
    finally:  # interrupted too (pytest-timeout, ^C): nothing it started outlives it
        for _, proc, fd, _ in running.values():
            kill_process_tree(proc.pid)
            proc.wait()
            os.close(fd)
        kill_process_tree(marker=marker)  # what left a run's tree (a rank's helper re-parented)
    return results


@catalogue
@only_in_the_tier
# The first one grades every round: 8 runs in AT_ONCE=3 slots, at most 3 x LOCAL_RUN_S (scaled) unless busy.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("round_", range(len(ROUNDS)), ids=lambda i: "+".join(ROUNDS[i]))
def test_each_cheat_scores_zero_on_the_local_path_too(round_, local_results, source):
    """The catalogue through `pytest --impl templates --student-dir=...` as an instructor runs it: 0 each, for the
    same reason as on Gradescope's path, and the checkout as it was."""
    results, out = local_results[round_]
    for name, reason in ROUNDS[round_].items():
        exercise = GRADED[cheat_file(name).name][0]
        assert exercise in results, (name, f"no score for {exercise}", out[-3000:])
        test = results[exercise]
        assert test["score"] == 0 and reason in test["output"], (name, test, out[-2000:])
    assert not changed_files(source), f"the checkout changed: {changed_files(source)}"


def test_a_patch_at_import_is_put_back_for_the_exercises_graded_after_it(tmp_path, monkeypatch):
    """The carry-over: the sampler tests load the template in pytest's own process."""
    import torch

    from distlab import loader

    (tmp_path / "phase1_data_parallel").mkdir()
    shutil.copy(cheat_file("carry_over_patch_at_import"), tmp_path / "phase1_data_parallel")
    monkeypatch.setenv(loader.IMPL_ENV, "templates")
    monkeypatch.setenv(loader.STUDENT_DIR_ENV, str(tmp_path))
    original = torch.testing.assert_close
    try:
        with pytest.raises(loader.IntegrityError, match="torch.testing.assert_close"):
            loader.load("phase1_data_parallel", "data_loader")
        assert torch.testing.assert_close is original, "the patch outlived the refused template"
    finally:
        torch.testing.assert_close = original


def finished(phase: str, name: str, where: Path) -> Path:
    """The template of ``phase/name`` with every exercise region filled in from its solution."""
    from distlab import bugs

    solution = REPO / "solutions" / phase / f"{name}.py"
    path = where / f"template_{name}.py"
    ids = set(re.findall(r"BEGIN SOLUTION (\d+\.\d+)[a-z]?:", solution.read_text()))  # 4.4a, 4.4b: "4.4"
    path.write_text(bugs.render_partial(solution, ids))
    return path


# Honest work that writes, replaces and prunes its own files (os.replace, shutil.rmtree) in ranks and in
# pytest's process: the sandbox must let it through.
CHECKPOINT = {"4.1 atomic checksummed save": "save_file_roundtrip_matches_torch_save",
              "4.4 checkpoint manager": "manager_falls_back_to_newest_good_checkpoint and 2"}


@catalogue
@only_in_the_tier
def test_untouched_templates_grade_and_an_honest_submission_scores(source, tmp_path):
    """Nothing submitted but untouched templates: 0, no crash. Finished regions copied in: full marks."""
    honest = finished("phase1_data_parallel", "data_loader", tmp_path)
    checkpoint = finished("phase4_production", "checkpoint", tmp_path)
    untouched = REPO / "phase1_data_parallel" / "template_collectives.py"
    exercises = [GRADED["template_collectives.py"][0], GRADED["template_data_loader.py"][0], *CHECKPOINT]
    k = " or ".join(f"({e})" for e in [GRADED["template_collectives.py"][1], GRADED["template_data_loader.py"][1],
                                       *CHECKPOINT.values()])
    results = run_autograder(source, tmp_path / "ag", {"template_data_loader.py": honest,
                                                       "template_collectives.py": untouched,
                                                       "template_checkpoint.py": checkpoint}, exercises, k)
    by_name = {t["name"]: t for t in results["tests"]}
    assert by_name[exercises[1]]["score"] == 2, by_name[exercises[1]]
    assert by_name[exercises[0]]["score"] == 0 and "TODO 1.2" in by_name[exercises[0]]["output"], by_name[exercises[0]]
    for e in CHECKPOINT:
        assert by_name[e]["score"] == by_name[e]["max_score"] > 0, by_name[e]


@catalogue
@only_in_the_tier
def test_duplicate_uploads_are_refused_naming_both(source, tmp_path):
    first = REPO / "phase1_data_parallel" / "template_collectives.py"
    results = run_autograder(source, tmp_path, {"a/template_collectives.py": first,
                                                "b/template_collectives.py": cheat_file("lazy_import_inside_function")},
                             [GRADED["template_collectives.py"][0]], GRADED["template_collectives.py"][1])
    assert results["score"] == 0 and not results["tests"], results
    assert "a/template_collectives.py and b/template_collectives.py" in results["output"], results["output"]


# --------------------------------------------------------------------------- as root, as on Gradescope
@catalogue
@only_in_the_tier
@pytest.mark.venv  # ranks as nobody run this interpreter, wherever it lives
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="the root path needs root, as Gradescope runs the grader")
def test_a_locked_down_bundle_grades_honest_work_and_refuses_a_cheat(tmp_path):
    """setup.sh's lockdown on the unpacked bundle (user nobody), then run_autograder as root."""
    from distlab.grading.grade import autograder_zip

    with zipfile.ZipFile(autograder_zip(tmp_path / "autograder.zip")) as z:
        z.extractall(tmp_path / "source")
    source = tmp_path / "source"
    subprocess.run(["bash", str(source / "grading/gradescope/lockdown.sh"), str(source), "nobody"], check=True)
    assert (source / "solutions").stat().st_mode & 0o077 == 0
    assert (source / ".distlab").stat().st_mode & 0o077 == 0, "the reference run's recorded checks must be root's only"
    files = {"template_collectives.py": finished("phase1_data_parallel", "collectives", tmp_path),
             "template_data_loader.py": cheat_file("read_test_file"),
             "template_checkpoint.py": finished("phase4_production", "checkpoint", tmp_path)}
    exercises = [GRADED[f][0] for f in list(files)[:2]] + list(CHECKPOINT)
    k = " or ".join(f"({e})" for e in [GRADED[f][1] for f in list(files)[:2]] + list(CHECKPOINT.values()))
    results = run_autograder(source, tmp_path / "ag", files, exercises, k, python_readable_by_all(tmp_path / "py"))
    assert "grader: the submission runs as nobody, in the grading jail" in results["stdout"], results["stdout"][-2000:]
    by_name = {t["name"]: t for t in results["tests"]}
    assert by_name[exercises[0]]["score"] == 3, by_name[exercises[0]]  # the jail ran it as nobody
    assert by_name[exercises[1]]["score"] == 0, by_name[exercises[1]]
    for e in CHECKPOINT:  # tests in the jail write checkpoints to their own tmp_path
        assert by_name[e]["score"] == by_name[e]["max_score"] > 0, by_name[e]


# --------------------------------------------------------------------------- the rules themselves
def _finished_text(solution: Path) -> str:
    from distlab import bugs

    return bugs.render_partial(solution, set(re.findall(r"BEGIN SOLUTION (\d+\.\d+)[a-z]?:", solution.read_text())))


def test_untouched_and_finished_templates_pass_the_rules(tmp_path):
    """The rules refuse cheats, not lessons: every template as generated, and with every region filled in
    from its solution, passes them."""
    from distlab.grading import isolation
    from distlab.templates import sources, template_path

    problems = []
    for solution in sources():
        phase, name = solution.parent.name, solution.stem
        finished_copy = tmp_path / f"{phase}-{name}.py"
        finished_copy.write_text(_finished_text(solution))
        problems += isolation.lint(template_path(solution), phase, name) + isolation.lint(finished_copy, phase, name)
    assert not problems, "\n".join(problems)


def test_no_template_may_import_the_bench_copy_of_its_own_exercise(tmp_path):
    """Per-exercise import rule. Every function or class holding an exercise region whose name a distlab
    module also defines is in isolation.BENCH_COPIES, and each listed copy is refused to its template."""
    import ast

    from distlab.grading import isolation
    from distlab.templates import sources

    bench = {}
    for path in sorted((REPO / "distlab").rglob("*.py")):  # distlab.lessons holds the given copies
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bench.setdefault(node.name, []).append(module)
    for solution in sources():
        text = solution.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and "BEGIN SOLUTION" in ast.get_source_segment(text, node):
                for module in bench.get(node.name, []):
                    assert node.name in isolation.BENCH_COPIES.get(solution.stem, {}).get(module, ()), \
                        f"{module}.{node.name} copies exercise code of {solution.stem}: add it to isolation.BENCH_COPIES"
    for stem, modules in isolation.BENCH_COPIES.items():
        phase = next(s.parent.name for s in sources() if s.stem == stem)
        for module, names in modules.items():
            for name in names:
                cheat = tmp_path / "t.py"
                cheat.write_text(f"from {module} import {name}\n")
                assert any("the bench's copy of this exercise" in p for p in isolation.lint(cheat, phase, stem)), \
                    (stem, module, name)


# --------------------------------------------------------------------------- where the verdict is made
@pytest.mark.e2e  # a whole grading session through nested processes (23 s of the main suite on a fresh clone)
def test_a_grading_run_runs_the_submission_in_a_jail_and_scores_it_outside(tmp_path):
    """pytest's process runs no learner code: the exercise's tests run in a jail (distlab/grading/jail.py),
    their outcomes come out as data, and the verdict is made outside (distlab/grading/verdict.py)."""
    (tmp_path / "copy" / "phase1_data_parallel").mkdir(parents=True)
    finished("phase1_data_parallel", "data_loader", tmp_path / "copy" / "phase1_data_parallel")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_phase1.py",
                           "-k", "sampler_shards_are_disjoint or sampler_rejects_bad_rank", "--impl=templates",
                           f"--student-dir={tmp_path / 'copy'}", f"--results-json={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert "jail: 1.4-1.5 distributed sampler: 2 test(s)" in proc.stdout, proc.stdout[-3000:]
    results = json.loads(out.read_text())
    assert len(results["per_test"]) == 2 and all(t["outcome"] == "passed" for t in results["per_test"].values()), \
        proc.stdout[-3000:]


# --------------------------------------------------------------------------- the verdict is the parent's
def _check(site, actual, expected, *, baseline=True, rank=0, tol=0.0):
    return {"site": site, "what": f"check at {site}", "rank": rank, "actual": torch.tensor(actual),
            "expected": torch.tensor(expected), "rtol": tol, "atol": tol, "baseline": baseline}


def test_the_parent_compares_reported_values_with_the_reference_runs_baseline():
    """distlab.grading.verdict.compare: the grader's process checks what the ranks reported, against the expected
    values of the same test run on the reference (where no learner code ran)."""
    from distlab.grading.verdict import compare

    reference = [_check("t.py:1", [1.0, 2.0], [1.0, 2.0]), _check("t.py:2", [3.0], [3.0], baseline=False)]
    compare([_check("t.py:1", [1.0, 2.0], [1.0, 2.0]), _check("t.py:2", [5.0], [5.0], baseline=False)], reference)
    # A rank whose own comparison was subverted and whose baseline was bent to its wrong answer.
    with pytest.raises(AssertionError, match=r"check at t.py:1 \(t.py:1 in rank 0\): max abs diff 1.000e\+00 .*"
                                             "found by the grader's process although the rank reported a pass"):
        compare([_check("t.py:1", [1.0, 3.0], [1.0, 3.0]), reference[1]], reference)
    # Its own result on both sides (a resumed model against the one saved): checked as reported.
    with pytest.raises(AssertionError, match="check at t.py:2"):
        compare([reference[0], _check("t.py:2", [5.0], [6.0], baseline=False)], reference)
    with pytest.raises(AssertionError, match="the graded run made 1 checks, the same test on the reference 2"):
        compare(reference[:1], reference)
    with pytest.raises(AssertionError, match="check 1: the graded run checked at t.py:2 in rank 0 where the "
                                             "reference run checked at t.py:1 in rank 0"):
        compare(reference[::-1], reference)
    with pytest.raises(AssertionError, match=r"\(1,\) torch.float32 reported, \(2,\) torch.float32 expected"):
        compare([_check("t.py:1", [1.0], [1.0]), reference[1]], reference)
    # Counts (distlab.testing.assert_equal / assert_at_most): the reference run's expected count.
    count = {"site": "t.py:3", "what": "sent 96 B", "rank": 1, "kind": "equal", "actual": 96, "expected": 96,
             "baseline": True}
    budget = {**count, "site": "t.py:4", "kind": "at_most", "actual": 2, "expected": 3}
    compare([count, budget], [count, budget])
    with pytest.raises(AssertionError, match=r"sent 64 B \(t.py:3 in rank 1\): 64 reported, == 96 expected"):
        compare([{**count, "what": "sent 64 B", "actual": 64, "expected": 64}, budget], [count, budget])
    with pytest.raises(AssertionError, match=r"4 reported, <= 3 expected"):
        compare([count, {**budget, "actual": 4, "expected": 9}], [count, budget])


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (os.getpid, ())  # harmless here; a forged outcome would name something worse


def test_the_parent_reads_a_childs_outcome_as_values_and_tensors_only():
    """The graded test's child ran learner code: unpickling its message could run code in pytest's process."""
    from distlab.grading import verdict

    assert verdict._loads(verdict._dumps(("passed", [_check("t.py:1", [1.0], [1.0])])))[1][0]["site"] == "t.py:1"
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        verdict._loads(verdict._dumps(("passed", [_RunsCodeWhenUnpickled()])))


def test_a_cache_entry_that_does_not_read_is_run_again_not_an_error(tmp_path, monkeypatch):
    import types

    from distlab.grading import verdict

    monkeypatch.setenv(verdict.CACHE_ENV, str(tmp_path / "cache"))
    test_file = tmp_path / "test_x.py"
    test_file.write_text("def test_x(): pass\n")
    item = types.SimpleNamespace(nodeid="test_x.py::test_x", path=test_file)
    path = verdict._cache_path(item)
    path.parent.mkdir(parents=True)
    path.write_bytes(verdict._dumps([_check("t.py:1", [1.0], [1.0])])[:40])  # cut short
    assert verdict._cached(item) is None
    path.write_bytes(verdict._dumps([_check("t.py:1", [1.0], [1.0])]))
    assert verdict._cached(item)[0]["site"] == "t.py:1"


def _worker_forges_its_result(rank, world_size):
    payload = pickle.dumps(("ok", "forged"))  # what a rank's result was before checks travelled with it
    frame = len(payload).to_bytes(4, "big") + payload
    for fd in range(3, 256):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                os.write(fd, frame)
        except OSError:
            pass
    os._exit(0)


def test_a_rank_that_forges_its_result_pipe_fails_when_checks_are_recorded(monkeypatch):
    from distlab import testing
    from distlab.spawn import RankError, run_distributed

    monkeypatch.setattr(testing, "_records", [])
    monkeypatch.setenv(testing.RECORD_ENV, "1")
    with pytest.raises(RankError, match="reported success without the records of its checks"):
        run_distributed(_worker_forges_its_result, 2)


def test_templates_may_not_reach_os_through_another_module(tmp_path):
    from distlab.grading.isolation import lint

    cheat = tmp_path / "t.py"
    cheat.write_text("import torch\nw = torch.serialization.os.write\nx = getattr(torch.serialization, 'os')\n")
    problems = lint(cheat, "phase1_data_parallel", "collectives")
    assert any("`.os`" in p for p in problems) and any("getattr(..., 'os')" in p for p in problems), problems


SUBVERTED_TESTS = '''
import pytest
import torch

from distlab import load, testing
from distlab.spawn import run_distributed


def _worker(rank, world_size):
    collectives = load("phase1_data_parallel", "collectives")
    x = torch.arange(4, dtype=torch.float64) + rank
    mine = collectives.allreduce_allgather_sum(x.clone())
    expected = sum(torch.arange(4, dtype=torch.float64) + r for r in range(world_size))
    # A rank whose comparison was switched off: the values are recorded, nothing is asserted here.
    testing._record(f"rank {rank}: the sum", mine, expected, 0, 0, True)


@pytest.mark.exercise("1.1-1.3")
def test_sum():
    run_distributed(_worker, 2)
'''


@catalogue
@only_in_the_tier
def test_a_pass_reported_by_ranks_is_checked_against_the_reference_in_pytests_process(tmp_path):
    """End to end: the in-rank comparison is gone, the ranks report a wrong sum; the grading run's pytest
    process fails the test against the reference run's baseline, read from the checks setup.sh's
    --record-reference kept. The finished template scores."""
    tests = tmp_path / "test_subverted.py"
    tests.write_text(SUBVERTED_TESTS)
    wrong = tmp_path / "wrong" / "phase1_data_parallel"
    wrong.mkdir(parents=True)
    template = (REPO / "phase1_data_parallel" / "template_collectives.py").read_text()
    (wrong / "template_collectives.py").write_text(  # lint-clean and wrong: keeps its own tensor
        template + "\n\ndef allreduce_allgather_sum(tensor, op='sum', group=None):\n    return tensor\n")
    (tmp_path / "right" / "phase1_data_parallel").mkdir(parents=True)
    finished("phase1_data_parallel", "collectives", tmp_path / "right" / "phase1_data_parallel")
    cache = tmp_path / "cache"
    env = {**os.environ, "DISTLAB_REFERENCE_CHECKS": str(cache)}
    common = ["-p", "no:cacheprovider", str(tests), f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml")]
    # As setup.sh builds the autograder: the reference's checks, recorded once for every submission.
    proc = subprocess.run([sys.executable, "-m", "pytest", *common, "--record-reference"], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=env)
    (kept,) = cache.rglob("*.pt")
    assert proc.returncode == 0, proc.stdout[-3000:]
    recorded_at = kept.stat().st_mtime_ns
    scores = {}
    for copy in ("wrong", "right"):
        out = tmp_path / f"{copy}.json"
        proc = subprocess.run([sys.executable, "-m", "pytest", *common, "--impl=templates",
                               f"--student-dir={tmp_path / copy}", f"--results-json={out}"],
                              cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
        scores[copy] = (json.loads(out.read_text())["score"], proc.stdout)
    assert scores["wrong"][0] == 0, scores["wrong"][1][-3000:]
    assert "found by the grader's process although the rank reported a pass" in scores["wrong"][1], \
        scores["wrong"][1][-3000:]
    assert scores["right"][0] == 3, scores["right"][1][-3000:]
    assert list(cache.rglob("*.pt")) == [kept] and kept.stat().st_mtime_ns == recorded_at, \
        "the grading runs ran the reference again instead of reading its recorded checks"
