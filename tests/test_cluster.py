"""The cluster tier: the project's docker-compose.yaml up for real, three containers as nodes.

Marked ``cluster`` and skipped unless DISTLAB_CLUSTER=1 (``.ci/run`` sets it for its cluster run,
after the main suite): it starts a Docker engine if none answers (root), builds the offline image
with the operator's own command (``python -m distlab.compose image``: a Debian base made with
debootstrap once, the project's Dockerfile without its pip steps; distlab/compose.py says how), and
brings the compose file up under a project name of its own. Where no engine can start, every test
skips with the reason.

Waits follow progress, not the clock: a node that is alive and printing, or whose healthcheck is still
'starting', is waited for (within a hard cap of distlab.compose.CAP_S); one that exits or turns
unhealthy fails the test at once with its last lines. Every test ends with ``down`` retried until no
container, network or volume of its project is left, and checks that nothing is.

    DISTLAB_CLUSTER=1 python -m pytest -m cluster tests/test_cluster.py
"""
from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster import ENABLE_ENV
from distlab.compose import Cluster, EngineUnavailable, NodeFailed, docker, python_mounts, start_engine
from distlab.launch import init_from_env
from distlab.procs import die_with_parent
from python_env import PTH_NAME, pth_text

REPO = Path(__file__).resolve().parents[1]
# Cold: ~40 s of debootstrap and ~15 s of import for the base image, then the cluster; a cached base skips both.
# The tests' own waits follow the nodes' progress; this is only the outer net (a cluster's up and finish, each
# within distlab.compose.CAP_S, and its down within DOWN_CAP_S).
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if os.environ.get(ENABLE_ENV) != "1":
        pytest.skip(f"the cluster tier builds images and starts containers: run it with {ENABLE_ENV}=1")
    try:
        engine = start_engine(tmp_path_factory.mktemp("engine"))
    except EngineUnavailable as exc:
        pytest.skip(f"no Docker engine: {exc}")
    try:
        yield engine
    finally:
        engine.stop()


