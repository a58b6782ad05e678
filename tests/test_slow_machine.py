"""A slow machine is said, never blamed: DISTLAB_TIMEOUT_SCALE multiplies every course deadline.

On a machine its user knows to be slow, ``DISTLAB_TIMEOUT_SCALE=3`` gives every deadline three times as
long: ``run_distributed``'s run deadline, hang delay and process-group timeout, the torchrun watchdog's,
and pytest-timeout's limit of each test (whose end ``run_distributed`` also knows: a run waited for on a
busy machine gives its verdict before pytest-timeout's bare stack dump). The busy-machine behaviour
itself (a run still progressing is waited for, then called slow) is tests/test_busy_machine.py's.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distlab import doctor_watch
from distlab.spawn import run_distributed
from test_busy_machine import busy_core  # noqa: F401 (a fixture: two busy processes pinned to one core)


def _worker_idle_then_all_reduce(rank, world_size, idle_s):
    time.sleep(idle_s)  # a rank that makes no progress for idle_s: the doctor's and the deadline's business
    t = torch.ones(3)
    dist.all_reduce(t)
    return t.tolist()


def test_the_scale_multiplies_the_run_deadline_and_the_hang_delay(monkeypatch):
    """1.5 s without progress fails a run with timeout_s=1 (hang delay 0.5 s, deadline 1 s); with the
    scale at 5 the same run has 2.5 s and 5 s, and passes."""
    monkeypatch.setenv(doctor_watch.TIMEOUT_SCALE_ENV, "5")
    assert run_distributed(_worker_idle_then_all_reduce, 2, 1.5, timeout_s=1) == [[2.0] * 3] * 2


@pytest.mark.parametrize("setting", ["fast", "0", "-2"])
def test_a_bad_scale_says_what_to_write(setting, monkeypatch):
    monkeypatch.setenv(doctor_watch.TIMEOUT_SCALE_ENV, setting)
    with pytest.raises(ValueError, match=rf"^DISTLAB_TIMEOUT_SCALE='{setting}' must be a number > 0 that multiplies "
                                         r"every deadline \(e\.g\. DISTLAB_TIMEOUT_SCALE=3 on a slow machine\)$"):
        run_distributed(_worker_idle_then_all_reduce, 1, 0.0, timeout_s=10)


def test_the_scale_multiplies_the_torchrun_watchdogs_timeout(monkeypatch):
    monkeypatch.setenv(doctor_watch.TIMEOUT_SCALE_ENV, "2")
    assert doctor_watch.watchdog_timeout(None, 300) == 60.0  # 30 s unscaled (tests/test_busy_machine.py)
    assert doctor_watch.watchdog_timeout("45", 300) == 90.0
    assert doctor_watch.watchdog_timeout("0", 300) == 0.0  # off stays off


def test_pytest_timeouts_go_through_the_scale_and_tell_the_runs_when_they_end(monkeypatch, request):
    """This very test runs under distlab's pytest_timeout_set_timer: its end is in TEST_DEADLINE_ENV."""
    import pytest_timeout

    left = doctor_watch.test_time_left()
    limit = pytest_timeout._get_item_settings(request.node).timeout
    assert left is not None and 0 < left <= limit * doctor_watch.timeout_scale(), (left, limit)
    monkeypatch.setenv(doctor_watch.TEST_DEADLINE_ENV, os.environ[doctor_watch.TEST_DEADLINE_ENV])  # restored after
    monkeypatch.setenv(doctor_watch.TIMEOUT_SCALE_ENV, "3")

    class Item:
        nodeid = "a test"

    item = Item()
    settings = pytest_timeout.Settings(timeout=100, method="thread", func_only=False, disable_debugger_detection=False)
    assert doctor_watch.set_test_timer(item, settings)
    try:
        assert 299 < doctor_watch.test_time_left() <= 300  # 100 s times 3
        assert 289 < doctor_watch.hard_cap_s(60) <= 290, "the cap ends 10 s before pytest-timeout fires"
        assert doctor_watch.hard_cap_s(20) == 200, "10x the deadline, within the test's time"
        assert doctor_watch.hard_cap_s(400) == 400, "never before the deadline itself"
    finally:
        item.cancel_timeout()
    assert doctor_watch.test_time_left() is None, "a run after the test would be capped by a stale deadline"


