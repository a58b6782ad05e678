"""ZeRO-1/2/3 from scratch against torch's ZeroRedundancyOptimizer and FSDP2: step time and peak memory.

Model: ``_Net``, a stack of 8 pre-norm residual MLP blocks (a transformer's feed-forward
half: LayerNorm, Linear 256->1024, GELU, Linear 1024->256, + x) between an input Linear
256->256 and a LayerNorm + Linear 256->10 head; 4.28 M parameters (17.1 MB fp32; one block
is 2.1 MB), AdamW (lr 1e-3, weight decay 0.1), cross-entropy, batch 64 rows per rank, gloo
CPU ranks at W=2 and W=4. Big enough that a step's collectives (17 MB all-reduced, or
reduce-scattered and all-gathered) are a real share of it, small enough that 3 launches
per world size fit in minutes on 2 cores. Contenders, per stage ours against torch's:

* torch DDP + AdamW: the replicated baseline, and the reference every result is checked against;
* stage 1: ours ``ZeroOptimizer(stage=1)`` vs ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (AdamW inside, on torch DDP);
* stage 2: ours ``ZeroOptimizer(stage=2)`` vs FSDP2 ``fully_shard(reshard_after_forward=False)``;
* stage 3: ours ``FullyShardedDataParallel`` (trained by a plain ``torch.optim.AdamW`` over
  ``fsdp.parameters()``) vs FSDP2 ``fully_shard`` (resharded after forward).

Like for like: FSDP2 shards every block, then the root (which keeps the input layer, the
final norm and the head); ours ZeRO-3 gets the same units (``units=blocks``), and ours ZeRO-1/2
one bucket per block plus one for the root's parameters, in backward order: what FSDP2
reduce-scatters at a time, and (ours steps AdamW on a bucket's chunk) temporaries no bigger
than a unit's, as torch's per-parameter steps. Like FSDP2's defaults, ours keeps one
reduce-scatter in flight (``max_in_flight=1``; FSDP2: ``reduce_scatter_max_input_buffers=1``)
and prefetches one unit in backward. On a CPU, FSDP2's collectives are synchronous (the CPU
waits for each, ``unshard_async_op=False``); ours ZeRO-3 waits likewise (``overlap_comm=False``),
so its time and memory rows compare two contenders that overlap nothing. Ours ZeRO-2 still
overlaps one reduce-scatter with backward, and FSDP2's ZeRO-2 does not: its time row says so. Torch DDP keeps its gradients as views of its buckets
(``gradient_as_bucket_view``), as ours' flat buffers are, so the buckets are counted.
``memory_note`` in the JSON gives the peaks of ours with its defaults (one 25 MiB bucket, two
reduce-scatters in flight, ZeRO-3's default units), measured in the same run.

Time: on benchmarks/harness.py: contenders rotated per repeat, one untimed warm-up round,
the slowest rank's time, 3 launches per world size; every contender's full parameters
(FSDP2's DTensors and ours' shards gathered) checked against torch DDP's after the warm-up
and after the last repeat (float32, rtol 1e-4, atol 1e-5), or ContenderMismatch.

Process memory (``process peak`` rows): each contender alone in fresh processes (3 launches),
built, stepped and dropped once, then built again and stepped twice; then per step the peak
resident set above the resident set before that build, glibc returning every block over 64 KiB
when freed. It counts what tensors do not: a backend's buffers (gloo copies a collective's input
or output while it runs) and the allocator's. Ours ZeRO-3 overlapping its collectives
(``overlap_comm=True``, its default on a GPU) measured 1.14x-1.15x FSDP2's at W=2 and 1.26x-1.28x at
W=4 by this measure, with equal tensor peaks: a reduce-scatter in flight during the next unit's
backward holds gloo's copy of a unit's gradient. Hence its default on a CPU, ``overlap_comm=False``
(default units otherwise): 0.96x at W=2, 0.92x-0.95x at W=4 (2 launches each, issue 33).

Memory: one meter for all, ``LiveTensorBytes``: every tensor storage alive in the process,
each once, sampled after every op and storage resize. Before the timed contenders exist, each
contender in turn is built, stepped twice unmetered (optimizer state; torch DDP rebuilds its
buckets in the second step) and metered over the next step(s) (zero_grad, forward, backward,
optimizer step); what was alive before it was built (the input batch, what earlier contenders
left behind) is left out. A row's ratio: the largest peak over the ranks, ours / torch's. The
peak is split by what each storage was at that moment: params (module parameters and tensor
attributes: gathered ones too), grads (their ``.grad``), optimizer (state), other (activations,
autograd temporaries, communication buffers, full gradients waiting for their reduce-scatter).
Cross-checked against torch's ``torch.distributed._tools.mem_tracker.MemTracker`` seeded with
the same census (``track_external`` of every live tensor): the same peaks to the byte for all
seven contenders at W=2 (torch 2.14). MemTracker alone counts only tensors created inside it
or handed to it, files torch DDP's bucket-view gradients under activations, and needs a new
tracker for every iteration of the same model; hence a meter of our own.

``--quick``: 4 blocks 64-256-64, batch 16, W=2 only, 2 repeats of one step (for the tests).

    python -m benchmarks.bench_zero [--quick]

writes benchmarks/results/zero.json and zero_memory.png.
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import Contender, format_row, launch, load_of, measure, ratio_row, stat_row
from distlab.comm import all_gather_single
from distlab.meters import LiveTensorBytes, storages
from distlab.metrics import format_bytes, format_table

LR, WEIGHT_DECAY = 1e-3, 0.1
REFERENCE = "torch DDP + AdamW"
STAGES = {1: ("ours ZeRO-1", "torch ZeroRedundancyOptimizer"),
          2: ("ours ZeRO-2", "torch FSDP2 (reshard_after_forward=False)"),
          3: ("ours ZeRO-3", "torch FSDP2 (fully_shard)")}
CONTENDERS = [REFERENCE, *(name for pair in STAGES.values() for name in pair)]
OURS_DEFAULTS = " with its defaults"  # memory only: what the matched configuration above changes
DEFAULTS = [f"ours ZeRO-{stage}{OURS_DEFAULTS}" for stage in STAGES]
CATEGORIES = ("params", "grads", "optimizer", "other")


@dataclass(frozen=True)
class Size:
    dim: int = 256
    hidden: int = 1024
    blocks: int = 8
    batch: int = 64
    classes: int = 10

    def describe(self) -> str:
        params = sum(p.numel() for p in _Net(self).parameters())
        return (f"{self.blocks} residual MLP blocks {self.dim}-{self.hidden}-{self.dim}, "
                f"{params / 1e6:.2f}M params, batch {self.batch}/rank")


FULL, QUICK = Size(), Size(dim=64, hidden=256, blocks=4, batch=16)


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.proj = nn.Linear(size.dim, size.dim)
        self.blocks = nn.ModuleList(_Block(size.dim, size.hidden) for _ in range(size.blocks))
        self.norm, self.head = nn.LayerNorm(size.dim), nn.Linear(size.dim, size.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --------------------------------------------------------------------------- contenders
@dataclass
class _Setup:
    forward: nn.Module                        # what the batch goes through
    model: nn.Module                          # whose parameters and attributes the meter calls "params"
    optimizer: torch.optim.Optimizer
    full_params: Callable[[], dict[str, torch.Tensor]]  # collective for the sharded ones
    set_to_none: bool = True                  # torch DDP's buckets stay: its gradients are kept (zeroed)


def _named(model: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    def full() -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()}  # FSDP2: DTensor shards gathered (a collective)
    return full


def _gathered(fsdp) -> Callable[[], dict[str, torch.Tensor]]:
    """Ours ZeRO-3: every unit's flat shards all-gathered, cut into the original parameters by name."""
    def full() -> dict[str, torch.Tensor]:
        out = {}
        for u in fsdp.units:
            flat = torch.empty(u.shard.numel() * fsdp.world_size, dtype=u.shard.dtype)
            all_gather_single(flat, u.shard.detach(), group=fsdp.group)
            for p, name, start in zip(u.params, u.names, u.offsets):
                out[name] = flat[start:start + p.numel()].view(p.shape).clone()
        return out
    return full


