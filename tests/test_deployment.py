"""Running on several machines: entrypoint.sh, the docker-compose simulation, cluster manifests.

No Docker engine is needed: the compose file is validated offline (structure here,
and ``docker-compose config -q`` when that binary exists), and its nodes are run the
way the containers would run them: one entrypoint.sh per service, with that
service's environment, on 127.0.0.1 instead of the bridge network.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from distlab.devices import free_port, loopback_interface
from distlab.procs import _marked, kill_process_tree, marked_environ
from test_hygiene import _listening, _loopback

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "entrypoint.sh"


def entrypoint_modes() -> dict[str, str]:
    """The MODES table of entrypoint.sh: RUN_MODE -> module."""
    return dict(re.findall(r"^\s*\[(\w+)\]=([\w.]+)\s*$", ENTRYPOINT.read_text(), flags=re.M))


def _run_nodes(envs: list[dict], args: list[str], timeout_s: float = 240, watch=None) -> list[tuple[int, str]]:
    """Start one entrypoint.sh per node environment; return (exit code, output) per node.

    Every node and all it starts (torchrun's workers run in sessions of their own) carry a
    marker and are killed in ``finally``: nothing outlives the test. ``watch(pids)``, if given,
    is called with the pids of every process of the job about every 0.5 s while a node runs.
    """
    procs, marker = [], os.urandom(8).hex()
    try:
        for env in envs:
            procs.append(subprocess.Popen([str(ENTRYPOINT), *args], cwd=REPO, env={**marked_environ(marker), **env},
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while watch is not None and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            watch(set(_marked(marker)) | {p.pid for p in procs})
            time.sleep(0.5)  # a sampling interval (a sample costs ~20-70 ms of CPU), not a wait for an event
        return [(p.wait(timeout=timeout_s), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            kill_process_tree(p.pid, marker)
            p.wait()
            p.stdout.close()


def test_every_run_mode_names_a_module_with_main():
    modes = entrypoint_modes()
    assert {"comm", "train", "data_parallel_naive"} <= set(modes), modes
    for mode, module in modes.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"RUN_MODE={mode}: module {module} not found"
        assert "def main(" in Path(spec.origin).read_text(), f"RUN_MODE={mode}: {module} has no main()"


def test_templates_run_stops_at_the_first_todo_with_one_line():
    """``IMPL=templates RUN_MODE=comm ./entrypoint.sh`` on untouched templates, 2 ranks."""
    out = subprocess.run([str(ENTRYPOINT)], env={**os.environ, "RUN_MODE": "comm", "IMPL": "templates", "NPROC": "2",
                                                 "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 3, out.stderr[-3000:]
    todo_lines = [line for line in out.stderr.splitlines() if line.startswith("TODO ")]
    assert todo_lines == ["TODO 1.1 all-reduce by reduce + broadcast: not implemented yet "
                          "(see phase1_data_parallel/guidelines.md#all-reduce-three-ways)"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr[-3000:]


def test_unknown_run_mode_lists_the_valid_ones():
    out = subprocess.run([str(ENTRYPOINT)], env={**os.environ, "RUN_MODE": "nope"}, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2
    assert "unknown RUN_MODE 'nope'" in out.stderr and "data_parallel_naive" in out.stderr


# --------------------------------------------------------------------------- docker-compose
def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def _resolve(value: str, overrides: dict) -> str:
    """Compose's ${VAR:-default} substitution, with ``overrides`` as the shell environment."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: overrides.get(m.group(1), m.group(2)), str(value))


def test_compose_file_describes_a_cluster():
    compose = _compose()
    services = compose["services"]
    nodes = sorted(s for s in services if s.startswith("node"))
    assert len(nodes) >= 2
    envs = {name: services[name]["environment"] for name in nodes}
    assert {e["NNODES"] for e in envs.values()} == {str(len(nodes))}, "NNODES must equal the number of node services"
    assert sorted(e["NODE_RANK"] for e in envs.values()) == [str(i) for i in range(len(nodes))]
    head = services["node0"]
    assert all(e["MASTER_ADDR"] == head["hostname"] for e in envs.values()), "every node must rendezvous at node0"
    assert "healthcheck" in head
    for name in nodes:
        svc = services[name]
        assert svc["build"] == "." and svc["networks"] == ["cluster"] and svc["hostname"] == name
        assert any(v.startswith("checkpoints:") for v in svc["volumes"]), f"{name} lacks the shared checkpoint volume"
        if name != "node0":
            assert svc["depends_on"]["node0"]["condition"] == "service_healthy"
    assert compose["networks"]["cluster"]["driver"] == "bridge"
    assert "checkpoints" in compose["volumes"]
    mode = _resolve(envs["node0"]["RUN_MODE"], {})
    assert mode in entrypoint_modes(), f"compose's default RUN_MODE {mode} is not a mode of entrypoint.sh"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ENTRYPOINT \[\"\./entrypoint\.sh\"\]", dockerfile, flags=re.M)
    assert "requirements.txt" in dockerfile


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose binary not installed")
def test_compose_file_passes_docker_compose_config():
    out = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yaml"), "config", "-q"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.e2e
def test_compose_nodes_run_as_the_containers_would():
    """Each service's environment, as compose resolves it, with loopback standing in for the network.

    A multi-node job binds what the user names and nothing else: while it runs, every socket
    it listens on (rendezvous store on MASTER_ADDR, gloo on GLOO_SOCKET_IFNAME) is on loopback.
    """
    services = _compose()["services"]
    port = str(free_port())
    envs = []
    for name in sorted(s for s in services if s.startswith("node")):
        env = {k: _resolve(v, {}) for k, v in services[name]["environment"].items()}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RDZV_ID=f"compose-{port}", OMP_NUM_THREADS="1")
        env.pop("GLOO_SOCKET_IFNAME", None)  # eth0 is the containers' interface, not this machine's:
        if loopback_interface():  # the user names this machine's loopback instead
            env["GLOO_SOCKET_IFNAME"] = loopback_interface()
        envs.append(env)
    listening: set[str] = set()
    results = _run_nodes(envs, ["--epochs", "1"], watch=lambda pids: listening.update(_listening(pids)))
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node{node} exited {code}:\n{output[-3000:]}"
    assert "test accuracy" in results[0][1]
    assert all(map(_loopback, listening)), f"a two-node job told 127.0.0.1 listens beyond it: {sorted(listening)}"
    # Node 0's agent listens twice (the rendezvous store on MASTER_PORT, the store it gives its workers);
    # a third address is a worker's gloo socket: without both, the check above would prove little.
    assert f"127.0.0.1:{port}" in listening and len(listening) > 2, \
        f"the store on MASTER_ADDR and a worker's socket were not both seen listening: {sorted(listening)}"


