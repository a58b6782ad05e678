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

Run: ``RUN_MODE=activation_checkpointing ./entrypoint.sh`` (TinyGPT, with and without).
"""
from __future__ import annotations

import argparse
import functools
import time
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
        # --- TODO 2.6: remember the RNG state, save only the inputs, run without a graph ---
        # * if preserve_rng_state: ctx.cpu_rng_state = torch.get_rng_state();
        #   ctx.cuda_devices = sorted indices of the CUDA devices among args (empty on CPU);
        #   ctx.cuda_rng_states = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices];
        # * ctx.save_for_backward(*args): the only activations this block keeps;
        # * return run_function(*args) computed under torch.no_grad(), so nothing
        #   inside the block is saved for backward.
        raise todo("2.6 checkpoint forward", "guidelines.md#activation-checkpointing")
        # --- end TODO 2.6 ---

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        # Fresh leaves: the recomputed graph must end here, not run on into the
        # graph before the block (that part is the outer backward's job).
        inputs = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        # --- TODO 2.7: recompute the block with the forward's RNG and autocast, then backward ---
        # * inside torch.random.fork_rng(devices=<ctx.cuda_devices, or [] without
        #   preserve_rng_state>, enabled=ctx.preserve_rng_state) (it restores the caller's
        #   RNG on exit): if preserving, torch.set_rng_state(ctx.cpu_rng_state) and
        #   torch.cuda.set_rng_state(state, device) for each saved CUDA state;
        # * then, under torch.enable_grad() and torch.autocast(**ctx.autocast) (backward
        #   runs outside the caller's autocast), outputs = ctx.run_function(*inputs);
        # * make outputs a tuple; torch.autograd.backward(outputs, grad_outputs) (this
        #   fills the parameters' .grad and each input's .grad);
        # * return None for run_function and preserve_rng_state, then the inputs' .grad
        #   (None for inputs that do not require grad).
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


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from distlab.data import synthetic_tokens
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0, progress
    from distlab.models import Block, GPTConfig, TinyGPT
    from distlab.testing import shard

    parser = argparse.ArgumentParser(description="Data-parallel TinyGPT with and without activation checkpointing.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        if args.global_batch % env.world_size:
            raise ValueError(f"--global-batch {args.global_batch} is not divisible by the world size {env.world_size}")
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=args.n_layer, n_head=4, n_embd=64, dropout=0.1)
        data = synthetic_tokens(n_seq=args.steps * args.global_batch, seq_len=32, vocab_size=64, seed=0)
        # What one block saves for backward (its input included), measured on a spare block.
        x = torch.randn(args.global_batch // env.world_size, cfg.block_size, cfg.n_embd, requires_grad=True)
        block = Block(cfg)
        with SavedActivationMeter(block.parameters()) as meter:
            block(x)
        block_bytes = meter.bytes
        rows = []
        for every in (0, 2, 1):  # 0: no checkpointing
            torch.manual_seed(0)  # same weights and the same dropout masks in every run
            model = TinyGPT(cfg).to(env.device)
            wrapped = apply_activation_checkpointing(model.blocks, every) if every else 0
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            saved, start = 0, time.perf_counter()
            for step in progress(range(args.steps), desc=f"checkpoint {wrapped}/{cfg.n_layer} blocks"):
                x, y = (shard(t[step * args.global_batch:(step + 1) * args.global_batch], env.rank,
                              env.world_size).to(env.device) for t in data.tensors)
                optimizer.zero_grad(set_to_none=True)
                with SavedActivationMeter(model.parameters()) as meter:
                    _, loss = model(x, y)
                saved = max(saved, meter.bytes)
                loss.backward()
                for p in model.parameters():  # Phase 1's gradient average
                    dist.all_reduce(p.grad)
                    p.grad /= env.world_size
                optimizer.step()
            elapsed = time.perf_counter() - start
            dist.all_reduce(loss)
            # While backward runs through a checkpointed block, that block's insides are
            # alive again: the peak is the saved inputs plus one recomputed block.
            peak = saved + (block_bytes if wrapped else 0)
            rows.append({"checkpointed blocks": f"{wrapped}/{cfg.n_layer}",
                         "saved fwd->bwd": format_bytes(saved), "vs none": f"{saved / (rows[0]['_saved'] if rows else saved):.0%}",
                         "peak in bwd (est.)": format_bytes(peak), "_saved": saved,
                         "final loss": f"{loss.item() / env.world_size:.4f}",
                         "ms/step": f"{1000 * elapsed / args.steps:.0f}"})
        for row in rows:
            del row["_saved"]
        log0(f"\nTinyGPT n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, T={cfg.block_size}, dropout {cfg.dropout}, "
             f"{env.world_size} ranks, local batch {args.global_batch // env.world_size}, {args.steps} steps")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
