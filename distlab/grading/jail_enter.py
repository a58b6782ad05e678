"""The first process inside a grading jail: it builds the walls, then becomes the learner's side.

Run by distlab/grading/jail.py as ``unshare [--user --map-root-user] --mount --pid --fork --kill-child
--propagation private -- python -I jail_enter.py SPEC``: a new mount namespace (and, for an ordinary
user, a user namespace in which it holds the capabilities to mount) and a new PID namespace, of which
this process is PID 1. Standalone on purpose (the standard library only): it runs before the checkout is
hidden, and nothing of the course is imported here.

In this order, before any learner code exists in the namespace:

1. every mount the namespace inherited becomes read-only (``/proc`` and ``/sys`` keep their own rules);
2. a fresh, empty tmpfs covers ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (what the host wrote there is out of
   sight, and what the jail writes there is gone with it), and a read-only empty tmpfs covers each hidden
   path that is still in sight: the instructor's checkout, the reference cache, the student's own folder,
   the grader's home;
3. the jail's own folder is mounted at ``/tmp/sandbox``: ``copy/`` read-only (the private copy of the bench,
   without the reference), ``out/`` and ``work/`` writable; ``copy/solutions/`` read-only: the reference's
   building blocks without the exercise's own regions (jail.py's ``reference_for``);
4. the interpreter's own folders, where a cover hid them (a venv in /tmp, pyenv under a 0700 /root, whose
   closed folder is covered too), are shown again, read-only, at their own paths;
5. this process forks: the child drops to the jail's identity and runs the command; this one stays PID 1,
   reaps orphans, and exits with the child's status (which ends every process left in the namespace).

The identity: as root, the unprivileged user in SPEC (``setgroups([])``, ``setgid``, ``setuid``: no way
back); as an ordinary user (mapped to root inside its own user namespace) an empty capability bounding set,
so the command runs with no capability at all and cannot unmount what hides the checkout. In both cases
``no_new_privs``: no set-user-ID program can give privileges back.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 16384, 1 << 18, 1 << 21, 1 << 24
_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
          "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG = 24, 38, 1
INSIDE = "/tmp/sandbox"

_libc = ctypes.CDLL(None, use_errno=True)


class WallError(RuntimeError):
    """A wall could not be built: the jail does not start (the grader says so and grades nothing)."""


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise WallError(f"mount {source or fstype} on {target}: {os.strerror(err)}")


def _mounts() -> list[tuple[str, int]]:
    """(mount point, its per-mount flags) of every mount in this namespace, parents first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # "\040" for a space
            flags = 0
            for opt in fields[5].split(","):
                flags |= _FLAGS.get(opt, 0)
            found.append((point, flags))
    return sorted(found, key=lambda m: m[0].count("/"))


def read_only_everywhere() -> None:
    """Every inherited mount read-only (locked flags kept: a user namespace may add ``ro``, not drop others)."""
    for point, flags in _mounts():
        if point.startswith(("/proc", "/sys")) or not os.path.isdir(point):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except WallError:
            if point == "/":
                raise  # without a read-only root the jail could write anywhere its identity can
            # A mount under another one that is read-only already, or one this namespace cannot change
            # (an overlay's lower layer): checked below, where it matters, by writing.


def cover(path: str, mode: int, read_only: bool) -> None:
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o}")  # (a tmpfs's default cap: half the memory)
    if read_only:
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def bind(source_fd: int, target: str, read_only: bool) -> None:
    os.makedirs(target, exist_ok=True)
    _mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND)
    # A bind copies its source mount's flags, read-only included (step 1 made it so): set them here.
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0))


def build(spec: dict) -> None:
    """Steps 1-4 of the module's docstring."""
    # Hold the folders by descriptor now: the covers are about to hide where they live.
    scratch_fd = os.open(spec["scratch"], os.O_PATH | os.O_DIRECTORY)
    copy_fd = os.open(spec["copy"], os.O_PATH | os.O_DIRECTORY)
    reference_fd = os.open(spec["reference"], os.O_PATH | os.O_DIRECTORY)
    kept = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in spec.get("keep", [])]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    read_only_everywhere()
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            cover(path, 0o1777, read_only=False)
    hidden = []
    for path in spec["hide"]:
        if os.path.isdir(path):
            cover(path, 0o755, read_only=False)  # read-only below, once the kept trees have their folders
            hidden.append(path)
        elif os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND)
    for path, fd in kept:  # the interpreter, at its own path, where a cover hid it
        bind(fd, path, read_only=True)
    for path in hidden:
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    bind(scratch_fd, INSIDE, read_only=False)
    bind(copy_fd, f"{INSIDE}/copy", read_only=True)
    bind(reference_fd, f"{INSIDE}/copy/solutions", read_only=True)
    for fd in (scratch_fd, copy_fd, reference_fd, *(fd for _, fd in kept)):
        os.close(fd)


def become(spec: dict) -> None:
    """Step 5's identity, in the child, right before the command."""
    if spec.get("user"):
        uid, gid = spec["user"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)  # real, effective and saved: no way back to root
        if os.getuid() != uid or os.geteuid() != uid:
            raise WallError(f"could not become uid {uid}")
    else:
        for cap in range(64):  # the bounding set: an exec as (namespace) root gets no capability back
            if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() not in (22,):  # EINVAL: no such cap
                raise WallError(f"could not drop capability {cap}: {os.strerror(ctypes.get_errno())}")
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise WallError("could not set no_new_privs")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    try:
        build(spec)
    except (WallError, OSError) as exc:
        print(f"distlab jail: {exc}", file=sys.stderr, flush=True)
        return 97  # jail.py reads this code as "the walls did not go up"
    pid = os.fork()
    if pid == 0:
        try:
            become(spec)
            os.chdir(spec["cwd"])
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as exc:  # noqa: BLE001 - anything here means the command never ran
            print(f"distlab jail: {exc}", file=sys.stderr, flush=True)
            os._exit(97)
    while True:  # PID 1: reap every orphan until the command itself ends
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 1
        if done == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
