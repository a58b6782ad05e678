"""The compose cluster without the internet: an offline image, the compose file up, the job's exit code.

    python -m distlab.compose image                       # build distlab:cpu-offline (once; as root)
    RUN_MODE=comm NPROC=2 python -m distlab.compose up    # docker-compose.yaml's nodes, attached; exit code: the job's
    RUN_MODE=comm python -m distlab.compose up --online   # the same on the Dockerfile's own image (Docker Hub, pip)

The public base image (python:3.11-slim) and the PyTorch wheel index cannot be fetched where the
course's CI runs (nor in an air-gapped lab); Debian's package mirrors can. So this builds what it needs:

1. a base image: a minimal Debian root file system made by ``debootstrap`` and ``docker import``ed,
   tagged by the hash of what went into it (built once per engine, then reused);
2. the course's image: the project's own Dockerfile with its ``FROM`` pointed at that base and its
   ``RUN`` steps (pip from the network) left out, and ``PATH`` leading to this machine's Python
   environment, which every node mounts read-only at the same path;
3. a cluster: ``docker-compose.yaml`` itself plus an override file that names that image and adds
   the mounts, under a project name of its own. Waits follow the nodes' progress (a node that is
   alive, printing or still starting is waited for, within a hard cap; one that exits or turns
   unhealthy ends the wait at once, with its last lines), and ``down`` is retried until no
   container, network or volume of the project is left.

``up`` exits with the job's code: 0 when every node exited 0, else the code of the node that failed
first (the others are stopped then: torchrun's agents would wait minutes for it). Plain attached
``docker-compose up`` exits 0 even when every node failed.

The cluster tier (tests/test_cluster.py) uses the same code, and also starts ``dockerd`` itself where
none answers (``start_engine``). Nothing here listens on a port of the host: the nodes talk on the
compose project's bridge network.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distlab.procs import stop

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yaml"
OFFLINE_TAG = "distlab:cpu-offline"  # not the compose file's distlab:cpu: this one needs the mounted Python

# What the mounted Python environment links against beyond Debian's minimal base (sqlite3, readline,
# curses, expat for the standard library; libgomp for torch's OpenMP), plus the tools a node's
# scripts call (hostname -I, getent, ps, ip).
BASE_PACKAGES = ("ca-certificates", "hostname", "procps", "iproute2", "libsqlite3-0", "libreadline8",
                 "libncursesw6", "libexpat1", "libbz2-1.0", "liblzma5", "libffi8", "libssl3", "zlib1g",
                 "libgomp1")
BASE_FORMAT = 1  # bump when the way the base is made changes, so cached bases are rebuilt

# Waiting on nodes. A node that is alive is waited for while it makes progress: its log grows, its state
# or health changes, or its healthcheck is still 'starting' (torch's import alone took over a minute at
# load 15 on 2 cores). QUIET_S: how long every watched node may stay silent; CAP_S: the hard cap of one wait.
QUIET_S = 420.0
CAP_S = 1500.0
# One step of cleanup (a `compose down`, a `docker rm`) may hang on a loaded engine; the loop around it
# retries until nothing is left or DOWN_CAP_S has passed.
DOWN_STEP_S = 180.0
DOWN_CAP_S = 900.0


class EngineUnavailable(Exception):
    """No Docker engine can be used here; the message says why (the cluster tier skips with it)."""


class NodeFailed(RuntimeError):
    """A node exited, turned unhealthy or stopped progressing while waited on; the message holds its last lines."""


def _run(argv: list[str], timeout: float, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["docker", *args], timeout=timeout, check=check)


def _engine_answers() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# --------------------------------------------------------------------------- the engine
@dataclass
class Engine:
    """A Docker engine to talk to; ``dockerd`` is the daemon this process started (stopped by ``stop``)."""

    compose: list[str]
    dockerd: subprocess.Popen | None = None
    log: Path | None = None

    def stop(self) -> None:
        if self.dockerd is None:
            return
        self.dockerd.terminate()  # dockerd stops its containerd and exits
        try:
            self.dockerd.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()
        self.dockerd = None


def _start_dockerd(log: Path, extra: list[str]) -> subprocess.Popen:
    from distlab.procs import die_with_parent  # here: it imports torch (the doctor), which the operator's commands need not

    with open(log, "ab") as f:
        # SIGTERM when this process dies, even by SIGKILL (pytest-timeout, CI's limit): the daemon ends with the tier.
        proc = subprocess.Popen(["dockerd", *extra], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    # A daemon still running is still starting: waited for up to 180 s (a loaded host); one that exited failed.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if _engine_answers():
            return proc
        time.sleep(1)  # polling the engine's socket until it answers
    stop(proc, grace_s=30)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    raise EngineUnavailable(f"dockerd {' '.join(extra)} did not start: {' | '.join(tail)}")


def _compose_command() -> list[str]:
    if _run(["docker", "compose", "version"], timeout=60, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise EngineUnavailable("no compose: apt-get install docker-compose (or the docker compose plugin)")


def connect_engine() -> Engine:
    """The engine that answers (an operator's): EngineUnavailable, saying what to do, where none does."""
    if shutil.which("docker") is None:
        raise EngineUnavailable("no docker client: apt-get install docker.io docker-compose")
    if not _engine_answers():
        raise EngineUnavailable("no Docker engine answers: start it (systemctl start docker, or dockerd as root)")
    return Engine(compose=_compose_command())


def start_engine(log_dir: Path) -> Engine:
    """The engine that answers, else one started here (root only); EngineUnavailable says why not."""
    if shutil.which("docker") is None:
        raise EngineUnavailable("no docker client: apt-get install docker.io (and docker-compose)")
    dockerd, log = None, None
    if not _engine_answers():
        if os.geteuid() != 0:
            raise EngineUnavailable("no Docker engine answers and only root can start dockerd here")
        if shutil.which("dockerd") is None:
            raise EngineUnavailable("no Docker engine answers and dockerd is not installed: apt-get install docker.io")
        log = log_dir / "dockerd.log"
        try:
            dockerd = _start_dockerd(log, [])
        except EngineUnavailable as first:
            # Where the kernel offers no iptables (some sandboxes), dockerd refuses to start with it on.
            try:
                dockerd = _start_dockerd(log, ["--iptables=false"])
            except EngineUnavailable as second:
                raise EngineUnavailable(f"{first}; {second}") from None
    engine = Engine(compose=[], dockerd=dockerd, log=log)
    try:
        engine.compose = _compose_command()
    except BaseException:
        engine.stop()
        raise
    return engine


# --------------------------------------------------------------------------- images
def _debian_suite() -> str:
    """This machine's Debian release where it is Debian (the mounted Python links against its libc)."""
    release = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', Path("/etc/os-release").read_text(), flags=re.M)) \
        if Path("/etc/os-release").exists() else {}
    return release.get("VERSION_CODENAME") if release.get("ID") == "debian" and release.get("VERSION_CODENAME") \
        else "bookworm"


def base_image(work_dir: Path, mirror: str | None = None) -> str:
    """A minimal Debian image made here (debootstrap + docker import), reused while its inputs are the same."""
    suite = _debian_suite()
    mirror = mirror or os.environ.get("DISTLAB_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    key = hashlib.sha256(json.dumps([BASE_FORMAT, suite, sorted(BASE_PACKAGES)]).encode()).hexdigest()[:12]
    tag = f"distlab-cluster-base:{suite}-{key}"
    if docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    if shutil.which("debootstrap") is None:
        raise EngineUnavailable("no base image cached and debootstrap is not installed: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise EngineUnavailable(f"no base image {tag} cached, and debootstrap makes one as root only")
    rootfs = Path(tempfile.mkdtemp(prefix="distlab-rootfs-", dir=work_dir))
    try:
        out = _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", suite, str(rootfs),
                    mirror], timeout=1800, check=False)  # downloads: minutes on a slow mirror
        if out.returncode != 0:
            raise EngineUnavailable(f"debootstrap {suite} from {mirror} failed (exit {out.returncode}): "
                                    f"{(out.stdout + out.stderr).strip().splitlines()[-1:]}")
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        _run(["bash", "-o", "pipefail", "-c", f'tar -C "{rootfs}" -c . | docker import -c \'CMD ["bash"]\' - "{tag}"'],
             timeout=900)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return tag


def python_mounts() -> list[str]:
    """The directories of this Python environment (base and venv), mounted read-only at the same paths."""
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs))


