"""Where a submission's code runs in a grading run: a jail the operating system keeps.

An instructor's grading run (``pytest --impl templates --student-dir=DIR``, and Gradescope's
grading/gradescope/run_autograder) never runs learner code in its own processes. For each exercise it
starts one jail (distlab/grading/jail_enter.py builds its walls) and runs that exercise's tests there, in a
nested pytest, on a private copy of the bench:

* the copy holds the bench (distlab/), the tests, the demos and configs, the phase folders with the
  student's templates over the untouched ones, and pyproject.toml; not the reference (solutions/, but for
  the few modules graded tests still build on: ``BUILDING_BLOCKS``, and in an exercise's jail without that
  exercise's own regions: :func:`reference_for`), not the grader's files (grading/), not the reference
  cache (.distlab/), not .git;
* inside, everything is read-only but the jail's own ``out/`` and ``work/`` (and a private ``/tmp``); the
  instructor's checkout, the reference cache, the student's folder and the grader's home are covered
  by empty file systems; the processes run as an unprivileged user (as root: ``DISTLAB_SANDBOX_USER``,
  default ``nobody``) or with no capability in a user namespace of their own (as an ordinary user), in a
  PID namespace that ends with the jail;
* what comes out is data: one file per test, written by the nested pytest (distlab/grading/report.py),
  read here with ``torch.load(weights_only=True)`` (tensors and plain values, nothing that runs code),
  file by file, never following a link.

The verdict is made by the caller (distlab/grading/verdict.py) from that data and the reference run's.
Where no jail can be built (no ``unshare``, user namespaces switched off), :class:`JailUnavailable` says so
in one line and nothing is graded.
"""
from __future__ import annotations

import io
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from distlab import outcome

REPO = Path(__file__).resolve().parents[2]
USER_ENV = "DISTLAB_SANDBOX_USER"  # as root: the identity learner code runs as (default: nobody)
COPIED = ("distlab", "tests", "demos", "configs", "pyproject.toml")  # and every phase*/ folder
# The reference modules graded tests still take building blocks from (load(..., impl="solutions"): 4.2's
# tests write a file with the reference's 4.1, the fault-tolerance harness runs on the reference's
# checkpoint and elastic modules, 2.x and 3.19 build on the reference's tensor parallel and FSDP), with what
# they import. In an exercise's jail each comes without that exercise's own regions (reference_for): a
# submission can read the reference of the other exercises of its lesson, never of its own (README's "What a
# submission cannot do"), until each has a bench copy as 1.6-1.8's and 4.4's have (distlab/lessons/).
BUILDING_BLOCKS = ("phase2_advanced/tensor_parallel", "phase2_advanced/tp_primitives", "phase3_multi_node/zero",
                   "phase3_multi_node/fsdp", "phase4_production/checkpoint", "phase4_production/elastic")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "cheats")
_EXERCISE_IDS = re.compile(r"(\d+)\.(\d+)(?:-(\d+)\.(\d+))?(?:\s|$)")
OUTCOME_LIMIT = 64 << 20  # bytes: one test's records (tensors included) are far smaller
WALLS_DOWN = 97  # jail_enter.py's exit code when a wall could not be built


class JailUnavailable(RuntimeError):
    """No jail can be built here: nothing is graded (a grade whose code ran unwalled is not a grade)."""


