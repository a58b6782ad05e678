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
The engine is in ``distlab.compose_engine``, the offline image in ``distlab.compose_image`` and the
cluster in ``distlab.compose_cluster``; their names are importable from here.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# Re-exported: `from distlab.compose import Cluster, docker, ...` (tests, benchmarks).
from distlab.compose_cluster import CAP_S, DOWN_CAP_S, DOWN_STEP_S, QUIET_S, Cluster, leftovers  # noqa: F401
from distlab.compose_engine import (  # noqa: F401
    COMPOSE_FILE, REPO, Engine, EngineUnavailable, NodeFailed, connect_engine, docker, start_engine)
from distlab.compose_image import (  # noqa: F401
    BASE_FORMAT, BASE_PACKAGES, OFFLINE_TAG, base_image, build_image, offline_dockerfile, offline_image,
    python_mounts)


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
