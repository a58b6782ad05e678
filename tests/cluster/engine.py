"""A Docker engine, an image built without the internet, and the project's compose file brought up for real.

The public base image (python:3.11-slim) and the PyTorch wheel index cannot be fetched where
the course's CI runs; Debian's package mirrors can. So the tier builds what it needs itself:

1. the engine: ``docker info`` answers, or (as root) this module starts ``dockerd`` and stops it
   at the end; where neither works the tier skips, saying why;
2. a base image: a minimal Debian root file system made by ``debootstrap`` and ``docker import``ed,
   tagged by the hash of what went into it (built once per engine, then reused);
3. the course's image: the project's own Dockerfile with its ``FROM`` pointed at that base and its
   ``RUN`` steps (pip from the network) left out, and ``PATH`` leading to this machine's Python
   environment, which every container mounts read-only at the same path; tagged per run and
   removed with it;
4. a cluster: ``docker-compose.yaml`` itself plus an override file that names that image and adds
   the mounts, under a project name of its own; ``down -v --remove-orphans`` ends it, and
   ``leftovers()`` checks that nothing of it remains.

Nothing here listens on a port of the host: the nodes talk on the compose project's bridge network.
"""
from __future__ import annotations

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

from distlab.procs import die_with_parent

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yaml"
ENABLE_ENV = "DISTLAB_CLUSTER"  # =1: run the cluster tier (it builds images and starts containers)

# What the mounted Python environment links against beyond Debian's minimal base (sqlite3, readline,
# curses, expat for the standard library; libgomp for torch's OpenMP), plus the tools a node's
# scripts call (hostname -I, getent, ps, ip).
BASE_PACKAGES = ("ca-certificates", "hostname", "procps", "iproute2", "libsqlite3-0", "libreadline8",
                 "libncursesw6", "libexpat1", "libbz2-1.0", "liblzma5", "libffi8", "libssl3", "zlib1g",
                 "libgomp1")
BASE_FORMAT = 1  # bump when the way the base is made changes, so cached bases are rebuilt


class EngineUnavailable(Exception):
    """No Docker engine can be used here; the message says why (the tier skips with it)."""


def _run(argv: list[str], timeout: float, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
    return out


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["docker", *args], timeout=timeout, check=check)


def _engine_answers() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


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
            self.dockerd.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()
        self.dockerd = None


def _start_dockerd(log: Path, extra: list[str]) -> subprocess.Popen:
    with open(log, "ab") as f:
        # SIGTERM when this process dies, even by SIGKILL (pytest-timeout, CI's limit): the daemon ends with the tier.
        proc = subprocess.Popen(["dockerd", *extra], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if _engine_answers():
            return proc
        time.sleep(1)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    raise EngineUnavailable(f"dockerd {' '.join(extra)} did not start within 60 s: {' | '.join(tail)}")


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
        if _run(["docker", "compose", "version"], timeout=30, check=False).returncode == 0:
            engine.compose = ["docker", "compose"]
        elif shutil.which("docker-compose"):
            engine.compose = ["docker-compose"]
        else:
            raise EngineUnavailable("no compose: apt-get install docker-compose (or the docker compose plugin)")
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
    if docker("image", "inspect", tag, timeout=30, check=False).returncode == 0:
        return tag
    if shutil.which("debootstrap") is None:
        raise EngineUnavailable("no base image cached and debootstrap is not installed: apt-get install debootstrap")
    rootfs = Path(tempfile.mkdtemp(prefix="distlab-rootfs-", dir=work_dir))
    try:
        out = _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", suite, str(rootfs),
                    mirror], timeout=420, check=False)
        if out.returncode != 0:
            raise EngineUnavailable(f"debootstrap {suite} from {mirror} failed (exit {out.returncode}): "
                                    f"{(out.stdout + out.stderr).strip().splitlines()[-1:]}")
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        _run(["bash", "-o", "pipefail", "-c", f'tar -C "{rootfs}" -c . | docker import -c \'CMD ["bash"]\' - "{tag}"'],
             timeout=180)
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
    _run(["docker", "build", "-q", "-f", str(dockerfile), "-t", tag, str(REPO)], timeout=300,
         env={**os.environ, "DOCKER_BUILDKIT": "0"})  # the classic builder: no buildx plugin needed


# --------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    """The project's docker-compose.yaml under a project name of its own, with the offline image."""

    engine: Engine
    image: str
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # compose's own environment: RUN_MODE, NPROC, RUN_ARGS...
    node_env: dict[str, str] = field(default_factory=dict)  # added to every node's environment
    name: str = field(default_factory=lambda: f"distlab-{os.urandom(4).hex()}")

    def __post_init__(self) -> None:
        import yaml

        nodes = [s for s in yaml.safe_load(COMPOSE_FILE.read_text())["services"] if s.startswith("node")]
        self.nodes = sorted(nodes)
        override = {"services": {n: {"image": self.image,
                                     "volumes": [f"{d}:{d}:ro" for d in python_mounts()],
                                     "environment": {"OMP_NUM_THREADS": "1", **self.node_env}}
                                 for n in self.nodes}}
        self.override = self.work_dir / f"{self.name}.override.yaml"
        self.override.write_text(json.dumps(override, indent=2))  # JSON is YAML

    def compose(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        argv = [*self.engine.compose, "-p", self.name, "-f", str(COMPOSE_FILE), "-f", str(self.override), *args]
        return _run(argv, timeout=timeout, check=check, env={**os.environ, **self.env}, cwd=REPO)

    def container(self, service: str) -> str:
        out = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}",
                     "--filter", f"label=com.docker.compose.service={service}")
        ids = out.stdout.split()
        assert len(ids) == 1, f"{service}: expected one container, found {ids}"
        return ids[0]

    def state(self, service: str) -> dict:
        return json.loads(docker("inspect", "-f", "{{json .State}}", self.container(service)).stdout)

    def logs(self, service: str) -> str:
        out = docker("logs", self.container(service), timeout=60, check=False)
        return out.stdout + out.stderr

    def wait(self, service: str, timeout: float) -> int:
        """The exit code of ``service``'s container once it stops (TimeoutExpired after ``timeout``)."""
        return int(docker("wait", self.container(service), timeout=timeout).stdout.strip())

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=120, check=False)

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        found = []
        for kind, argv in (("container", ["ps", "-aq"]), ("volume", ["volume", "ls", "-q"]),
                           ("network", ["network", "ls", "-q"])):
            found += [f"{kind} {i}" for i in docker(*argv, "--filter", label).stdout.split()]
        return found