def _build(name: str, size: Size, lr_factor: float = 1.0) -> _Setup:
    from solutions.phase3_multi_node.fsdp import FullyShardedDataParallel
    from solutions.phase3_multi_node.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = _Net(size)
    adamw = dict(lr=LR * lr_factor, weight_decay=WEIGHT_DECAY)
    if name in (REFERENCE, "torch ZeroRedundancyOptimizer"):
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        if name == REFERENCE:
            opt = torch.optim.AdamW(model.parameters(), **adamw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
        return _Setup(ddp, model, opt, _named(model), set_to_none=False)
    defaults = name.endswith(OURS_DEFAULTS)
    if name.startswith(("ours ZeRO-1", "ours ZeRO-2")):
        # One bucket per FSDP2 unit (every block, then the root's own parameters), in backward
        # order. Ours steps its optimizer on a bucket's chunk: AdamW's temporaries are chunk-sized.
        blocks = [list(b.parameters()) for b in reversed(model.blocks)]
        root = [p for m in (model.head, model.norm, model.proj) for p in m.parameters()]
        # Stage 2: one reduce-scatter in flight, as FSDP2's reduce_scatter_max_input_buffers=1.
        matched = dict(params=[{"params": ps} for ps in (*blocks, root)], bucket_size_mb=1e6, max_in_flight=1)
        config = dict(params=model.parameters()) if defaults else matched
        zero = ZeroOptimizer(optimizer_class=torch.optim.AdamW, stage=int(name[len("ours ZeRO-")]), **config, **adamw)
        return _Setup(model, model, zero, _named(model))
    if name.startswith("ours ZeRO-3"):
        # As FSDP2: its units, one unit prefetched, one reduce-scatter at a time; and, as FSDP2 on a CPU
        # (its collectives are synchronous there), each collective waited for at once: nothing in flight
        # while compute runs (see the module docstring: what the process holds).
        config = {} if defaults else dict(units=list(model.blocks), prefetch=1, max_in_flight=1, overlap_comm=False)
        fsdp = FullyShardedDataParallel(model, **config)
        return _Setup(fsdp, fsdp, torch.optim.AdamW(fsdp.parameters(), **adamw), _gathered(fsdp))
    from torch.distributed.fsdp import fully_shard
    reshard = name == "torch FSDP2 (fully_shard)"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return _Setup(model, model, torch.optim.AdamW(model.parameters(), **adamw), _named(model))


def _train(setup: _Setup, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        setup.optimizer.zero_grad(set_to_none=setup.set_to_none)
        F.cross_entropy(setup.forward(x), y).backward()
        setup.optimizer.step()


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    # The same gradients summed in other groupings (all-reduce, reduce-scatter, per bucket or
    # unit) and averaged before or after the sum: float32 rounding, carried on by AdamW. Measured:
    # equal bit for bit at W=2 (a sum of two is the same in any order); at W=4 after the full
    # run's 14 steps at most 4.2e-6 apart (ours ZeRO-1: 38% of this tolerance). A learning rate
    # 1% off is ~1e-5 away after one step, and caught (tests/test_benchmarks.py).
    assert got.keys() == want.keys(), f"parameters {sorted(set(got) ^ set(want))} are not in both"
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- the memory meter
def _roles(setup: _Setup) -> Callable[[], dict[str, set[int]]]:
    """What each storage is now: module parameters or tensor attributes, their gradients, optimizer state."""
    optimizers = [setup.optimizer, *(v for v in vars(setup.optimizer).values() if isinstance(v, torch.optim.Optimizer))]

    modules = list(setup.model.modules())

    def roles() -> dict[str, set[int]]:
        tensors = [t for m in modules for t in [*m._parameters.values(), *vars(m).values()]
                   if isinstance(t, torch.Tensor)]
        tensors += [p for o in optimizers for g in o.param_groups for p in g["params"]]
        ids = lambda ts: {id(s) for t in ts for s in storages(t)}  # noqa: E731
        return {"params": ids(tensors), "grads": ids(t.grad for t in tensors),
                "optimizer": ids(v for o in optimizers for s in o.state.values() for v in s.values())}
    return roles


def _memory(size: Size, x: torch.Tensor, y: torch.Tensor, steps: int, names: list[str]) -> dict[str, dict]:
    """Per contender, one at a time: the peak live bytes of each of ``steps`` steps, at rest before them,
    and the split at the peak; nothing that was alive before the contender was built is counted.

    One meter from before the first contender is built until the last is gone: everything a
    contender allocates (build, warm-up steps) is an op's output, so the meter knows it when the
    metered steps start (checked against a gc census of every contender: equal to the byte).
    """
    out = {}
    meter = LiveTensorBytes()
    gc.freeze()  # what exists now stays: the collections below scan only what is new
    try:
        with meter:
            for name in names:
                gc.collect()  # the previous contender's cycles go now, not during this one's steps
                meter.restart(leave_out_alive=True)
                setup = _build(name, size)
                # Unmetered: optimizer state; torch DDP rebuilds its buckets in the second forward
                # (old and new alive at once, one time); ours ZeRO-3 records its order in the first backward.
                _train(setup, x, y, 2)
                meter.roles = _roles(setup)
                result = {"peak": [], "at_peak": [], "at_rest": [], "peak_at": []}
                for _ in range(steps):
                    gc.disable()  # no collection of unrelated garbage inside a metered step
                    try:
                        meter.restart()
                        result["at_rest"].append(meter.now)
                        _train(setup, x, y, 1)
                    finally:
                        gc.enable()
                    for key, value in (("peak", meter.peak), ("at_peak", meter.at_peak), ("peak_at", meter.peak_at)):
                        result[key].append(value)
                out[name] = result
                meter.roles = None
                del setup
    finally:
        gc.unfreeze()
    return out


# --------------------------------------------------------------------------- what the process holds
# LiveTensorBytes sees tensors; a backend's own buffers (gloo copies inputs and keeps outputs of
# collectives in flight on its threads) and the allocator's leftovers are memory the process holds
# too. The resident set counts them: its high-water mark over a step (reset through
# /proc/self/clear_refs) minus the resident set before the contender was built. Each rank makes glibc
# map every block over 64 KiB on its own and return it when freed (mallopt M_MMAP_THRESHOLD, which also
# stops glibc raising that threshold), so the resident set follows what is held, not what once was.
MMAP_THRESHOLD, M_MMAP_THRESHOLD = 64 * 1024, -3  # glibc's malloc.h


def _return_freed_blocks() -> None:
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the resident set would keep freed blocks")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM := VmRSS


def _process_memory(size: Size, x: torch.Tensor, y: torch.Tensor, steps: int, name: str) -> list[int]:
    """One contender alone in a fresh process: the resident set's peak during each of ``steps`` steps,
    above the resident set before it was built (bytes). A first life (built, stepped, dropped) loads
    code pages and does the backend's first-use setup before anything is counted."""
    setup = _build(name, size)
    _train(setup, x, y, 1)
    del setup
    gc.collect()
    before = _status_kib("VmRSS")
    setup = _build(name, size)
    _train(setup, x, y, 2)  # unmetered, as in _memory
    peaks = []
    for _ in range(steps):
        gc.disable()
        try:
            _reset_high_water()
            _train(setup, x, y, 1)
            peaks.append((_status_kib("VmHWM") - before) * 1024)
        finally:
            gc.enable()
    return peaks


def _worker_process_memory(rank: int, world_size: int, plan: "Plan", name: str) -> list[list[int]]:
    torch.set_num_threads(1)
    _return_freed_blocks()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(plan.size.batch, plan.size.dim, generator=g), torch.randint(plan.size.classes, (plan.size.batch,), generator=g)
    peaks = _process_memory(plan.size, x, y, plan.metered_steps, name)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, peaks)
    return everyone


# --------------------------------------------------------------------------- the worker
@dataclass(frozen=True)
class Plan:
    size: Size
    steps: int              # training steps per timed call
    repeats: int            # timed rounds per launch (after one warm-up round)
    metered_steps: int      # memory: steps metered per contender (0: no memory pass)
    defaults: bool = False  # memory: also ours' wrappers with their defaults
    lr_factor: tuple[tuple[str, float], ...] = ()  # (contender, factor): a test makes one wrong on purpose
    process_memory: bool = False  # also the resident set's peak, each contender in processes of its own


FULL_PLAN = Plan(FULL, steps=2, repeats=6, metered_steps=1, defaults=True, process_memory=True)
QUICK_PLAN = Plan(QUICK, steps=1, repeats=2, metered_steps=1)


def _worker(rank: int, world_size: int, plan: Plan) -> dict:
    torch.set_num_threads(1)  # the ranks share the cores; more threads per rank only contend
    size, lr_factor = plan.size, dict(plan.lr_factor)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(size.batch, size.dim, generator=g), torch.randint(size.classes, (size.batch,), generator=g)
    memory = {}
    if plan.metered_steps:  # before the timed contenders exist: one contender in the process at a time
        memory = _memory(size, x, y, plan.metered_steps, CONTENDERS + (DEFAULTS if plan.defaults else []))
    setups = {name: _build(name, size, lr_factor.get(name, 1.0)) for name in CONTENDERS}
    contenders = [Contender(name, run=functools.partial(_train, setups[name], x, y, plan.steps),
                            result=setups[name].full_params) for name in CONTENDERS]
    timing = measure(contenders, REFERENCE, repeats=plan.repeats, warmup=1, check=_check)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, memory)
    return {"timing": timing, "memory": {n: [r[n] for r in per_rank] for n in memory}}


