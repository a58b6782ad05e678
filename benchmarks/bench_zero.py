"""ZeRO-1/2/3 from scratch against torch's ZeroRedundancyOptimizer and FSDP2, side by side.

An MLP (Linear 256->1024->1024->256->10, AdamW), W=2 CPU ranks (gloo over loopback),
batch 64 per rank. For each contender: per-rank bytes of parameters, gradients and
optimizer state at rest (after a step), and the median step time:

* torch DDP + AdamW: the replicated baseline;
* ours ZeRO-1 (``ZeroOptimizer``) and ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (on top of torch DDP): ours shards a flat buffer, so per-rank optimizer state is
  balanced; torch's assigns whole tensors to ranks;
* ours ZeRO-2 and FSDP2 with ``reshard_after_forward=False`` (parameters stay gathered
  between forward and backward, gradients and optimizer state sharded);
* ours ZeRO-3 (``FullyShardedDataParallel``, one unit per Linear) and FSDP2
  (``torch.distributed.fsdp.fully_shard`` per Linear, then the root), if it runs on gloo CPU.
Ours also report the peaks their meters sampled at every hook during backward.

Every repeat runs every contender in turn (rotated each repeat) between barriers;
rank 0's times, medians.

    python -m benchmarks.bench_zero [--quick]

writes benchmarks/results/zero.json and zero_memory.png.
"""
from __future__ import annotations

import argparse
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import RESULTS, comparison, machine_info, median, write_result
from distlab.launch import run_distributed
from distlab.metrics import format_bytes, format_table

ADAMW = dict(lr=1e-3, weight_decay=0.1)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


def _local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _state_bytes(optimizer) -> int:
    return _nbytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def _build(name: str):
    """(forward callable, step callable, zero_grad callable, memory() -> dict)."""
    from solutions.phase3_multi_node.fsdp import FullyShardedDataParallel
    from solutions.phase3_multi_node.zero import ZeroOptimizer

    model = _mlp()
    if name in ("torch DDP + AdamW", "torch ZeroRedundancyOptimizer"):
        ddp = nn.parallel.DistributedDataParallel(model)
        if name == "torch DDP + AdamW":
            opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
        memory = lambda: {"params": _nbytes(model.parameters()),  # noqa: E731
                          "grads": _nbytes(p.grad for p in model.parameters()),
                          "optimizer": _state_bytes(getattr(opt, "optim", opt))}
        return ddp, opt.step, lambda: opt.zero_grad(set_to_none=False), memory
    if name.startswith("ours ZeRO-") and name[-1] in "12":
        zo = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=int(name[-1]), **ADAMW)
        return model, zo.step, zo.zero_grad, lambda: {**zo.memory_bytes(), **_peaks(zo)}
    if name == "ours ZeRO-3":
        fsdp = FullyShardedDataParallel(model)
        opt = torch.optim.AdamW(fsdp.parameters(), **ADAMW)  # torch's, on our flat shards
        return fsdp, opt.step, opt.zero_grad, lambda: {**fsdp.memory_bytes(), **_peaks(fsdp)}
    from torch.distributed.fsdp import fully_shard  # FSDP2: reshard after forward = ZeRO-3, without = ZeRO-2
    reshard = "reshard_after_forward=False" not in name
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    memory = lambda: {"params": _nbytes(model.parameters()),  # noqa: E731
                      "grads": _nbytes(p.grad for p in model.parameters()), "optimizer": _state_bytes(opt)}
    return model, opt.step, lambda: opt.zero_grad(set_to_none=False), memory


CONTENDERS = ["torch DDP + AdamW", "ours ZeRO-1", "torch ZeroRedundancyOptimizer", "ours ZeRO-2",
              "torch FSDP2 (fully_shard, reshard_after_forward=False)", "ours ZeRO-3", "torch FSDP2 (fully_shard)"]


def _peaks(wrapper) -> dict[str, int]:
    """Ours only: the peaks the wrapper's meter sampled at every hook (the torch contenders have no meter)."""
    return {f"peak {k}": v for k, v in wrapper.memory.peak.items()}