@dataclass
class Jail:
    """One grading run's jails: the private copy (made once) and the runs of each group of tests."""

    student_dir: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="distlab-jail-")))
    runs: int = 0

    def __post_init__(self) -> None:
        os.chmod(self.root, 0o755)
        make_copy(self.student_dir, self.root / "copy")
        self.identity = identity()
        self.hide, self.keep = hidden(self.student_dir, self.identity)

    def run(self, nodeids: list[str], timeout_s: float, log=print, env: dict[str, str] | None = None,
            exercise: str = "") -> dict[str, tuple]:
        """Run ``nodeids`` (this checkout's node ids) in a fresh jail; each one's outcome (missing: it sent none).
        ``exercise``: the name the tests are marked with (``"3.15 ZeRO-1"``): its own regions are left out of
        the reference's building blocks there. ``env``: more variables for the jail's environment (the tests
        of the walls pass what they probe)."""
        self.runs += 1
        scratch = self.root / f"run{self.runs}"
        scratch.mkdir(mode=0o755)
        reference = self.root / f"reference{self.runs}"  # beside the scratch, not in it: mounted read-only
        reference_for(exercise, reference)
        (scratch / "copy").mkdir(mode=0o755)  # where the jail mounts the copy, read-only
        for name in ("out", "work"):
            (scratch / name).mkdir(mode=0o700)
            if self.identity.user:
                os.chown(scratch / name, *self.identity.user)
        (scratch / "nodeids.json").write_text(json.dumps(nodeids))
        # hypothesis's and pytest-benchmark's plugins: ~2 s of imports per jail, no graded test uses them
        argv = [sys.executable, "-m", "pytest", *nodeids, "-p", "no:hypothesispytest", "-p", "no:benchmark",
                "-p", "distlab.grading.report",
                "--impl=templates", "-q", "-p", "no:cacheprovider", "--weights=/dev/null",
                f"--basetemp={jail_path('work', 'pytest')}", "-o", "console_output_style=classic"]
        spec = {"scratch": str(scratch.resolve()), "copy": str((self.root / "copy").resolve()),
                "reference": str(reference.resolve()), "hide": self.hide, "keep": self.keep,
                "user": self.identity.user, "argv": argv, "cwd": jail_path("copy"),
                "env": {**jail_environment(self.identity), **(env or {})}}
        cmd = [*self.identity.unshare, sys.executable, "-I", str(Path(__file__).with_name("jail_enter.py")),
               json.dumps(spec)]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        # Past its deadline while still progressing on a busy machine, it is waited for (up to the hard cap);
        # a kill of unshare (--kill-child) ends the jail's PID 1, and with it every process inside.
        from distlab.procs import communicate  # (torch.distributed, through the doctor)

        raw, why = communicate(proc, timeout_s)
        raw += f"\n(the jail: {why})".encode() if why else b""
        output = raw.decode(errors="replace")
        if proc.returncode == WALLS_DOWN:
            raise JailUnavailable(f"the grading jail's walls did not go up: {_last_line(output)}")
        outcomes = read_outcomes(scratch / "out", nodeids)
        log(f"jail: {len(outcomes)}/{len(nodeids)} test(s) reported in {time.monotonic() - start:.1f} s "
            f"(exit {proc.returncode})")
        for nodeid in nodeids:
            if nodeid not in outcomes:
                outcomes[nodeid] = outcome.failure_text(
                    f"the test sent no outcome from the grading jail (it ended with exit code {proc.returncode}; "
                    f"its last line: {_last_line(output)})", output[-3000:])
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(reference, ignore_errors=True)
        return outcomes

    def nodeid(self, item) -> str:
        """``item``'s node id inside the jail: the same for the checkout's tests; a test file from elsewhere
        (an instructor's own, given to pytest by path) is copied into the jail's ``tests/outside/`` first."""
        path = Path(item.path).resolve()
        if path.is_relative_to(REPO / "tests"):
            return item.nodeid
        target = self.root / "copy" / "tests" / "outside" / path.name
        if not target.exists():
            target.parent.mkdir(mode=0o755, exist_ok=True)
            shutil.copy(path, target)
            os.chmod(target, 0o644)
        return f"tests/outside/{path.name}::{item.nodeid.split('::', 1)[1]}"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(nothing printed)"


def jail_path(*parts: str) -> str:
    return "/".join(("/tmp/sandbox", *parts))


# --------------------------------------------------------------------------- the copy
def make_copy(student_dir: Path, dest: Path) -> None:
    """The bench without the reference: what the jail's pytest runs on (see the module's docstring)."""
    dest.mkdir(mode=0o755)
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=IGNORED, symlinks=False)
        elif source.is_file():
            shutil.copy(source, dest / name)
    for phase in sorted(REPO.glob("phase*")):
        if phase.is_dir():
            shutil.copytree(phase, dest / phase.name, ignore=IGNORED)
            for template in phase.glob("template_*.py"):  # the student's version, where there is one
                theirs = Path(student_dir) / phase.name / template.name
                if theirs.is_file() and not theirs.is_symlink():
                    shutil.copy(theirs, dest / phase.name / template.name)
    (dest / "solutions").mkdir()  # where each run's reference_for() is mounted
    # The lint (a teaching message, distlab/grading/isolation.py) compares a template with what its untouched
    # version and its solution import; the solutions stay out, so their imports come along as data.
    from distlab.grading import isolation

    (dest / isolation.ALLOWANCES).write_text(allowances())
    for path in [dest, *dest.rglob("*")]:  # readable by the jail's user, writable by nobody inside
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def exercise_ids(exercise: str) -> set[str]:
    """The TODO ids an exercise grades, from the id its name starts with: "3.15-3.18 ..." -> 3.15 ... 3.18."""
    m = _EXERCISE_IDS.match(exercise.strip())
    if not m:
        return set()
    return {f"{m[1]}.{i}" for i in range(int(m[2]), int(m[4] or m[2]) + 1)}