# --------------------------------------------------------------------------- rows, note, table, plot
MEMORY_MEANING = "peak bytes per rank during a step, ours / torch's; below 1: ours holds less"
PROCESS_MEANING = ("peak resident set per rank during a step above the process before the contender was built "
                   "(tensors, the backend's buffers, the allocator's), ours / torch's; below 1: ours holds less")
# What a step-time ratio compares on gloo CPU ranks, where FSDP2's collectives are synchronous.
TIME_MEANING = {1: "both overlap the gradient all-reduce with backward (DDP's buckets)",
                2: "FSDP2 on a CPU waits for each collective; ours overlaps one reduce-scatter with backward",
                3: "both wait for each collective (FSDP2 on a CPU; ours overlap_comm=False)"}


def _peaks(memory: list[list[dict]]) -> list[list[int]]:
    """Per launch, per metered step: the largest peak over the ranks."""
    return [[max(rank["peak"][k] for rank in ranks) for k in range(len(ranks[0]["peak"]))] for ranks in memory]


def _memory_row(memory: dict, ours: str, torchs: str, **row: Any) -> dict:
    o, t = _peaks(memory[ours]), _peaks(memory[torchs])
    return stat_row([[a / b for a, b in zip(lo, lt)] for lo, lt in zip(o, t)], meaning=MEMORY_MEANING,
                    metric="bytes", unit="B", ours=statistics.median(v for lo in o for v in lo),
                    builtin=statistics.median(v for lt in t for v in lt), **row)


