"""Resume from the newest checkpoint that *loads*, and every rank from the same one.

A checkpoint can verify (its checksum matches) and still be unusable: a forged file that
``torch.load(weights_only=True)`` refuses, another model's checkpoint (a size mismatch in
``load_state_dict``), one written by a world size the loader cannot reshard. ``restore``
tries the checkpoints a manager yields, newest first, and moves on after a failure with one
warning; only a run with nothing loadable starts fresh, and says so. The ranks agree on
every try, so a failure on one rank (its own file refused) moves all of them.

Used by ``CheckpointManager.restore`` (phase4_production/checkpoint.py); see
phase4_production/guidelines.md#crash-safe-checkpoints. Tests: tests/test_checkpoint_fallback.py.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

# What loading a checkpoint that does not fit raises: CheckpointError (a ValueError), a missing
# key, a ValueError of a loader, load_state_dict's RuntimeError. Anything else is a bug: it propagates.
LOAD_ERRORS = (KeyError, ValueError, RuntimeError)


def restore(manager: Any, apply: Callable[[Any], Any], group: dist.ProcessGroup | None = None) -> Any | None:
    """Call ``apply`` on the newest checkpoint of ``manager`` it accepts; return that checkpoint, or None.

    Args:
        manager: yields good checkpoints newest first (``checkpoints()``), lists its step
            directories (``_published()``) and has a ``directory``.
        apply: loads a checkpoint into *freshly built* training state; raises one of
            ``LOAD_ERRORS`` when it cannot (it must leave nothing half-loaded behind).

    A failed checkpoint costs one warning per rank naming the directory and the reason (a rank
    that did not fail itself names the ranks that did). When none is left: one warning that
    the run starts fresh, unless the directory held no checkpoint at all.

    Collective: every rank of ``group`` calls it; one all-reduce of W + 2 integers per checkpoint
    tried. Ranks that see different checkpoints get a ``RuntimeError``, not a hang.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    candidates = iter(manager.checkpoints())
    while True:
        found, error = next(candidates, None), None
        if found is not None:
            try:
                apply(found)
            except NotImplementedError:  # a learner's unfinished TODO (a RuntimeError): say so, not "cannot load"
                raise
            except LOAD_ERRORS as exc:
                error = exc
        failed = _agree(found.step if found is not None else -1, error is not None, rank, group, manager.directory)
        if found is None:
            if manager._published():
                warnings.warn(f"no loadable checkpoint in {manager.directory} (every one was skipped): "
                              "starting fresh from step 0", stacklevel=3)
            return None
        if not failed:
            return found
        reason = (" ".join(f"{type(error).__name__}: {error}".split()) if error is not None
                  else f"rank(s) {', '.join(map(str, failed))} could not load it")
        warnings.warn(f"cannot resume from {found.path}: {reason}; falling back to an older checkpoint",
                      stacklevel=3)


def _agree(step: int, failed: bool, rank: int, group: dist.ProcessGroup | None, directory: Any) -> list[int]:
    """The ranks of ``group`` for which the checkpoint of ``step`` failed: the same list on every rank."""
    if not dist.is_initialized():
        return [rank] if failed else []
    world_size = dist.get_world_size(group)
    votes = torch.zeros(world_size + 2, dtype=torch.int64)
    votes[rank], votes[-2], votes[-1] = int(failed), step, -step
    if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        votes = votes.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    votes = votes.cpu()
    if int(votes[-2]) != -int(votes[-1]):
        raise RuntimeError(f"{directory}: ranks would resume from different steps ({-int(votes[-1])} to "
                           f"{int(votes[-2])}; -1 is none): every rank must see the same checkpoint directory")
    return [r for r in range(world_size) if votes[r]]
