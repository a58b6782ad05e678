"""The learner's cockpit (``python -m distlab``), played as a learner plays it, on a copy of phase 1.

The copy is a folder with phase1_data_parallel/ only (templates, guidelines): the cockpit runs
the tests of this checkout against it (``--student-dir``), as it would run them on a learner's
own checkout. The real templates are never edited. Expected values come from the files
themselves (the line of a TODO, the guidelines' hint list, the pristine stub), not from the
cockpit's own code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlab import templates
from distlab.cockpit import checks, course
from distlab.cockpit.hints import hints

REPO = Path(__file__).resolve().parent.parent
PHASE = "phase1_data_parallel"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / PHASE, tmp_path / PHASE, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def distlab(root: Path, *args: str, check: int | None = 0) -> str:
    proc = subprocess.run([sys.executable, "-m", "distlab", *args, "--root", str(root)], cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    if check is not None:
        assert proc.returncode == check, f"distlab {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


def solve(root: Path, ids: set[str]) -> None:
    """What a learner does: the solution's code for TODO ``ids`` in place of each region's ``raise todo``."""
    for solution in sorted((REPO / "solutions" / PHASE).glob("*.py")):
        lines, bodies, i = solution.read_text().splitlines(), {}, 0
        while i < len(lines):
            if (m := templates.BEGIN.match(lines[i])) and m["id"] in ids:
                j = i + 1
                while lines[j].strip().startswith("#"):  # the stub's comments stay as the template has them
                    j += 1
                k = j
                while not templates.END.match(lines[k]):
                    k += 1
                bodies[m["id"]], i = lines[j:k], k
            i += 1
        template = root / PHASE / f"template_{solution.name}"
        if not bodies:
            continue
        out, current = [], None
        for line in template.read_text().splitlines():
            if m := templates.TODO_BEGIN.match(line):
                current = m["id"]
            if current in bodies and line.strip().startswith("raise todo("):
                out.extend(bodies[current])
                continue
            out.append(line)
        template.write_text("\n".join(out) + "\n")


def region_text(text: str, rid: str) -> str:
    m = re.search(rf"^[ \t]*# --- TODO {re.escape(rid)}:.*?# --- end TODO {re.escape(rid)} ---$", text, re.S | re.M)
    assert m, f"region {rid} not found"
    return m.group(0)


def phase1_lines(status: str) -> dict[str, str]:
    return {ex.name: next(l for l in status.splitlines() if l.strip().startswith(ex.name))
            for ex in course.exercises() if ex.phase == 1}


@pytest.mark.e2e
def test_learner_plays_phase1_with_the_cockpit_only(copy: Path):
    collectives = copy / PHASE / "template_collectives.py"
    pristine = collectives.read_text()
    # status: nothing done yet
    status = distlab(copy, "status")
    assert "Phase 1  [....................]  0/8 points, 0 of 3 exercises passing" in status, status
    assert all("untouched" in line for line in phase1_lines(status).values()), status
    # next: 1.1's TODO, where the file has it, and the command that checks it
    line = pristine.splitlines().index(next(l for l in pristine.splitlines() if "# --- TODO 1.1:" in l)) + 1
    nxt = distlab(copy, "next")
    assert f"{PHASE}/template_collectives.py:{line}" in nxt and "TODO 1.1" in nxt, nxt
    assert "python -m distlab check 1.1-1.3" in nxt and "guidelines.md#all-reduce-three-ways" in nxt, nxt
    # check: every test fails at the TODO, the whole exercise is scored
    out = distlab(copy, "check", "1.1-1.3", check=1)
    fails = [l for l in out.splitlines() if l.strip().startswith("FAIL")]
    assert fails and not any(l.strip().startswith("pass") for l in out.splitlines()), out
    assert f"1.1-1.3 all-reduce three ways: 0/{len(fails)} tests, 0.00/3 points, failing" in out, out
    assert "TODO 1.1 all-reduce by reduce + broadcast: not implemented yet" in out, out
    # the learner writes 1.1-1.3; check passes, status shows the progress
    solve(copy, {"1.1", "1.2", "1.3"})
    out = distlab(copy, "check", "1.1", "--trace", str(copy / "trace"))
    passes = [l for l in out.splitlines() if l.strip().startswith("pass")]
    assert len(passes) == len(fails), out
    assert f"1.1-1.3 all-reduce three ways: {len(fails)}/{len(fails)} tests, 3.00/3 points, passing" in out, out
    # --trace: every world the exercise's tests started, one process per rank, named after its test
    trace = json.loads((copy / "trace" / "trace.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert f"trace: {copy / 'trace' / 'trace.json'}" in out, out
    assert len(trace["otherData"]["worlds"]) >= len(passes) - 1 and \
        all(re.match(r"rank \d+ \(tests/test_phase1.py::test_allreduce_", n) for n in names), names
    assert any(e.get("cat") == "comm" for e in trace["traceEvents"]), "the ranks' communication is in the trace"
    status = distlab(copy, "status")
    assert "Phase 1  [########............]  3/8 points, 1 of 3 exercises passing" in status, status
    assert re.search(r"passing\s+\d+/\d+ tests\s+3/3$", phase1_lines(status)["1.1-1.3 all-reduce three ways"]), status
    # next moves on; hints come one at a time, in the guidelines' order
    assert "next: 1.4-1.5 distributed sampler" in distlab(copy, "next")
    guide = (copy / PHASE / "guidelines.md").read_text()
    block = guide.split("<summary>Hints for TODO 1.4</summary>", 1)[1].split("</details>", 1)[0]
    items = [l for l in block.splitlines() if re.match(r"\d+\. ", l)]
    first, second = distlab(copy, "hint", "1.4"), distlab(copy, "hint", "1.4")
    assert "hint 1 of" in first and items[0] in first and items[1] not in first, first
    assert "hint 2 of" in second and items[1] in second and items[0] not in second, second
    # reset 1.2: its region is the stub again, 1.1 and 1.3 keep the learner's code, the old 1.2 is kept
    solved = collectives.read_text()
    out = distlab(copy, "reset", "1.2")
    stub = region_text(pristine, "1.2")
    assert collectives.read_text() == solved.replace(region_text(solved, "1.2"), stub), "only 1.2 changes, to its stub"
    kept = list((copy / ".distlab" / "reset").glob("template_collectives.py.1.2.*.py"))
    assert len(kept) == 1 and "dist.all_gather" in kept[0].read_text() and "raise todo" not in kept[0].read_text(), out
    assert kept[0].relative_to(copy).as_posix() in out, out
    assert re.search(r"1\.1-1\.3 all-reduce three ways\s+edited", distlab(copy, "status")), "reset forgets the verdict"


@pytest.mark.e2e
def test_watch_rechecks_on_save_and_stays_on_the_named_exercise(copy: Path):
    proc = subprocess.Popen([sys.executable, "-m", "distlab", "watch", "1.4-1.5", "--max-checks", "2",
                             "--interval", "0.2", "--root", str(copy)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:  # the first verdict, then the watch waits for a save
            seen.append(line)
            if line.startswith("watching "):
                break
        assert any("0.00/2 points, failing" in l for l in seen), "".join(seen)
        solve(copy, {"1.4", "1.5"})  # the save the watch is waiting for
        rest = proc.stdout.read()
        assert proc.wait(timeout=240) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "1.4-1.5 distributed sampler: 5/5 tests, 2.00/2 points, passing" in rest, rest
    assert "1.4-1.5 distributed sampler passes; still watching" in rest and "checking 1.1-1.3" not in rest, rest


def test_ids_a_learner_types_name_the_narrowest_exercise():
    assert course.find("1.2").name == "1.1-1.3 all-reduce three ways"
    assert course.find("2.5").name == "2.5 mixed-precision data parallel"  # not 2.3-2.5's
    assert course.find("3.8").name.startswith("3.8 ")
    with pytest.raises(ValueError, match="python -m distlab status"):
        course.find("9.9")


def test_every_exercise_has_tests_hints_and_regions():
    for ex in course.exercises():
        assert course.test_files(ex), f"{ex.name}: no test carries its marker"
        assert course.regions_of(ex, REPO), f"{ex.name}: no TODO region in the templates"
    assert [t for t, _ in hints(course.find("1.1"), REPO)][:1] == ["1.1"]


def test_a_partial_run_is_never_shown_as_the_exercise_score():
    ex = course.find("1.4")
    result = {"passed": 2, "total": 2, "points": 2.0, "partial": True, "tests": []}
    last = checks.verdict_lines(ex, result)[-1]
    assert "partial" in last and "not the exercise's score" in last and "2.00/2 points" not in last, last
    assert not checks.passed(result)


def test_check_ties_pytest_to_the_cockpit():
    from distlab.procs import TIE_ENV

    assert checks.TIE_ENV == TIE_ENV


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_warm_checks_see_each_save_agree_with_a_cold_check_and_leave_nothing(tmp_path: Path):
    """``check --warm`` in a learner's own checkout (a clone: its distlab, tests and templates): the
    server forks a fresh pytest per check, so a save between two warm checks is seen; its verdicts are
    the cold check's; ranks start from its forkserver (1.1-1.3 at W=1-4); ``warm --stop`` ends it all."""
    import os

    from benchmarks.check_latency import learner_checkout
    from distlab.cockpit import warm

    clone = learner_checkout(tmp_path / "clone", set())  # the untouched templates, as generated
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "PYTHONPATH": str(clone)}

    def run(*args: str, expect: int) -> str:
        proc = subprocess.run([sys.executable, "-m", "distlab", *args], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=150)
        assert proc.returncode == expect, f"distlab {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        return proc.stdout

    def server_pid() -> int:
        return warm._request(warm.socket_path(clone), {"op": "ping"}, 5.0)["pid"]

    try:
        cold = run("check", "1.4-1.5", expect=1)
        first = run("check", "1.4-1.5", "--warm", expect=1)  # starts the server
        pid = server_pid()
        assert first.splitlines()[-1] == cold.splitlines()[-1] == \
            "1.4-1.5 distributed sampler: 0/5 tests, 0.00/2 points, failing"
        solve(clone, {"1.1", "1.2", "1.3", "1.4", "1.5"})  # a save: the next warm check must see it
        assert run("check", "1.4-1.5", "--warm", expect=0).splitlines()[-1] == \
            "1.4-1.5 distributed sampler: 5/5 tests, 2.00/2 points, passing"
        assert run("check", "1.1-1.3", "--warm", expect=0).splitlines()[-1] == \
            "1.1-1.3 all-reduce three ways: 15/15 tests, 3.00/3 points, passing"
        assert server_pid() == pid, "each check started a server of its own"
    finally:
        run("warm", "--stop", expect=0)
    left = subprocess.run(["pgrep", "-f", f"cockpit.warm --serve {clone}"], capture_output=True, text=True).stdout
    assert not left.strip() and not warm.socket_path(clone).exists(), f"the warm launcher outlived --stop: {left}"