def _worst(memory: list[list[dict]]) -> tuple[int, dict, str, int]:
    """The largest peak over launches, ranks and steps: (bytes, its split, the op that reached it, bytes at rest)."""
    return max(((m["peak"][k], m["at_peak"][k], m["peak_at"][k], m["at_rest"][k])
                for ranks in memory for m in ranks for k in range(len(m["peak"]))), key=lambda t: t[0])


def _memory_note(result: dict) -> str:
    """What the memory ratios do not show: ours with its defaults, and where a stage above 1.05 peaks (ours, torch's)."""
    defaults, above = [], []
    for w, per in result["per_world_size"].items():
        memory = per["memory"]
        if DEFAULTS[0] in memory:
            ratios = (_memory_row(memory, d, STAGES[s][1], world_size=int(w), size="")["ratio"]
                      for s, d in zip(STAGES, DEFAULTS))
            defaults.append(f"W={w} " + ", ".join(f"ZeRO-{s} {r:.2f}" for s, r in zip(STAGES, ratios)))
        for stage, (ours, torchs) in STAGES.items():
            row = result["comparisons"].get(f"ZeRO-{stage} W={w} peak memory: {ours} / {torchs}")
            if row and row["ratio"] > 1.05:
                (po, so, ao, _), (pt, st, at, _) = _worst(memory[ours]), _worst(memory[torchs])
                split = lambda sp: ", ".join(f"{c} {format_bytes(sp[c])}" for c in CATEGORIES)  # noqa: E731
                above.append(f"W={w} ZeRO-{stage} peak {row['ratio']:.3f} > 1.05: ours {format_bytes(po)} at {ao} "
                             f"({split(so)}); torch's {format_bytes(pt)} at {at} ({split(st)})")
    if defaults:
        defaults = [f"ours with its defaults (ZeRO-1/2: one 25 MiB bucket, so AdamW's temporaries span this rank's "
                    f"chunk of the whole model; ZeRO-2: two reduce-scatters in flight; ZeRO-3: on a CPU each "
                    f"collective waited for, overlap_comm's default there; proj, norm and head are units too), "
                    f"peak / torch's: {'; '.join(defaults)}"]
    return "; ".join(defaults + above)


