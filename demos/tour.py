"""The tour: every strategy of the course on the same model and data, side by side, measured.

``./entrypoint.sh`` (RUN_MODE=tour, 2 CPU processes) trains one seeded MLP on
scikit-learn's digits for the same steps with each strategy, then prints, per
strategy: the final loss and the largest parameter difference from a single process
trained on the same global batches (exactness), throughput, payload bytes each rank
sends per step (CommLedger.wire_bytes: collectives counted as ring algorithms send), the
bytes of model state each rank holds (parameters + gradients + optimizer state: what
ZeRO divides), and wall time. PNGs in runs/tour/: loss curves with each run's difference
from its single process under them, bytes per step, state per rank (one column of panels
per model trained), and the 1F1B pipeline timeline.

    ./entrypoint.sh                    # the full tour
    ./entrypoint.sh --quick            # the CI version
    NPROC=4 ./entrypoint.sh            # 4 ranks: ZeRO shards 4 ways, 4 pipeline stages
    IMPL=templates ./entrypoint.sh     # the same with your code (stops at your first unfinished TODO)

The model: Linear(64, H) -> [Linear(H, H), Tanh] x L -> Linear(H, 10), L = 2 x ranks,
so the pipeline gives each rank 2 blocks and tensor parallelism splits each pair of
blocks Megatron-style (column, then row). Two strategies need a model of their own, each
compared with its own single-process twin on the same data: context parallelism (phase
5's ring attention) trains a one-block TinyGPT on 128-token sequences (a bigram rule), each
rank holding a zig-zag share of every sequence's tokens; expert parallelism trains an MoE
classifier on the same digits, Linear(64, h) -> Tanh -> residual mixture of 2 x ranks
experts (top-2, none dropped) -> Linear(h, 10), h = min(H, 64), two experts per rank.
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

from demos.sizes import multiple_of, positive
from distlab.comm import CommLedger
from distlab.loader import load
from distlab.metrics import format_bytes, format_table, log0, nbytes
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
    return nbytes(params) + nbytes(p.grad for p in params) + nbytes(state)


class Run:
    """What one strategy needs: a step function, the full parameters at the end, its state bytes."""

    def __init__(self, step: Callable, full_state: Callable[[], dict], state_bytes: Callable[[], int],
                 timeline: Callable[[], list] | None = None,
                 baseline: Callable[[], tuple[list[float], dict]] | None = None,
                 samples_per_step: int | None = None) -> None:
        self.step, self.full_state, self.state_bytes, self.timeline = step, full_state, state_bytes, timeline
        self.baseline = baseline  # a model of its own: (losses, state) of its single-process twin
        self.samples_per_step = samples_per_step  # None: the global batch of digits


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _data_parallel(kind: str, model: nn.Module, rank: int, world_size: int) -> Run:
    """single, naive, accumulation, ours, torch_ddp, zero1/2/3: the data-parallel family."""
    from distlab.testing import shard

    def local(x, y):
        return (x, y) if kind == "single" else (shard(x, rank, world_size), shard(y, rank, world_size))

    if kind == "zero3":
        fsdp = load("phase3_multi_node", "fsdp").FullyShardedDataParallel(model)
        opt = _sgd(fsdp.parameters())  # torch's SGD on the wrapper's parameters: its flat shards

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(fsdp(*local(x, y)[:1]), local(x, y)[1])
            loss.backward()
            opt.step()
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
    tp = nn.Sequential(*layers, model[-1]).to(model[0].weight.device)  # the shards are made on the CPU
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


def _pipeline(model: nn.Sequential, rank: int, world_size: int, microbatches: int, hidden: int,
              device: torch.device) -> Run:
    pipeline = load("phase2_advanced", "pipeline")
    PipelineStage, train_step = pipeline.PipelineStage, pipeline.train_step

    blocks = list(model[1:-1])
    per = len(blocks) // world_size
    mine = blocks[rank * per:(rank + 1) * per]
    first = [model[0]] if rank == 0 else []
    last = [model[-1]] if rank == world_size - 1 else []
    stage_module = nn.Sequential(*first, *mine, *last)
    stage = PipelineStage(stage_module, recv_shape=(0, hidden), device=device)
    optimizer = _sgd(stage_module.parameters())
    offset = 1 + rank * per

    def step(x, y):
        stage.recv_shape = (len(y) // microbatches, hidden)
        loss = train_step(stage, optimizer, "1f1b", x, y, F.cross_entropy, microbatches)
        out = torch.tensor([loss if loss is not None else 0.0], device=device)
        dist.broadcast(out, src=world_size - 1)  # the loss lives on the last stage
        return out

    def full_state():
        named = {}
        for i, layer in enumerate(first + mine + last):
            index = 0 if (first and i == 0) else (len(model) - 1 if (last and i == len(first + mine + last) - 1)
                                                  else offset + i - len(first))
            named.update({f"{index}.{k}": v.cpu() for k, v in layer.state_dict().items()})  # pickled: CPU
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


class HeadsProjection(torch.autograd.Function):
    """``proj`` applied to attention output ``y`` (B, heads, T, D) where it lies: reshaping the
    ring's head-major output to (B, T, heads*D) for an ``nn.Linear`` would copy it (flash
    attention writes token-major and needs no copy). Saves only ``y`` and the weight."""

    @staticmethod
    def forward(ctx, y, weight, bias):
        ctx.save_for_backward(y, weight)
        return torch.einsum("bhtd,ohd->bto", y, weight.view(weight.shape[0], y.shape[1], y.shape[3])) + bias

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        w = weight.view(weight.shape[0], y.shape[1], y.shape[3])
        return (torch.einsum("bto,ohd->bhtd", grad, w), torch.einsum("bto,bhtd->ohd", grad, y).reshape(weight.shape),
                grad.sum(dim=(0, 1)))


class RingSelfAttention(nn.Module):
    """TinyGPT's causal attention (its q, k, v, proj, same names) on this rank's tokens, at the
    positions ``layout[rank]``; the K/V blocks travel the ring (``ring_attention``, phase 5)."""

    def __init__(self, attn: nn.Module, layout: list[torch.Tensor], ring_attention: Callable,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.n_head, self.head_dim = attn.n_head, attn.head_dim
        self.layout, self.ring_attention, self.group = layout, ring_attention, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = self.ring_attention(q, k, v, self.layout, self.group)
        return HeadsProjection.apply(y, self.proj.weight, self.proj.bias)


class MoEMLP(nn.Module):
    """An ``ExpertParallelMoE`` where an MLP was: (..., d) in and out; ``aux`` holds the last
    forward's load-balancing share."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe, self.aux = moe, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.aux = self.moe(x.reshape(-1, x.shape[-1]))
        return y.view_as(x)


