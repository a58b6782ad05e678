"""The cluster tier, SLURM: the project's slurm.sbatch submitted with a real ``sbatch`` to a one-host SLURM.

Debian's slurm-wlm (slurmctld, slurmd, munged) runs here as the test's own processes, on ports chosen
free and written into a slurm.conf of its own (tests/cluster/slurm.py): two nodes, two slurmd's on this
host (slurm-wlm is built with multiple-slurmd support), 2 CPUs each. The job runs RUN_MODE=comm on CPU
nodes (``--gpus-per-node=0``), 2 nodes x 2 ranks, through each node's entrypoint.sh, from a venv the
script activates: the submitting shell's PATH has no ``python`` at all. This host's /etc/hosts maps
its name to 127.0.0.1, so ``hostname --ip-address`` gives loopback; the head address must not be that.

Marked ``cluster``: skipped unless DISTLAB_CLUSTER=1 (``.ci/run``'s cluster tier), and skipped with the
reason where SLURM is not installed or does not start.

    DISTLAB_CLUSTER=1 python -m pytest -m cluster tests/test_cluster_slurm.py
"""
from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from pathlib import Path

import pytest

from cluster import ENABLE_ENV
from cluster.slurm import SlurmUnavailable, free_ports, processes_with_marker, start
from python_env import make_venv

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "solutions" / "phase4_production" / "deployment" / "slurm.sbatch"
NODES, RANKS_PER_NODE = 2, 2
# the submitting shell's PATH: SLURM's clients, coreutils, no python (the venv's comes from the script)
BARE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

# Measured here: 45-55 s in all with `sbatch --wait`. Daemons up in ~1.5 s, the job done ~20 s after submission
# (2 s to schedule, torch imported by 2 agents and 4 ranks on 2 cores), but `sbatch --wait` polls ever more
# slowly and returned at ~42 s; the test polls the job itself each second, and follows its progress (a loaded
# host takes minutes), so the only fixed bounds are hard caps: the job's --time and the outer timeout here.
pytestmark = [pytest.mark.cluster, pytest.mark.venv, pytest.mark.timeout(3600)]


def _head_addresses(slurm, node: str) -> list[str]:
    """The addresses the head node has, asked of the node itself through a job step (srun), as the script may."""
    out = slurm.run("srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "hostname", "--all-ip-addresses",
                    timeout=60)
    assert out.returncode == 0, f"srun on {node} failed: {out.stderr}"
    return out.stdout.split()


def test_slurm_sbatch_runs_comm_on_two_nodes_at_the_head_nodes_address(tmp_path):
    if os.environ.get(ENABLE_ENV) != "1":
        pytest.skip(f"the cluster tier starts SLURM daemons: run it with {ENABLE_ENV}=1")
    probe = subprocess.run(["env", f"PATH={BARE_PATH}", "python", "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, f"{BARE_PATH} has a python with torch: the venv would not be needed"
    venv = make_venv(tmp_path / "venv")  # the course's environment: this interpreter's packages, torch included
    try:
        slurm = start(tmp_path / "slurm", nodes=NODES, cpus=RANKS_PER_NODE)
    except SlurmUnavailable as exc:
        pytest.skip(f"no one-host SLURM: {exc}")
    try:
        port, = free_ports(1)
        env = {"PATH": BARE_PATH, "HOME": str(tmp_path), "LANG": "C.UTF-8", "VENV": str(venv),
               "RUN_MODE": "comm", "RUN_ARGS": "--numel 4096 --repeats 1", "NPROC": str(RANKS_PER_NODE),
               "MASTER_PORT": str(port), "CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
        # The script's own directives ask for 2 nodes x 8 GPUs x 64 CPUs for 48 h: CPU nodes and a 25-minute cap here.
        submit = slurm.sbatch(SBATCH, "--gpus-per-node=0", f"--cpus-per-task={RANKS_PER_NODE}",
                              "--time=25", f"--output={tmp_path}/job-%j.out", env=env, cwd=REPO)
        job = re.search(r"Submitted batch job (\d+)", submit.stdout)
        assert job and submit.returncode == 0, f"sbatch exit {submit.returncode}: {submit.stderr.strip()[-600:]}"
        out_file = tmp_path / f"job-{job.group(1)}.out"
        fields = slurm.wait_job(job.group(1), out_file)
        output = out_file.read_text() if out_file.exists() else ""
        report = f"job {job.group(1)}: {fields.get('JobState')}, exit {fields.get('ExitCode')}\njob output:\n" \
                 f"{output[-3000:]}"
        assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", report

        # Each node's entrypoint.sh prints its torchrun command: both dial the head node's store. On one host
        # a loopback endpoint would work all the same, so the address itself is checked.
        endpoints = re.findall(r"--rdzv_endpoint=(\S+):(\d+)", output)
        assert len(endpoints) == NODES, f"{NODES} torchrun commands expected, one per node:\n{report}"
        head_node = slurm.nodes[0]  # the first node of the job's allocation (all of them here)
        head = _head_addresses(slurm, head_node)
        for addr, used_port in endpoints:
            assert not ipaddress.ip_address(addr).is_loopback, (
                f"the nodes rendezvous at {addr}, a loopback address: another host would dial itself. "
                f"`hostname --ip-address` gives that where /etc/hosts maps the name to loopback; take the head "
                f"node's address from DNS or from the node itself ({head})\n{report}")
            assert addr in head and used_port == str(port), f"rendezvous at {addr}:{used_port}, not at one of " \
                                                            f"{head_node}'s addresses {head} on port {port}\n{report}"
        # The result: rank r contributed r, so every rank's all_reduce(sum) holds 0 + 1 + ... + (W - 1).
        world_size = NODES * RANKS_PER_NODE
        assert f"== the primitives on {world_size} ranks" in output, report
        line = next((l for l in output.splitlines() if l.startswith("all_reduce(sum)")), "")
        expected = float(sum(range(world_size)))
        assert line.split()[1:] == [f"r{r}:[{expected}]" for r in range(world_size)], f"{line!r}\n{report}"
    finally:
        leftovers = slurm.stop()
    assert not leftovers, f"still running after the daemons stopped (killed now): {leftovers}"
    assert all(proc.poll() is not None for proc in slurm.procs.values()), "a SLURM daemon outlived stop()"
    assert processes_with_marker(slurm.root) == [], "ps still shows this cluster's processes"
