"""The bench's copy of lesson 4.1-4.2's checkpoint file (atomic save, verified load), for the tests of 4.4.

4.4's checkpoint manager is graded alone: its tests give the learner's module these functions in place
of its own 4.1-4.2 (``distlab.testing.given_prerequisites``), so a learner who finished only 4.4 scores
it. Not the reference's: in a grading run the reference is out of the learner's processes' reach
(distlab/grading/jail.py). The format is the module's own (its ``MAGIC`` and ``_HEADER``, given outside
the exercise regions), and a bad file raises the module's own ``CheckpointError``, which its manager
catches. A template may not use this copy for 4.1-4.2 themselves (distlab/grading/isolation.py).
"""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, Callable

import torch

from distlab.lessons import resume


def given(module) -> dict[str, Callable]:
    """``save_file``, ``verify_file`` and ``load_file`` in ``module``'s format, raising its ``CheckpointError``."""
    magic, header, error = module.MAGIC, module._HEADER, module.CheckpointError
    header_bytes = len(magic) + header.size

    def save_file(obj: Any, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = buffer.getvalue()
            with open(tmp, "wb") as f:
                f.write(magic + header.pack(len(payload), hashlib.sha256(payload).digest()) + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            resume.fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def verify_file(path: str | Path) -> bytes:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise error(f"{path}: cannot read it: {exc.strerror or exc}") from None
        if not data.startswith(magic) or len(data) < header_bytes:
            raise error(f"{path}: not a distlab checkpoint, or truncated")
        length, digest = header.unpack_from(data, len(magic))
        payload = data[header_bytes:]
        if len(payload) != length or hashlib.sha256(payload).digest() != digest:
            raise error(f"{path}: truncated, or checksum mismatch")
        return payload

    def load_file(path: str | Path, map_location=None) -> Any:
        payload = verify_file(path)
        try:
            return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - refused by weights_only, or undecodable
            raise error(f"{path}: refused by torch.load(weights_only=True): {exc}") from exc

    return {"save_file": save_file, "verify_file": verify_file, "load_file": load_file}
