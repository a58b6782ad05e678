"""The cluster tier: the project's docker-compose.yaml up for real, three containers as nodes.

Marked ``cluster`` and skipped unless DISTLAB_CLUSTER=1 (``.ci/run`` sets it for its cluster run,
after the main suite): it starts a Docker engine if none answers (root), builds a Debian base
image with debootstrap once, builds the course's image from the project's Dockerfile without the
internet (tests/cluster/engine.py says how), and brings the compose file up under a project name
of its own. Where no engine can start, every test skips with the reason.

    DISTLAB_CLUSTER=1 python -m pytest -m cluster tests/test_cluster.py
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cluster.engine import ENABLE_ENV, Cluster, EngineUnavailable, base_image, build_image, docker, start_engine

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


def _finish(cluster: Cluster, timeout_s: float) -> dict[str, tuple[int, str]]:
    """Every node's exit code and log, once all have stopped."""
    deadline = time.monotonic() + timeout_s
    results = {}
    for node in cluster.nodes:
        try:
            code = cluster.wait(node, timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{node} still runs after {timeout_s:.0f} s:\n{cluster.logs(node)[-3000:]}")
        results[node] = (code, cluster.logs(node))
    return results


MODES = [
    # mode, arguments (cheap settings), processes per node, what node 0 prints when all 3 nodes took part
    ("comm", "--numel 4096 --repeats 1", "1", "== the primitives on 3 ranks"),
    ("data_parallel_naive", "--epochs 1", "2", "naive data parallel: 6 ranks"),
]
# The hang doctor's watchdog is off for the mode runs: with it on, ranks on these nodes abort at exit
# ("terminate called without an active exception", SIGABRT after the summary): its daemon thread is
# still in a store call when the interpreter finalizes (distlab/doctor.py start_watchdog; nothing
# stops it before exit). test_ranks_exit_cleanly_with_the_hang_watchdog_on keeps that bug in view.
NO_WATCHDOG = {"DISTLAB_HANG_TIMEOUT": "0"}


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
    results = _run_mode(engine, image, tmp_path, mode, args, nproc, NO_WATCHDOG)
    for node, (code, log) in results.items():
        assert code == 0, f"{node} exited {code}:\n{log[-3000:]}"
        assert "--nnodes=3" in log and f"--nproc_per_node={nproc}" in log, log[-2000:]
    assert says in results["node0"][1], results["node0"][1][-3000:]


@pytest.mark.xfail(reason="the hang watchdog's daemon thread aborts ranks at interpreter exit (distlab/doctor.py)",
                   strict=False)
def test_ranks_exit_cleanly_with_the_hang_watchdog_on(engine, image, tmp_path):
    """The default (watchdog on under torchrun): every node ends with 0, no rank aborts after its summary."""
    results = _run_mode(engine, image, tmp_path, "data_parallel_naive", "--epochs 1", "2", {})
    for node, (code, log) in results.items():
        assert "terminate called without an active exception" not in log and code == 0, \
            f"{node} exited {code}:\n{log[-3000:]}"
