"""The tour: every strategy of the course on the same model and data, side by side, measured.

``./entrypoint.sh`` (RUN_MODE=tour, 2 CPU processes) trains one seeded MLP on
scikit-learn's digits for the same steps with each strategy, then prints, per
strategy: the final loss and the largest parameter difference from a single process
trained on the same global batches (exactness), throughput, payload bytes each rank
sends per step (CommLedger.wire_bytes: collectives counted as ring algorithms send), the
bytes of model state each rank holds (parameters + gradients + optimizer state: what
ZeRO divides), and wall time. PNGs in runs/tour/: loss curves, bytes per step, state
per rank, and the 1F1B pipeline timeline.

    ./entrypoint.sh                    # the full tour
    ./entrypoint.sh --quick            # the CI version
    NPROC=4 ./entrypoint.sh            # 4 ranks: ZeRO shards 4 ways, 4 pipeline stages
    IMPL=templates ./entrypoint.sh     # the same with your code (stops at your first unfinished TODO)

The model: Linear(64, H) -> [Linear(H, H), Tanh] x L -> Linear(H, 10), L = 2 x ranks,
so the pipeline gives each rank 2 blocks and tensor parallelism splits each pair of
blocks Megatron-style (column, then row).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm import CommLedger
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, tensor_bytes
from distlab.todo import run_demo


def build_model(hidden: int, blocks: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(64, hidden)]
    layers += [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(blocks)]
    return nn.Sequential(*layers, nn.Linear(hidden, 10))


def global_batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from distlab.data import digits

    x, y = digits("train", flatten=True).tensors
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        idx = torch.randint(len(y), (global_batch,), generator=g)
        out.append((x[idx], y[idx]))
    return out


def _state_bytes(params, optimizer: torch.optim.Optimizer | None) -> int:
    params = list(params)
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                           if torch.is_tensor(v) and v.dim() > 0]
    return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + tensor_bytes(state)


class Run:
    """What one strategy needs: a step function, the full parameters at the end, its state bytes."""

    def __init__(self, step: Callable, full_state: Callable[[], dict], state_bytes: Callable[[], int],
                 timeline: Callable[[], list] | None = None) -> None:
        self.step, self.full_state, self.state_bytes, self.timeline = step, full_state, state_bytes, timeline


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _data_parallel(kind: str, model: nn.Module, rank: int, world_size: int) -> Run:
    """single, naive, accumulation, ours, torch_ddp, zero1/2/3: the data-parallel family."""
    from distlab.testing import shard

    def local(x, y):
        return (x, y) if kind == "single" else (shard(x, rank, world_size), shard(y, rank, world_size))

    if kind == "zero3":
        fsdp = load("phase3_multi_node", "fsdp").FullyShardedDataParallel(model, torch.optim.SGD, lr=0.1, momentum=0.9)

        def step(x, y):
            fsdp.zero_grad()
            loss = F.cross_entropy(fsdp(*local(x, y)[:1]), local(x, y)[1])
            loss.backward()
            fsdp.step()
            return loss
        mem = fsdp.memory_bytes
        return Run(step, lambda: load("phase3_multi_node", "fsdp_state").full_state_dict(fsdp), lambda: sum(mem().values()))
    if kind in ("zero1", "zero2"):
        zero = load("phase3_multi_node", "zero").ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=int(kind[-1]), bucket_size_mb=0.05, lr=0.1, momentum=0.9)

        def step(x, y):
            zero.zero_grad()
            xs, ys = local(x, y)
            loss = F.cross_entropy(model(xs), ys)
            loss.backward()
            zero.step()
            return loss
        return Run(step, model.state_dict, lambda: sum(zero.memory_bytes().values()))
    if kind == "ours":
        wrapped = load("phase3_multi_node", "ddp_bucketed").DDPBucketed(model, bucket_size_mb=0.05)  # several buckets even for this small model
    elif kind == "torch_ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.05)
        # torch's reducer calls the backend from C++, out of CommLedger's sight; its default
        # hook, registered explicitly, all-reduces each bucket through dist.all_reduce instead.
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "accumulation":
        wrapped = load("phase2_advanced", "grad_accumulation").AccumulatingDataParallel(model)
    elif kind == "naive":
        load("phase1_data_parallel", "trainer").broadcast_parameters(model)
        wrapped = model
    else:
        wrapped = model
    optimizer = _sgd(model.parameters())

    def step(x, y):
        xs, ys = local(x, y)
        if kind == "accumulation":
            return load("phase2_advanced", "grad_accumulation").train_step(wrapped, optimizer, F.cross_entropy, xs, ys, micro_batch_size=max(1, len(ys) // 2))
        if kind == "naive":
            return load("phase1_data_parallel", "trainer").train_step(model, optimizer, F.cross_entropy, xs, ys)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(xs), ys)
        loss.backward()
        if kind == "ours":
            wrapped.finish_gradient_synchronization()
        optimizer.step()
        return loss

    return Run(step, model.state_dict, lambda: _state_bytes(model.parameters(), optimizer))


def _tensor_parallel(model: nn.Sequential) -> Run:
    """Each pair of hidden blocks becomes column-parallel -> Tanh -> row-parallel -> Tanh."""
    tp_lesson = load("phase2_advanced", "tensor_parallel")
    ColumnParallelLinear, RowParallelLinear = tp_lesson.ColumnParallelLinear, tp_lesson.RowParallelLinear

    layers, blocks = [model[0]], list(model[1:-1])
    names = {}
    for i in range(0, len(blocks), 2):
        col = ColumnParallelLinear.from_linear(blocks[i][0])
        row = RowParallelLinear.from_linear(blocks[i + 1][0])
        names[col], names[row] = (f"{i + 1}.0", 0), (f"{i + 2}.0", 1)
        layers += [col, nn.Tanh(), row, nn.Tanh()]
    tp = nn.Sequential(*layers, model[-1])
    optimizer = _sgd(tp.parameters())

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(tp(x), y)  # every rank sees the whole batch; the layers are split
        loss.backward()
        optimizer.step()
        return loss

    def full_state():
        state = {}
        for layer, (name, dim) in names.items():
            for pname, p in layer.named_parameters():
                parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, p.detach().contiguous())
                full = torch.cat(parts, dim=dim if pname == "weight" else 0)
                state[f"{name}.{pname}"] = full if not (pname == "bias" and dim == 1) else p.detach()
        state.update({f"0.{k}": v for k, v in model[0].state_dict().items()})
        state.update({f"{len(model) - 1}.{k}": v for k, v in model[-1].state_dict().items()})
        return state

    return Run(step, full_state, lambda: _state_bytes(tp.parameters(), optimizer))


def _pipeline(model: nn.Sequential, rank: int, world_size: int, microbatches: int, hidden: int) -> Run:
    pipeline = load("phase2_advanced", "pipeline")
    PipelineStage, train_step = pipeline.PipelineStage, pipeline.train_step

    blocks = list(model[1:-1])
    per = len(blocks) // world_size
    mine = blocks[rank * per:(rank + 1) * per]
    first = [model[0]] if rank == 0 else []
    last = [model[-1]] if rank == world_size - 1 else []
    stage_module = nn.Sequential(*first, *mine, *last)
    stage = PipelineStage(stage_module, recv_shape=(0, hidden))
    optimizer = _sgd(stage_module.parameters())
    offset = 1 + rank * per

    def step(x, y):
        stage.recv_shape = (len(y) // microbatches, hidden)
        loss = train_step(stage, optimizer, "1f1b", x, y, F.cross_entropy, microbatches)
        out = torch.tensor([loss if loss is not None else 0.0])
        dist.broadcast(out, src=world_size - 1)  # the loss lives on the last stage
        return out

    def full_state():
        named = {}
        for i, layer in enumerate(first + mine + last):
            index = 0 if (first and i == 0) else (len(model) - 1 if (last and i == len(first + mine + last) - 1)
                                                  else offset + i - len(first))
            named.update({f"{index}.{k}": v for k, v in layer.state_dict().items()})
        parts = [None] * world_size
        dist.all_gather_object(parts, named)
        return {k: v for p in parts for k, v in p.items()}

    return Run(step, full_state, lambda: _state_bytes(stage_module.parameters(), optimizer),
               timeline=lambda: list(stage.events))


def _compression(method: str, model: nn.Module, rank: int, world_size: int) -> Run:
    from torch.nn.parallel import DistributedDataParallel

    from distlab.testing import shard
    make_hook = load("phase4_production", "compression").make_hook

    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    hook, state = make_hook(method)
    ddp.register_comm_hook(state, hook)
    optimizer = _sgd(model.parameters())

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(shard(x, rank, world_size)), shard(y, rank, world_size))
        loss.backward()
        optimizer.step()
        return loss

    return Run(step, model.state_dict, lambda: _state_bytes(model.parameters(), optimizer))


STRATEGIES = {  # name -> (family, argument)
    "single process": ("dp", "single"),
    "naive DP [phase 1]": ("dp", "naive"),
    "DP + accumulation [phase 2]": ("dp", "accumulation"),
    "bucketed DDP, ours [phase 3]": ("dp", "ours"),
    "torch DDP": ("dp", "torch_ddp"),
    "ZeRO-1 [phase 3]": ("dp", "zero1"),
    "ZeRO-2 [phase 3]": ("dp", "zero2"),
    "ZeRO-3 / FSDP [phase 3]": ("dp", "zero3"),
    "tensor parallel [phase 2]": ("tp", None),
    "pipeline 1F1B [phase 2]": ("pp", None),
    "PowerSGD DDP [phase 4]": ("compress", "powersgd"),
    "fp16 DDP [phase 4]": ("compress", "fp16"),
}


def run_strategy(name: str, rank: int, world_size: int, batches, hidden: int, microbatches: int) -> dict:
    family, arg = STRATEGIES[name]
    model = build_model(hidden, 2 * world_size)
    if family == "dp":
        run = _data_parallel(arg, model, rank, world_size)
    elif family == "tp":
        run = _tensor_parallel(model)
    elif family == "pp":
        run = _pipeline(model, rank, world_size, microbatches, hidden)
    else:
        run = _compression(arg, model, rank, world_size)
    losses, ledger = [], CommLedger()
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches:
        with ledger:
            loss = run.step(x, y).detach().reshape(1).clone()
        if family in ("dp", "compress") and arg != "single":
            dist.all_reduce(loss)  # outside the ledger: the mean of the shard losses
            loss /= world_size
        losses.append(loss.item())
    dist.barrier()
    wall = time.perf_counter() - start
    return {"losses": losses, "wall": wall, "bytes_per_step": ledger.wire_bytes() / len(batches),
            "state_bytes": run.state_bytes(), "full_state": {k: v.detach().clone() for k, v in run.full_state().items()},
            "timeline": run.timeline() if run.timeline else None}


def main(argv: list[str] | None = None) -> dict:
    from distlab.launch import init_from_env, shutdown
    from distlab.plots import plot_bars, plot_loss_curves, plot_timeline

    parser = argparse.ArgumentParser(description="Every strategy on the same model and data, side by side.")
    parser.add_argument("--quick", action="store_true", help="a sub-minute version (fewer steps, smaller model)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--out", default="runs/tour")
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of: {list(STRATEGIES)}")
    args = parser.parse_args(argv)
    steps = args.steps or (12 if args.quick else 60)
    env = init_from_env()
    try:
        W = env.world_size
        # Tensor parallelism splits the hidden layers W ways: round the default down to a multiple of W.
        hidden = args.hidden or (64 if args.quick else 256) // W * W
        microbatches = 2 * W
        global_batch = 24 * W * microbatches // W  # divisible by W and by the micro-batch count
        batches = global_batches(steps, global_batch)
        names = [n for n in STRATEGIES if args.only is None or n in args.only or n == "single process"]
        log0(f"tour: {len(names)} strategies x {steps} steps on {W} ranks ({env.backend}); MLP 64-{hidden}x"
             f"{2 * W}-10 on digits, global batch {global_batch}, SGD(lr=0.1, momentum=0.9)")
        results = {}
        for i, name in enumerate(names):
            log0(f"[{i + 1}/{len(names)}] {name} ...")
            results[name] = run_strategy(name, env.rank, W, batches, hidden, microbatches)
        base = results["single process"]
        rows, summary = [], {}
        for name, r in results.items():
            diff = max((r["full_state"][k] - v).abs().max().item() for k, v in base["full_state"].items())
            state = torch.tensor([float(r["state_bytes"])])
            dist.all_reduce(state, op=dist.ReduceOp.MAX)  # the fullest rank
            summary[name] = {"final_loss": r["losses"][-1], "max_param_diff": diff, "state_bytes": state.item(),
                             "bytes_per_step": r["bytes_per_step"]}
            rows.append({"strategy": name, "final loss": f"{r['losses'][-1]:.4f}", "max |param - single|": f"{diff:.1e}",
                         "samples/s": f"{steps * global_batch / r['wall']:.0f}",
                         "sent/step/rank": format_bytes(r["bytes_per_step"]),
                         "model state/rank": format_bytes(state.item()), "wall s": f"{r['wall']:.2f}"})
        log0("\n" + format_table(rows))
        log0("max |param - single|: float32 sums reordered across ranks give ~1e-7..1e-5 after many steps; "
             "compression is lossy by design.")
        if env.rank == 0:
            out = Path(args.out)
            paths = [plot_loss_curves({n: r["losses"] for n, r in results.items()}, out / "loss_curves.png",
                                      title=f"training loss, {W} ranks"),
                     plot_bars({n: r["bytes_per_step"] for n, r in results.items()}, out / "bytes_per_step.png",
                               "sent per step", title=f"bytes rank 0 sends per step (ring estimate), {W} ranks",
                               unit="bytes"),
                     plot_bars({n: r["state_bytes"] for n, r in results.items()}, out / "state_per_rank.png",
                               "state per rank", title=f"params + grads + optimizer state on rank 0, {W} ranks",
                               unit="bytes")]
        timeline = results.get("pipeline 1F1B [phase 2]", {}).get("timeline")
        if timeline is not None:
            events = [None] * W
            dist.all_gather_object(events, timeline)
            if env.rank == 0:
                paths.append(plot_timeline([e for ev in events for e in ev], out / "pipeline_1f1b.png",
                                           title=f"1F1B, {W} stages, {microbatches} micro-batches (last step)"))
        if env.rank == 0:
            log0("plots: " + ", ".join(str(p) for p in paths))
        # Drop the strategies' objects (torch DDP's reducers with their comm hooks, pipeline
        # sends) so shutdown() collects them while the group exists, and leave together:
        # destroying the group under live communication objects aborted 1 quick tour in 8.
        del results
        dist.barrier()
        return summary
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