def test_ctrl_c_of_check_prints_one_line_not_a_traceback(copy: Path):
    """Ctrl-C while ``check`` waits for its pytest printed the cockpit's KeyboardInterrupt traceback
    (27 lines); now one line, exit code 130, and the check's pytest and ranks end with it."""
    from test_launch_errors import interrupted

    code, after = interrupted([sys.executable, "-m", "distlab", "check", "1.1", "--root", str(copy)], dict(os.environ),
                              when="checking ")
    lines = [line for line in after.splitlines() if line.strip()]
    assert lines == ["distlab check: stopped (Ctrl-C): nothing was recorded for this check"], after[-3000:]
    assert code == 130, f"exit code {code}:\n{after[-2000:]}"



# --- the cockpit keeps its books (issue 32, part 5): in-process, no ranks, no pytest of its own --------------

def passing_result(ex) -> dict:
    return {"passed": 1, "total": 1, "points": ex.weight, "weight": ex.weight, "partial": False, "tests": []}


def record_passing(root: Path, *idents: str) -> None:
    for ident in idents:
        ex = course.find(ident)
        course.record_check(root, ex, passing_result(ex))


def guide_anchor(todo: str) -> str:
    """The TODO's guideline section as its solution's BEGIN marker has it (not the manifest)."""
    for sol in (REPO / "solutions").glob("phase*/*.py"):
        for line in sol.read_text().splitlines():
            if (m := templates.BEGIN.match(line)) and m["id"] == todo:
                return f"{sol.parent.name}/{m['where']}"
    raise AssertionError(f"no region {todo}")