def _rows(runs: list[dict], world_size: int, size: Size, process: dict | None = None) -> dict[str, dict]:
    rows, what, memory = {}, size.describe(), _by_name(runs)
    for stage, (ours, torchs) in STAGES.items():
        rows[f"ZeRO-{stage} W={world_size} step time: {ours} / {torchs}"] = ratio_row(
            runs, ours, torchs, key=lambda result: result["timing"], world_size=world_size, size=what,
            meaning=f"step time of {ours} / {torchs} (below 1: ours faster; {TIME_MEANING[stage]})")
        if memory:
            rows[f"ZeRO-{stage} W={world_size} peak memory: {ours} / {torchs}"] = _memory_row(
                memory, ours, torchs, world_size=world_size, size=what, load=load_of(runs))
        if process and ours in process:
            o, t = process[ours]["peaks"], process[torchs]["peaks"]  # per launch, per rank, per step
            largest = lambda launch: [max(rank[k] for rank in launch) for k in range(len(launch[0]))]  # noqa: E731
            rows[f"ZeRO-{stage} W={world_size} process peak: {ours} / {torchs}"] = stat_row(
                [[a / b for a, b in zip(largest(lo), largest(lt))] for lo, lt in zip(o, t)], meaning=PROCESS_MEANING,
                metric="bytes", unit="B", world_size=world_size, size=what, load=process[ours]["load"],
                ours=statistics.median(v for lo in o for v in largest(lo)),
                builtin=statistics.median(v for lt in t for v in largest(lt)))
    return rows


