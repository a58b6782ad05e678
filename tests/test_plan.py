"""The planner (distlab/plan.py) against what the course's own implementations measure.

One world of 2 ranks trains a TinyGPT with each strategy the planner covers: DDP (phase 3's
bucketed DDP), ZeRO-1/2 (ZeroOptimizer), ZeRO-3 (FullyShardedDataParallel), tensor
parallelism (phase 2's ParallelGPT), a 2-stage 1F1B pipeline, context parallelism (phase
5's ring attention in every block) and expert parallelism (phase 5's MoE as every block's
MLP); one world of 4 ranks, their combinations on a 2 x 2 grid (phase 2's ``build_grid``):
tensor x data parallel, ZeRO-3 x tensor parallel, pipeline x data parallel, and experts
sharded 2 ways inside 4 data-parallel ranks. Each rank measures the bytes it sends in one
step (CommLedger.wire_bytes, by axis) and the bytes it holds (parameters, gradients,
optimizer state; activations with SavedActivationMeter); the test compares each with
``plan.estimate`` for the same configuration. The CP and EP blocks are the tour's
(``demos.tour.RingSelfAttention``, ``MoEMLP``). The reference solutions are measured
(``impl="solutions"``): the formulas are the course's, whatever state a learner's templates are in.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from demos.tour import MoEMLP, RingSelfAttention
from distlab import load, plan
from distlab.comm import CommLedger
from distlab.spawn import run_distributed
from distlab.models import GPTConfig, TinyGPT, seeded
from distlab.lessons.sync import allreduce_gradients

L, H, HEADS, V, S, B = 2, 32, 4, 64, 32, 2      # TinyGPT sizes; B: sequences per micro-batch
E, K = 4, 2                                     # experts, top-k
MODEL = plan.Model(layers=L, hidden=H, heads=HEADS, vocab=V, seq=S)
MOE_MODEL = plan.Model(layers=L, hidden=H, heads=HEADS, vocab=V, seq=S, experts=E, top_k=K)
# case -> (model, plan, micro-batches per step); float32 (4 bytes), AdamW (exp_avg, exp_avg_sq: 8 bytes)
CASES = {
    "ddp": (MODEL, plan.Plan(dp=2), 2),
    "zero1": (MODEL, plan.Plan(dp=2, zero=1), 2),
    "zero2": (MODEL, plan.Plan(dp=2, zero=2), 2),
    "zero3": (MODEL, plan.Plan(dp=2, zero=3), 2),
    "tp": (MODEL, plan.Plan(tp=2), 1),
    "pp": (MODEL, plan.Plan(pp=2), 4),
    "cp": (MODEL, plan.Plan(cp=2), 1),
    "ep": (MOE_MODEL, plan.Plan(dp=2, ep=2), 1),
    "tp x dp": (MODEL, plan.Plan(dp=2, tp=2), 1),
    "zero3 x tp": (MODEL, plan.Plan(dp=2, tp=2, zero=3), 1),
    "pp x dp": (MODEL, plan.Plan(dp=2, pp=2), 4),
    "ep x dp": (MOE_MODEL, plan.Plan(dp=4, ep=2), 1),
}
# Within 5 %: what the formulas leave out is the padding of flat ZeRO/FSDP buffers to a
# multiple of W elements and, in the expert-parallel cases, the router's imbalance (rows a
# rank receives: compared as the mean over ranks); both are < 1 % here. A factor missed
# (the ring's 2, a W, one all-gather, a layer) is 25 % or more.
RTOL = 0.05


def _train(case: str) -> plan.Train:
    model, p, m = CASES[case]
    return plan.Train(micro_batch=B, global_batch=B * p.dp * m, dtype_bytes=4, optimizer_bytes=8)


def _gpt(seed: int = 0) -> TinyGPT:
    return seeded(TinyGPT, seed, GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=HEADS, n_embd=H))


def _batches(m: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(V, (B, S), generator=g), torch.randint(V, (B, S), generator=g)) for _ in range(m)]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _held(params, optimizer) -> dict[str, int]:
    params = list(params)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": _nbytes(params), "grads": _nbytes(p.grad for p in params), "optimizer": _nbytes(state)}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _saved(fn, exclude) -> int:
    meter = load("phase2_advanced", "activation_checkpointing", impl="solutions").SavedActivationMeter(exclude)
    with meter:
        fn()
    return meter.bytes


# --------------------------------------------------------------------------- the strategies, measured
def _data_parallel(kind: str, rank: int) -> dict:
    model, ledger, batches = _gpt(), CommLedger(), _batches(2, rank)
    if kind == "zero3":
        fsdp = load("phase3_multi_node", "fsdp", impl="solutions").FullyShardedDataParallel(model)
        optimizer = _adamw(fsdp.parameters())  # its flat shards
        with ledger:
            optimizer.zero_grad()
            for x, y in batches:  # accumulation: every micro-batch gathers twice and reduce-scatters
                fsdp(x, y)[1].backward()
            optimizer.step()
        return {"comm": {"dp": ledger.wire_bytes()}, **fsdp.memory_bytes()}
    if kind in ("zero1", "zero2"):
        zero = load("phase3_multi_node", "zero", impl="solutions").ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, stage=int(kind[-1]), lr=1e-3)
        with ledger:
            zero.zero_grad()
            for x, y in batches:
                model(x, y)[1].backward()
            zero.step()
        return {"comm": {"dp": ledger.wire_bytes()}, **zero.memory_bytes()}
    ddp = load("phase3_multi_node", "ddp_bucketed", impl="solutions").DDPBucketed(model, bucket_size_mb=0.01)
    optimizer = _adamw(model.parameters())
    with ledger:
        optimizer.zero_grad(set_to_none=True)
        with ddp.no_sync():  # accumulate the first micro-batch; the second backward reduces once
            ddp(*batches[0])[1].backward()
        ddp(*batches[1])[1].backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    return {"comm": {"dp": ledger.wire_bytes()}, **_held(model.parameters(), optimizer)}


def _tensor_parallel(grid=None, zero3: bool = False) -> dict:
    """ParallelGPT over ``grid``'s rows (None: the world); with a grid, data parallel over its
    columns: phase 2's gradient all-reduce, or phase 3's ZeRO-3 (``zero3``)."""
    tp = load("phase2_advanced", "tensor_parallel", impl="solutions").ParallelGPT(_gpt(), grid and grid.tp_group)
    (x, y), = _batches(1, grid.dp_rank if grid else 0)  # the same tokens on a tensor-parallel row
    tp_ledger, dp_ledger, out = CommLedger(), CommLedger(), {}
    if zero3:
        fsdp = load("phase3_multi_node", "fsdp", impl="solutions").FullyShardedDataParallel(
            tp, units=list(tp.blocks), group=grid.dp_group)  # the head reads wte.weight: it stays in the root
        optimizer = _adamw(fsdp.parameters())
        with tp_ledger:  # (activations: as "tp x dp"; the meter would count the gathered weights too)
            optimizer.zero_grad()
            fsdp(x, y)[1].backward()
            optimizer.step()
        tp_bytes = tp_ledger.wire_bytes("all_reduce")  # ZeRO-3 gathers and reduce-scatters; TP all-reduces
        comm = {"tp": tp_bytes, "dp": tp_ledger.wire_bytes() - tp_bytes}
        return {"comm": comm, **fsdp.memory_bytes()}
    optimizer = _adamw(tp.parameters())
    with tp_ledger:
        optimizer.zero_grad(set_to_none=True)
        out["act"] = _saved(lambda: out.setdefault("loss", tp(x, y)[1]), tp.parameters())
        out.pop("loss").backward()
    if grid:
        with dp_ledger:
            load("phase2_advanced", "tp_dp_2d", impl="solutions").allreduce_dp_gradients(tp, grid)
    optimizer.step()
    return {"comm": {"tp": tp_ledger.wire_bytes(), "dp": dp_ledger.wire_bytes()}, **out,
            **_held(tp.parameters(), optimizer)}


class _First(nn.Module):
    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks = gpt.wte, gpt.wpe, gpt.blocks[:L // 2]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class _Last(nn.Module):
    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.blocks, self.ln_f = gpt.blocks[L // 2:], gpt.ln_f
        self.head = nn.Linear(H, V, bias=False)  # the tied weight lives on stage 0: a copy here (Megatron's)
        self.head.weight = nn.Parameter(gpt.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pipeline(grid=None) -> dict:
    """Two 1F1B stages over ``grid``'s rows (None: the world); with a grid, the stages' gradients
    averaged over its columns."""
    pipeline = load("phase2_advanced", "pipeline", impl="solutions")
    m, stage_id = CASES["pp"][2], grid.tp_rank if grid else dist.get_rank()
    module = (_First if stage_id == 0 else _Last)(_gpt())
    stage = pipeline.PipelineStage(module, recv_shape=(B, S, H), group=grid and grid.tp_group)
    optimizer, batches = _adamw(module.parameters()), _batches(m, grid.dp_rank if grid else 0)
    pp_ledger, dp_ledger = CommLedger(), CommLedger()
    with pp_ledger:
        optimizer.zero_grad(set_to_none=True)
        pipeline.one_f_one_b(stage, [b[0] for b in batches] if stage_id == 0 else [None] * m,
                             [b[1] for b in batches] if stage_id == 1 else [None] * m, _lm_loss)
    if grid:
        with dp_ledger:
            allreduce_gradients(module.parameters(), group=grid.dp_group)
    optimizer.step()
    one = (lambda: module(batches[0][0])) if stage_id == 0 else \
        (lambda: _lm_loss(module(torch.randn(B, S, H, requires_grad=True)), batches[0][1]))
    act = _saved(one, module.parameters()) * stage.peak_in_flight  # one micro-batch's, times those held at once
    return {"comm": {"pp": pp_ledger.wire_bytes(), "dp": dp_ledger.wire_bytes()}, "act": act,
            **_held(module.parameters(), optimizer)}


def _context_parallel(rank: int) -> dict:
    ring = load("phase5_large_models", "ring_attention", impl="solutions")
    layout = ring.sequence_layout(S, 2, "zigzag")
    gpt, pos = _gpt(), layout[rank]
    for block in gpt.blocks:
        block.attn = RingSelfAttention(block.attn, layout, ring.ring_attention)
    optimizer, ledger, (x, y) = _adamw(gpt.parameters()), CommLedger(), _batches(1, 0)[0]

    def loss():
        h = gpt.wte(x[:, pos]) + gpt.wpe(pos)
        for block in gpt.blocks:
            h = block(h)
        return _lm_loss(gpt.lm_head(gpt.ln_f(h)), y[:, pos])

    out = {}
    with ledger:
        optimizer.zero_grad(set_to_none=True)
        out["act"] = _saved(lambda: out.setdefault("loss", loss()), gpt.parameters())
        out.pop("loss").backward()
        allreduce_gradients(gpt.parameters())  # the cp ranks hold the same parameters, other tokens
        optimizer.step()
    comm = {"cp": ledger.wire_bytes("isend"), "dp": ledger.wire_bytes("all_reduce")}
    return {"comm": comm, **out, **_held(gpt.parameters(), optimizer)}


def _expert_parallel(grid=None) -> dict:
    """E/ep experts per rank of ``grid``'s rows (None: the world); dense gradients averaged over
    the world, experts' over the grid's columns (the ranks holding the same experts)."""
    moe = load("phase5_large_models", "moe", impl="solutions")
    gpt = _gpt()
    torch.manual_seed(1)  # every rank: the same router and experts (each keeps E/ep of them)
    for block in gpt.blocks:
        router, experts = nn.Linear(H, E, bias=False), moe.Experts(E, H, 4 * H)
        block.mlp = MoEMLP(moe.ExpertParallelMoE(router, experts, top_k=K, capacity_factor=E / K,  # C = N: no drops
                                                  group=grid and grid.tp_group))
    (x, y), = _batches(1, dist.get_rank())
    optimizer, ep_ledger, dp_ledger, out = _adamw(gpt.parameters()), CommLedger(), CommLedger(), {}
    with ep_ledger:
        optimizer.zero_grad(set_to_none=True)
        out["act"] = _saved(lambda: out.setdefault("loss", gpt(x, y)[1] + sum(b.mlp.aux for b in gpt.blocks)),
                            gpt.parameters())
        out.pop("loss").backward()
    with dp_ledger:
        allreduce_gradients(p for n, p in gpt.named_parameters() if ".experts." not in n)  # dense: replicated
        if grid:
            allreduce_gradients((p for n, p in gpt.named_parameters() if ".experts." in n), group=grid.dp_group)
    optimizer.step()
    return {"comm": {"ep": ep_ledger.wire_bytes(), "dp": dp_ledger.wire_bytes()}, **out,
            **_held(gpt.parameters(), optimizer)}


def _worker_measure_2d(rank, world_size):
    grid = load("phase2_advanced", "tp_dp_2d", impl="solutions").build_grid(2)  # rows: tp/pp/ep; columns: dp
    return {"tp x dp": _tensor_parallel(grid), "zero3 x tp": _tensor_parallel(grid, zero3=True),
            "pp x dp": _pipeline(grid), "ep x dp": _expert_parallel(grid)}


def _worker_measure(rank, world_size):
    measured = {kind: _data_parallel(kind, rank) for kind in ("ddp", "zero1", "zero2", "zero3")}
    measured.update(tp=_tensor_parallel(), pp=_pipeline(), cp=_context_parallel(rank), ep=_expert_parallel())
    return measured


def _check(measured: float, predicted: float, what: str) -> None:
    if predicted == 0:
        assert measured == 0, f"{what}: measured {measured:.0f} B, the planner says none"
        return
    assert abs(measured / predicted - 1) <= RTOL, \
        f"{what}: measured {measured:.0f} B, planner {predicted:.0f} B ({measured / predicted - 1:+.1%})"


@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_matches_measured_bytes_and_memory(world_size):
    ranks = run_distributed(_worker_measure if world_size == 2 else _worker_measure_2d, world_size, timeout_s=120)
    for case in ranks[0]:
        model, p, _ = CASES[case]
        got = [r[case] for r in ranks]
        if case.startswith("ep"):  # the router sends each rank a different share: the mean over ranks
            got = [{**{k: sum(g[k] for g in got) / world_size for k in ("params", "grads", "optimizer", "act")},
                    "comm": {ax: sum(g["comm"][ax] for g in got) / world_size for ax in got[0]["comm"]}}] * world_size
        for rank, g in enumerate(got):
            est = plan.estimate(model, p, _train(case), stage=rank % p.pp)  # stages: consecutive ranks
            what = f"{case} ({p.name()}), rank {rank}"
            for key in ("params", "grads", "optimizer"):
                _check(g[key], getattr(est, key), f"{what}: {key}")
            for axis, nbytes in est.comm.items():
                _check(g["comm"].get(axis, 0), nbytes, f"{what}: bytes sent per step on the {axis} axis")
            if "act" in g:
                _check(g["act"], est.activations, f"{what}: activations")


def test_plan_activations_match_saved_tensors_with_and_without_recomputation():
    """Single process (what data parallelism keeps per rank): every layer's saved tensors, and
    with phase 2's checkpointing only each layer's input (+ one layer's insides during its backward)."""
    ckpt = load("phase2_advanced", "activation_checkpointing", impl="solutions")
    est = plan.estimate(MODEL, plan.Plan(dp=2), _train("ddp"))
    (x, y), = _batches(1, 0)
    gpt = _gpt()
    _check(_saved(lambda: gpt(x, y), gpt.parameters()), est.activations, "activations, no recomputation")
    block_in = torch.randn(B, S, H, requires_grad=True)
    _check(_saved(lambda: gpt.blocks[0](block_in), gpt.parameters()), est.layer_activations, "one layer's insides")
    ckpt.apply_activation_checkpointing(gpt.blocks)
    _check(_saved(lambda: gpt(x, y), gpt.parameters()), est.activations_recompute - est.layer_activations,
           "activations kept with recomputation")


def test_plan_memory_is_the_zero_papers_table():
    """phase3 guidelines_ddp_zero.md#memory-math: Psi = 7.5 B, W = 64, fp16 + Adam (2 + 2 + 12 bytes)."""
    model = plan.Model(layers=1, hidden=8, heads=1, vocab=8, seq=8, params=7.5e9)
    train = plan.Train(global_batch=64)
    for zero, gb in ((0, 120), (1, 31.4), (2, 16.6), (3, 1.9)):
        est = plan.estimate(model, plan.Plan(dp=64, zero=zero), train)
        state = (est.params + est.grads + est.optimizer) / 1e9
        assert abs(state - gb) < 0.05 * gb, f"ZeRO-{zero}: {state:.1f} GB per rank, the paper's table says {gb}"
    assert plan.estimate(model, plan.Plan(pp=4), plan.Train(global_batch=12)).bubble == pytest.approx(3 / 15)


def test_plan_cli_ranks_feasible_plans_and_names_the_bad_flag(capsys):
    feasible = plan.main(["--params", "7e9", "--layers", "32", "--hidden", "4096", "--seq", "4096",
                          "--gpus", "64", "--gpu-mem", "80"])
    out = capsys.readouterr().out
    assert "ZeRO-3 DP64" in out and "DDP DP64" in out, out
    assert feasible and all(r["est"].total <= 80e9 for r in feasible)
    assert [r["time"] for r in feasible] == sorted(r["time"] for r in feasible)
    ddp = plan.evaluate(plan.Model(32, 4096, 32, 32000, 4096, params=7e9), plan.Plan(dp=64), plan.Train(),
                        plan.Cluster(64))
    assert not ddp["fits"], "7e9 parameters x 16 bytes = 112 GB of model state cannot fit in 80 GB"
    for argv, message in ((["--gpus", "60", "--tp", "4", "--pp", "2"], "--gpus 60 is not divisible by --tp 4 x --pp 2"),
                          (["--gpus", "48", "--tp", "3"], "--heads 32 is not divisible by --tp 3"),
                          (["--gpus", "64", "--pp", "3"], "--layers 32 is not divisible by --pp 3")):
        with pytest.raises(SystemExit):
            plan.main(["--preset", "llama-7b", *argv])
        assert message in capsys.readouterr().err