class MoEClassifier(nn.Module):
    """Linear(64, H) -> Tanh -> h + MoE(h) -> Linear(H, 10): the tour's MoE model."""

    def __init__(self, inp: nn.Linear, moe: nn.Module, out: nn.Linear) -> None:
        super().__init__()
        self.inp, self.mlp, self.out = inp, MoEMLP(moe), out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.mlp(h))


def _long_sequences(steps: int, seq_len: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from distlab.data import synthetic_tokens

    x, y = synthetic_tokens(n_seq=2 * steps, seq_len=seq_len, vocab_size=32).tensors
    return [(x[i:i + 2].to(device), y[i:i + 2].to(device)) for i in range(0, 2 * steps, 2)]


def _context_parallel(rank: int, world_size: int, steps: int, device: torch.device, seq_len: int = 128) -> Run:
    """A one-block TinyGPT on sequences of ``seq_len`` tokens, 2 per step; every rank holds a
    zig-zag share of each sequence's tokens (and every parameter)."""
    from distlab.models import GPTConfig, TinyGPT
    from distlab.lessons.sync import allreduce_gradients

    ring = load("phase5_large_models", "ring_attention")
    cfg = GPTConfig(vocab_size=32, block_size=seq_len, n_layer=1, n_head=4, n_embd=32)
    data = _long_sequences(steps, seq_len, device)
    layout = ring.sequence_layout(seq_len, world_size, "zigzag")
    pos = layout[rank].to(device)
    torch.manual_seed(0)
    gpt = TinyGPT(cfg).to(device)
    for block in gpt.blocks:
        block.attn = RingSelfAttention(block.attn, [p.to(device) for p in layout], ring.ring_attention)
    optimizer, batches = _sgd(gpt.parameters()), iter(data)

    def step(x, y):  # the digits batch is not this model's: its own token batches, in order
        tokens, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        h = gpt.wte(tokens[:, pos]) + gpt.wpe(pos)
        for block in gpt.blocks:
            h = block(h)
        logits = gpt.lm_head(gpt.ln_f(h))
        # this rank's share of the mean over every token: the shares' gradients sum to the whole's
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, pos].flatten(), reduction="sum") / targets.numel()
        loss.backward()
        allreduce_gradients(gpt.parameters(), average=False)  # every rank holds every parameter
        optimizer.step()
        return loss

    def baseline():  # the same model and batches in one process, torch's attention on every token
        torch.manual_seed(0)
        single = TinyGPT(cfg).to(device)
        opt, losses = _sgd(single.parameters()), []
        for tokens, targets in data:
            opt.zero_grad(set_to_none=True)
            loss = single(tokens, targets)[1]
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, single.state_dict()

    return Run(step, gpt.state_dict, lambda: _state_bytes(gpt.parameters(), optimizer), baseline=baseline,
               samples_per_step=len(data[0][0]))