def _deadline_verdict(code: str, timeout_s: float) -> tuple[str, float]:
    """What ``procs.Deadline`` says about a job running ``code`` (looked at every 50 ms, as a caller does)."""
    from distlab.procs import Deadline, kill_process_tree

    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline, start = Deadline([child.pid], timeout_s), time.monotonic()
        while (over := deadline.passed()) is None:
            threading.Event().wait(0.05)  # the caller's polling interval
        return over, time.monotonic() - start
    finally:
        kill_process_tree(child.pid)
        child.wait()


def test_a_jobs_deadline_holds_for_a_job_that_makes_no_progress():
    over, took = _deadline_verdict("import time\ntime.sleep(60)", 0.5)
    assert over == "" and took < 3, (over, took)  # a plain timeout, at the deadline plus two looks (0.5 s apart)


def test_a_jobs_deadline_waits_for_a_job_progressing_on_a_busy_machine_then_says_slow(busy_core, monkeypatch):
    """torchrun jobs (phase 4's kill-and-resume) have their own deadline: it waits like run_distributed's."""
    monkeypatch.setattr(doctor_watch, "HARD_CAP", 3)  # 3 s, not 10, to keep the test cheap
    over, took = _deadline_verdict(f"import os\nos.sched_setaffinity(0, {{{busy_core}}})\nos.nice(19)\n"
                                   "while True: pass", 1)
    assert re.match(r"slow machine \(load \d+\.\d on \d+ cores?\), not your code: rerun \(or set "
                    r"DISTLAB_TIMEOUT_SCALE=2\); its processes were still making progress after 3 s$", over), over
    assert took < 5, took


@pytest.mark.parametrize("pressure, load, busy", [("some avg10=35.00 avg60=20.00 avg300=5.00 total=1", 0.5, True),
                                                   ("some avg10=5.00 avg60=50.00 avg300=50.00 total=1", 9.0, False),
                                                   (None, 9.0, True), (None, 0.5, False)],
                         ids=["pressure", "no-pressure", "load", "no-load"])
def test_a_machine_that_keeps_tasks_waiting_is_busy_whatever_the_jobs_last_sample_says(pressure, load, busy,
                                                                                      tmp_path, monkeypatch):
    """A starved process's wait for a CPU reaches /proc only when it runs: beside 8 busy processes a job's half
    second read 0.04 s of waiting, then 2 s, and a job still progressing was ended at its deadline as stuck.
    The machine's own pressure (or, without it, its load) says busy between those lumps."""
    path = tmp_path / "cpu"
    if pressure is not None:
        path.write_text(pressure + "\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    monkeypatch.setattr(doctor_watch, "PRESSURE", str(path))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert doctor_watch.busy(0.04, 0.5) == busy  # the job's own sample: below BUSY_SHARE
    assert doctor_watch.busy(0.2, 0.5)  # its own sample alone says busy


_SPIN_ON = "import os\nos.sched_setaffinity(0, {{{core}}})\nos.nice(19)\nwhile True: pass"  # a job's slow child


def test_a_bugs_nested_pytest_still_progressing_on_a_busy_machine_is_said_slow_not_timeout(busy_core, monkeypatch):
    """distlab.bugs ran each bug's pytest under subprocess.run(timeout=N): a loaded machine marked bugs
    "timeout". The job's deadline now waits like run_distributed's, and a bug's verdict says slow machine."""
    from distlab import bugs

    monkeypatch.setattr(doctor_watch, "HARD_CAP", 3)  # waited for 3 s, not 10, to keep the test cheap
    start = time.monotonic()
    proc, over = bugs.run_job([sys.executable, "-c", _SPIN_ON.format(core=busy_core)], dict(os.environ), 1)
    assert proc.returncode is None and re.match(r"slow machine \(load \d+\.\d on \d+ cores?\), not your code: rerun "
                                                r".*; its processes were still making progress after 3 s$", over), over
    assert time.monotonic() - start < 6, "waited past the hard cap (3 s) and two looks"
    failed = {"outcome": "failed", "message": over, "error_type": "TimeoutError"}
    assert bugs.verdict([failed]) == ("slow machine", over)


def test_a_bugs_nested_pytest_that_makes_no_progress_still_times_out_and_leaves_nothing(tmp_path):
    from distlab import bugs
    from distlab.procs import _alive

    pid_file = tmp_path / "grandchild"
    proc, over = bugs.run_job(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], dict(os.environ), 0.5)
    assert over == "pytest did not finish within 0.5 s", over  # no CPU used: a plain timeout, busy machine or not
    assert bugs.verdict([{"outcome": "failed", "message": over, "error_type": "TimeoutError"}])[0] == "timeout"
    assert not _alive(int(pid_file.read_text())), "the job's grandchild outlived it"


