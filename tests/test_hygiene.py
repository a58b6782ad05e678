"""Nothing left behind, nothing exposed: every way a run can end leaves zero processes, and a
one-machine job listens on loopback only.

Each test snapshots the processes of a job (its tree through /proc, plus the environment
marker every process of the job inherits), ends the job the way it is ended in practice
(SIGTERM or SIGKILL to the launcher, a test's or a grader's timeout), and asserts that
none of them is alive a few seconds later (a zombie counts as gone: it only waits to be reaped).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.deadlines import timeout_scale
from distlab.grading import grade
from distlab.procs import _alive, _descendants, _marked, kill_process_tree, marked_environ

REPO = Path(__file__).resolve().parent.parent


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


def _all_gone(pids, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:  # the failure is reported; the machine is not left with them
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived their job: {[(p, _cmdline(p)) for p in left]}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


# --------------------------------------------------------------------------- run_distributed's launcher killed
def _worker_hangs_with_a_helper(rank, world_size, pid_dir, stop=False):
    # A helper in a session of its own (as torchrun starts its workers), then a deadlock.
    helper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path(pid_dir, f"rank{rank}").write_text(f"{os.getpid()} {helper.pid}")
    if stop and rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # a stopped rank (a debugger, ^Z): it cannot notice anything
    t = torch.zeros(1)
    dist.recv(t, src=(rank + 1) % world_size)  # everyone receives, nobody sends


def _launcher(pid_dir: str, stop: str = "") -> None:
    from distlab.spawn import run_distributed

    # pytest's timeout is 300 s: the test kills this launcher long before its own deadline
    run_distributed(_worker_hangs_with_a_helper, 2, pid_dir, bool(stop), timeout_s=250, hang_s=0)


@pytest.mark.e2e
def test_killing_run_distributeds_parent_leaves_no_process(tmp_path):
    """SIGTERM and SIGKILL to a launcher whose ranks hang, and SIGKILL to one whose rank 1 is stopped
    (SIGSTOP): ranks, their helpers, the forkserver and the resource tracker all go. The stopped rank
    used to hold the forkserver's "alive" pipe, so the forkserver (its parent) never exited and the
    parent-death signal that wakes the rank never came. The launchers run at once (the cores are the cost)."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.test_hygiene import _launcher; "
            "_launcher(*sys.argv[1:])")
    launchers = {}
    for name, sig, stop in (("SIGTERM", signal.SIGTERM, ""), ("SIGKILL", signal.SIGKILL, ""),
                            ("SIGKILL-stopped-rank", signal.SIGKILL, "stop")):
        pid_dir = tmp_path / name
        pid_dir.mkdir()
        launchers[name] = (subprocess.Popen([sys.executable, "-c", code, str(pid_dir), stop], cwd=REPO), pid_dir, sig)
    try:
        for name, (proc, pid_dir, sig) in launchers.items():
            files = _wait_for(lambda: len(list(pid_dir.iterdir())) == 2 and list(pid_dir.iterdir()), 120,
                              f"the ranks of the {name} launcher did not start")
            pids = {int(p) for f in files for p in f.read_text().split()}
            tree = set(_descendants(proc.pid))
            assert pids <= tree, f"ranks and helpers {pids} are not below the launcher {proc.pid}: {tree}"
            assert len(tree) >= 5, f"expected forkserver, resource tracker, 2 ranks, helpers; got {tree}"
            os.kill(proc.pid, sig)
            proc.wait()
            _all_gone(tree)
    finally:
        for proc, _, _ in launchers.values():
            kill_process_tree(proc.pid)
            proc.wait()


# --------------------------------------------------------------------------- torchrun: loopback, doctor, timeout
_HANG_SCRIPT = """
import os, signal, torch, torch.distributed as dist
from distlab.launch import init_from_env
env = init_from_env(timeout_s=100)  # the watchdog is on by default: 100 s / 10 = 10 s
t = torch.ones(4)
dist.all_reduce(t)
print(f"ready {env.rank}", flush=True)
if env.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # a stopped rank: rank 0 waits for it in the next all_reduce
dist.all_reduce(t)
"""


def _listening(pids) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on ("127.0.0.1:4242", "[::]:29500")."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                host = ".".join(map(str, words)) if width == 8 else (
                    "[" + ":".join(words[i:i + 2].hex() for i in range(0, 16, 2)) + "]")
                out.append(f"{host}:{int(port, 16)}")
    return out


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("[0000:0000:0000:0000:0000:0000:0000:0001]",
                                               "[0000:0000:0000:0000:0000:ffff:7f00:0001]")


@pytest.mark.e2e
def test_a_one_machine_torchrun_job_listens_on_loopback_names_its_hang_and_dies_whole(tmp_path):
    """entrypoint.sh's launcher (``python -m distlab.launch --standalone``), DISTLAB_HANG_TIMEOUT unset:
    while the job runs, every socket it listens on is on loopback; rank 1 stops itself, and rank 0's
    watchdog (on by default, 10 s for this job) prints the doctor's table naming it within its
    timeout, not the process group's 100 s; torchrun then waits for the
    stopped worker, as a hung test would, and the test's cleanup kills the whole tree."""
    script, log = tmp_path / "hang.py", tmp_path / "out.log"
    script.write_text(_HANG_SCRIPT)
    marker = os.urandom(8).hex()
    env = dict(marked_environ(marker), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.pop("DISTLAB_HANG_TIMEOUT", None)  # the default
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "distlab.launch", "--standalone", "--nnodes=1",
                                 "--nproc_per_node=2", "--monitor-interval=0.1", str(script)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: log.read_text().count("ready ") == 2, 120, "the workers did not start")
        job = set(_marked(marker)) | {proc.pid}
        listening = _listening(job)
        assert listening, f"no listening socket found for the job {job}: the check would prove nothing"
        assert all(map(_loopback, listening)), f"the job listens beyond loopback: {listening}"
        _wait_for(lambda: "never entered all_reduce #2" in log.read_text(), 40, "no diagnosis")
        text = log.read_text()
        assert "distlab hang doctor (rank 0" in text and "rank 1 never entered all_reduce #2 (16 B) on WORLD" in text, text
        job |= set(_marked(marker))
    finally:
        kill_process_tree(proc.pid, marker)  # what test_phase4/test_deployment do when a job times out
        proc.wait()
    _all_gone(job)
    assert not _marked(marker)