def offline_dockerfile(base: str) -> str:
    """The project's Dockerfile for a machine without the internet: FROM ``base``, no RUN, PATH to the mount.

    Everything else (WORKDIR, ENV, COPY order and .dockerignore, ENTRYPOINT) is the real file's.
    """
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    kept = []
    for line in text.splitlines():
        word = line.split(None, 1)[0].upper() if line.strip() and not line.lstrip().startswith("#") else ""
        if word == "FROM":
            kept += [f"FROM {base}", f"ENV PATH={os.path.dirname(sys.executable)}:/usr/local/sbin:/usr/local/bin:"
                                     "/usr/sbin:/usr/bin:/sbin:/bin PYTHONDONTWRITEBYTECODE=1"]
        elif word and word != "RUN":
            kept.append(line)
    return "\n".join(kept) + "\n"


def build_image(base: str, tag: str, work_dir: Path) -> None:
    dockerfile = work_dir / "Dockerfile.offline"
    dockerfile.write_text(offline_dockerfile(base))
    _run(["docker", "build", "-q", "-f", str(dockerfile), "-t", tag, str(REPO)], timeout=900,
         env={**os.environ, "DOCKER_BUILDKIT": "0"})  # the classic builder: no buildx plugin needed


def offline_image(tag: str = OFFLINE_TAG) -> str:
    """Base (cached) and course image, tagged ``tag``: what ``python -m distlab.compose image`` builds."""
    with tempfile.TemporaryDirectory(prefix="distlab-image-") as work:
        build_image(base_image(Path(work)), tag, Path(work))
    return tag


