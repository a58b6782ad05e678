"""The cluster tier: the project's docker-compose.yaml up for real, three containers as nodes.

Marked ``cluster`` and skipped unless DISTLAB_CLUSTER=1 (``.ci/run`` sets it for its cluster run,
after the main suite): it starts a Docker engine if none answers (root), builds a Debian base
image with debootstrap once, builds the course's image from the project's Dockerfile without the
internet (tests/cluster/engine.py says how), and brings the compose file up under a project name
of its own. Where no engine can start, every test skips with the reason.

    DISTLAB_CLUSTER=1 python -m pytest -m cluster tests/test_cluster.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from cluster.engine import (ENABLE_ENV, Cluster, EngineUnavailable, base_image, build_image, docker, python_mounts,
                            start_engine)

# Cold: ~40 s of debootstrap and ~15 s of import for the base image, then the cluster; a cached base skips both.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


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


@pytest.fixture(scope="module")
def image(engine, tmp_path_factory):
    """The course's image for this run (the base is cached; this one is removed at the end)."""
    work = tmp_path_factory.mktemp("image")
    try:
        base = base_image(work)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    tag = f"distlab-cluster-{os.urandom(4).hex()}:cpu"
    build_image(base, tag, work)
    try:
        yield tag
    finally:
        docker("rmi", "-f", tag, timeout=120, check=False)


def _health_report(cluster: Cluster) -> str:
    state = cluster.state("node0")
    health = state.get("Health") or {}
    last = (health.get("Log") or [{}])[-1]
    return (f"node0 is {health.get('Status', 'without a healthcheck')} ({state.get('Status')}); its last probe said: "
            f"{(last.get('Output') or '').strip()[-600:]}\nnode0's log:\n{cluster.logs('node0')[-2000:]}")


def _up(cluster: Cluster) -> None:
    """``up -d``: node0 first, the others once its healthcheck passes (depends_on: service_healthy)."""
    out = cluster.compose("up", "-d", "--no-build", timeout=150, check=False)
    if out.returncode != 0:
        pytest.fail(f"docker-compose up failed (exit {out.returncode}): {out.stderr.strip()[-800:]}\n"
                    f"{_health_report(cluster)}\nThe healthcheck must probe where node0's rendezvous store listens "
                    "(MASTER_ADDR:MASTER_PORT): fix it in docker-compose.yaml")
    assert cluster.state("node0").get("Health", {}).get("Status") == "healthy", _health_report(cluster)