def test_next_links_every_todo_to_its_guideline_even_once_it_holds_code(copy: Path):
    import io

    from distlab.cockpit import cli

    solve(copy, {"1.1"})  # 1.1 holds code: its stub's `raise todo(..., "guidelines.md#...")` is gone
    out = io.StringIO()
    assert cli.next_(copy, out).id == "1.1-1.3"
    todo_lines = [l for l in out.getvalue().splitlines() if l.strip().startswith("TODO ")]
    assert len(todo_lines) == 3, out.getvalue()
    for line in todo_lines:
        assert line.endswith(f"(read {guide_anchor(line.split()[1])})"), out.getvalue()


def test_status_fingerprints_regions_not_files(tmp_path: Path):
    """3.1-3.4 share template_ring_allreduce.py: editing 3.4 leaves 3.1's verdict current, editing 3.1 does not."""
    shutil.copytree(REPO / "phase3_multi_node", tmp_path / "phase3_multi_node", ignore=shutil.ignore_patterns("__pycache__"))
    ring = tmp_path / "phase3_multi_node" / "template_ring_allreduce.py"
    record_passing(tmp_path, "3.1")
    ex, state = course.find("3.1"), lambda: course.load_state(tmp_path)
    assert course.exercise_state(ex, tmp_path, state()) == "passing"
    text = ring.read_text()
    stub_34 = region_text(text, "3.4")
    ring.write_text(text.replace(stub_34, stub_34.replace("raise todo(", "x = 1\n        raise todo(", 1)))
    assert course.exercise_state(ex, tmp_path, state()) == "passing", "only 3.4 changed"
    assert course.exercise_state(course.find("3.4"), tmp_path, state()) == "edited"
    text = ring.read_text()
    stub_31 = region_text(text, "3.1")
    ring.write_text(text.replace(stub_31, stub_31.replace("raise todo(", "x = 1\n    raise todo(", 1)))
    assert course.exercise_state(ex, tmp_path, state()) == "passing (edited since)"


