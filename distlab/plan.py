"""The planner: which parallelism fits a model on a cluster, and what each costs, by the course's formulas.

    python -m distlab.plan --params 7e9 --layers 32 --hidden 4096 --seq 4096 --gpus 64 --gpu-mem 80
    python -m distlab.plan --preset llama-7b --gpus 64 --gpu-mem 80
    python -m distlab.plan --preset gpt2-small --gpus 8 --gpu-mem 24 --tp 1
    python -m distlab.plan --preset mixtral-8x7b --gpus 64 --ep 8
    python -m distlab.plan --reproduce megatron     # the step-time model against Megatron-LM's Table 1

For every way of writing --gpus as dp x tp x pp x cp (tp within a node, experts sharded ep
ways inside dp), with DDP or ZeRO-1/2/3 on the data-parallel axis and with or without
recomputation, it computes per rank the bytes of parameters, gradients, optimizer state
and activations, and the bytes each rank sends per step on each axis, then ranks the
plans that fit in --gpu-mem by an estimated step time (compute, bubble, communication).

The model is the course's TinyGPT at any size (GPT-2 blocks: separate q/k/v, 4h MLP with
GELU, LayerNorms, learned positions; ``--experts E`` turns every MLP into the course's
mixture of experts, ReLU experts without biases). ``--params`` rescales the architecture's
parameter count to the given total. Memory and bytes are the formulas of
phase5_large_models/guidelines.md#planner, which tests/test_plan.py checks against what the
course's own implementations (DDP, ZeRO, FSDP, tensor parallel, 1F1B, ring attention, MoE)
measure at small scale; the step time is an estimate from --tflops and the bandwidths. The
step-time model checked against published runs (tensor x pipeline x data parallel, on a
described cluster) is distlab/plan_time.py's: ``--reproduce megatron``.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from distlab.metrics import format_table
from distlab.plan_cli import parser

from distlab.plan_memory import GB, PRESETS, Estimate, Model, Plan, Train, estimate  # noqa: F401 - re-exported


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_mem_gb: float = 80.0
    gpus_per_node: int = 8
    tflops: float = 400.0      # achieved per GPU (bf16 dense peak is ~1000 on an H100)
    intra_gbs: float = 450.0   # NVLink, per GPU and direction
    inter_gbs: float = 50.0    # InfiniBand, 400 Gb/s per GPU


def step_time(model: Model, plan: Plan, train: Train, cluster: Cluster, stages: list[Estimate]) -> float:
    """Estimated seconds per step: compute / (1 - bubble) + communication, nothing overlapped."""
    cnt = model.counts()
    active = sum(cnt.values()) - cnt.get("experts", 0) * (1 - model.top_k / model.experts)
    per_token = 6 * active + 6 * model.layers * model.seq * model.hidden  # matmuls + causal attention
    flops = per_token * (4 / 3 if plan.recompute else 1) * train.global_batch * model.seq
    compute = flops / (plan.world_size * cluster.tflops * 1e12)
    span = {"tp": plan.tp, "cp": plan.tp * plan.cp, "ep": plan.tp * plan.cp * plan.ep,
            "dp": plan.tp * plan.cp * plan.dp, "pp": plan.world_size}  # ranks: tp fastest, then cp, dp, pp
    comm = 0.0
    for axis, nbytes in ((ax, max(s.comm[ax] for s in stages)) for ax in span):
        gbs = cluster.intra_gbs if span[axis] <= cluster.gpus_per_node else cluster.inter_gbs
        comm += nbytes / (gbs * GB)
    return compute / (1 - stages[0].bubble) + comm


def check_degrees(model: Model, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> None:
    """ValueError naming the flag when a degree does not divide what it splits."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)
    need(model.hidden % model.heads == 0, f"--hidden {model.hidden} is not divisible by --heads {model.heads}")
    need(1 <= model.top_k <= model.experts, f"--top-k {model.top_k} must be between 1 and --experts {model.experts}")
    need(model.heads % tp == 0, f"--heads {model.heads} is not divisible by --tp {tp}")
    need(model.f % tp == 0, f"the MLP width {model.f} (--ffn) is not divisible by --tp {tp}")
    need(model.experts == 1 or tp == 1, f"--tp {tp} with --experts {model.experts}: tensor parallelism of "
                                        f"the experts is not modelled; use --tp 1")
    need(model.layers % pp == 0, f"--layers {model.layers} is not divisible by --pp {pp}")
    need(cp == 1 or model.seq % (2 * cp) == 0,
         f"--seq {model.seq} is not divisible by 2 x --cp {cp} = {2 * cp} (the zig-zag split)")
    need(model.experts % ep == 0, f"--experts {model.experts} is not divisible by --ep {ep}")


