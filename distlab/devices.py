"""Where a script's tensors go and which backend moves them; a free port, the loopback interface.

``resolve_device`` and ``resolve_backend`` are what ``distlab.launch.init_from_env`` uses under
torchrun (and ``distlab.spawn.run_distributed`` for its ranks): CUDA with NCCL where every local
rank has a GPU, the CPU with gloo otherwise, or what ``DISTLAB_DEVICE`` says.
"""
from __future__ import annotations

import os
import socket

import torch

def loopback_interface() -> str | None:
    """Name of the loopback interface ("lo" on Linux, "lo0" on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


DEVICE_ENV = "DISTLAB_DEVICE"  # "cpu" or "cuda": where init_from_env puts a script's tensors


def resolve_device(local_rank: int, local_world_size: int) -> torch.device:
    """The device a script's model, batches and communicated tensors go to.

    ``DISTLAB_DEVICE`` decides when set ("cpu", or "cuda" for ``cuda:local_rank``);
    otherwise ``cuda:local_rank`` when every local rank has a GPU, else the CPU.
    """
    name = os.environ.get(DEVICE_ENV, "").strip().lower()
    if not name:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name = "cuda" if gpus >= local_world_size else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={name!r}: expected 'cpu' or 'cuda' (unset: cuda when every local rank "
                         f"has a GPU)")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device("cpu")


def resolve_backend(backend: str, world_size: int, device: torch.device | None = None) -> str:
    """The process-group backend for tensors on ``device``; "auto" never gives NCCL for CPU tensors.

    "auto" is "cpu:gloo,cuda:nccl" when ``device`` is a CUDA device (NCCL moves the CUDA
    tensors; gloo beside it keeps CPU-side control messages working: object collectives,
    ``monitored_barrier``), and "gloo" otherwise, including without a device:
    ``run_distributed``'s workers keep their tensors on the CPU unless a test asks for
    a backend. Any other name is returned as given.
    """
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if device is not None and device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for torchrun rendezvous in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
