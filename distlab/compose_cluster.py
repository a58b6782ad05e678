"""The compose cluster: docker-compose.yaml under a project name of its own, waited on, taken down.

``Cluster`` runs the project's compose file (with the offline image and this Python mounted, or
the file's own image), waits on its nodes while they progress, returns the job's exit code
(``run_job``) and retries ``down`` until nothing of the project is left. The course's code
imports these names from ``distlab.compose``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distlab.compose_engine import COMPOSE_FILE, REPO, Engine, NodeFailed, _run, docker
from distlab.compose_image import python_mounts

# Waiting on nodes. A node that is alive is waited for while it makes progress: its log grows, its state
# or health changes, or its healthcheck is still 'starting' (torch's import alone took over a minute at
# load 15 on 2 cores). QUIET_S: how long every watched node may stay silent; CAP_S: the hard cap of one wait.
QUIET_S = 420.0
CAP_S = 1500.0
# One step of cleanup (a `compose down`, a `docker rm`) may hang on a loaded engine; the loop around it
# retries until nothing is left or DOWN_CAP_S has passed.
DOWN_STEP_S = 180.0
DOWN_CAP_S = 900.0


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
