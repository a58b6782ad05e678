"""A warm launcher for ``check``: torch, pytest and the ranks' forkserver stay loaded between checks.

A check's fixed cost is starting Python with torch and pytest (~2 s) and the forkserver that
starts its ranks importing torch and the bench again (~2 s) before the first test runs. With
``check --warm`` (and in ``watch``) a server started by the first check keeps both: it has imported
torch and pytest and started the forkserver, but never runs a tensor op, so it can fork. Each check
is a child forked from it that runs pytest on the learner's files as they are now (test modules
and templates are imported in the child, fresh every time) and starts its ranks from the server's
forkserver. The server listens on ``.distlab/warm.sock`` in the checkout, ends after
``IDLE_S`` seconds without a check, when ``stop`` asks, or when the bench it loaded changes
(a ``git pull``: the next check starts a new one).

    python -m distlab check 1.6-1.8 --warm       # starts the server if none answers
    python -m distlab warm --stop                # ends it
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

from distlab.deadlines import TIMEOUT_SCALE_ENV, timeout_scale

IDLE_S = 600.0  # a server nobody asked for 10 minutes ends
REQUEST_S = 10.0  # a request is one short line, sent at once
START_TIMEOUT_S = 60.0  # importing torch and pytest and starting the forkserver: ~4 s idle, far more at high load


class NotStarted(RuntimeError):
    """The warm launcher did not answer in time: the cockpit says so in one line."""


def start_timeout_s() -> float:
    return START_TIMEOUT_S * timeout_scale()  # ValueError: the setting, in one line


def socket_path(root: Path) -> Path:
    return root / ".distlab" / "warm.sock"


def _bench_stamp() -> float:
    """The newest modification time of the bench's files: a server older than them is stale."""
    bench = Path(__file__).resolve().parents[1]
    return max(p.stat().st_mtime for p in bench.rglob("*.py"))


def _request(path: Path, message: dict, timeout_s: float | None) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        s.sendall(json.dumps(message).encode() + b"\n")
        with s.makefile("rb") as answer:  # one line of JSON back
            data = answer.readline()
    if not data.endswith(b"\n"):
        raise ConnectionError("the warm launcher closed the connection without an answer")
    return json.loads(data)


def _answers(path: Path) -> bool:
    try:
        return _request(path, {"op": "ping"}, 5.0).get("stamp") == _bench_stamp()
    except (OSError, ValueError, ConnectionError):
        return False