def check(model: Model, plan: Plan, train: Train) -> None:
    """ValueError naming the flag when ``plan`` cannot run ``model`` with ``train``'s batch."""
    check_degrees(model, plan.tp, plan.pp, plan.cp, plan.ep)
    if plan.dp % plan.ep:
        raise ValueError(f"--ep {plan.ep} does not divide the data-parallel size {plan.dp} "
                         f"(experts are sharded inside the data-parallel ranks)")
    if plan.pp > 1 and plan.zero > 1:
        raise ValueError(f"--zero {plan.zero} with --pp {plan.pp}: ZeRO-2/3 would communicate every "
                         f"micro-batch; pipelines use DDP or ZeRO-1")
    per = train.micro_batch * plan.dp
    if train.global_batch % per:
        raise ValueError(f"--global-batch {train.global_batch} is not divisible by --micro-batch "
                         f"{train.micro_batch} x data-parallel size {plan.dp} = {per}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plans(model: Model, train: Train, cluster: Cluster, fixed: dict) -> list[Plan]:
    """Every valid plan over ``cluster.gpus``, with the degrees in ``fixed`` (tp, pp, ...) held."""
    W, out = cluster.gpus, []
    pick = lambda key, options: [fixed[key]] if fixed.get(key) is not None else options  # noqa: E731
    for tp in pick("tp", [d for d in divisors(W) if d <= cluster.gpus_per_node]):
        for pp in pick("pp", divisors(W // tp) if W % tp == 0 else []):
            for cp in pick("cp", divisors(W // (tp * pp)) if W % (tp * pp) == 0 else []):
                if W % (tp * pp * cp):
                    continue
                dp = W // (tp * pp * cp)
                for ep in pick("ep", [d for d in divisors(dp) if model.experts % d == 0]):
                    for zero in pick("zero", [0, 1, 2, 3] if dp * cp > 1 else [0]):
                        for rc in pick("recompute", [False, True]):
                            plan = Plan(dp, tp, pp, cp, ep, zero, rc)
                            try:
                                check(model, plan, train)
                            except ValueError:
                                continue
                            out.append(plan)
    return out


def evaluate(model: Model, plan: Plan, train: Train, cluster: Cluster) -> dict:
    stages = [estimate(model, plan, train, s) for s in range(plan.pp)]
    worst = max(stages, key=lambda x: x.total)
    return {"plan": plan, "est": worst, "comm": sum(max(s.comm[ax] for s in stages) for ax in worst.comm),
            "fits": worst.total <= cluster.gpu_mem_gb * GB, "time": step_time(model, plan, train, cluster, stages)}


def _row(r: dict) -> dict:
    est, g = r["est"], lambda x: f"{x / GB:.1f}"
    return {"plan": r["plan"].name(), "params": g(est.params), "grads": g(est.grads), "optim": g(est.optimizer),
            "act": g(est.activations), "act (recompute)": g(est.activations_recompute), "total GB": g(est.total),
            "fits": "yes" if r["fits"] else "no", "sent/step GB": g(r["comm"]),
            "bubble": f"{est.bubble:.1%}" if r["plan"].pp > 1 else "-",
            "micro-batches": est.microbatches if r["plan"].pp > 1 else "-", "step s (est.)": f"{r['time']:.2f}"}


def _model(args: argparse.Namespace) -> Model:
    """The preset, overridden by the flags given; ValueError naming a missing or bad flag."""
    fields = dict(PRESETS.get(args.preset, {}))
    fields.update({k: getattr(args, k) for k in ("params", "layers", "hidden", "heads", "vocab", "seq", "ffn",
                                                   "experts", "top_k") if getattr(args, k) is not None})
    if args.untied:
        fields["tied"] = False
    for key in ("layers", "hidden", "seq"):
        if key not in fields:
            raise ValueError(f"--{key} is required (or a --preset)")
    fields.setdefault("heads", max(1, fields["hidden"] // 128))
    fields.setdefault("vocab", 32000)
    for key, value in fields.items():
        if key != "tied" and value <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {value}")
    return Model(**fields)


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the tables; return the feasible plans, best first (``evaluate``'s dicts; --reproduce: its rows)."""
    ap = parser(sorted(PRESETS), __doc__.splitlines()[0])
    args = ap.parse_args(argv)
    if args.reproduce == "megatron":  # Table 1's rows (imported when asked: it loads the cluster model)
        from distlab.plan_time import reproduce_megatron  # noqa: PLC0415
        return reproduce_megatron()
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "cp", "ep", "zero")}
    fixed["recompute"] = None if args.recompute is None else args.recompute == "yes"
    try:
        if args.gpus is None:
            raise ValueError("--gpus is required (or --reproduce megatron)")
        for key in ("gpus", "micro_batch", "global_batch", "gpu_mem", "tp", "pp", "cp", "ep"):
            if getattr(args, key) is not None and getattr(args, key) <= 0:
                raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
        model = _model(args)
        check_degrees(model, *(fixed[k] or 1 for k in ("tp", "pp", "cp", "ep")))
        held = math.prod(fixed[k] or 1 for k in ("tp", "pp", "cp"))
        if args.gpus % held:
            raise ValueError(f"--gpus {args.gpus} is not divisible by --tp {fixed['tp'] or 1} x --pp "
                             f"{fixed['pp'] or 1} x --cp {fixed['cp'] or 1} = {held}")
        train = Train(args.micro_batch, args.global_batch, args.dtype_bytes, args.optimizer_bytes)
        if all(fixed[k] is not None for k in ("tp", "pp", "cp")):  # one split: say exactly what is wrong
            check(model, Plan(args.gpus // held, fixed["tp"], fixed["pp"], fixed["cp"], fixed["ep"] or 1,
                              fixed["zero"] or 0), train)
        cluster = Cluster(args.gpus, args.gpu_mem, args.gpus_per_node, args.tflops, args.intra_gbs, args.inter_gbs)
        found = plans(model, train, cluster, fixed)
        if not found:
            raise ValueError(f"no plan splits --gpus {args.gpus} for this model with {fixed}; check that "
                             f"--heads, --layers, --seq, --experts and --global-batch divide")
    except ValueError as exc:
        ap.error(str(exc))
    results = [evaluate(model, p, train, cluster) for p in found]
    print(f"model: {sum(model.counts().values()):.3g} parameters, {model.layers} layers, hidden {model.hidden}, "
          f"{model.heads} heads, vocab {model.vocab}, seq {model.seq}"
          + (f", {model.experts} experts top-{model.top_k}" if model.experts > 1 else ""))
    print(f"step: {train.global_batch} sequences in micro-batches of {train.micro_batch}; {train.dtype_bytes}-byte "
          f"params/grads/activations, {train.optimizer_bytes} optimizer bytes per parameter; {args.gpus} GPUs x "
          f"{args.gpu_mem:g} GB, {args.gpus_per_node} per node")
    alone = {}  # one axis takes every GPU (experts, if any, sharded over all of them or none)
    for r in results:
        pl = r["plan"]
        if (pl.recompute == bool(fixed["recompute"]) and args.gpus in (pl.dp, pl.tp, pl.pp, pl.cp)
                and pl.ep in (1, pl.dp)):
            alone.setdefault(pl.name(), r)
    if alone:
        print(f"\neach strategy alone over {args.gpus} GPUs (per rank; the fullest pipeline stage):")
        print(format_table([_row(r) for r in alone.values()]))
    feasible = sorted((r for r in results if r["fits"]), key=lambda r: r["time"])
    print(f"\n{len(feasible)} of {len(results)} plans fit in {args.gpu_mem:g} GB; the best by estimated step time:")
    if feasible:
        print(format_table([_row(r) for r in feasible[:args.top]]))
    else:
        best = min(results, key=lambda r: r["est"].total)
        print(f"none: the smallest needs {best['est'].total / GB:.1f} GB per GPU ({best['plan'].name()})")
    print("\nformulas: phase5_large_models/guidelines.md#planner; sent/step = bytes each rank sends per step, "
          "ring estimate; step time = compute / (1 - bubble) + communication, no overlap assumed")
    return feasible


if __name__ == "__main__":
    main(sys.argv[1:])