def _expert_parallel(rank: int, world_size: int, hidden: int, batches, device: torch.device) -> Run:
    """The MoE classifier, 2 experts per rank, on this rank's shard of every digits batch."""
    from distlab.lessons.sync import allreduce_gradients
    from distlab.testing import shard

    moe = load("phase5_large_models", "moe")
    experts = 2 * world_size
    single_group, _ = dist.new_subgroups(group_size=1)  # collective: every rank, a group of itself

    def build(group) -> MoEClassifier:
        torch.manual_seed(0)  # every rank and the twin: the same model (each rank keeps its experts)
        inp, out = nn.Linear(64, hidden), nn.Linear(hidden, 10)
        router, every_expert = nn.Linear(hidden, experts, bias=False), moe.Experts(experts, hidden, 2 * hidden)
        # capacity factor E / k: C = N, no token dropped, so the twin's routing is the same
        layer = moe.ExpertParallelMoE(router, every_expert, top_k=2, capacity_factor=experts / 2, group=group)
        return MoEClassifier(inp, layer, out).to(device)

    def backward(model, x, y, ranks: int) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y, reduction="sum") / (len(y) * ranks) + model.mlp.aux  # shares sum
        loss.backward()
        return loss

    model = build(None)
    optimizer = _sgd(model.parameters())
    dense = [p for name, p in model.named_parameters() if ".experts." not in name]

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = backward(model, shard(x, rank, world_size), shard(y, rank, world_size), world_size)
        allreduce_gradients(dense, average=False)  # replicated: sum the shares; each expert lives on one rank
        optimizer.step()
        return loss

    def full_state():
        state = model.state_dict()
        for name in [n for n in state if ".experts." in n]:  # experts: every rank's, in rank order
            parts = [torch.empty_like(state[name]) for _ in range(world_size)]
            dist.all_gather(parts, state[name].contiguous())
            state[name] = torch.cat(parts)
        return state

    def baseline():  # all the experts in one process, the whole batch
        single = build(single_group)
        opt, losses = _sgd(single.parameters()), []
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            losses.append(backward(single, x, y, 1).item())
            opt.step()
        return losses, single.state_dict()

    return Run(step, full_state, lambda: _state_bytes(model.parameters(), optimizer), baseline=baseline)


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
    "context parallel, ring [phase 5]": ("cp", None),
    "expert parallel, MoE [phase 5]": ("ep", None),
}


def run_strategy(name: str, rank: int, world_size: int, batches, hidden: int, microbatches: int,
                 device: torch.device = torch.device("cpu")) -> dict:
    family, arg = STRATEGIES[name]
    model = build_model(hidden, 2 * world_size).to(device)
    if family == "cp":
        run = _context_parallel(rank, world_size, len(batches), device)
    elif family == "ep":
        run = _expert_parallel(rank, world_size, min(hidden, 64), batches, device)  # small: the tour's time
    elif family == "dp":
        run = _data_parallel(arg, model, rank, world_size)
    elif family == "tp":
        run = _tensor_parallel(model)
    elif family == "pp":
        run = _pipeline(model, rank, world_size, microbatches, hidden, device)
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
        elif family in ("cp", "ep"):
            dist.all_reduce(loss)  # outside the ledger: the shares sum to the loss
        losses.append(loss.item())
    dist.barrier()
    wall = time.perf_counter() - start
    return {"losses": losses, "wall": wall, "bytes_per_step": ledger.wire_bytes() / len(batches),
            "state_bytes": run.state_bytes(),
            "full_state": {k: v.detach().cpu().clone() for k, v in run.full_state().items()},
            "timeline": run.timeline() if run.timeline else None,
            "baseline": run.baseline() if run.baseline else None,
            "samples_per_step": run.samples_per_step or len(batches[0][1])}


# Strategies that train a model of their own: each gets its own panel, beside its own single-process twin
OWN_MODELS = {"cp": "TinyGPT, 128-token sequences", "ep": "MoE classifier, digits"}


