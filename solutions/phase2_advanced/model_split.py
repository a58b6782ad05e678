"""Naive model parallelism: consecutive layers on consecutive ranks, one batch at a time.

A model too big for one device is cut into p consecutive stages; rank s holds
stage s. Forward passes the activation down the line with ``send``/``recv``;
backward passes the gradient of each activation back up:

    forward    rank 0 --x1--> rank 1 --x2--> rank 2 --> loss
    backward   rank 0 <-dx1-- rank 1 <-dx2-- rank 2 <-- loss.backward()

Autograd does not cross process boundaries, so each stage makes its received
activation a leaf that requires grad; after its local backward, that leaf's
``.grad`` is exactly what the previous stage needs to continue.

Only one rank computes at a time: the others wait (p-1)/p of the step. Pipelining
(pipeline.py) cuts the batch into micro-batches to fill that idle time.

Cost per step, per stage boundary: one activation forward and one gradient
backward (batch x hidden x bytes each); memory per rank: 1/p of the parameters.
See phase2_advanced/guidelines_model_parallel.md#naive-model-split.

Run: ``RUN_MODE=model_split ./entrypoint.sh`` (an MLP on digits, one stage per rank).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn


def _peer(stage: int, group: dist.ProcessGroup | None) -> int:
    """Global rank of ``stage`` (stages are the group's ranks, in order)."""
    return stage if group is None else dist.get_global_rank(group, stage)


def forward_stage(module: nn.Module, x: torch.Tensor | None, recv_shape: tuple[int, ...],
                  dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the forward pass; returns (stage input, stage output).

    Args:
        x: the batch (stage 0 only; None elsewhere).
        recv_shape: the shape of the activation this stage receives (stages > 0).

    Equivalent to: the matching slice of ``full_model(x)``.
    Collective: every stage of ``group`` calls it, in order (each waits for its predecessor).
    Cost: stage s < p-1 sends its output once (|activation| bytes); stage s > 0 receives once.
    """
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    if stage == 0:
        inp = x
    else:
        inp = torch.empty(recv_shape, dtype=dtype, device=next(module.parameters()).device)
        dist.recv(inp, src=_peer(stage - 1, group), group=group)
        inp.requires_grad_()  # a leaf: its .grad is what the previous stage needs in backward
    out = module(inp)
    if stage < num_stages - 1:
        dist.send(out.detach().contiguous(), dst=_peer(stage + 1, group), group=group)
    return inp, out


def backward_stage(inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """This rank's part of the backward pass (on the last stage, ``out`` is the loss).

    Equivalent to: ``loss.backward()`` of the unsplit model, for this stage's parameters.
    Collective: every stage calls it, the last first (each waits for its successor).
    Cost: stage s > 0 sends dL/d(input) once; stage s < p-1 receives dL/d(output) once.
    """
    stage, num_stages = dist.get_rank(group), dist.get_world_size(group)
    if stage == num_stages - 1:
        out.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=_peer(stage + 1, group), group=group)
        out.backward(grad)
    if stage > 0:
        dist.send(inp.grad.contiguous(), dst=_peer(stage - 1, group), group=group)


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
               x: torch.Tensor | None, y: torch.Tensor | None, recv_shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None) -> float | None:
    """One step of the split model; returns the loss on the last stage, None elsewhere.

    ``x`` is read on stage 0 and ``y`` on the last stage; each stage updates its own parameters.
    """
    is_last = dist.get_rank(group) == dist.get_world_size(group) - 1
    optimizer.zero_grad(set_to_none=True)
    inp, out = forward_stage(module, x, recv_shape, dtype, group)
    if is_last:
        out = loss_fn(out, y)
    backward_stage(inp, out, group)
    optimizer.step()
    return out.item() if is_last else None


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    from distlab.comm import CommLedger
    from distlab.data import digits
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0, progress

    parser = argparse.ArgumentParser(description="An MLP split across ranks, one stage each, on digits.")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        p = env.world_size
        x_all, y_all = digits("train", flatten=True).tensors
        torch.manual_seed(0)  # every rank builds the whole model and keeps its stage
        blocks = [nn.Sequential(nn.Linear(x_all.shape[1] if i == 0 else args.hidden, args.hidden), nn.ReLU())
                  for i in range(p)]
        head = nn.Linear(args.hidden, 10)
        module = nn.Sequential(blocks[env.rank], *([head] if env.rank == p - 1 else [])).to(env.device)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        steps = x_all.shape[0] // args.batch
        log0(f"model split: {p} stages, {sum(q.numel() for q in module.parameters())} parameters on rank 0")
        ledger, loss, start = CommLedger(), None, time.perf_counter()
        for epoch in range(args.epochs):
            perm = torch.randperm(x_all.shape[0], generator=torch.Generator().manual_seed(epoch))
            for i in progress(range(steps), desc=f"epoch {epoch}"):
                idx = perm[i * args.batch:(i + 1) * args.batch]
                ledger.reset()
                with ledger:
                    loss = train_step(module, opt, nn.functional.cross_entropy, x_all[idx].to(env.device),
                                      y_all[idx].to(env.device), (args.batch, args.hidden), group=None)
        elapsed = time.perf_counter() - start
        last = [loss]
        dist.broadcast_object_list(last, src=p - 1)
        log0("\n" + format_table([{
            "stages": p, "epochs": args.epochs, "final loss": f"{last[0]:.4f}",
            "p2p sent/step (rank 0)": format_bytes(ledger.sent_bytes()),
            "samples/s": f"{args.epochs * steps * args.batch / elapsed:.0f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