def _worker(rank, world_size, steps, repeats):
    setups, errors = {}, {}
    for name in CONTENDERS:
        try:
            setups[name] = _build(name)
        except Exception as exc:  # reported in the output: e.g. FSDP2 on a backend without support
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 256, generator=g), torch.randint(10, (64,), generator=g)

    def train(name, n):
        fwd, step, zero_grad, _ = setups[name]
        for _ in range(n):
            zero_grad()
            F.cross_entropy(fwd(x), y).backward()
            step()

    for name in list(setups):
        try:
            train(name, 2)
        except Exception:
            errors[name] = traceback.format_exc().strip().splitlines()[-1][:300]
            del setups[name]
    memory = {name: setups[name][3]() for name in setups}
    samples = {name: [] for name in setups}
    for repeat in range(repeats):
        names = list(setups)
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # rotated: no fixed position
            dist.barrier()
            start = time.perf_counter()
            train(name, steps)
            dist.barrier()
            samples[name].append((time.perf_counter() - start) / steps)
    return {"samples": samples, "memory": memory, "errors": errors}


def run(quick: bool = False) -> dict:
    world_size = 2
    steps, repeats = (3, 3) if quick else (5, 9)
    ranks = run_distributed(_worker, world_size, steps, repeats, backend="gloo", timeout_s=1200)
    samples, errors = ranks[0]["samples"], ranks[0]["errors"]
    result = {"name": "zero", "machine": machine_info(), "world_size": world_size,
              "model": "MLP 256-1024-1024-256-10, AdamW", "batch_per_rank": 64, "repeats": repeats,
              "note": "gloo CPU ranks on one machine, possibly shared: contenders interleaved, medians",
              "median_step_s": {n: median(s) for n, s in samples.items()},
              "memory_per_rank": {n: [r["memory"][n] for r in ranks] for n in samples},
              "errors": errors, "comparisons": {}}
    opt_bytes = result["memory_per_rank"]
    for name in ("ours ZeRO-1", "torch ZeroRedundancyOptimizer"):
        if name in opt_bytes:
            per_rank = [m["optimizer"] for m in opt_bytes[name]]
            result[f"optimizer_state_split {name}"] = [b / sum(per_rank) for b in per_rank]
    pairs = [("ours ZeRO-1", "torch ZeroRedundancyOptimizer"), ("ours ZeRO-3", "torch FSDP2 (fully_shard)"),
             ("ours ZeRO-2", "torch FSDP2 (fully_shard, reshard_after_forward=False)")]
    for ours, builtin in pairs:
        if ours in samples and builtin in samples:
            result["comparisons"][f"{ours} vs {builtin} (step time)"] = comparison(
                samples[ours], samples[builtin], world_size, "MLP 1.6M params")
    if "ours ZeRO-1" in opt_bytes and "torch ZeroRedundancyOptimizer" in opt_bytes:
        imbalance = lambda n: max(m["optimizer"] for m in opt_bytes[n]) / (sum(m["optimizer"] for m in opt_bytes[n]) / world_size)  # noqa: E731
        result["comparisons"]["ZeRO-1 optimizer-state imbalance (max/mean): ours vs torch"] = comparison(
            imbalance("ours ZeRO-1"), imbalance("torch ZeroRedundancyOptimizer"), world_size,
            "MLP 1.6M params", metric="bytes", unit="ratio")
    rows = []
    for name in samples:
        mems = opt_bytes[name]
        rows.append({"contender": name, "step ms": f"{result['median_step_s'][name] * 1e3:.1f}",
                     **{k: " / ".join(format_bytes(m[k]) for m in mems if k in m)
                        for k in ("params", "grads", "optimizer", "peak params", "peak grads")}})
    for name, err in errors.items():
        rows.append({"contender": name, "step ms": "did not run", "params": err[:60]})
    result["table"] = rows
    from distlab.plots import plot_bars

    RESULTS.mkdir(parents=True, exist_ok=True)
    png = plot_bars({f"{n} r{r}": sum(v for k, v in m.items() if not k.startswith("peak")) / 2**20 for n in samples for r, m in enumerate(opt_bytes[n])},
                    RESULTS / "zero_memory.png", "MiB per rank (params + grads + optimizer state)",
                    f"per-rank memory at rest, W={world_size}")
    result["plot"] = str(png.relative_to(RESULTS.parent.parent))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    path = write_result("zero", result)
    print(format_table(result["table"]))
    print("memory columns: rank 0 / rank 1, at rest after a step")
    for key in (k for k in result if k.startswith("optimizer_state_split")):
        print(f"{key.removeprefix('optimizer_state_split ')}: optimizer state split "
              + " / ".join(f"{f:.1%}" for f in result[key]))
    for name, err in result["errors"].items():
        print(f"{name} could not run here: {err}")
    print(f"wrote {path} and {RESULTS / 'zero_memory.png'}")


if __name__ == "__main__":
    main()