def by_model(results: dict[str, dict], key: str, hidden: int, world_size: int) -> dict[str, dict[str, object]]:
    """``results[name][key]`` grouped by the model trained: the MLP's strategies, then each own model's.

    ``key="losses"``: each group starts with its single-process run (the MLP's "single process", an own
    model's twin from ``baseline``), as ``plots.loss_panels`` wants. Other keys: the strategies' values.
    """
    mlp = f"MLP 64-{hidden}x{2 * world_size}-10, digits"
    groups: dict[str, dict[str, object]] = {mlp: {}}
    for name, r in results.items():
        family = STRATEGIES[name][0]
        if family not in OWN_MODELS:
            groups[mlp][name] = r[key]
            continue
        group = groups.setdefault(f"{OWN_MODELS[family]} ({name})", {})
        if key == "losses" and r["baseline"]:
            group["its single process"] = r["baseline"][0]
        group[name] = r[key]
    return {model: runs for model, runs in groups.items() if runs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Every strategy on the same model and data, side by side.")
    parser.add_argument("--quick", action="store_true", help="a sub-minute version (fewer steps, smaller model)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--out", default="runs/tour")
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of: {list(STRATEGIES)}")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """The steps, and a hidden width that tensor parallelism splits ``world_size`` ways."""
    args.steps = args.steps or (12 if args.quick else 60)
    positive(args, "--steps")
    # The default is rounded down to a multiple of the world size; a width given must be one.
    args.hidden = multiple_of(args.hidden, (64 if args.quick else 256) // world_size * world_size, world_size,
                              "--hidden", "the world size")
    return args


def main(argv: list[str] | None = None) -> dict:
    from distlab.launch import init_from_env, shutdown
    from distlab.plots import bar_panels, loss_panels, plot_panels, plot_timeline

    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        W, steps, hidden = env.world_size, args.steps, args.hidden
        microbatches = 2 * W
        global_batch = 24 * W * microbatches // W  # divisible by W and by the micro-batch count
        batches = [(x.to(env.device), y.to(env.device)) for x, y in global_batches(steps, global_batch)]
        names = [n for n in STRATEGIES if args.only is None or n in args.only or n == "single process"]
        log0(f"tour: {len(names)} strategies x {steps} steps on {W} ranks ({env.backend}); MLP 64-{hidden}x"
             f"{2 * W}-10 on digits, global batch {global_batch}, SGD(lr=0.1, momentum=0.9)")
        results = {}
        for i, name in enumerate(names):
            log0(f"[{i + 1}/{len(names)}] {name} ...")
            results[name] = run_strategy(name, env.rank, W, batches, hidden, microbatches, env.device)
        base = results["single process"]
        rows, summary = [], {}
        for name, r in results.items():
            twin_losses, twin_state = r["baseline"] or (base["losses"], base["full_state"])
            diff = max((r["full_state"][k] - v.cpu()).abs().max().item() for k, v in twin_state.items())
            state = torch.tensor([float(r["state_bytes"])], device=env.device)
            dist.all_reduce(state, op=dist.ReduceOp.MAX)  # the fullest rank
            summary[name] = {"final_loss": r["losses"][-1], "max_param_diff": diff, "state_bytes": state.item(),
                             "bytes_per_step": r["bytes_per_step"], "single_final_loss": twin_losses[-1]}
            rows.append({"strategy": name, "final loss": f"{r['losses'][-1]:.4f}", "max |param - single|": f"{diff:.1e}",
                         "samples/s": f"{steps * r['samples_per_step'] / r['wall']:.0f}",
                         "sent/step/rank": format_bytes(r["bytes_per_step"]),
                         "model state/rank": format_bytes(state.item()), "wall s": f"{r['wall']:.2f}"})
        log0("\n" + format_table(rows))
        log0("max |param - single|: float32 sums reordered across ranks give ~1e-7..1e-5 after many steps; "
             "compression is lossy by design. Context and expert parallelism train models of their own "
             "(TinyGPT on long sequences, an MoE classifier), compared with their own single-process twins.")
        if env.rank == 0:
            out = Path(args.out)
            # One column per model: the MLP's strategies together, context and expert parallelism beside
            # their own twins (other models: their losses and bytes do not compare with the MLP's)
            group = lambda key: by_model(results, key, hidden, W)  # noqa: E731
            paths = [plot_panels(loss_panels(group("losses")), out / "loss_curves.png", rows_of=2,
                                 title=f"training loss (top) and its difference from single process (bottom), {W} ranks"),
                     plot_panels(bar_panels(group("bytes_per_step"), "sent per step", unit="bytes"),
                                 out / "bytes_per_step.png",
                                 title=f"bytes rank 0 sends per step (ring estimate), {W} ranks, per model"),
                     plot_panels(bar_panels(group("state_bytes"), "state per rank", unit="bytes"),
                                 out / "state_per_rank.png",
                                 title=f"params + grads + optimizer state on rank 0, {W} ranks, per model")]
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