def _by_name(runs: list[dict]) -> dict[str, list[list[dict]]]:
    """Contender -> per launch, per rank: its memory figures."""
    return {n: [r["result"]["memory"][n] for r in runs] for n in runs[0]["result"]["memory"]}


def _table(result: dict) -> list[dict]:
    rows = []
    for w, per in result["per_world_size"].items():
        for name in CONTENDERS + [d for d in DEFAULTS if d in per["memory"]]:
            step = per["median_step_s"].get(name)
            row = {"W": w, "contender": name, "step ms": f"{step * 1e3:.1f}" if step else "-"}
            if name in per["memory"]:  # the rank, step and launch with the largest peak, split at that moment
                peak, split, where, rest = _worst(per["memory"][name])
                row.update({"peak/rank": format_bytes(peak), "at rest": format_bytes(rest),
                            **{c: format_bytes(split[c]) for c in CATEGORIES}, "peak at": where})
            rows.append(row)
    return rows


def _process_runs(plan: Plan, world_size: int, launches: int) -> dict[str, dict]:
    """Contender -> its resident-set peaks (per launch, per rank, per step) and the load around them."""
    out = {}
    for name in CONTENDERS:
        runs = launch(_worker_process_memory, world_size, plan, name, launches=launches, backend="gloo",
                      timeout_s=600)
        out[name] = {"peaks": [r["result"] for r in runs], "load": load_of(runs)}
    return out


