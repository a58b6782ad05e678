"""The deployment files' node start-up, checked here without a cluster (the main suite runs these).

- docker-compose.yaml: node0's healthcheck passes once the rendezvous store listens, where it listens;
- Terraform: a node count the global batch does not divide is refused at plan time (``terraform plan``
  on variables.tf alone: no provider, no network), and the startup script installs from the checkout;
- SLURM: slurm.sbatch run by bash with stand-ins for scontrol, srun, getent and hostname on PATH (and
  for torchrun, as entrypoint.sh's TORCHRUN), on a machine whose /etc/hosts maps the host name to
  loopback, with a typed GPU request.

The containers themselves (compose up, the startup script's install branch) are in tests/test_cluster.py;
slurm.sbatch under a real sbatch on a one-host SLURM is in tests/test_cluster_slurm.py.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from distlab.devices import free_port
from distlab.launch import BoundTCPStore

REPO = Path(__file__).resolve().parent.parent
TERRAFORM = REPO / "deploy" / "terraform" / "aws"
SBATCH = REPO / "solutions" / "phase4_production" / "deployment" / "slurm.sbatch"


# --------------------------------------------------------------------------- docker-compose
def _healthcheck(env: dict) -> subprocess.CompletedProcess:
    """node0's healthcheck command, run here with node0's environment but ``env``'s address."""
    services = yaml.safe_load((REPO / "docker-compose.yaml").read_text())["services"]
    test = services["node0"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"], f"the healthcheck runs python in exec form: {test}"
    node_env = {k: str(v) for k, v in services["node0"]["environment"].items()}
    return subprocess.run([sys.executable, *test[2:]], env={**os.environ, **node_env, **env}, capture_output=True,
                          text=True, timeout=30)


def test_compose_healthcheck_passes_once_the_store_listens_where_it_listens():
    """The store listens on MASTER_ADDR's address only: in a container that is not 127.0.0.1.

    Here 127.0.0.2 stands in for node0's address on the bridge network (a local address that is
    not 127.0.0.1, as eth0's is in the container).
    """
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.2", "MASTER_PORT": str(port)}
    assert _healthcheck(env).returncode != 0, "healthy before the rendezvous store listens"
    store = BoundTCPStore("127.0.0.2", port, 1, is_master=True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    try:
        out = _healthcheck(env)
        assert out.returncode == 0, f"node0 stays unhealthy while its store listens on 127.0.0.2:{port}: " \
                                    f"probe MASTER_ADDR:MASTER_PORT, where the store listens\n{out.stderr[-1500:]}"
    finally:
        del store


# --------------------------------------------------------------------------- Terraform
def _terraform_plan(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["terraform", "plan", "-input=false", "-no-color", "-var", "key_name=k",
                           "-var", "admin_cidr=203.0.113.7/32", *args], cwd=work, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1"})


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform not installed")
def test_terraform_plan_refuses_a_node_count_the_global_batch_does_not_divide(tmp_path):
    """node_count accepts 1-16, but 2048 images split over 8 GPUs per node only at 1, 2, 4, 8 or 16 nodes."""
    shutil.copy(TERRAFORM / "variables.tf", tmp_path)  # the variables alone: no provider to download
    init = subprocess.run(["terraform", "init", "-input=false", "-no-color"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "CHECKPOINT_DISABLE": "1"})
    assert init.returncode == 0, init.stdout + init.stderr
    accepted = [n for n in range(1, 17) if _terraform_plan(tmp_path, "-var", f"node_count={n}").returncode == 0]
    assert accepted == [1, 2, 4, 8, 16], f"plan accepts node_count {accepted} with global_batch 2048 and 8 GPUs"
    out = _terraform_plan(tmp_path, "-var", "node_count=3")
    message = " ".join(out.stderr.split())
    assert "3 x 8 = 24 ranks" in message and "use node_count 1 or 2 or 4 or 8 or 16" in message, out.stderr
    assert _terraform_plan(tmp_path, "-var", "node_count=3", "-var", "global_batch=48").returncode == 0
    (tmp_path / "no_batch.tfvars").write_text("global_batch = null\nnode_count = 3\n")  # a mode without the flag
    assert _terraform_plan(tmp_path, "-var-file=no_batch.tfvars").returncode == 0
    out = _terraform_plan(tmp_path, "-var", "run_args=--global-batch 96")
    assert out.returncode != 0 and "set it with -var global_batch=N" in " ".join(out.stderr.split()), out.stderr


def test_terraform_passes_the_checked_global_batch_to_the_mode():
    import hcl2

    variables = {name.strip('"'): spec for block in hcl2.loads((TERRAFORM / "variables.tf").read_text())["variable"]
                 for name, spec in block.items()}
    assert "--global-batch" not in variables["run_args"]["default"], "the global batch belongs in global_batch"
    conditions = " ".join(str(v["condition"]) for v in variables["node_count"]["validation"])
    assert "var.global_batch" in conditions and "var.gpus_per_node" in conditions, conditions
    main = (TERRAFORM / "main.tf").read_text()
    assert re.search(r'run_args\s+=.*--global-batch \$\{var\.global_batch\}', main), "main.tf must pass global_batch"
    version = re.search(r'required_version\s*=\s*">=\s*1\.(\d+)', main)
    assert version and int(version.group(1)) >= 9, "validations that read other variables need Terraform >= 1.9"


def test_terraform_startup_installs_from_inside_the_checkout():
    """requirements.txt ends with ``-e .``: pip must run in the checkout, or it installs / (and set -e stops)."""
    text = (TERRAFORM / "startup.sh.tftpl").read_text()
    install = text[text.index("else\n"):text.index("\nfi\n")]
    pip = next(i for i, line in enumerate(install.splitlines()) if "pip install" in line)
    cds = [i for i, line in enumerate(install.splitlines()) if re.match(r'\s*cd "\$repo"\s*$', line)]
    assert cds and cds[0] < pip, f"pip install runs before cd \"$repo\":\n{install}"


# --------------------------------------------------------------------------- SLURM
STUBS = {
    # one write, as scontrol's stdio makes (bash's printf may write line by line)
    "scontrol": 'if [[ "$1 $2" == "show hostnames" ]]; then cat <<< $\'gpu-a\\ngpu-b\'; else exit 1; fi',
    # /etc/hosts maps the host name to loopback (Debian's 127.0.1.1), as on many cluster images
    "getent": 'if [[ "$1" == ahostsv4 ]]; then printf "127.0.1.1       STREAM %s\\n127.0.1.1       DGRAM\\n" "$2"; '
              'else exit 2; fi',
    "hostname": 'case "$1" in --ip-address|-i) echo 127.0.1.1 ;; -I) echo "10.9.0.11 172.17.0.1 " ;; '
                '*) echo gpu-a ;; esac',
    # srun: a step on one node (-w) runs its command here; the job step runs its command here too, as
    # node 0 of the allocation (srun passes the environment on, SLURM_NODEID set per node)
    "srun": 'while [[ "$1" == -* ]]; do [[ "$1" == -w ]] && shift; shift; done; SLURM_NODEID=0 exec "$@"',
    # entrypoint.sh's launcher (TORCHRUN) stands in for torchrun: it records its arguments, and which
    # `python` the step's PATH gives (the one entrypoint.sh's own launcher, `python -m ...`, would run)
    "record-torchrun": 'printf "%s\\n" "$@" > "$SRUN_LOG"; echo "program=$(command -v python)" >> "$SRUN_LOG"',
}


def _sbatch(tmp_path: Path, gpus_per_node: str, venv: bool = True) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    venv_dir = tmp_path / "venv"
    if venv:  # the course's environment: a venv whose python runs this one (torch installed)
        (venv_dir / "bin").mkdir(parents=True, exist_ok=True)
        # A script, not a symlink: a link to a venv's python, away from its pyvenv.cfg, is the base interpreter.
        (venv_dir / "bin" / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        (venv_dir / "bin" / "python").chmod(0o755)
        (venv_dir / "bin" / "activate").write_text(f'export VIRTUAL_ENV="{venv_dir}" PATH="{venv_dir}/bin:$PATH"\n')
    log = tmp_path / "srun.log"
    log.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SRUN_LOG": str(log), "VENV": str(venv_dir),
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "distlab-imagenet", "SLURM_CPUS_PER_TASK": "64", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_GPUS_PER_NODE": gpus_per_node, "TORCHRUN": "record-torchrun"}
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    return out, log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def sbatch_8(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    """One run with --gpus-per-node=8, shared by the tests that only read what it launched."""
    tmp_path = tmp_path_factory.mktemp("sbatch")
    return (*_sbatch(tmp_path, "8"), tmp_path)


def _launch_flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


@pytest.mark.venv
def test_slurm_head_address_is_not_loopback_where_hosts_maps_the_name_to_it(sbatch_8):
    out, args, tmp_path = sbatch_8
    assert out.returncode == 0, out.stderr
    endpoint = _launch_flag(args, "rdzv_endpoint")
    assert endpoint == "10.9.0.11:29500", f"the other nodes would dial {endpoint}: not the head node's address " \
                                          "(hostname --ip-address prints 127.0.1.1 where /etc/hosts says so)"


@pytest.mark.venv  # the job step's python: a venv's, made here
def test_slurm_launcher_is_on_the_path_the_job_step_gets(sbatch_8):
    out, args, tmp_path = sbatch_8
    assert out.returncode == 0, out.stderr
    program = next(a.split("=", 1)[1] for a in args if a.startswith("program="))
    assert program == str(tmp_path / "venv" / "bin" / "python"), \
        f"the job step's python is {program or 'missing'}, not the venv's: no torchrun there"
    launcher = re.search(r"TORCHRUN:-python (-m [\w.]+)", (REPO / "entrypoint.sh").read_text())
    assert launcher, "entrypoint.sh's default launcher is no longer `python -m <module>`: update this test"
    check = subprocess.run([program, *launcher.group(1).split(), "--help"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "--nproc_per_node" in check.stdout, f"{launcher.group(0)} is not torchrun: " \
                                                                          f"{check.stderr}"


@pytest.mark.venv
def test_slurm_runs_the_capstone_with_a_checkpoint_directory_per_job(sbatch_8):
    out, args, tmp_path = sbatch_8
    assert out.returncode == 0, out.stderr
    assert args[args.index("-m") + 1] == "demos.imagenet", args
    assert _launch_flag(args, "checkpoint-dir").startswith("/shared/checkpoints/distlab-imagenet-4242/"), args
    assert _launch_flag(args, "rdzv_id") == "4242" and _launch_flag(args, "nnodes") == "2", args
    assert _launch_flag(args, "nproc_per_node") == "8", f"--gpus-per-node=8: {args}"


@pytest.mark.venv
@pytest.mark.parametrize("gpus, nproc", [("a100:8", "8"), ("h100:4", "4")])  # "8": sbatch_8
def test_slurm_starts_one_rank_per_gpu_of_a_typed_request(tmp_path, gpus, nproc):
    out, args = _sbatch(tmp_path, gpus)
    assert out.returncode == 0, out.stderr
    assert _launch_flag(args, "nproc_per_node") == nproc, f"--gpus-per-node={gpus}: {args}"


@pytest.mark.venv
def test_slurm_refuses_what_it_cannot_run_in_one_line(tmp_path):
    out, _ = _sbatch(tmp_path, "a100")
    assert out.returncode == 2 and "cannot read a GPU count from --gpus-per-node=a100" in out.stderr, out.stderr
    out, _ = _sbatch(tmp_path, "")  # no --gpus-per-node at all
    assert out.returncode == 2 and "or for CPU nodes with --gpus-per-node=0" in out.stderr, out.stderr
    (tmp_path / "bare").mkdir()
    out, _ = _sbatch(tmp_path / "bare", "8", venv=False)
    assert out.returncode == 2 and "no Python with torch here" in out.stderr, out.stderr