# --------------------------------------------------------------------------- the cluster
def leftovers(project: str, timeout: float = 120) -> list[str]:
    """Containers, volumes and networks of compose project ``project`` that still exist ("kind id" each)."""
    label = f"label=com.docker.compose.project={project}"
    found = []
    for kind, argv in (("container", ["ps", "-aq"]), ("volume", ["volume", "ls", "-q"]),
                       ("network", ["network", "ls", "-q"])):
        found += [f"{kind} {i}" for i in docker(*argv, "--filter", label, timeout=timeout).stdout.split()]
    return found


@dataclass
class Cluster:
    """The project's docker-compose.yaml under a project name of its own, with the offline image."""

    engine: Engine
    image: str | None  # the offline image (this Python mounted into every node); None: the compose file's own
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # compose's own environment: RUN_MODE, NPROC, RUN_ARGS...
    node_env: dict[str, str] = field(default_factory=dict)  # added to every node's environment
    name: str = field(default_factory=lambda: f"distlab-{os.urandom(4).hex()}")

    def __post_init__(self) -> None:
        import yaml

        nodes = [s for s in yaml.safe_load(COMPOSE_FILE.read_text())["services"] if s.startswith("node")]
        self.nodes = sorted(nodes)
        # OMP_NUM_THREADS=1: every node shares this host's cores; torch's default (all of them) oversubscribes.
        offline = {"image": self.image, "volumes": [f"{d}:{d}:ro" for d in python_mounts()]} if self.image else {}
        override = {"services": {n: {**offline, "environment": {"OMP_NUM_THREADS": "1", **self.node_env}}
                                 for n in self.nodes}}
        self.override = self.work_dir / f"{self.name}.override.yaml"
        self.override.write_text(json.dumps(override, indent=2))  # JSON is YAML

    def compose_argv(self, *args: str) -> list[str]:
        return [*self.engine.compose, "-p", self.name, "-f", str(COMPOSE_FILE), "-f", str(self.override), *args]

    def compose(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        return _run(self.compose_argv(*args), timeout=timeout, check=check, env={**os.environ, **self.env}, cwd=REPO)

    def containers(self) -> dict[str, dict]:
        """``docker inspect`` of each node's container that exists now, by service (one call for all)."""
        ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}").stdout.split()
        found: dict[str, dict] = {}
        for info in json.loads(docker("inspect", *ids, check=False).stdout or "[]") if ids else []:
            service = info["Config"]["Labels"].get("com.docker.compose.service", "")
            assert service not in found, f"{service}: two containers ({found[service]['Id'][:12]}, {info['Id'][:12]})"
            found[service] = info
        return found

    def container(self, service: str) -> str:
        info = self.containers().get(service)
        assert info is not None, f"{service} has no container"
        return info["Id"]

    def state(self, service: str) -> dict:
        return json.loads(docker("inspect", "-f", "{{json .State}}", self.container(service)).stdout)

    def logs(self, service: str, tail: int | None = None) -> str:
        info = self.containers().get(service)
        if info is None:
            return f"({service} has no container)"
        out = docker("logs", *(["--tail", str(tail)] if tail else []), info["Id"], check=False)
        return out.stdout + out.stderr

    def wait_for(self, what: str, done: Callable[[dict[str, dict]], bool], nodes: list[str] | None = None,
                 exits: str = "fail", quiet_s: float = QUIET_S, cap_s: float = CAP_S) -> dict[str, dict]:
        """Poll the nodes until ``done(containers)`` (``containers()``: inspect output by service); those then.

        Waited for while the watched ``nodes`` (default: all) progress (a log that grows, a state or health that
        changes, a healthcheck still 'starting'), up to ``quiet_s`` without any progress and ``cap_s`` in all.
        NodeFailed at once, with its last lines, when a watched node exits: ``exits`` says which exits are
        expected instead ("fail": none, "zero": exit code 0, "any": every one). (An unhealthy node0 is not one:
        its healthcheck fails too once the job is over and its store closed; compose's `up` reports the
        unhealthy start, see ``up``.)
        """
        nodes = nodes or self.nodes
        start = last_progress = time.monotonic()
        seen: dict[str, tuple] = {}
        while True:
            found = self.containers()
            if done(found):
                return found
            now = time.monotonic()
            for node in nodes:
                info = found.get(node)
                if info is None:
                    continue  # not created yet: compose creates it once its dependency is healthy
                state = info["State"]
                health = (state.get("Health") or {}).get("Status")
                exited = state["Status"] in ("exited", "dead")
                expected = exits == "any" or (exits == "zero" and state["ExitCode"] == 0)
                if exited and not expected:
                    raise NodeFailed(f"{node} exited {state['ExitCode']} while waiting for {what}:\n"
                                     f"{self._report(node, info)}")
                try:
                    size = os.stat(info["LogPath"]).st_size
                except (OSError, KeyError, TypeError):  # not this user's to read: the state alone then
                    size = None
                mark = (state["Status"], health, size)
                if mark != seen.get(node) or health == "starting":
                    seen[node], last_progress = mark, now
            if now - last_progress > quiet_s or now - start > cap_s:
                why = (f"no node progressed for {now - last_progress:.0f} s" if now - last_progress > quiet_s
                       else f"still not after {cap_s:.0f} s, although they progressed")
                raise NodeFailed(f"waiting for {what}: {why}\n" +
                                 "\n".join(self._report(n, found[n]) for n in nodes if n in found))
            time.sleep(1)  # polling the containers' states: compose offers no event to block on for all of this

    def _report(self, node: str, info: dict) -> str:
        state = info["State"]
        health = state.get("Health") or {}
        probe = (health.get("Log") or [{}])[-1].get("Output") or ""
        said = f" (its last healthcheck said: {probe.strip()[-300:]})" if health.get("Status") not in (None,
                                                                                                        "healthy") else ""
        return f"--- {node}: {state['Status']}, health {health.get('Status', '-')}{said}; its last lines:\n" \
               f"{self.logs(node, tail=40)[-3000:]}"

    def up(self) -> None:
        """``up -d``: node0 first, the others once its healthcheck passes (depends_on: service_healthy).

        Waited for while node0 is starting or alive; NodeFailed at once when it exits, or when compose gives up
        on it (unhealthy: no probe connected within the healthcheck's start_period and retries).
        """
        log = self.work_dir / f"{self.name}.up.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.compose_argv("up", "-d", "--no-build"), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **self.env}, cwd=REPO)
        try:
            self.wait_for("docker-compose up -d (node0's healthcheck)", lambda _: proc.poll() is not None,
                          nodes=[self.nodes[0]])
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode != 0:
            found = self.containers()
            raise NodeFailed(f"docker-compose up failed (exit {proc.returncode}): "
                             f"{log.read_text(errors='replace').strip()[-800:]}\n" +
                             "\n".join(self._report(n, found[n]) for n in self.nodes if n in found))

    def finish(self) -> dict[str, tuple[int | None, str]]:
        """Every node's exit code (None: still running) and log, once all have stopped or one has failed.

        A failed node ends the wait: the others may wait minutes for it (torchrun's exit barrier).
        """
        def over(found: dict[str, dict]) -> bool:
            states = [found[n]["State"] for n in self.nodes if n in found]
            stopped = [s for s in states if s["Status"] in ("exited", "dead")]
            return len(stopped) == len(self.nodes) or any(s["ExitCode"] for s in stopped)

        found = self.wait_for("every node to finish", over, exits="zero")
        return {node: (None if found[node]["State"]["Status"] not in ("exited", "dead")
                       else found[node]["State"]["ExitCode"], self.logs(node)) for node in self.nodes}

    def down(self, volumes: bool = True, step_s: float = DOWN_STEP_S, cap_s: float = DOWN_CAP_S) -> list[str]:
        """``down --remove-orphans`` (``-v``: the checkpoint volume too), retried until nothing of it is left.

        What compose leaves (a step that timed out, an engine too busy to answer) is removed one by one, and the
        whole tried again, each round's steps given twice the time of the last (from ``step_s``), for up to
        ``cap_s``. Returns what is still there then (an empty list: nothing).
        """
        deadline = time.monotonic() + cap_s
        while True:
            for step in (lambda: self.compose("down", "--remove-orphans", "-t", "5", *(["-v"] if volumes else []),
                                              timeout=step_s, check=False),
                         lambda: self._remove(self._left(volumes, step_s), step_s)):
                try:
                    step()
                except subprocess.TimeoutExpired:
                    pass  # the next step, or the next round, removes what this one did not
            try:
                left = self._left(volumes, max(step_s, 60))
            except subprocess.TimeoutExpired:
                left = ["(the engine did not answer `docker ps` within a minute)"]
            if not left or time.monotonic() > deadline:
                return left
            step_s = min(2 * step_s, DOWN_CAP_S / 2)

    def _left(self, volumes: bool, timeout: float) -> list[str]:
        return [item for item in leftovers(self.name, timeout) if volumes or not item.startswith("volume ")]

    @staticmethod
    def _remove(items: list[str], step_s: float) -> None:
        for kind in ("container", "network", "volume"):  # containers first: a network or volume in use stays
            ids = [item.split()[1] for item in items if item.startswith(kind + " ")]
            if ids:
                argv = {"container": ["rm", "-f", "-v"], "network": ["network", "rm"], "volume": ["volume", "rm", "-f"]}
                docker(*argv[kind], *ids, timeout=step_s, check=False)

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project that still exist."""
        return leftovers(self.name)

    def run_job(self) -> int:
        """``up`` attached (the nodes' output streams to this terminal); the job's exit code.

        0 when every node exited 0; else the code of the node that failed first, the others stopped at that
        point (they would wait for it); 130 on Ctrl-C. Plain `docker-compose up` returns 0 in every case.
        """
        proc = subprocess.Popen(self.compose_argv("up", "--no-build"), env={**os.environ, **self.env}, cwd=REPO)
        failed = None
        try:
            while proc.poll() is None:
                found = self.containers()
                failed = failed or next((n for n in self.nodes if n in found
                                         and found[n]["State"]["Status"] in ("exited", "dead")
                                         and found[n]["State"]["ExitCode"] != 0), None)
                if failed:
                    print(f"distlab.compose: {failed} failed: stopping the other nodes", file=sys.stderr, flush=True)
                    self.compose("stop", "-t", "10", timeout=DOWN_STEP_S, check=False)
                    break
                time.sleep(1)  # polling the nodes' states: compose's attached `up` reports no exit codes
            try:
                proc.wait(timeout=DOWN_STEP_S)  # it returns once the nodes it attached to have stopped
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        except KeyboardInterrupt:  # compose got the Ctrl-C too, and stops the nodes
            proc.wait()
            return 130
        found = self.containers()
        codes = {n: found[n]["State"]["ExitCode"] if n in found and found[n]["State"]["Status"] in ("exited", "dead")
                 else None for n in self.nodes}
        bad = sorted((n for n, c in codes.items() if c != 0),
                     key=lambda n: found[n]["State"]["FinishedAt"] if n in found else "~")
        if not bad and proc.returncode == 0:
            print(f"distlab.compose: the job succeeded on {len(self.nodes)} nodes", file=sys.stderr, flush=True)
            return 0
        first = bad[0] if bad else None
        code = (codes[first] or 1) if first else proc.returncode
        print(f"distlab.compose: the job failed (exit {code}): " +
              ", ".join(f"{n} {'never ran' if c is None else f'exited {c}'}" for n, c in codes.items()) +
              (f"; {first} first" if first else f"; docker-compose up exited {proc.returncode}"),
              file=sys.stderr, flush=True)
        return code


# --------------------------------------------------------------------------- the operator's commands
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.compose", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    image = sub.add_parser("image", help="build the offline image (a debootstrapped Debian base, cached; root)")
    image.add_argument("--tag", default=OFFLINE_TAG, help=f"the image's tag (default {OFFLINE_TAG})")
    up = sub.add_parser("up", help="docker-compose.yaml's nodes on the offline image, attached; exits with the job's "
                                   "code (RUN_MODE, NPROC, RUN_ARGS, MAX_RESTARTS as for docker-compose)")
    up.add_argument("--tag", default=OFFLINE_TAG, help=f"the image to run (default {OFFLINE_TAG})")
    up.add_argument("--no-build", action="store_true", help="run the image as it is (default: build it first)")
    up.add_argument("--online", action="store_true",
                    help="the Dockerfile's own image (distlab:cpu: python:3.11-slim and pip, from the internet) "
                         "instead of the offline one")
    up.add_argument("--project", default="distlab", help="compose project name (default distlab)")
    up.add_argument("--remove-volumes", action="store_true",
                    help="at the end, remove the checkpoint volume too (default: keep it, for a resume)")
    up.add_argument("--keep", action="store_true", help="leave the stopped containers for inspection (no down)")
    args = parser.parse_args(argv)
    online = args.command == "up" and args.online
    try:
        engine = connect_engine()
        if online and not args.no_build:
            if subprocess.run([*engine.compose, "-p", args.project, "-f", str(COMPOSE_FILE), "build"],
                              cwd=REPO).returncode != 0:
                print("distlab.compose: docker-compose build failed (offline? then: python -m distlab.compose image, "
                      "and up without --online)", file=sys.stderr)
                return 1
        elif args.command == "image" or not args.no_build:
            print(f"distlab.compose: building {args.tag} (offline: {REPO / 'Dockerfile'} without its RUN steps)",
                  file=sys.stderr, flush=True)
            offline_image(args.tag)
            if args.command == "image":
                print(f"distlab.compose: built {args.tag}; run the cluster with: python -m distlab.compose up "
                      f"--no-build{'' if args.tag == OFFLINE_TAG else f' --tag {args.tag}'}", file=sys.stderr)
                return 0
    except EngineUnavailable as exc:  # exit 2: nothing can be done here (the cluster tier skips on it)
        print(f"distlab.compose: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a build that failed
        print(f"distlab.compose: {exc}", file=sys.stderr)
        return 1
    code = 1
    with tempfile.TemporaryDirectory(prefix="distlab-compose-") as work:
        cluster = Cluster(engine, None if online else args.tag, Path(work), name=args.project)
        try:
            code = cluster.run_job()
        finally:
            if not args.keep:  # even after a failure or Ctrl-C: nothing of the project is left running
                left = cluster.down(volumes=args.remove_volumes)
                if left:
                    print(f"distlab.compose: still there after down: {left}", file=sys.stderr)
                    code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
