"""A Docker engine to talk to: the operator's, or one started here (root only) for the cluster tier.

``connect_engine`` finds the engine that answers (``python -m distlab.compose``); ``start_engine``
starts ``dockerd`` where none does (tests/test_cluster.py). ``docker(...)`` runs the client with a
timeout. The course's code imports these names from ``distlab.compose``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from distlab.procs import stop

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yaml"


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