def without_regions(text: str, ids: set[str]) -> str:
    """``text`` (a solution) with each region of ``ids`` (3.15 covers 3.15a, 3.15b) replaced by a raise."""
    from distlab.regions import BEGIN, END

    out, skipping = [], False
    for line in text.splitlines():
        if skipping:
            skipping = not END.match(line)
            continue
        m = BEGIN.match(line)
        if m and m["id"].rstrip("abcdefghijklmnopqrstuvwxyz") in ids:
            out.append(f'{m["indent"]}raise RuntimeError("TODO {m["id"]}: its reference is not in the grading jail of its '
                       'own exercise; a test of that exercise must use the graded code (load() without impl)")')
            skipping = True
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def reference_for(exercise: str, dest: Path) -> None:
    """The reference's building blocks for ``exercise``'s jail, in ``dest`` (mounted at the copy's solutions/):
    each without the exercise's own regions, so its jail never holds the reference of what it teaches (the
    tests of an exercise build on the other exercises' regions only: they are graded alone)."""
    ids = exercise_ids(exercise)
    for block in BUILDING_BLOCKS:
        phase = block.split("/")[0]
        (dest / phase).mkdir(parents=True, exist_ok=True)
        for init in (REPO / "solutions" / "__init__.py", REPO / "solutions" / phase / "__init__.py"):
            shutil.copy(init, dest / init.relative_to(REPO / "solutions"))
        (dest / f"{block}.py").write_text(without_regions((REPO / "solutions" / f"{block}.py").read_text(), ids))
    for path in [dest, *dest.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def allowances() -> str:
    """The lint's allowances of every template (distlab/grading/isolation.py), as JSON: rendered from the
    solutions once per version of the bench (a few seconds on 2 cores) and kept beside the reference's
    recorded checks, which depend on the same files."""
    from distlab.grading import isolation, verdict

    folder = Path(os.environ.get(verdict.CACHE_ENV) or REPO / ".distlab" / "reference-checks")
    path = folder / f"allowances-{verdict._bench_digest()}.json"
    try:
        return path.read_text()
    except OSError:
        pass
    text = json.dumps(isolation.all_allowances())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(text)
        os.replace(scratch, path)
    except OSError:
        pass  # a read-only checkout: computed again next time
    return text


# --------------------------------------------------------------------------- who runs inside
@dataclass
class Identity:
    unshare: list[str]
    user: tuple[int, int] | None  # (uid, gid) to become; None: the caller's own, without capabilities


def identity() -> Identity:
    if shutil.which("unshare") is None:
        raise JailUnavailable("no `unshare` here (util-linux): learner code cannot be walled off, so nothing is "
                              "graded; install util-linux, or grade on a machine that has it")
    base = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
    if os.geteuid() != 0:
        return Identity([base[0], "--user", "--map-root-user", *base[1:]], None)
    name = os.environ.get(USER_ENV, "nobody")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise JailUnavailable(f"the jail's user {name!r} does not exist: create it or set {USER_ENV}") from None
    if entry.pw_uid == 0:
        raise JailUnavailable(f"{USER_ENV}={name} is root: learner code must run as an unprivileged user")
    return Identity(base, (entry.pw_uid, entry.pw_gid))


COVERED = ("/tmp", "/var/tmp", "/dev/shm")  # fresh and empty in every jail (jail_enter.py)


def _closed_above(path: str) -> str | None:
    """The topmost folder above ``path`` that others may not enter (pyenv under a 0700 /root), or None."""
    parts = Path(path).parents
    return next((str(d) for d in reversed(parts) if str(d) != "/" and not d.stat().st_mode & stat.S_IXOTH), None)


def interpreter_trees() -> list[str]:
    """The folders this interpreter runs from (its prefix, its base's, its binary's), as real paths."""
    trees = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(t for t in trees if not any(t != o and t.startswith(o + os.sep) for o in trees))


def hidden(student_dir: Path, ident: Identity | None = None) -> tuple[list[str], list[str]]:
    """(covered, kept): what the jail covers with an empty file system (the checkout, the reference cache,
    the student's folder, the grader's home, and any folder the jail's user cannot enter above the
    interpreter), and the interpreter's trees it shows again, read-only, at their own paths inside a cover."""
    paths = {str(p.resolve()) for p in (REPO, Path(student_dir), Path.home())}
    cache = os.environ.get("DISTLAB_REFERENCE_CHECKS")
    if cache:
        paths.add(str(Path(cache).resolve()))
    trees = interpreter_trees()
    if ident is not None and ident.user is not None:
        paths |= {closed for closed in map(_closed_above, trees) if closed}
    paths.discard("/")
    covers = sorted(paths) + list(COVERED)
    kept = [t for t in trees if any(t == c or t.startswith(c + os.sep) for c in covers)]
    return sorted(paths), kept


def jail_environment(ident: Identity) -> dict[str, str]:
    """A clean environment: nothing of the grader's (tokens, paths), only what the tests need."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": jail_path("work"), "TMPDIR": jail_path("work"), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "DISTLAB_IMPL": "templates",
           "DISTLAB_OUTCOMES": jail_path("out"), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
    for name in ("DISTLAB_TIMEOUT_SCALE", "CUDA_VISIBLE_DEVICES", "DISTLAB_EXERCISES"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


# --------------------------------------------------------------------------- what comes out
def read_outcomes(out: Path, nodeids: list[str]) -> dict[str, tuple]:
    """``out/<i>.pt`` for the i-th node id: read as data, checked for shape; anything else is ignored."""
    outcomes = {}
    for i, nodeid in enumerate(nodeids):
        path = out / f"{i}.pt"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > OUTCOME_LIMIT:
                got = _refused(f"its outcome file is not a regular file under {OUTCOME_LIMIT >> 20} MiB")
            else:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    got = checked(_loads(f.read()))
        except Exception as exc:  # noqa: BLE001 - whatever the jail wrote, it is a failure, never a pass
            got = _refused(f"its outcome does not read as the grader's data ({str(exc)[:200]})")
        finally:
            os.close(fd)
        outcomes[nodeid] = got
    return outcomes


def _loads(payload: bytes):
    import torch

    return torch.load(io.BytesIO(payload), weights_only=True)


def _refused(why: str) -> tuple:
    return outcome.failure_text(f"the graded run's outcome was refused: {why}")


def checked(message) -> tuple:
    """``message`` if it has the shape of an outcome (report.py's); otherwise a refusal."""
    if not isinstance(message, tuple) or not message or message[0] not in ("passed", "skipped", "error"):
        return _refused("not an outcome")
    if message[0] == "passed":
        if len(message) != 2 or not isinstance(message[1], list) or not all(isinstance(r, dict) for r in message[1]):
            return _refused("a pass without a list of recorded checks")
        return message
    if message[0] == "skipped":
        return message if len(message) == 2 and isinstance(message[1], str) else _refused("a malformed skip")
    if len(message) != 6 or not all(isinstance(x, str) for x in message[1:5]) or not isinstance(message[5], bool):
        return _refused("a malformed failure")
    return message


# --------------------------------------------------------------------------- a grading run's groups
def run_groups(items, student_dir: str, log=None) -> dict[str, tuple]:
    """Each exercise's tests in a jail of their own (one exercise's code never shares a process with another's
    tests); the tests of no exercise (the bench's scaffold checks) in one more. Outcomes by node id."""
    log = log or (lambda line: print(line, flush=True))
    from distlab.manifest import canonical

    groups: dict[str, list] = {}
    for item in items:  # by the exercise's full name, however its marker spells it (id or name)
        marker = item.get_closest_marker("exercise")
        groups.setdefault(canonical(marker.args[0]) if marker else "", []).append(item)
    jail = Jail(Path(student_dir))
    outcomes: dict[str, tuple] = {}
    try:
        inside = {item.nodeid: jail.nodeid(item) for item in items}
        for name, group in groups.items():
            log(f"\njail: {name or 'the bench'}: {len(group)} test(s)")
            got = jail.run([inside[item.nodeid] for item in group], _deadline(group), log, exercise=name)
            outcomes.update({item.nodeid: got[inside[item.nodeid]] for item in group})
    finally:
        jail.close()
    return outcomes


def _deadline(items) -> float:
    """The group's hard cap: its tests' own timeouts (pytest-timeout's, marker or ini) and a minute to start."""
    total = 60.0
    for item in items:
        marker = item.get_closest_marker("timeout")
        ini = item.config.getini("timeout") if "timeout" in item.config._parser._inidict else 300
        total += float(marker.args[0]) if marker and marker.args else float(ini or 300)
    return total