def test_what_next_is_the_smallest_exercise_of_the_first_unfinished_todo(copy: Path):
    """2.3-2.4 / 2.3-2.5 / 2.5 overlap: with 2.3-2.4 passing, 2.5 is next (2.3-2.5 needs it); then 2.3-2.5."""
    record_passing(copy, *[ex.id for ex in course.exercises() if ex.phase == 1], "2.1-2.2")
    assert course.what_next(copy).id == "2.3-2.4"
    record_passing(copy, "2.3-2.4")
    assert course.what_next(copy).id == "2.5"
    record_passing(copy, "2.5")
    assert course.what_next(copy).id == "2.3-2.5"
    record_passing(copy, "2.3-2.5")
    assert course.what_next(copy).id == "2.6-2.7"


def test_check_accepts_every_manifest_id_and_a_range_of_exercises(copy: Path, monkeypatch):
    import io

    from distlab.cockpit import cli

    ran = []
    monkeypatch.setattr(checks, "run_check", lambda ex, root, trace_dir=None, warm=False: ran.append(ex.id) or passing_result(ex))
    result = cli.check("3.1-3.3", copy, io.StringIO())
    assert ran == ["3.1", "3.2", "3.3"] and checks.passed(result), ran
    for ex in course.exercises():
        assert [e.id for e in course.select(ex.id)] == [ex.id]
    assert [e.id for e in course.select("1.1-1.2")] == ["1.1-1.3"]  # inside one exercise: that one
    assert [e.id for e in course.select("3.15-3.16")] == ["3.15", "3.16"]
    with pytest.raises(ValueError, match="python -m distlab status"):
        course.select("3.1-4.2")