def _operator(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m distlab.compose ARGS`` as an operator runs it, in a session of its own (killed with its group)."""
    return subprocess.Popen([sys.executable, "-m", "distlab.compose", *args], cwd=REPO, text=True,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))


def _end(proc: subprocess.Popen) -> None:
    """The operator's command and everything it started (docker-compose, debootstrap) end with the test."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def image(engine, tmp_path_factory):
    """The course's image for this run, built by the operator's command (the base is cached; this one is removed)."""
    tag = f"distlab-cluster-{os.urandom(4).hex()}:cpu"
    proc = _operator("image", "--tag", tag)
    try:
        # A hard cap only: a cold base is a debootstrap from Debian's mirror (minutes on a slow one).
        out, _ = proc.communicate(timeout=2400)
    finally:
        _end(proc)
    if proc.returncode == 2:  # the engine, debootstrap or root is missing: the command says which
        pytest.skip(out.strip()[-600:])
    assert proc.returncode == 0, f"python -m distlab.compose image exited {proc.returncode}:\n{out[-3000:]}"
    try:
        yield tag
    finally:
        docker("rmi", "-f", tag, timeout=300, check=False)


def _up(cluster: Cluster) -> None:
    """``up -d``: node0 first, the others once its healthcheck passes (depends_on: service_healthy)."""
    try:
        cluster.up()
    except NodeFailed as exc:
        pytest.fail(f"{exc}\n(if node0 is unhealthy: the healthcheck must probe where node0's rendezvous store "
                    "listens, MASTER_ADDR:MASTER_PORT; fix it in docker-compose.yaml)", pytrace=False)


MODES = [
    # mode, arguments (cheap settings), processes per node, what node 0 prints when all 3 nodes took part.
    # (comm, 3 x 1, runs through the operator's command: test_the_operator_command_exits_with_the_jobs_code.)
    ("data_parallel_naive", "--epochs 1", "2", "naive data parallel: 6 ranks"),
]
# The mode runs keep the hang doctor's watchdog on (the default under torchrun): before 44fe6bb its
# daemon thread, still in a store call at interpreter exit, aborted ranks on these nodes after their
# summary ("terminate called without an active exception", SIGABRT; 6 runs in 6 at 3 x 2).
NO_WATCHDOG = {"DISTLAB_HANG_TIMEOUT": "0"}  # where a test is about something else than a hang


def _run_mode(engine, image, tmp_path, mode, args, nproc, node_env) -> dict[str, tuple[int, str]]:
    cluster = Cluster(engine, image, tmp_path, env={"RUN_MODE": mode, "RUN_ARGS": args, "NPROC": nproc},
                      node_env=node_env)
    assert len(cluster.nodes) == 3, cluster.nodes
    try:
        _up(cluster)
        results = cluster.finish()
    finally:
        left = cluster.down()
    assert left == [] == cluster.leftovers(), f"down, retried, left these behind: {left}"
    return results


@pytest.mark.parametrize("mode, args, nproc, says", MODES, ids=[m[0] for m in MODES])
def test_compose_cluster_runs_a_mode_on_three_nodes(engine, image, tmp_path, mode, args, nproc, says):
    results = _run_mode(engine, image, tmp_path, mode, args, nproc, {})
    for node, (code, log) in sorted(results.items(), key=lambda item: item[1][0] is None):  # the failed first
        assert "terminate called without an active exception" not in log and code == 0, \
            f"{node} {'still runs' if code is None else f'exited {code}'}:\n{log[-3000:]}"
        assert "--nnodes=3" in log and f"--nproc_per_node={nproc}" in log, log[-2000:]
    assert says in results["node0"][1], results["node0"][1][-3000:]


# --------------------------------------------------------------------------- the operator's command
@pytest.mark.parametrize("job", ["succeeds", "fails"])
def test_the_operator_command_exits_with_the_jobs_code(engine, image, tmp_path, job):
    """``python -m distlab.compose up``, as the README documents it, on 3 nodes x 1 process of ``comm``.

    Its exit code is the job's: 0 when all nodes finished, non-zero when they failed (an argument the mode
    does not know: every rank exits 2). Attached ``docker-compose up`` exits 0 in both cases. It takes
    the whole project down at the end: nothing of it is left.
    """
    cluster = Cluster(engine, image, tmp_path)  # its name, for the command; its waits and cleanup, for the test
    args = "--numel 4096 --repeats 1" + ("" if job == "succeeds" else " --no-such-flag")
    proc = _operator("up", "--no-build", "--tag", image, "--project", cluster.name, "--remove-volumes",
                     env={"RUN_MODE": "comm", "NPROC": "1", "RUN_ARGS": args})
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)  # drains the pipe
    reader.start()
    try:
        # Followed like any cluster: waited for while its nodes progress; the command itself ends the job.
        cluster.wait_for("python -m distlab.compose up to end", lambda _: proc.poll() is not None, exits="any")
        reader.join(timeout=60)
    finally:
        _end(proc)
        left = cluster.down()  # only where the command did not get to its own
    log = "".join(output)
    assert left == [] == cluster.leftovers(), f"left behind: {left}\n{log[-3000:]}"
    if job == "succeeds":
        assert proc.returncode == 0, f"the command exited {proc.returncode} for a job that succeeded:\n{log[-3000:]}"
        assert "== the primitives on 3 ranks" in log and "--nnodes=3" in log, log[-3000:]
        assert "terminate called without an active exception" not in log, log[-3000:]
    else:
        assert proc.returncode != 0, f"the command exited 0 although every node failed:\n{log[-3000:]}"
        assert "unrecognized arguments: --no-such-flag" in log and "the job failed" in log, log[-3000:]


def test_cleanup_leaves_nothing_when_a_step_times_out(engine, image, tmp_path):
    """A ``down`` that times out (one did at load 97: 2 containers, 2 networks, 2 volumes stayed) is retried."""
    cluster = Cluster(engine, image, tmp_path, env={"RUN_MODE": "comm"})
    try:
        cluster.compose("up", "--no-start", "--no-build", timeout=600)  # containers, network, volume: nothing runs
        made = cluster.leftovers()
        assert {item.split()[0] for item in made} == {"container", "network", "volume"}, made
        with pytest.raises(subprocess.TimeoutExpired):
            cluster.compose("down", "-v", timeout=0.2)  # a step cut short, as a loaded engine's was
        assert cluster.leftovers(), "the cut-short down removed everything: nothing left to retry"
    finally:
        # Steps start at 0.2 s and double each round, so the first ones time out here too.
        left = cluster.down(step_s=0.2)
    assert left == [] == cluster.leftovers(), f"down, retried, left these behind: {left}"


