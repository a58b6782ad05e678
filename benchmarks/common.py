"""What every benchmark shares: repeated timing, medians, the machine, and the results files.

Every benchmark module ``benchmarks/bench_<topic>.py`` has
``run(quick: bool = False) -> dict`` and a ``main()`` (``python -m benchmarks.bench_<topic>``).
``run`` measures ours and PyTorch's built-in side by side in the same run (timings on
benchmarks/harness.py: rotated contenders, checked results, spread over launches) and returns

    {"name": "<topic>", "machine": machine_info(),
     "comparisons": {"<comparison>": {"ratio": median ours/builtin (time, or bytes),
                                      "metric": "time" | "bytes" | ...,
                                      "world_size": W, "size": "16 MiB" (what was measured at),
                                      "ours": median, "builtin": median, "unit": "s",
                                      "meaning": "what the ratio means", and from the harness:
                                      "spread": {median, q1, q3, min, max, n}, "launch_medians": [...],
                                      "load": {"before_max", "after_max", "cores"}}},
     ...anything else worth keeping (raw samples, bus bandwidths)}

and writes it with ``write_result`` to benchmarks/results/<topic>.json (PNGs beside it).
``python -m benchmarks.run`` runs them all and writes benchmarks/results/summary.json.

Backends: bench_collectives runs on NCCL with cuda tensors when every rank has a GPU
(absolute bus bandwidths then mean something); the training benchmarks (ddp, zero,
pipeline, compression) compare on gloo CPU ranks everywhere, so their ratios are
comparable between machines.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from distlab.metrics import median, time_repeats  # noqa: F401  (re-exported for the benchmarks)

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def comparison(ours: list[float] | float, builtin: list[float] | float, world_size: int, size: str,
               metric: str = "time", unit: str = "s", meaning: str | None = None) -> dict:
    """One entry of ``comparisons``: medians of both sides and their ratio (ours / built-in), no spread.

    Deterministic figures (bytes, accuracy of a seeded run) need nothing more; timings
    should come from benchmarks/harness.py (``ratio_row``: rotated, checked, spread over launches).
    """
    o = median(ours) if isinstance(ours, (list, tuple)) else float(ours)
    b = median(builtin) if isinstance(builtin, (list, tuple)) else float(builtin)
    return {"ratio": o / b if b else float("nan"), "metric": metric, "world_size": world_size,
            "size": size, "ours": o, "builtin": b, "unit": unit,
            "meaning": meaning or f"{metric} of ours / the built-in's"}


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload.setdefault("name", name)
    payload.setdefault("machine", machine_info())
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float))
    return path
