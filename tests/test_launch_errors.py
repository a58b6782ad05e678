"""A multi-node start that cannot work ends with one line naming the cause and the fix.

torchrun reports a taken MASTER_PORT and an unreachable node 0 alike as "The connection to the
C10d store has failed" at the end of a ~42-line traceback, and a wrong GLOO_SOCKET_IFNAME as a
gloo enforce failure in every rank. ``python -m distlab.launch`` (what ``entrypoint.sh`` runs)
ends each with one line; these tests provoke each on 127.0.0.1 with free ports and short
timeouts, and check that the last line is that message and that no Python traceback is shown.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
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
    if "nobody answered" in says:
        last = out.splitlines()[-1]
        assert all(check in last for check in ("node 0 is started", "getent hosts", "ip route get", "firewall")), last


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