# --------------------------------------------------------------------------- the Terraform node startup, installing
STARTUP_STUBS = {
    # what a node reaches over the network, stood in for: the package mirror, EFS, the git server
    "apt-get": "exit 0",
    "mount": "exit 0",
    "git": 'if [[ "$1" == clone ]]; then cp -a /workspace "$3" && mkdir -p "$3/.git"; fi',
    # the venv sees this machine's installed packages (mounted): pip finds every requirement but `-e .` there.
    # Its bundled setuptools (65, no bdist_wheel) goes: a node's pip builds `-e .` with a fresh setuptools
    # from PyPI (build isolation); offline, with build isolation off, the mounted one (>= 70) stands in.
    # --system-site-packages sees the base interpreter's packages: the .pth adds this environment's (a venv's).
    "python3": 'if [[ "$1 $2" == "-m venv" ]]; then python -m venv --system-site-packages "$3" && '
               'rm -rf "$3"/lib/python3*/site-packages/setuptools* && '
               f'for d in "$3"/lib/python3*/site-packages; do echo {shlex.quote(pth_text())} > "$d/{PTH_NAME}"; done; '
               'exit; fi; exec python "$@"',
}


@pytest.mark.venv  # builds a venv on the node that must see this environment's packages
def test_terraform_startup_script_installs_and_starts_a_node(engine, image, tmp_path):
    """The rendered user data of a one-node cluster, its install branch for real (pip, venv) in a container.

    apt-get, mount and git are stand-ins (no mirror, EFS or git server here); pip installs the course's
    requirements.txt offline from the mounted environment (--system-site-packages), `-e .` included.
    """
    from test_deployment import TERRAFORM, _render

    script = _render((TERRAFORM / "startup.sh.tftpl").read_text(), {
        "node_rank": 0, "master_addr": "", "node_count": 1, "gpus_per_node": 1, "efs_dns": "fs-0.efs.example",
        "repo_url": "https://git.example/distlab.git", "repo_ref": "main", "run_mode": "comm",
        "run_args": "--numel 4096 --repeats 1"})
    (tmp_path / "startup.sh").write_text(script)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, body in STARTUP_STUBS.items():
        (stubs / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (stubs / name).chmod(0o755)
    path = docker("image", "inspect", "-f", "{{range .Config.Env}}{{println .}}{{end}}", image).stdout
    path = next(line.split("=", 1)[1] for line in path.splitlines() if line.startswith("PATH="))
    mounts = [a for d in python_mounts() for a in ("-v", f"{d}:{d}:ro")]
    # A one-node project of the cluster's kind (its labels): followed by the same waits, removed by the same down.
    cluster = Cluster(engine, image, tmp_path)
    labels = ["--label", f"com.docker.compose.project={cluster.name}", "--label", "com.docker.compose.service=node"]
    try:
        docker("run", "-d", *labels, *mounts, "-v", f"{tmp_path}:/boot:ro", "-e", f"PATH=/boot/stubs:{path}",
                     "-e", "PIP_NO_INDEX=1", "-e", "PIP_NO_BUILD_ISOLATION=0", "-e", "PIP_DISABLE_PIP_VERSION_CHECK=1",
                     "-e", "OMP_NUM_THREADS=1", "-e", "DISTLAB_HANG_TIMEOUT=0", "-w", "/",  # cloud-init runs user data in /
                     "--entrypoint", "bash", image,
                     "/boot/startup.sh")
        found = cluster.wait_for("the startup script to end", lambda f: f["node"]["State"]["Status"] == "exited",
                                 nodes=["node"], exits="any")
        code, log = found["node"]["State"]["ExitCode"], cluster.logs("node")
    finally:
        left = cluster.down()
    assert left == [] == cluster.leftovers(), f"down, retried, left these behind: {left}"
    assert code == 0, f"the node's startup script exited {code}:\n{log[-3000:]}"
    assert "-m demos.comm" in log and "== the primitives on 1 ranks" in log, log[-3000:]


# --------------------------------------------------------------------------- a node cut off the network
def _stopped(*nodes: str):
    """``done`` for Cluster.wait_for: every one of ``nodes`` has exited."""
    return lambda found: all(found[n]["State"]["Status"] in ("exited", "dead") for n in nodes if n in found)


# What the doctor must beat: the process group's timeout under torchrun (init_from_env's default).
PG_TIMEOUT_S = inspect.signature(init_from_env).parameters["timeout_s"].default


def test_a_node_cut_off_the_network_ends_the_job_with_the_doctors_report(engine, image, tmp_path):
    """node2 loses its network mid-training: no connection is reset, its peers' collectives just stop.

    The hang doctor's watchdog (on by default under torchrun; DISTLAB_HANG_TIMEOUT: timeout/10 within
    10-30 s) must end the job on the nodes that are left, with its report, within about a minute,
    instead of the process group's timeout.
    """
    cluster = Cluster(engine, image, tmp_path, env={"RUN_MODE": "data_parallel_naive", "RUN_ARGS": "--epochs 200",
                                                      "NPROC": "1"})
    try:
        _up(cluster)
        cluster.wait_for("node0 to print 'epoch 0:'", lambda _: "epoch 0:" in cluster.logs("node0"))
        node2 = cluster.container("node2")
        network = next(iter(json.loads(docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", node2).stdout)))
        docker("network", "disconnect", "-f", network, node2)
        cut = time.monotonic()
        found = cluster.wait_for("node0 to end after node2 lost its network", _stopped("node0"),
                                 nodes=["node0", "node1"], exits="any")
        waited = time.monotonic() - cut
        code = found["node0"]["State"]["ExitCode"]
        log = cluster.logs("node0") + cluster.logs("node1")
    finally:
        leftover = cluster.down()
    assert code != 0, "node0 exited 0 although a node was cut off mid-training"
    blamed = re.findall(r"hang diagnosed: rank (\d+) never entered", log)
    assert blamed, f"no report from the hang doctor on node0 or node1:\n{log[-4000:]}"
    # c10d hands out ranks in arrival order: node0's and node1's are the ones their summaries name
    left = set(re.findall(r"failed on rank (\d+) \(exit code 75\): ended by the hang doctor", log))
    assert left and blamed[0] not in left, f"the doctor blames rank {blamed[0]}, one of the nodes left " \
                                           f"({sorted(left)}), not node2's:\n{log[-4000:]}"
    # About 35 s on an idle host; the watchdog's clock is the ranks' progress, so a loaded host takes longer,
    # but the doctor's report must come before the process group's own timeout would have ended the job.
    assert waited < PG_TIMEOUT_S, f"the job took {waited:.0f} s to end after node2 was cut off"
    assert leftover == [] == cluster.leftovers(), f"down, retried, left these behind: {leftover}"


# --------------------------------------------------------------------------- a node's container killed
def test_a_killed_node_restarts_the_elastic_job_which_resumes_from_the_shared_checkpoint(engine, image, tmp_path):
    """RUN_MODE=fault_tolerance MAX_RESTARTS=2, as an elastic job of 2-3 nodes (NNODES=2:3 on every node).

    node2's container is killed once the first checkpoint is on the shared volume: node0 and node1
    restart their workers, rendezvous again without it, and resume from the last checkpoint that
    3 ranks saved, now with 2 ranks, to the end.

    (With NNODES=3 a killed node must come back, and a restarted container does not get back in:
    torch 2.14's agents keep the first round's store address, so the new agent waits for a key no
    one writes (DistStoreError after 60 s). The elastic range is the way a lost machine is survived.)
    """
    cluster = Cluster(engine, image, tmp_path,
                      env={"RUN_MODE": "fault_tolerance", "RUN_ARGS": "--steps 600 --ckpt-every 50", "NPROC": "1",
                           "MAX_RESTARTS": "2"},
                      node_env={**NO_WATCHDOG, "NNODES": "2:3"})
    try:
        _up(cluster)
        node0 = cluster.container("node0")
        cluster.wait_for("a checkpoint on the shared volume", lambda _: docker(
            "exec", node0, "ls", "/checkpoints/fault_tolerance", check=False).stdout.strip() != "")
        docker("kill", cluster.container("node2"))
        # (node0 and node1 running on for ever was seen in about 1 run of 6 while init_from_env prefixed the
        # store with the restart count: an agent that only saw the membership change restarts without counting,
        # so the new ranks waited under different prefixes. They now agree on one through the store.)
        cluster.wait_for("node0 and node1 to finish without node2", _stopped("node0", "node1"),
                         nodes=["node0", "node1"], exits="zero")
        results = {node: (cluster.state(node)["ExitCode"], cluster.logs(node)) for node in ("node0", "node1")}
    finally:
        leftover = cluster.down()
    for node, (code, log) in results.items():
        assert code == 0, f"{node} exited {code} after node2 was killed:\n{log[-3000:]}"
    # Rank 0 prints, on whichever node it landed, with its own agent's restart count: 1 where that agent saw
    # its worker fail, 0 where it only saw the membership change (torch does not count that restart).
    log = results["node0"][1] + results["node1"][1]
    resumed = re.search(r"\[attempt [01]\] resumed from \S+step_(\d+) \(step \d+, saved by 3 ranks, now 2\)", log)
    assert resumed and int(resumed.group(1)) >= 50, f"the restarted job did not resume with 2 ranks:\n{log[-3000:]}"
    assert re.search(r"^[01]\s+2\s+600\s", log, flags=re.M), f"the restart did not finish 600 steps on 2 ranks:\n" \
                                                             f"{log[-3000:]}"
    assert leftover == [] == cluster.leftovers(), f"down, retried, left these behind: {leftover}"
