"""A one-host SLURM for the cluster tier: munged, slurmctld and one slurmd per node, all under one directory.

Debian's slurm-wlm is built with multiple-slurmd support: several slurmd daemons, each started as
``slurmd -N <node>``, share one host as separate nodes (same NodeHostname, a port of their own), so a
2-node job really is two slurmd's job steps, each starting its own torchrun. Every daemon runs in the
foreground as a child of the test, on ports chosen free here and written into the slurm.conf under
``root``; munged listens on a socket there too. Nothing is read from or written to /etc or /run.

    slurm = start(tmp_path, nodes=2, cpus=2)
    try:
        out = slurm.sbatch(script, f"--output={tmp_path}/job.out", env={...}, cwd=checkout)
        state = slurm.wait_job(job_id, tmp_path / "job.out")     # followed while it progresses
    finally:
        leftovers = slurm.stop()   # what was still running (killed): a test fails on any
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from distlab.procs import die_with_parent, stop

DAEMONS = ("munged", "slurmctld", "slurmd")
# JobStates after which a job does no more (scontrol's names; COMPLETING still runs its epilog)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY"}
CLIENTS = ("sbatch", "sinfo", "scontrol", "scancel", "srun")
MARKER = "DISTLAB_SLURM_ROOT"  # in every daemon's environment and each job's: how leftovers are found


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here; the message says why and what to install."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago on every address (held together while chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def processes_with_marker(root: Path) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment names this cluster's ``root`` (ps, via /proc)."""
    needle = f"{MARKER}={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":  # a zombie has ended; only its parent's wait is missing
            found.append((int(entry.name), cmdline))
    return found


@dataclass
class Slurm:
    root: Path
    conf: Path
    nodes: list[str]
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (``SLURM_CONF`` names its slurm.conf)."""
        return subprocess.run(list(args), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def sbatch(self, script: Path, *args: str, env: dict[str, str], cwd: Path,
               timeout: float = 120) -> subprocess.CompletedProcess:
        """``sbatch ARGS SCRIPT`` from ``cwd``; ``env``: the submitting shell's whole environment (+ the cluster's)."""
        return subprocess.run(["sbatch", *args, str(script)], env={**env, "SLURM_CONF": str(self.conf),
                                                                   MARKER: str(self.root)},
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, ...); {} where SLURM does not know the job."""
        out = self.run("scontrol", "--oneliner", "show", "job", job_id, timeout=60)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}

    def wait_job(self, job_id: str, output: Path, quiet_s: float = 420, cap_s: float = 1500) -> dict[str, str]:
        """The job's fields once it has ended; waited for while it progresses (its state changes, its output grows).

        RuntimeError, with the job's output and the daemons' logs, after ``quiet_s`` without progress or ``cap_s``
        in all (torch's import by every rank of a node, on a loaded host, prints nothing for a minute or more).
        """
        start = last_progress = time.monotonic()
        seen = None
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in ENDED:
                return fields
            size = output.stat().st_size if output.exists() else -1
            now = time.monotonic()
            if (fields.get("JobState"), size) != seen:
                seen, last_progress = (fields.get("JobState"), size), now
            if now - last_progress > quiet_s or now - start > cap_s:
                why = (f"silent for {now - last_progress:.0f} s" if now - last_progress > quiet_s
                       else f"still not done after {cap_s:.0f} s")
                text = output.read_text(errors="replace") if output.exists() else "(no output yet)"
                raise RuntimeError(f"job {job_id} is {fields.get('JobState')} and {why}:\n{text[-3000:]}\n"
                                   f"{self.logs()}")
            time.sleep(1)  # polling the controller: sbatch --wait polls too, ever more slowly

    def logs(self) -> str:
        """The tail of every daemon's log, for a failure message."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> list[tuple[int, str]]:
        """Cancel every job, stop the daemons (TERM, then KILL after 15 s); return what was still running after.

        Anything still carrying this cluster's marker afterwards (a job step's torchrun, a slurmstepd) is
        killed too, and returned, so the caller can fail on it.
        """
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run("scancel", "--full", "--user", str(os.getuid()), timeout=15)
        for name in reversed(list(self.procs)):  # slurmd's, slurmctld, then munged (the others need it to the end)
            stop(self.procs[name], grace_s=15)
        deadline = time.monotonic() + 10  # a slurmstepd ends on its own once its task has ended: give it a moment
        while (left := processes_with_marker(self.root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


def _wait_for(what: str, check, slurm: Slurm, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [name for name, proc in slurm.procs.items() if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            reason = f"{', '.join(dead)} exited" if dead else f"not within {timeout_s:.0f} s"
            raise SlurmUnavailable(f"{what}: {reason}\n{slurm.logs()}")
        time.sleep(0.2)


def _slurm_conf(root: Path, host: str, nodes: list[str], cpus: int, ports: list[int]) -> str:
    ctld_port, node_ports = ports[0], ports[1:]
    lines = [
        "ClusterName=distlab",
        f"SlurmctldHost={host}",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={node_ports[0]}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        # no cgroups in a container: processes are tracked through /proc, tasks are not bound to CPUs
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        *(f"NodeName={name} NodeHostname={host} Port={port} CPUs={cpus} State=UNKNOWN"
          for name, port in zip(nodes, node_ports)),
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def start(root: Path, nodes: int = 2, cpus: int = 2, timeout_s: float = 30) -> Slurm:
    """munged, slurmctld and ``nodes`` slurmd's under ``root``, each node with ``cpus`` CPUs; all idle on return."""
    missing = [name for name in (*DAEMONS, *CLIENTS, "munge") if shutil.which(name) is None]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge")
    if os.getuid() != 0:
        raise SlurmUnavailable("slurmd starts job steps as their user, which needs root: run the cluster tier as root")
    for sub in ("munge", "state", "run", "log", *(f"spool/n{i}" for i in range(1, nodes + 1))):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)  # munged refuses a key others can read
    names = [f"n{i}" for i in range(1, nodes + 1)]
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, names, cpus, free_ports(1 + nodes)))
    env = {**os.environ, "SLURM_CONF": str(conf), MARKER: str(root)}
    slurm = Slurm(root, conf, names, env)

    def daemon(name: str, *args: str) -> None:
        log = open(root / "log" / f"{name}.out", "wb")
        with log:
            # SIGTERM when pytest dies (even by SIGKILL): no daemon outlives the test run
            slurm.procs[name] = subprocess.Popen(list(args), env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                                 preexec_fn=lambda: die_with_parent(signal.SIGTERM))

    try:
        munge = root / "munge"
        daemon("munged", "munged", "--foreground", "--force", f"--socket={munge}/munge.socket",
               f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
               f"--seed-file={munge}/munged.seed")
        _wait_for("munged", lambda: subprocess.run(["munge", "-n", "-S", f"{munge}/munge.socket"],
                                                   capture_output=True).returncode == 0, slurm, timeout_s)
        daemon("slurmctld", "slurmctld", "-D", "-f", str(conf))
        for name in names:
            daemon(f"slurmd-{name}", "slurmd", "-D", "-N", name, "-f", str(conf))

        def all_idle() -> bool:
            out = slurm.run("sinfo", "--noheader", "--Node", "--format=%N %T", timeout=10)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            return out.returncode == 0 and all(states.get(name) == "idle" for name in names)

        _wait_for(f"{nodes} slurmd nodes idle", all_idle, slurm, timeout_s)
    except BaseException:
        slurm.stop()
        raise
    return slurm