def test_watch_stays_on_the_named_exercise_when_it_passes(copy: Path, monkeypatch):
    import io

    from distlab.cockpit import cli

    checked = []

    def fake(ex, root, trace_dir=None, warm=False):
        checked.append(ex.id)
        course.record_check(root, ex, passing_result(ex))
        return passing_result(ex)

    def save(result):  # the learner saves 1.4 again after each verdict
        loader = copy / PHASE / "template_data_loader.py"
        loader.write_text(loader.read_text().replace("# --- end TODO 1.4 ---", "pass\n        # --- end TODO 1.4 ---", 1))

    monkeypatch.setattr(checks, "run_check", fake)
    out = io.StringIO()
    assert cli.watch(copy, out, "1.4-1.5", interval_s=0.01, max_checks=2, warm=False, on_check=save) == 2
    assert checked == ["1.4-1.5", "1.4-1.5"], out.getvalue()
    assert "1.4-1.5 distributed sampler passes; still watching" in out.getvalue()


def test_guide_prints_the_section_without_its_hints(copy: Path):
    import io

    from distlab.cockpit import cli

    text = cli.guide("1.4", copy, io.StringIO())
    guide = (copy / PHASE / "guidelines.md").read_text()
    section = guide.split("## Sharding the data", 1)[1].split("\n## ", 1)[0]
    hints_block = section.split("<details>", 1)[1].split("</details>", 1)[0]
    hint_lines = [l for l in hints_block.splitlines() if re.match(r"\d+\. ", l)]
    assert text.startswith("## Sharding the data") and "<details>" not in text and "<summary>" not in text, text
    assert hint_lines and not any(h in text for h in hint_lines), text
    prose = next(l for l in section.splitlines() if len(l) > 40 and "<" not in l)
    assert prose in text and "python -m distlab hint 1.4-1.5" in text, text


def test_restore_undoes_a_reset(copy: Path):
    import io

    from distlab.cockpit import cli

    collectives = copy / PHASE / "template_collectives.py"
    pristine = collectives.read_text()
    solve(copy, {"1.2"})
    solved = collectives.read_text()
    cli.reset("1.2", copy, io.StringIO())
    assert collectives.read_text() == pristine
    out = io.StringIO()
    cli.restore("1.2", copy, out)
    assert collectives.read_text() == solved, out.getvalue()
    cli.restore("1.2", copy, io.StringIO())  # a second restore undoes the first
    assert collectives.read_text() == pristine
    with pytest.raises(ValueError, match="only code that `python -m distlab reset` replaced"):
        cli.restore("1.5", copy, io.StringIO())


def test_a_corrupt_state_file_is_one_line(copy: Path, capsys):
    from distlab.cockpit import cli

    (copy / ".distlab").mkdir()
    for corrupt in ('{"checks": {', "[]"):  # cut mid-write; JSON, but not the state's object
        (copy / ".distlab" / "state.json").write_text(corrupt)
        assert cli.main(["status", "--root", str(copy)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "state.json is corrupt" in err[0] and "delete it" in err[0], err


def short_socket_dir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="dlw-", dir="/tmp"))  # an AF_UNIX path has at most 107 bytes