# --------------------------------------------------------------------------- SLURM and Kubernetes
DEPLOYMENT = REPO / "solutions" / "phase4_production" / "deployment"


def _check_module_command(args: list[str], where: str) -> None:
    """``-m module --flag=value ...``: the module exists and its parser accepts every flag and value."""
    assert "-m" in args, f"{where}: no `-m module` in {args}"
    module = args[args.index("-m") + 1]
    assert importlib.util.find_spec(module) is not None, f"{where}: module {module} not found"
    flags = args[args.index("-m") + 2:]
    parser = importlib.import_module(module).build_parser()
    try:
        parser.parse_args(flags)
    except SystemExit:
        raise AssertionError(f"{where}: {module} rejects {flags}") from None


def _manifests(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOYMENT / name).read_text()) if d]


def _flag(command: list[str], name: str) -> str:
    return next(c.split("=", 1)[1] for c in command if c.startswith(f"--{name}="))


def test_kubernetes_pytorchjob_is_elastic_and_runs_the_capstone():
    docs = _manifests("kubernetes.yaml")
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    elastic = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    container = worker["template"]["spec"]["containers"][0]
    command = [str(c).split("#")[0].strip() for c in container["command"]]
    assert command[0] == "torchrun"
    _check_module_command(command, "kubernetes.yaml")
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert f"--nproc_per_node={gpus}" in command, "one process per GPU"
    # Every legal scale of the elastic range must divide the global batch, or a scale-up crashes.
    batch = int(_flag(command, "global-batch"))
    for pods in range(elastic["minReplicas"], elastic["maxReplicas"] + 1):
        assert batch % (pods * gpus) == 0, f"{pods} pods x {gpus} GPUs = {pods * gpus} ranks do not divide {batch}"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    assert set(mounts) <= set(volumes)
    ckpt = _flag(command, "checkpoint-dir")
    assert ckpt.startswith(mounts["checkpoints"]), "checkpoints must go to the shared volume"
    # The claims the job mounts are defined beside it, with the access modes a cluster job needs.
    claims = {d["metadata"]["name"]: d["spec"]["accessModes"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    ckpt_claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
    data_claim = volumes["data"]["persistentVolumeClaim"]["claimName"]
    assert claims.get(ckpt_claim) == ["ReadWriteMany"], f"{ckpt_claim}: every pod writes, any pod resumes"
    assert claims.get(data_claim) in (["ReadOnlyMany"], ["ReadWriteMany"]), f"{data_claim}: read by every pod"


def test_trainjob_variant_runs_the_same_capstone():
    job = _manifests("trainjob.yaml")[0]
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    command = [str(c).split("#")[0].strip() for c in trainer["command"]]
    _check_module_command(command, "trainjob.yaml")
    ranks = trainer["numNodes"] * trainer["numProcPerNode"]
    assert trainer["numProcPerNode"] == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
    assert int(_flag(command, "global-batch")) % ranks == 0
    assert trainer["image"].endswith(":gpu")


def test_slurm_script_finds_the_head_node_and_runs_the_capstone():
    text = (DEPLOYMENT / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))
    assert directives["ntasks-per-node"] == "1", "one torchrun per node"
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | awk 'NR == 1'" in text  # not head: SIGPIPE
    srun = text.split("srun --kill-on-bad-exit=1", 1)[1]
    command = " ".join(line.rstrip("\\").strip() for line in srun.splitlines()
                       if line.strip() and not line.strip().startswith("#"))
    # srun does not inherit --cpus-per-task from sbatch since SLURM 22.05: it must be passed on.
    assert command.startswith('--cpus-per-task="$cpus"') and "export SRUN_CPUS_PER_TASK=$cpus" in text, command
    # Each node runs the course's entrypoint.sh (as a compose or cloud node does), as node SLURM_NODEID.
    assert "NODE_RANK=$SLURM_NODEID exec ./entrypoint.sh" in command, command
    assert "MASTER_ADDR=$head_addr" in text and "RDZV_ID=$SLURM_JOB_ID" in text
    # The default run: the capstone, through entrypoint.sh's imagenet mode, with arguments its parser accepts.
    assert "RUN_MODE=${RUN_MODE:-imagenet}" in text
    assert "[imagenet]=demos.imagenet" in (REPO / "entrypoint.sh").read_text()
    capstone = re.search(r"run_args=\((.*?)\)", text, flags=re.S).group(1).split()
    _check_module_command(["-m", "demos.imagenet", *capstone], "slurm.sbatch")
    # A resubmitted job starts its own run: the checkpoint directory is keyed on the job id.
    assert "run_id=${RESUME_RUN:-$SLURM_JOB_ID}" in text
    assert re.search(r"export CHECKPOINT_DIR=.*-\$run_id$", text, flags=re.M), "checkpoints keyed on the job id"
    out = subprocess.run(["bash", "-n", str(DEPLOYMENT / "slurm.sbatch")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- images and arguments
def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_dockerfile_builds_a_cpu_and_a_gpu_variant_that_the_manifests_name():
    text = _dockerfile()
    assert re.search(r"^FROM python:\$\{PYTHON\}-slim$", text, flags=re.M) and "ARG PYTHON=3.11" in text
    variants = set(re.findall(r"^\s+(\w+)\) index=", text, flags=re.M))
    assert variants == {"cpu", "gpu"}, variants
    # Layer order: requirements (and torch) before the code, so a code edit does not reinstall torch.
    assert text.index("COPY requirements.txt") < text.index("COPY . .")
    assert re.search(r'^ENTRYPOINT \["\./entrypoint\.sh"\]$', text, flags=re.M), "exec form, so signals reach torchrun"
    images = {"docker-compose.yaml": _compose()["x-node"]["image"]}
    job = _manifests("kubernetes.yaml")[0]
    images["kubernetes.yaml"] = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"]
    images["trainjob.yaml"] = _manifests("trainjob.yaml")[0]["spec"]["trainer"]["image"]
    for where, image in images.items():
        tag = image.rsplit(":", 1)[-1]
        assert tag in variants, f"{where} runs {image}, but the Dockerfile builds only {sorted(variants)}"
    assert images["docker-compose.yaml"].endswith(":cpu") and images["kubernetes.yaml"].endswith(":gpu")


def test_dockerignore_keeps_history_and_runs_out_of_the_build_context():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", "runs/", ".venv/", "data/"} <= ignored, ignored


def _entrypoint_argv(tmp_path, env: dict, args: list[str]) -> list[str]:
    """What entrypoint.sh hands torchrun, with a stand-in torchrun on PATH that prints its argv."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (fake / "torchrun").chmod(0o755)
    out = subprocess.run([str(ENTRYPOINT), *args], env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
                                                        "TORCHRUN": str(fake / "torchrun"), **env},
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    return lines[lines.index("-m") + 2:]


def test_compose_arguments_reach_the_mode_and_checkpoints_go_to_the_shared_volume(tmp_path):
    env = {"RUN_MODE": "imagenet", "NPROC": "1", "CHECKPOINT_DIR": "/checkpoints"}
    # docker-compose turns an unset RUN_ARGS into one empty argument: it must not reach argparse.
    assert _entrypoint_argv(tmp_path, env, [""]) == ["--checkpoint-dir=/checkpoints/imagenet"]
    assert _entrypoint_argv(tmp_path, env, ["--max-steps", "3", "--checkpoint-dir", "/mine"]) == \
        ["--max-steps", "3", "--checkpoint-dir", "/mine"]
    env["RUN_MODE"] = "fault_tolerance"
    assert _entrypoint_argv(tmp_path, env, []) == ["--ckpt-dir=/checkpoints/fault_tolerance"]
    env["RUN_MODE"] = "comm"  # a mode that keeps no checkpoints gets none
    assert _entrypoint_argv(tmp_path, env, ["--numel", "8"]) == ["--numel", "8"]
    compose = _compose()
    assert compose["x-node"]["command"] == "${RUN_ARGS:-}", "compose must pass RUN_ARGS to the mode"


# --------------------------------------------------------------------------- Terraform
TERRAFORM = REPO / "deploy" / "terraform" / "aws"


def _hcl() -> dict[str, dict]:
    import hcl2

    return {p.name: hcl2.loads(p.read_text()) for p in sorted(TERRAFORM.glob("*.tf"))}


def _render(template: str, values: dict) -> str:
    """Terraform's templatefile() for the subset the startup script uses: ${name} and $${ escapes."""
    missing = sorted(set(re.findall(r"(?<!\$)\$\{(\w+)\}", template)) - set(values))
    assert not missing, f"startup.sh.tftpl uses {missing}, which main.tf does not pass"
    text = re.sub(r"(?<!\$)\$\{(\w+)\}", lambda m: str(values[m.group(1)]), template)
    return text.replace("$${", "${")


def test_terraform_files_parse_and_every_variable_is_declared():
    files = _hcl()
    assert {"main.tf", "variables.tf", "outputs.tf"} <= set(files)
    declared = {name.strip('"') for block in files["variables.tf"]["variable"] for name in block}
    used = set()
    for path in TERRAFORM.glob("*.tf"):
        used |= set(re.findall(r"\bvar\.(\w+)", path.read_text()))
    assert used <= declared, f"undeclared variables: {sorted(used - declared)}"
    resources = {kind.strip('"') for block in files["main.tf"]["resource"] for kind in block}
    assert {"aws_instance", "aws_placement_group", "aws_efs_file_system", "aws_efs_mount_target",
            "aws_security_group"} <= resources, resources
    main = (TERRAFORM / "main.tf").read_text()
    passed = set(re.findall(r"^\s+(\w+)\s+=", main.split("locals {")[1].split("\n}\n")[0], flags=re.M))
    passed |= {"node_rank", "master_addr"}  # merged per node
    _render((TERRAFORM / "startup.sh.tftpl").read_text(), dict.fromkeys(passed, ""))
    assert 'strategy = "cluster"' in main, "nodes of one job belong in one cluster placement group"


@pytest.mark.e2e  # 7-15 s: in the end-to-end tier, which .ci/run runs after the main suite
def test_terraform_startup_script_runs_two_nodes_on_loopback(tmp_path):
    """The rendered user data of node 0 and node 1, in dry-run mode, rendezvous and run a mode."""
    template = (TERRAFORM / "startup.sh.tftpl").read_text()
    common = {"node_count": 2, "gpus_per_node": 8, "efs_dns": "fs-0.efs.example", "repo_url": "unused",
              "repo_ref": "main", "run_mode": "comm", "run_args": "--numel 4096 --repeats 1"}
    head = tmp_path / "node0.sh"
    head.write_text(_render(template, {**common, "node_rank": 0, "master_addr": ""}))
    worker = tmp_path / "node1.sh"
    worker.write_text(_render(template, {**common, "node_rank": 1, "master_addr": "10.42.1.10"}))
    port = str(free_port())
    procs, marker = [], os.urandom(8).hex()
    try:
        for rank, script in enumerate([head, worker]):
            env = {**marked_environ(marker), "DISTLAB_DRY_RUN": "1", "DISTLAB_REPO_DIR": str(REPO), "DISTLAB_PORT": port,
                   "DISTLAB_SHARED": str(tmp_path / "shared"), "DISTLAB_LOG": str(tmp_path / f"node{rank}.log"),
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            kill_process_tree(p.pid, marker)  # the node script, torchrun and its workers (own sessions)
            p.wait()
    logs = [(tmp_path / f"node{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "--nnodes=2" in logs[0] and f"--rdzv_endpoint=127.0.0.1:{port}" in logs[0], logs[0][-2000:]
    assert (tmp_path / "shared" / "checkpoints").is_dir()


# --------------------------------------------------------------------------- the rendezvous address, checked
def _entrypoint(env: dict) -> subprocess.CompletedProcess:
    """entrypoint.sh with ``env`` over a clean rendezvous environment; torchrun replaced by ``echo``."""
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")}
    return subprocess.run([str(ENTRYPOINT)], env={**base, "RUN_MODE": "comm", "TORCHRUN": "echo", **env},
                          capture_output=True, text=True, timeout=30)  # the lookup's own bound is 10 s


@pytest.mark.parametrize("env, says", [
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a TCP port: use an integer from 1 to 65535"),
    ({"MASTER_PORT": "0", "NNODES": "2"}, "MASTER_PORT='0' is not a TCP port"),
    ({"MASTER_PORT": "65536", "NNODES": "2"}, "MASTER_PORT='65536' is not a TCP port"),
    ({"MASTER_PORT": "-5"}, "MASTER_PORT='-5' is not a TCP port"),
    ({"MASTER_ADDR": "", "NNODES": "2"}, "MASTER_ADDR is set but empty: name node 0's host or IP address"),
    ({"MASTER_ADDR": "node0:29500"}, "MASTER_ADDR='node0:29500' has a port: use MASTER_ADDR=node0 MASTER_PORT=29500"),
    ({"MASTER_ADDR": "tcp://node0"}, "MASTER_ADDR='tcp://node0' is not a host name or IP address"),
    # .invalid never resolves (RFC 2606): a typo'd host, found before torchrun starts
    ({"MASTER_ADDR": "node0.invalid", "NNODES": "2"}, "MASTER_ADDR='node0.invalid' does not resolve on this node"),
], ids=["port-abc", "port-0", "port-65536", "port-negative", "addr-empty", "addr-with-port", "addr-url",
        "addr-unresolvable"])
def test_entrypoint_refuses_a_bad_rendezvous_address_in_one_line(env, says):
    """`MASTER_PORT=abc ./entrypoint.sh` used to end in torchrun's 35-line traceback."""
    out = _entrypoint(env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"entrypoint.sh: {says}"), out.stderr
    assert not out.stdout, "torchrun must not start"


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1", "::1"])
def test_entrypoint_passes_a_good_rendezvous_address_to_torchrun(addr):
    out = _entrypoint({"MASTER_ADDR": addr, "MASTER_PORT": "29501", "NNODES": "2", "NODE_RANK": "0"})
    assert out.returncode == 0 and f"--rdzv_endpoint={addr}:29501" in out.stdout, out.stderr
