"""A multi-node start that cannot work ends with one line naming the cause and the fix.

torchrun reports a taken MASTER_PORT and an unreachable node 0 alike as "The connection to the
C10d store has failed" at the end of a ~42-line traceback, and a wrong GLOO_SOCKET_IFNAME as a
gloo enforce failure in every rank. ``python -m distlab.launch`` (what ``entrypoint.sh`` runs)
ends each with one line; these tests provoke each on 127.0.0.1 with free ports and short
timeouts, and check that the last line is that message and that no Python traceback is shown.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distlab.devices import free_port
from distlab.launch import init_from_env, socket_ifname_problem
from distlab.procs import kill_process_tree, marked_environ

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "entrypoint.sh"
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                  "DISTLAB_TRACEBACK", "TORCHRUN")


def _clean_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    return {**base, "OMP_NUM_THREADS": "1", **env}


def _run(cmd: list[str], env: dict[str, str], timeout_s: float = 60) -> tuple[int, str]:
    """Run a launcher (own session, marked) to its end; nothing it started outlives the test."""
    marker = os.urandom(8).hex()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**marked_environ(marker), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        kill_process_tree(proc.pid, marker)
        proc.wait()
    return proc.returncode, out


def _assert_ends_with_one_line(code: int, out: str, says: str) -> None:
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert code != 0, f"the launch did not fail:\n{out[-2000:]}"
    assert last.startswith("distlab.launch: ") and says in last, f"the last line is not the cause:\n{out[-3000:]}"
    assert "Traceback (most recent call last)" not in out, f"a traceback is shown:\n{out[-3000:]}"


def test_a_master_port_in_use_on_node_0_ends_in_one_line_naming_the_port():
    # A socket this test holds makes the port "in use" on 127.0.0.1, as another job's store would.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        code, out = _run([str(ENTRYPOINT), "--numel", "64"],
                         _clean_env(RUN_MODE="comm", NPROC="1", NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT=str(port)))
    _assert_ends_with_one_line(code, out, f"port {port} is already in use on this node")
    assert "MASTER_PORT=" in out.splitlines()[-1] and f"ss -ltnp 'sport = :{port}'" in out.splitlines()[-1], out


@pytest.mark.parametrize("addr, says", [
    # TEST-NET-1 (RFC 5737) is never routed: a timeout, or at once "unreachable" where there is no route.
    # (Nobody listening on 127.0.0.1 takes the same path: "timed out ... while trying to connect".)
    ("192.0.2.1", "nobody answered at 192.0.2.1:{port}"),
    ("node0.invalid", "MASTER_ADDR node0.invalid does not resolve on this node"),  # .invalid: RFC 2606
], ids=["unroutable", "unresolvable"])
def test_an_unreachable_master_addr_ends_in_one_line_with_the_checks(addr, says):
    # Node 1 connects only; read_timeout=2 bounds each of torch's connection attempts (default 60 s).
    port = free_port()
    cmd = [sys.executable, "-m", "distlab.launch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint={addr}:{port}", f"--rdzv_id=unreachable-{port}",
           "--rdzv_conf=is_host=false,read_timeout=2", "-m", "demos.comm"]
    code, out = _run(cmd, _clean_env())
    _assert_ends_with_one_line(code, out, says.format(port=port))
    # Only the line: torch's C++ log of each failed connection attempt (23 lines of "[W...] TCPStore.cpp",
    # "[E...] socket.cpp" and C++ frames before it) is off in the agent.
    assert out.strip().splitlines() == [out.strip().splitlines()[-1]], f"more than the one line:\n{out[-3000:]}"
    if "nobody answered" in says:
        last = out.splitlines()[-1]
        assert all(check in last for check in ("node 0 is started", "getent hosts", "ip route get", "firewall")), last


def _started(cmd: list[str], env: dict[str, str], marker: str) -> tuple[subprocess.Popen, bytearray, threading.Thread]:
    """``cmd`` in a session of its own (as a terminal's job), its output gathered by a thread as it comes.

    SIGINT goes back to its default first: a pytest started in the background of a non-interactive
    shell ignores SIGINT, and an ignored SIGINT is inherited (the Ctrl-C tests would send nothing).
    """
    default_sigint = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", default_sigint, *cmd], cwd=REPO, env={**marked_environ(marker), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out = bytearray()

    def gather() -> None:
        while chunk := proc.stdout.read1(65536):
            out.extend(chunk)

    reader = threading.Thread(target=gather, daemon=True)
    reader.start()
    return proc, out, reader


def _wait_for(proc: subprocess.Popen, out: bytearray, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text.encode() not in out:
        assert proc.poll() is None, f"it ended ({proc.returncode}) before printing {text!r}:\n{out.decode()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:g} s:\n{out.decode()[-3000:]}"
        time.sleep(0.05)  # polling a pipe's gathered output: nothing to block on


def interrupted(cmd: list[str], env: dict[str, str], when: str, timeout_s: float = 90) -> tuple[int, str]:
    """Run ``cmd`` until it prints ``when``, then press Ctrl-C (SIGINT to its whole process group, as a
    terminal does): its exit code and what it printed after that. Nothing it started outlives the test."""
    marker = os.urandom(8).hex()
    proc, out, reader = _started(cmd, env, marker)
    try:
        _wait_for(proc, out, when, timeout_s)
        seen = len(out)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        reader.join(10)
    finally:
        kill_process_tree(proc.pid, marker)
        proc.wait()
    return code, out[seen:].decode(errors="replace")


def test_ctrl_c_of_entrypoint_prints_one_line_not_every_ranks_traceback():
    """Ctrl-C reaches the agent and both ranks at once: each rank printed its KeyboardInterrupt's
    traceback and the agent its own (92 lines). Now the ranks print nothing and the agent one line."""
    code, after = interrupted([str(ENTRYPOINT), "--numel", "64", "--repeats", "100000000"],
                              _clean_env(RUN_MODE="comm", NPROC="2"),
                              # the primitives' last line: after it the timing loop prints nothing until
                              # its 1e8 repeats end (waiting for the first line let the other seven race Ctrl-C)
                              when="r1:[42.0]\n")  # "send 42 from 0 to 1 / recv ... r1:[42.0]"
    lines = [line for line in after.splitlines() if line.strip()]
    assert "Traceback" not in after and "KeyboardInterrupt" not in after, after[-4000:]
    assert lines == ["distlab.launch: stopped by SIGINT (Ctrl-C): this node's workers were ended"], after[-4000:]
    assert code == 128 + signal.SIGINT, f"exit code {code}:\n{after[-2000:]}"


def _two_nodes(port: str, worker: Path, marker: str) -> list:
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "distlab.launch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=lost-{port}",
               f"--rdzv_conf=is_host={'true' if node == 0 else 'false'}", str(worker)]
        nodes.append(_started(cmd, _clean_env(), marker))
    return nodes


# A worker that only runs: the agents' store is what is lost, and no torch import makes the test fast.
_RUNS = """
import os, time
print(f"rank {os.environ['RANK']} runs; its C++ log level: {os.environ.get('TORCH_CPP_LOG_LEVEL')}", flush=True)
time.sleep(600)
"""


def test_node_0_lost_mid_run_is_said_as_lost_not_as_a_start_that_failed(tmp_path):
    """Node 0 killed while the job runs: node 1 printed the start-up diagnosis ("nobody answered at ...
    check that node 0 is started"), though node 0 had answered all along. Now: lost, and when."""
    worker = tmp_path / "runs.py"
    worker.write_text(_RUNS)
    port, marker = str(free_port()), os.urandom(8).hex()
    nodes = _two_nodes(port, worker, marker)
    try:
        (node0, out0, _), (node1, out1, reader1) = nodes
        _wait_for(node1, out1, " runs; its C++ log level", 90)
        os.killpg(node0.pid, signal.SIGKILL)  # node 0's agent and its worker, at once: a machine gone
        code = node1.wait(timeout=60)
        reader1.join(10)
    finally:
        for proc, _, _ in nodes:
            kill_process_tree(proc.pid, marker)
            proc.wait()
    out = out1.decode(errors="replace")
    last = out.strip().splitlines()[-1]
    assert code != 0, out[-3000:]
    assert re.match(rf"distlab\.launch: lost node 0 at 127\.0\.0\.1:{port} \(the host of the rendezvous\) at "
                    rf"\d\d:\d\d:\d\d, \d+ s into the job: it had answered since the job started", last), out[-3000:]
    assert "nobody answered" not in out and "check that node 0 is started" not in out, out[-3000:]
    # The agent's C++ log is off, the workers' is as the user left it (unset here)
    assert "its C++ log level: None" in out, out[-3000:]


def test_a_node_waiting_for_the_others_says_so_and_ends_in_one_line():
    """NNODES=2 with one node started: silence for torchrun's 600 s join timeout, then 41 lines ending
    in a bare RendezvousTimeoutError. Now a line every interval while it waits, then one line.
    (RDZV_TIMEOUT=4: the interval is 1 s at 20 s or less, 30 s at torch's default 600 s; times DISTLAB_TIMEOUT_SCALE.)"""
    from distlab.deadlines import timeout_scale

    port, join_s = free_port(), max(1, round(4 * timeout_scale()))  # distlab.launch_agent.scaled_join_timeout
    code, out = _run([str(ENTRYPOINT), "--numel", "64"],
                     _clean_env(RUN_MODE="comm", NPROC="1", NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), RDZV_ID=f"alone-{port}", RDZV_TIMEOUT="4"), timeout_s=60)
    _assert_ends_with_one_line(code, out, f"only 1 of 2 nodes joined the rendezvous at 127.0.0.1:{port} within "
                                          f"{join_s} s")
    waiting = re.findall(rf"^distlab\.launch: waiting for 1 of 2 nodes at 127\.0\.0\.1:{port} \(1 joined\), "
                         rf"(\d+) s of {join_s}$", out, re.M)
    assert len(waiting) >= 2 and waiting == sorted(waiting, key=int), f"no progress while it waited:\n{out[-3000:]}"
    rest = [line for line in out.strip().splitlines()[:-1]
            if not line.startswith(("entrypoint.sh: RUN_MODE=", "distlab.launch: waiting for"))]
    assert rest == [], f"more than the progress and the last line:\n{out[-3000:]}"
    assert "RDZV_TIMEOUT=" in out.splitlines()[-1] and "NNODES=2" in out.splitlines()[-1], out.splitlines()[-1]


def test_a_wrong_interface_name_ends_in_one_line_listing_the_interfaces():
    code, out = _run([str(ENTRYPOINT), "--numel", "64"],
                     _clean_env(RUN_MODE="comm", NPROC="2", GLOO_SOCKET_IFNAME="bogus0"))
    _assert_ends_with_one_line(code, out, "GLOO_SOCKET_IFNAME=bogus0 names no network interface of this machine")
    assert code == 2, "a configuration error, found before any worker starts"
    assert all(name in out.splitlines()[-1] for _, name in socket.if_nameindex()), out[-2000:]


@pytest.mark.parametrize("var, value, bad", [
    ("GLOO_SOCKET_IFNAME", "{lo}", False),
    ("GLOO_SOCKET_IFNAME", "{lo},bogus0", True),  # gloo opens every interface it is given
    ("NCCL_SOCKET_IFNAME", "{lo_prefix}", False),  # NCCL takes prefixes ...
    ("NCCL_SOCKET_IFNAME", "={lo_prefix}", True),  # ... "=" for exact names ...
    ("NCCL_SOCKET_IFNAME", "^bogus", False),  # ... "^" to exclude some
    ("NCCL_SOCKET_IFNAME", "bogus", True),
])
def test_socket_ifname_problem_follows_gloo_and_nccl_syntax(monkeypatch, var, value, bad):
    lo = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv(var, value.format(lo=lo, lo_prefix=lo[:-1] or lo))
    problem = socket_ifname_problem()
    assert (problem is not None) == bad, problem
    if bad:
        assert problem.startswith(f"{var}=") and lo in problem, problem


def test_init_from_env_refuses_a_wrong_interface_name_before_the_store(monkeypatch):
    # Under plain torchrun (no distlab.launch agent) the worker says it, as a ValueError (one line).
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME=bogus0 names no network interface"):
        init_from_env(timeout_s=2)


@pytest.mark.e2e  # 7-15 s: in the end-to-end tier, which .ci/run runs after the main suite
def test_a_two_node_start_on_loopback_gives_no_node_rank_warning():
    """torchrun warns "node_rank is only used for static rdzv_backend" on every c10d node but node 0."""
    port, marker = str(free_port()), os.urandom(8).hex()
    procs = []
    try:
        for node in (0, 1):
            env = _clean_env(RUN_MODE="comm", NPROC="1", NNODES="2", NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, RDZV_ID=f"no-warning-{port}")
            procs.append(subprocess.Popen([str(ENTRYPOINT), "--numel", "64", "--repeats", "1"], cwd=REPO,
                                          env={**marked_environ(marker), **env}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            kill_process_tree(p.pid, marker)
            p.wait()
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{out[-3000:]}"
        assert "node_rank is only used for static" not in out, f"node {node} printed torchrun's --node_rank " \
                                                                 f"warning:\n{out[-3000:]}"


# --------------------------------------------------------------------------- elastic restarts: one store prefix per start
_WORKER = """
import os, sys, torch, torch.distributed as dist
from distlab.launch import init_from_env, shutdown
for count in sys.argv[2:]:  # one start of the job per count; the process stands in for each start's worker
    os.environ["TORCHELASTIC_RESTART_COUNT"] = count
    env = init_from_env(timeout_s=float(sys.argv[1]))
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    print(f"restart count {count}: rank {env.rank} of {env.world_size}: sum {t.item():g}", flush=True)
    shutdown()
"""


def test_restarted_ranks_meet_whatever_restart_count_their_agents_gave_them():
    """After a node is lost, one torchrun agent restarts its workers with TORCHELASTIC_RESTART_COUNT=1 (its
    worker failed), another with 0 (it only saw the membership change, which torch does not count).

    Two starts of a 2-rank job share one store, as workers share their agent's store across restarts:
    the first with counts 0 and 0, the second with 1 and 0. Both must all-reduce to 1 + 2.
    (One process per rank runs both starts, destroying its group in between: a fresh process per start
    would cost a torch import each, and the generation lives in the store, not in the process.)
    """
    import torch.distributed as dist
    from datetime import timedelta

    port = free_port()
    # The agent's store, which outlives the workers of each start (TORCHELASTIC_USE_AGENT_STORE)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    marker = os.urandom(8).hex()
    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    procs = []
    try:
        for rank, counts in enumerate((["0", "1"], ["0", "0"])):
            env = _clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                             DISTLAB_HANG_TIMEOUT="0", DISTLAB_DEVICE="cpu", GLOO_SOCKET_IFNAME=loopback)
            # 10 s: ranks that do not meet fail at the process group's timeout instead of hanging the test
            procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, "10", *counts], cwd=REPO,
                                          env={**marked_environ(marker), **env}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            kill_process_tree(p.pid, marker)
            p.wait()
    for rank, (p, out, counts) in enumerate(zip(procs, outs, (["0", "1"], ["0", "0"]))):
        for count in counts:
            assert f"restart count {count}: rank {rank} of 2: sum 3" in out, \
                f"rank {rank} (restart counts {counts}) exited {p.returncode}:\n{out[-3000:]}"
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
    del store


_UNRAISABLE_CTRL_C = """
import sys, weakref
from distlab import launch
launch._quiet_ctrl_c()
class Lock: pass
def callback(_):
    raise KeyboardInterrupt  # Ctrl-C landing in a weakref callback (importlib's module locks have one)
lock = Lock(); ref = weakref.ref(lock, callback); del lock
def other(_):
    raise ValueError("a real error in a callback")
lock = Lock(); ref2 = weakref.ref(lock, other); del lock
"""


def test_a_ctrl_c_that_lands_in_a_callback_is_silent_and_other_errors_there_are_not():
    """CI saw 'Exception ignored in: <function _get_module_lock.<locals>.cb ...> ... KeyboardInterrupt' from
    a rank: a Ctrl-C in code Python cannot raise from goes to sys.unraisablehook, not sys.excepthook."""
    proc = subprocess.run([sys.executable, "-c", _UNRAISABLE_CTRL_C], capture_output=True, text=True, timeout=60)
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert "ValueError: a real error in a callback" in proc.stderr, proc.stderr