def test_the_warm_server_survives_a_client_gone_an_empty_and_a_garbled_connection():
    """Ctrl-C of `check --warm` closes the client before its answer (BrokenPipeError in the server), a probe
    connects and sends nothing; each cost the server its life and left a stale socket. Now: that connection only."""
    import socket
    import threading

    from distlab.cockpit import warm

    folder = short_socket_dir()
    path = folder / "warm.sock"
    client_gone, ran = threading.Event(), []

    def fake_pytest(request):  # answers only once its client has gone
        ran.append(request["args"])
        assert client_gone.wait(30), "the test never closed its client"
        return 0

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    server.settimeout(60)
    thread = threading.Thread(target=warm.answer_checks, args=(server, 1.0, fake_pytest), daemon=True)
    thread.start()
    try:
        for payload in (b"", b"not json\n", b'{"no": "op"}\n', b"[1, 2]\n"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
                s.sendall(payload)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.sendall(b'{"op": "pytest", "args": ["-q"]}\n')
        while not ran:  # the server has the request: now the learner presses Ctrl-C
            assert thread.is_alive(), "the server died of a connection before"
            thread.join(0.01)
        s.close()
        client_gone.set()
        assert warm._request(path, {"op": "ping"}, 10.0)["stamp"] == 1.0, "the server died"
        assert warm._request(path, {"op": "stop"}, 10.0)["pid"]
        thread.join(10)
        assert not thread.is_alive()
    finally:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_slow_warm_start_is_one_line_scaled_by_the_timeout_scale(copy: Path, monkeypatch, capsys):
    from distlab.cockpit import cli, warm
    from distlab.doctor_watch import TIMEOUT_SCALE_ENV

    assert warm.TIMEOUT_SCALE_ENV == TIMEOUT_SCALE_ENV
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "3")
    assert warm.start_timeout_s() == 3 * warm.START_TIMEOUT_S
    folder = short_socket_dir()
    monkeypatch.setattr(warm, "socket_path", lambda root: folder / "warm.sock")
    monkeypatch.setattr(warm, "START_TIMEOUT_S", 0.0)  # no server imports torch in no time: the slow start
    # what run_check does with --warm in the learner's own checkout, before pytest: start the launcher
    monkeypatch.setattr(checks, "run_check", lambda ex, root, trace_dir=None, warm=False: warm_.ensure_server(root, REPO))
    warm_ = warm
    try:
        assert cli.main(["check", "1.4-1.5", "--warm", "--root", str(copy)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the warm launcher did not start within 0 s" in err[0] and "without --warm" in err[0], err
        assert not (folder / "warm.sock").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_check_past_its_limit_is_one_line_scaled_by_the_timeout_scale(copy: Path, monkeypatch, capsys):
    """A cold check's pytest past its limit was subprocess's TimeoutExpired traceback, at a limit no scale moved."""
    from distlab.cockpit import cli
    from distlab.deadlines import TIMEOUT_SCALE_ENV

    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "2")
    monkeypatch.setattr(checks, "TIMEOUT_S", 0.005)  # pytest cannot even start in 10 ms: the slow check
    assert cli.main(["check", "1.4-1.5", "--root", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not end within 0 s" in err[0] and f"{TIMEOUT_SCALE_ENV}=3" in err[0], err


def test_a_learner_session_through_the_manifest(copy: Path, monkeypatch):
    """Phase 1 as the manifest lists it: next names each exercise in turn with the manifest's TODOs and
    section, the guide and a hint answer for it, its regions get the solution, a (stubbed) passing check
    moves status's points by the manifest's points."""
    import io

    from distlab.cockpit import cli

    monkeypatch.setattr(checks, "run_check", lambda ex, root, trace_dir=None, warm=False: (
        course.record_check(root, ex, passing_result(ex)), passing_result(ex))[1])
    got = 0.0
    for ex in [ex for ex in course.exercises() if ex.phase == 1]:
        out = io.StringIO()
        assert cli.next_(copy, out).id == ex.id, out.getvalue()
        shown = re.findall(r"TODO (\S+) .*\(read (\S+)\)", out.getvalue())
        assert [t for t, _ in shown] == list(ex.todos) and {g for _, g in shown} == {ex.guide}, out.getvalue()
        assert all((copy / lesson).is_file() for lesson in ex.lessons)
        assert cli.guide(ex.id, copy, io.StringIO()).strip()
        assert cli.hint(ex.id, copy, io.StringIO())
        solve(copy, set(ex.todos))
        assert checks.passed(cli.check(ex.id, copy, io.StringIO()))
        got += ex.points
        out = io.StringIO()
        cli.status(copy, out)
        assert re.search(rf"Phase 1 .* {got:g}/", out.getvalue()), out.getvalue()
    assert cli.next_(copy, io.StringIO()).phase == 2
