# Generated from solutions/phase2_advanced/activation_checkpointing.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Activation checkpointing: keep a block's input, recompute its insides during backward.

Backward needs what forward computed: a Linear keeps its input, GELU its input,
attention its q, k, v and output, LayerNorm its input and statistics. For a
transformer block that is ~20x the size of the block's input, for every block, held
from forward until backward reaches it. Checkpointing a block keeps only its input
(B*T*C values); backward reruns the block's forward (under grad this time), then
backpropagates through that fresh graph. Memory: n_layer inputs + one block's
insides at a time, instead of n_layer blocks' insides. Compute: one extra forward
per checkpointed block (~+33% of a step: backward costs ~2 forwards).

Dropout draws random numbers: the recomputation must draw the *same* ones, so
the checkpoint saves the RNG state before the block's forward and restores it
before the recomputation (and leaves the caller's RNG where it was). Autocast is
restored too: backward runs outside the forward's ``torch.autocast`` context.

No communication: checkpointing is per rank and composes with every parallelism
in this course. See phase2_advanced/guidelines.md#activation-checkpointing
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

Run the demo: ``RUN_MODE=activation_checkpointing ./entrypoint.sh`` (TinyGPT, with and without;
``IMPL=templates`` runs your template).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from distlab.todo import todo


class CheckpointFunction(torch.autograd.Function):
    """``run_function(*args)`` that saves only ``args`` and recomputes the rest in backward.

    ``args`` are tensors; at least one must require grad (or backward never reaches
    this node). Parameters used inside ``run_function`` get their gradients from the
    recomputed graph's own backward, accumulated into ``.grad`` as usual.
    """

    @staticmethod
    def forward(ctx, run_function: Callable, preserve_rng_state: bool, *args: torch.Tensor):
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        device_type = args[0].device.type
        ctx.autocast = dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                            dtype=torch.get_autocast_dtype(device_type))
        # --- TODO 2.6: checkpoint forward ---
        # Goal: keep only the inputs `args` for backward (nothing from inside the block),
        # remember the RNG state(s) when preserve_rng_state so that the recomputation can
        # replay dropout, and return run_function(*args) computed without building a graph.
        raise todo("2.6 checkpoint forward", "guidelines.md#activation-checkpointing")
        # --- end TODO 2.6 ---

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        # Fresh leaves: the recomputed graph must end here, not run on into the
        # graph before the block (that part is the outer backward's job).
        inputs = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]  # noqa: F841 (inputs: for TODO 2.7)
        # --- TODO 2.7: checkpoint backward ---
        # Goal: rerun the block on `inputs` with the forward's random numbers and autocast
        # state (and leave the caller's RNG as it was afterwards), backpropagate grad_outputs
        # through that fresh graph, and return one gradient per forward argument: None for
        # run_function and preserve_rng_state, then each input's (None if it needs none).
        raise todo("2.7 checkpoint backward", "guidelines.md#activation-checkpointing")
        # --- end TODO 2.7 ---


def checkpoint(function: Callable, *args: torch.Tensor, preserve_rng_state: bool = True) -> Any:
    """``function(*args)``, keeping only ``args`` for backward.

    Equivalent to: ``function(*args)`` (same outputs, same gradients; with
        ``preserve_rng_state`` also with dropout), and to
        ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)``.
    Cost: no communication; one extra forward of ``function`` during backward.
    """
    return CheckpointFunction.apply(function, preserve_rng_state, *args)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], every: int = 1,
                                   preserve_rng_state: bool = True) -> int:
    """Checkpoint every ``every``-th block (0, every, 2*every, ...) in place; returns how many.

    The block's ``forward`` is replaced on the instance, so parameter names and
    ``state_dict`` keys do not change (a checkpoint file loads either way).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    count = 0
    for i, block in enumerate(blocks):
        if i % every == 0:
            block.forward = functools.partial(checkpoint, block.forward, preserve_rng_state=preserve_rng_state)
            count += 1
    return count


class SavedActivationMeter:
    """Bytes of the tensors autograd saves for backward while active (parameters excluded).

    Deterministic on CPU and GPU alike: it counts what the graph holds, not what an
    allocator happens to reserve. Views of one storage count once.

        with SavedActivationMeter(model.parameters()) as meter:
            loss = model(x).sum()
        meter.bytes  # held from here until backward frees them
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._excluded and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