def test_the_forkserver_answered_before_the_first_tests_timer_was_armed():
    """This module imports the launcher, so this session started its forkserver after collection and armed the
    first test's timer once it answered (the e2e tier's test_busy_machine.py shows a slow start passing)."""
    from multiprocessing import forkserver

    from distlab import pytest_plugin

    assert pytest_plugin.FORKSERVER["started"] and pytest_plugin.FORKSERVER["ready_s"] is not None, \
        pytest_plugin.FORKSERVER
    assert forkserver._forkserver._forkserver_pid is not None, "no forkserver running"


class _State:  # torch's rendezvous state, as the join step sees it: who joined, who waits for the next round
    def __init__(self, participants=(), wait_list=()):
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

        node = {name: _NodeDesc("127.0.0.1", 1_000_000 + i, 0) for i, name in enumerate(["node0", "node1", "node2"])}
        self.participants, self.wait_list = {node[n]: 0 for n in participants}, {node[n] for n in wait_list}


def _join_verdict(deadline, states) -> tuple[float, float]:
    """Run ``JoinDeadline.check`` as torch's join step does (every 50 ms here) until the wait ends."""
    start, states = time.monotonic(), iter(states)
    state = next(states)
    while (over := deadline.check(state)) == float("inf"):
        threading.Event().wait(0.05)  # the join step's polling interval
        state = next(states, state)
    return over - deadline.start, time.monotonic() - start


def _agent_like(code: str, endpoint: str) -> subprocess.Popen:
    """A process whose command line is a launcher's for ``endpoint`` (like distlab.launch's), running ``code``."""
    agent = subprocess.Popen([sys.executable, "-c", code, "distlab.launch", f"--rdzv_endpoint={endpoint}"],
                             stdout=subprocess.PIPE)
    agent.stdout.readline()  # it has started (python's own start-up is over): from now on it runs `code`
    return agent


@pytest.mark.parametrize("peer, slow", [("print(flush=True)\nwhile True: pass", True),
                                        ("import time\nprint(flush=True)\ntime.sleep(60)", False)],
                         ids=["spinning", "asleep"])
def test_the_rendezvous_waits_for_a_node_still_starting_on_this_machine_and_says_slow(peer, slow, monkeypatch):
    """launch_agent's join deadline: past the (scaled) join timeout, a node of the job that is still starting here
    (its agent using CPU, as when it imports torch on a busy machine) is waited for up to the hard cap, then said
    slow and nobody is blamed; a node that is not progressing (asleep) is missing at the join timeout, as before."""
    from distlab.launch_agent import JoinDeadline
    from distlab.procs import kill_process_tree

    monkeypatch.setattr(doctor_watch, "HARD_CAP", 3)  # 3 x 0.5 s: the cap in 1.5 s, to keep the test cheap
    endpoint = f"127.0.0.1:{os.getpid() % 30000 + 30000}"
    child = _agent_like(peer, endpoint)
    try:
        # the asleep node must be asleep before the clock starts: on a busy machine the end of its print (runnable,
        # waiting for a CPU) is a sign of progress, and counts for WINDOW_S (seen with 4 spinners on 2 cores)
        while not slow and doctor_watch.thread_stat(child.pid)[0] != "S":
            threading.Event().wait(0.01)
        deadline = JoinDeadline(0.5, endpoint)
        at, took = _join_verdict(deadline, [_State(["node0"])])
    finally:
        kill_process_tree(child.pid)
        child.wait()
    assert deadline.slow == slow and (1.5 <= at < 3 if slow else 0.5 <= at < 1.5), (deadline.slow, at)
    if slow:
        assert re.match(rf"slow machine \(load \d+\.\d on \d+ cores?\), not your code: rerun \(or set "
                        rf"DISTLAB_TIMEOUT_SCALE=2\); 1 of 2 nodes joined the rendezvous at {endpoint} in \d+ s "
                        rf"and the others were still starting$", deadline.slow_line(1, 2)), deadline.slow_line(1, 2)


def test_the_rendezvous_waits_while_nodes_keep_joining(monkeypatch):
    """A node that joins is a sign that the rest are coming (slowly): the wait goes on for JoinDeadline.WINDOW_S
    past it, and ends when the nodes stop coming."""
    from distlab.launch_agent import JoinDeadline

    monkeypatch.setattr(JoinDeadline, "WINDOW_S", 1.0)  # 1 s, not 3, to keep the test cheap
    deadline = JoinDeadline(0.5, None)  # its hard cap: 5 s
    joining = [_State(["node0"])] * 6 + [_State(["node0", "node1"])]
    at, _ = _join_verdict(deadline, joining)
    # node1 joined ~0.3 s in (seen at the look at 0.5 s): the wait ends WINDOW_S (1 s) after that look, not at
    # the 0.5 s timeout, and before the cap (the bound allows a look late by 1 s on a busy machine)
    assert not deadline.slow and 1.5 <= at < 2.5, at