def ensure_server(root: Path, repo: Path) -> Path:
    """The socket of a server for this checkout whose bench is current; started here if none answers."""
    path = socket_path(root)
    if _answers(path):
        return path
    stop(root)  # a stale one (the bench changed) or a dead socket file
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "warm.log", "ab") as log:
        # Its own session: the server outlives this check (that is the point) but not IDLE_S of silence.
        # It says "ready" on its stdout once it listens, and closes it.
        proc = subprocess.Popen([sys.executable, "-m", "distlab.cockpit.warm", "--serve", str(path), str(repo)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, cwd=repo)
    timeout_s = start_timeout_s()
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()
    if line.strip() != b"ready" or not _answers(path):
        if proc.poll() is None:  # still importing: it would linger until its first idle timeout
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        path.unlink(missing_ok=True)
        raise NotStarted(f"the warm launcher did not start within {timeout_s:.0f} s (a busy machine?; its log: "
                         f"{path.parent / 'warm.log'}): check without --warm, or set {TIMEOUT_SCALE_ENV}=3 to wait longer")
    return path


def run(root: Path, repo: Path, cmd: list[str], env: dict, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """``cmd`` (``python -m pytest ...``) run by the warm server: a CompletedProcess, as subprocess.run gives."""
    path = ensure_server(root, repo)
    out = path.parent / f"warm.{os.getpid()}"
    try:
        answer = _request(path, {"op": "pytest", "args": cmd[cmd.index("pytest") + 1:], "env": env, "cwd": str(cwd),
                                 "stdout": f"{out}.out", "stderr": f"{out}.err", "timeout_s": timeout_s},
                          timeout_s + 30)
        stdout, stderr = Path(f"{out}.out").read_text(), Path(f"{out}.err").read_text()
    finally:
        for suffix in (".out", ".err"):
            Path(f"{out}{suffix}").unlink(missing_ok=True)
    return subprocess.CompletedProcess(cmd, answer["returncode"], stdout, stderr)


def stop(root: Path) -> bool:
    """End this checkout's server, if one answers, and wait until it (and its forkserver) has; True if one did."""
    path = socket_path(root)
    try:
        pid = _request(path, {"op": "stop"}, 10.0)["pid"]
    except (OSError, ValueError, ConnectionError, KeyError):
        path.unlink(missing_ok=True)
        return False
    try:
        gone = os.pidfd_open(pid)  # readable once the server has exited
    except ProcessLookupError:
        return True
    try:
        select.select([gone], [], [], 30.0)
    finally:
        os.close(gone)
    return True


# --------------------------------------------------------------------------- the server
def _check_in_child(request: dict) -> int:
    """In a child forked from the server: run pytest as the request says; its exit code."""
    import multiprocessing.forkserver as forkserver

    import pytest

    # The server's forkserver is running and this child inherited its address and "alive" pipe; it is
    # not this child's child, so the liveness check (waitpid) would fail here: the server keeps it alive.
    forkserver._forkserver.ensure_running = lambda: None
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["pytest", *request["args"]]
    code = pytest.main(request["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code)


def serve_checks(path: Path, repo: Path) -> None:
    import multiprocessing.forkserver as forkserver

    import pytest  # noqa: F401 (imported once here, so that no check imports it again)

    # Ranks unpickle a test's worker by its module name: the forkserver (which they fork from)
    # must find tests/ and the checkout as pytest's own process does.
    sys.path[:0] = [str(repo / "tests"), str(repo)]
    from distlab import spawn

    spawn._context()
    forkserver.ensure_running()
    stamp = _bench_stamp()
    path.unlink(missing_ok=True)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(path))
            os.chmod(path, 0o600)
            server.listen()
            server.settimeout(IDLE_S)
            print("ready", flush=True)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # the starter reads one line; nothing more goes there
            answer_checks(server, stamp, _pytest_in_child)
    finally:
        path.unlink(missing_ok=True)  # no stale socket for the next check to find


def answer_checks(server: socket.socket, stamp: float, run_pytest) -> None:
    """Answer connections until IDLE_S of silence or a stop. A client that goes away (Ctrl-C of its check:
    BrokenPipeError on the answer), an empty connection or a garbled request costs that connection only."""
    while True:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            return  # idle for IDLE_S: end, taking the forkserver with us
        with conn:
            conn.settimeout(REQUEST_S)  # a client that connects and says nothing does not stall the server
            try:
                request = json.loads(conn.makefile().readline())
                op = request["op"]
            except (ValueError, KeyError, TypeError, OSError):
                continue  # not a request (a probe, a client killed mid-write): nothing to answer
            if op == "stop":
                _answer(conn, {"pid": os.getpid()})
                return
            if op == "ping":
                answer = {"stamp": stamp, "pid": os.getpid()}
            elif op == "pytest":
                answer = {"returncode": run_pytest(request)}
            else:
                answer = {"error": f"unknown op {op!r}"}
            _answer(conn, answer)


def _answer(conn: socket.socket, answer: dict) -> None:
    try:
        conn.sendall(json.dumps(answer).encode() + b"\n")
    except OSError:  # BrokenPipeError, ConnectionResetError: the client is gone (its check was stopped)
        pass


def _pytest_in_child(request: dict) -> int:
    """Run the request's pytest in a child forked from the server, within its deadline; the exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            code = _check_in_child(request)
        except BaseException:
            code = 4
        os._exit(code)
    exited = os.pidfd_open(pid)  # readable when the child ends: a blocking wait with a timeout
    try:
        ended, _, _ = select.select([exited], [], [], float(request.get("timeout_s", 600)))
    finally:
        os.close(exited)
    if not ended:  # the check's own deadline: its pytest and every rank it started go
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if ended else 124

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve_checks(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m distlab.cockpit.warm --serve SOCKET REPO (started by check --warm)")