def _finish(cluster: Cluster, timeout_s: float) -> dict[str, tuple[int | None, str]]:
    """Every node's exit code (None: still running) and log, once all have stopped or one has failed.

    A failed node ends the wait: the others may wait minutes for it (torchrun's exit barrier).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        states = {node: cluster.state(node) for node in cluster.nodes}
        codes = {node: None if s["Status"] in ("created", "running", "restarting") else s["ExitCode"]
                 for node, s in states.items()}
        if all(c is not None for c in codes.values()) or any(codes.values()):
            return {node: (code, cluster.logs(node)) for node, code in codes.items()}
        if time.monotonic() > deadline:
            running = [n for n, c in codes.items() if c is None]
            pytest.fail(f"{running} still run after {timeout_s:.0f} s:\n{cluster.logs(running[0])[-3000:]}")
        time.sleep(1)  # polling three containers' states, not waiting for an event we could block on


MODES = [
    # mode, arguments (cheap settings), processes per node, what node 0 prints when all 3 nodes took part
    ("comm", "--numel 4096 --repeats 1", "1", "== the primitives on 3 ranks"),
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
        results = _finish(cluster, timeout_s=240)
    finally:
        cluster.down()
    assert cluster.leftovers() == [], "docker-compose down -v left these behind"
    return results


@pytest.mark.parametrize("mode, args, nproc, says", MODES, ids=[m[0] for m in MODES])
def test_compose_cluster_runs_a_mode_on_three_nodes(engine, image, tmp_path, mode, args, nproc, says):
    results = _run_mode(engine, image, tmp_path, mode, args, nproc, {})
    for node, (code, log) in sorted(results.items(), key=lambda item: item[1][0] is None):  # the failed first
        assert "terminate called without an active exception" not in log and code == 0, \
            f"{node} {'still runs' if code is None else f'exited {code}'}:\n{log[-3000:]}"
        assert "--nnodes=3" in log and f"--nproc_per_node={nproc}" in log, log[-2000:]
    assert says in results["node0"][1], results["node0"][1][-3000:]


# --------------------------------------------------------------------------- the Terraform node startup, installing
STARTUP_STUBS = {
    # what a node reaches over the network, stood in for: the package mirror, EFS, the git server
    "apt-get": "exit 0",
    "mount": "exit 0",
    "git": 'if [[ "$1" == clone ]]; then cp -a /workspace "$3" && mkdir -p "$3/.git"; fi',
    # the venv sees this machine's installed packages (mounted): pip finds every requirement but `-e .` there.
    # Its bundled setuptools (65, no bdist_wheel) goes: a node's pip builds `-e .` with a fresh setuptools
    # from PyPI (build isolation); offline, with build isolation off, the mounted one (>= 70) stands in.
    "python3": 'if [[ "$1 $2" == "-m venv" ]]; then python -m venv --system-site-packages "$3" && '
               'rm -rf "$3"/lib/python3*/site-packages/setuptools*; exit; fi; exec python "$@"',
}


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
    name = f"distlab-startup-{os.urandom(4).hex()}"
    try:
        out = docker("run", "--name", name, *mounts, "-v", f"{tmp_path}:/boot:ro", "-e", f"PATH=/boot/stubs:{path}",
                     "-e", "PIP_NO_INDEX=1", "-e", "PIP_NO_BUILD_ISOLATION=0", "-e", "PIP_DISABLE_PIP_VERSION_CHECK=1",
                     "-e", "OMP_NUM_THREADS=1", "-e", "DISTLAB_HANG_TIMEOUT=0", "-w", "/",  # cloud-init runs user data in /
                     "--entrypoint", "bash", image,
                     "/boot/startup.sh", timeout=240, check=False)
    finally:
        docker("rm", "-f", name, timeout=60, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"the node's startup script exited {out.returncode}:\n{log[-3000:]}"
    assert "-m demos.comm" in log and "== the primitives on 1 ranks" in log, log[-3000:]


# --------------------------------------------------------------------------- a node cut off the network
def _wait_for_log(cluster: Cluster, node: str, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in cluster.logs(node):
        if time.monotonic() > deadline or cluster.state(node)["Status"] != "running":
            pytest.fail(f"{node} never printed {text!r}:\n{cluster.logs(node)[-3000:]}")
        time.sleep(1)  # polling a log, not waiting for an event we could block on


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
        _wait_for_log(cluster, "node0", "epoch 0:", timeout_s=120)
        node2 = cluster.container("node2")
        network = next(iter(json.loads(docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", node2).stdout)))
        docker("network", "disconnect", "-f", network, node2)
        cut = time.monotonic()
        try:
            code = cluster.wait("node0", timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node0 still runs 150 s after node2 lost its network:\n{cluster.logs('node0')[-3000:]}")
        waited = time.monotonic() - cut
        log = cluster.logs("node0") + cluster.logs("node1")
    finally:
        cluster.down()
    assert code != 0, "node0 exited 0 although a node was cut off mid-training"
    blamed = re.findall(r"hang diagnosed: rank (\d+) never entered", log)
    assert blamed, f"no report from the hang doctor on node0 or node1:\n{log[-4000:]}"
    # c10d hands out ranks in arrival order: node0's and node1's are the ones their summaries name
    left = set(re.findall(r"failed on rank (\d+) \(exit code 75\): ended by the hang doctor", log))
    assert left and blamed[0] not in left, f"the doctor blames rank {blamed[0]}, one of the nodes left " \
                                           f"({sorted(left)}), not node2's:\n{log[-4000:]}"
    assert waited < 120, f"the job took {waited:.0f} s to end after node2 was cut off"
    assert cluster.leftovers() == [], "docker-compose down -v left these behind"


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
        deadline = time.monotonic() + 120
        while not docker("exec", node0, "ls", "/checkpoints/fault_tolerance", check=False).stdout.strip():
            if time.monotonic() > deadline or cluster.state("node0")["Status"] != "running":
                pytest.fail(f"no checkpoint on the shared volume:\n{cluster.logs('node0')[-3000:]}")
            time.sleep(1)  # polling a directory, not waiting for an event we could block on
        docker("kill", cluster.container("node2"))
        results = {}
        for node in ("node0", "node1"):
            try:
                results[node] = (cluster.wait(node, timeout=150), cluster.logs(node))
            except subprocess.TimeoutExpired:
                # (Seen in about 1 run of 6 while init_from_env prefixed the store with the restart count: an
                # agent that only saw the membership change restarts without counting, so the new ranks
                # waited under different prefixes. They now agree on one through the store.)
                pytest.fail(f"{node} still runs 150 s after node2 was killed:\n{cluster.logs(node)[-3000:]}")
    finally:
        cluster.down()
    for node, (code, log) in results.items():
        assert code == 0, f"{node} exited {code} after node2 was killed:\n{log[-3000:]}"
    # Rank 0 prints, on whichever node it landed, with its own agent's restart count: 1 where that agent saw
    # its worker fail, 0 where it only saw the membership change (torch does not count that restart).
    log = results["node0"][1] + results["node1"][1]
    resumed = re.search(r"\[attempt [01]\] resumed from \S+step_(\d+) \(step \d+, saved by 3 ranks, now 2\)", log)
    assert resumed and int(resumed.group(1)) >= 50, f"the restarted job did not resume with 2 ranks:\n{log[-3000:]}"
    assert re.search(r"^[01]\s+2\s+600\s", log, flags=re.M), f"the restart did not finish 600 steps on 2 ranks:\n" \
                                                             f"{log[-3000:]}"
    assert cluster.leftovers() == [], "docker-compose down -v left these behind"
