"""The offline image: a debootstrapped Debian base (cached) and the project's Dockerfile without its RUN steps.

What ``python -m distlab.compose image`` builds, for a machine that cannot reach Docker Hub or the
PyTorch wheel index: every node mounts this machine's Python environment read-only instead
(``python_mounts``). The course's code imports these names from ``distlab.compose``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from distlab.compose_engine import REPO, EngineUnavailable, _run, docker

OFFLINE_TAG = "distlab:cpu-offline"  # not the compose file's distlab:cpu: this one needs the mounted Python

# What the mounted Python environment links against beyond Debian's minimal base (sqlite3, readline,
# curses, expat for the standard library; libgomp for torch's OpenMP), plus the tools a node's
# scripts call (hostname -I, getent, ps, ip).
BASE_PACKAGES = ("ca-certificates", "hostname", "procps", "iproute2", "libsqlite3-0", "libreadline8",
                 "libncursesw6", "libexpat1", "libbz2-1.0", "liblzma5", "libffi8", "libssl3", "zlib1g",
                 "libgomp1")
BASE_FORMAT = 1  # bump when the way the base is made changes, so cached bases are rebuilt


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