_SLOW_AGENT = """import runpy, sys, time
start = time.thread_time()
while time.thread_time() - start < {spin_s}:  # a node still starting (importing torch on a busy machine): CPU
    pass
sys.argv = ["distlab.launch", *sys.argv[1:]]
runpy.run_module("distlab.launch", run_name="__main__", alter_sys=True)
"""


@pytest.mark.e2e  # 20-40 s: two agents, each importing torch, one of them late on purpose
@pytest.mark.timeout(240)
@pytest.mark.parametrize("late", ["late", "never"])
def test_a_node_starting_late_on_this_machine_is_waited_for_not_reported_missing(late, tmp_path):
    """Two nodes on one machine, join timeout 3 s (times the scale): node 1 spends longer than that starting, so
    with torch's fixed join timeout node 0 said "only 1 of 2 nodes joined the rendezvous ... within 3 s". Now
    node 0 sees node 1's agent progressing and waits for it: the job runs on both nodes. A node 1 that keeps
    starting past the hard cap (10 x 3 s) is said slow, and nobody is blamed."""
    from distlab.deadlines import timeout_scale
    from distlab.devices import free_port
    from distlab.procs import kill_process_tree, marked_environ

    worker = tmp_path / "worker.py"
    worker.write_text("import os\nprint(f\"rank {os.environ['RANK']} ran\", flush=True)\n")
    port, marker, repo = free_port(), os.urandom(8).hex(), os.path.dirname(os.path.dirname(__file__))
    procs = []
    for node in (0, 1):
        args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=late-{port}", f"--rdzv_conf=is_host={'true' if node == 0 else 'false'},join_timeout=3",
                str(worker)]
        spin_s = 4 * timeout_scale() if late == "late" else 3600  # "never": past any cap
        launcher = ["-m", "distlab.launch"] if node == 0 else ["-c", _SLOW_AGENT.format(spin_s=spin_s)]
        env = {**marked_environ(marker), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, *launcher, *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        outs = [p.communicate(timeout=180)[0] for p in (procs if late == "late" else procs[:1])]
    finally:
        for p in procs:
            kill_process_tree(p.pid, marker)
            p.wait()
    if late == "never":
        last = outs[0].strip().splitlines()[-1]
        assert procs[0].returncode == 1 and re.match(
            rf"distlab\.launch: slow machine \(load \d+\.\d on \d+ cores?\), not your code: rerun \(or set "
            rf"DISTLAB_TIMEOUT_SCALE=\d+\); 1 of 2 nodes joined the rendezvous at 127\.0\.0\.1:{port} in \d+ s "
            rf"and the others were still starting$", last), outs[0][-3000:]
        return
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and re.search(r"rank \d ran", out), f"node {node} ({p.returncode}):\n{out[-3000:]}"


def test_the_graders_job_still_progressing_on_a_busy_machine_is_said_slow_not_killed_at_its_timeout(busy_core,
                                                                                                    monkeypatch):
    """The grader's outer pytest (grade.run_and_reap) and each grading jail (jail.run) ended at a fixed
    timeout, and every test then read "sent no outcome": a student charged for the machine's load. Both now
    wait through procs.communicate, as run_distributed's deadline waits."""
    from distlab import procs
    from distlab.grading import grade

    monkeypatch.setattr(doctor_watch, "HARD_CAP", 3)  # waited for 3 s, not 10, to keep the test cheap
    start = time.monotonic()
    code = grade.run_and_reap([sys.executable, "-c", _SPIN_ON.format(core=busy_core)], timeout_s=1)
    assert re.match(r"killed: slow machine \(load \d+\.\d on \d+ cores?\), not your code: rerun .*"
                    r"; its processes were still making progress after 3 s$", code), code
    assert time.monotonic() - start < 8, "waited past the hard cap (3 s) and two looks"
    proc = subprocess.Popen([sys.executable, "-c", "import time\nprint('started', flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    out, why = procs.communicate(proc, 0.5)  # the jail's wait: no progress, so its plain deadline
    assert why == "ended after 0.5 s" and out == "started\n" and proc.returncode is not None, (out, why)