_TRAIN_SCRIPT = """
import time, torch, torch.distributed as dist
from distlab.launch import init_from_env
env = init_from_env()
t = torch.ones(4)
dist.all_reduce(t)
print(f"ready {env.rank}", flush=True)
while True:  # training for a long time; the pause keeps 2 jobs of 2 workers from taking both cores
    dist.all_reduce(t)
    time.sleep(0.05)
"""

# What a test's pytest is to its jobs: a process that starts a shell that starts the launcher (as
# entrypoint.sh does when its output is filtered), with the pytest plugin's TIE_ENV naming itself.
_OUTER = """
import os, subprocess, sys, time
from distlab.procs import TIE_ENV
os.environ[TIE_ENV] = str(os.getpid())
cmd = f"{sys.executable} -m distlab.launch --standalone --nnodes=1 --nproc_per_node=2 {sys.argv[1]}; echo done"
subprocess.Popen(["bash", "-c", cmd], stdout=sys.stdout, stderr=subprocess.STDOUT)
time.sleep(250)  # pytest's timeout is 300 s; the test SIGKILLs this process within seconds
"""


def _cmdlines(pids) -> dict[int, str]:
    return {pid: _cmdline(pid) for pid in pids}


@pytest.mark.e2e
def test_torchrun_workers_die_with_a_sigkilled_agent_and_jobs_with_a_sigkilled_pytest(tmp_path):
    """(1) SIGKILL to the torchrun agent: its workers, which it can no longer stop, die with it
    (init_from_env arms the parent-death signal). (2) SIGKILL to a test's pytest (or pytest-timeout's
    thread method, which ends it with os._exit): the agent below the shell below it dies too
    (distlab.procs.tie_to, armed by the pytest plugin), then its workers. The jobs run at once."""
    from distlab.procs import TIE_ENV

    assert os.environ.get(TIE_ENV) == str(os.getpid()), "the pytest plugin ties the jobs of tests to pytest"
    script = tmp_path / "train.py"
    script.write_text(_TRAIN_SCRIPT)
    base = dict(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    jobs = {}
    for name in ("agent", "pytest"):
        marker = os.urandom(8).hex()
        log = tmp_path / f"{name}.log"
        cmd = ([sys.executable, "-m", "distlab.launch", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                str(script)] if name == "agent" else [sys.executable, "-c", _OUTER, str(script)])
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env={**marked_environ(marker), **base}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        jobs[name] = (proc, marker, log)
    try:
        for name, (proc, marker, log) in jobs.items():
            _wait_for(lambda: log.read_text().count("ready ") == 2, 120, f"the {name} job's workers did not start")
            job = set(_marked(marker)) - {proc.pid}
            workers = [p for p, c in _cmdlines(job).items() if "train.py" in c and "distlab.launch" not in c]
            assert len(workers) == 2, f"expected 2 workers in {_cmdlines(job)}"
            os.kill(proc.pid, signal.SIGKILL)  # the agent itself, or the "pytest" above the shell
            proc.wait()
            _all_gone(job, timeout_s=15)
    finally:
        for proc, marker, _ in jobs.values():
            kill_process_tree(proc.pid, marker)
            proc.wait()


def test_entrypoint_runs_one_machine_jobs_through_the_loopback_launcher(tmp_path):
    out = subprocess.run([str(REPO / "entrypoint.sh")], env={**os.environ, "RUN_MODE": "comm", "NPROC": "2",
                                                            "TORCHRUN": "echo launcher:"},
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("launcher: --nproc_per_node=2") and "--standalone --nnodes=1" in out.stdout, out.stdout
    entrypoint = (REPO / "entrypoint.sh").read_text()
    assert 'TORCHRUN:-python -m distlab.launch' in entrypoint


# --------------------------------------------------------------------------- grading timeout
_GRADED_JOB = """
import os, subprocess, sys, time
helper = subprocess.Popen(["sleep", "600"], start_new_session=True)   # like a torchrun worker
open(sys.argv[1], "w").write(f"{os.getpid()} {helper.pid}")
time.sleep(600)
"""


def test_a_grading_timeout_kills_the_job_and_what_left_its_session(tmp_path):
    pid_file = tmp_path / "pids"
    start = time.monotonic()
    code = grade.run_and_reap([sys.executable, "-c", _GRADED_JOB, str(pid_file)], timeout_s=2)
    assert code == f"killed: ended after {round(2 * timeout_scale(), 1):g} s" and time.monotonic() - start < 15
    pids = [int(p) for p in pid_file.read_text().split()]
    _all_gone(pids, timeout_s=5)


def _worker_starts_a_helper(rank, world_size):
    return subprocess.Popen(["sleep", "600"], start_new_session=True).pid  # and forgets it


def test_helpers_a_rank_started_end_with_the_rank():
    from distlab.spawn import run_distributed

    pids = run_distributed(_worker_starts_a_helper, 2)
    _all_gone(pids, timeout_s=5)