def run(quick: bool = False, out_dir: Path | None = None, launches: int = 3,
        world_sizes: tuple[int, ...] | None = None) -> dict:
    out_dir = Path(out_dir or RESULTS)
    plan = QUICK_PLAN if quick else FULL_PLAN
    world_sizes = world_sizes or ((2,) if quick else (2, 4))
    result = {"name": "zero", "machine": machine_info(), "model": plan.size.describe(), "plan": asdict(plan),
              "world_sizes": list(world_sizes), "launches": launches, "per_world_size": {}, "comparisons": {},
              "note": "gloo CPU ranks on one machine (maybe shared); time: contenders rotated per repeat, the "
                      "slowest rank's time; every contender's parameters checked against torch DDP's after the "
                      "warm-up and after the last repeat; memory: one meter for all (LiveTensorBytes: every tensor "
                      "storage alive in the process, sampled after every op and storage resize) over one "
                      "contender at a time, after two unmetered steps, the input batch left out; a row's ratio: "
                      "the largest peak over the ranks, ours / torch's, per launch"}
    for w in world_sizes:
        process = _process_runs(plan, w, launches) if plan.process_memory else {}
        runs = launch(_worker, w, plan, launches=launches, backend="gloo", timeout_s=1800)
        result["per_world_size"][str(w)] = {
            "median_step_s": {n: statistics.median(t / plan.steps for r in runs
                                                   for t in r["result"]["timing"]["times"][n]) for n in CONTENDERS},
            "load": load_of(runs), "samples_s": [r["result"]["timing"]["times"] for r in runs],
            "memory": _by_name(runs), "process_peaks": process}
        result["comparisons"].update(_rows(runs, w, plan.size, process))
    result["memory_note"] = _memory_note(result)
    result["table"] = _table(result)
    from distlab.plots import plot_bars

    w = str(max(world_sizes))
    memory = result["per_world_size"][w]["memory"]
    peaks = {f"{n} r{r}": max(m["peak"]) for n in CONTENDERS if n in memory
             for r, m in enumerate(memory[n][0])}  # the first launch's ranks
    if peaks:
        png = plot_bars(peaks, out_dir / "zero_memory.png", "peak tensor bytes per rank",
                        f"one step, {plan.size.describe()}, W={w} gloo CPU ranks", unit="bytes")
        result["plot"] = png.name
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, W=2, fewer repeats")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None, help="default: 2 4 (--quick: 2)")
    parser.add_argument("--launches", type=int, default=3, help="fresh process groups per world size")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = run(quick=args.quick, launches=args.launches,
                 world_sizes=tuple(args.world_sizes) if args.world_sizes else None)
    path = write_result("zero", result)
    print(format_table(result["table"]))
    print("peak/rank: the largest over ranks, launches and metered steps, split at that moment; "
          "at rest: at that step's start")
    for name, row in result["comparisons"].items():
        print(f"{name}: {format_row(row)}")
    if result["memory_note"]:
        print(f"memory note: {result['memory_note']}")
    plan = result["plan"]
    print(f"{result['launches']} launches x {plan['repeats']} repeats x {plan['steps']} steps per world size; "
          f"load average {[p['load'] for p in result['per_world_size'].values()]}; "
          f"{time.perf_counter() - start:.0f} s")
    print(f"wrote {path} and {RESULTS / 'zero_memory.png'}")


if __name__ == "__main__":
    main()
