"""Host synchronisations per training step: each strategy's budget, counted as a GPU pays it.

``distlab.host_sync.HostSyncMeter`` counts every call that makes the CPU wait for the GPU
(``.item()``, ``bool(t)``, ``nonzero``, ``.cpu()``, ``torch.cuda.synchronize`` ...), also on CPU
tensors, so these CPU tests hold each strategy to the number of stalls it would cost on CUDA.
Each worker runs one warm-up step (first-step work is not the steady state), then meters
``STEPS`` steps; the parent compares, and a failure lists each sync with its line.

Budgets per steady-state step (world size 2):

| strategy | budget | why |
|---|---|---|
| naive DDP (1.x), per-parameter DDP (3.10-3.11), bucketed DDP (3.12-3.14), torch DDP | 0 | the all-reduces are queued; nothing asks the host |
| ZeRO-1/2, torch ZeroRedundancyOptimizer | 0 | as DDP |
| pipeline GPipe/1F1B (timeline on or off) | 0, the last stage 1 | ``train_step`` returns the loss as a float |
| ring attention, forward and backward | 0 | the visible rows/columns come from host positions |
| loss scaler (``unscale_``/``step``/``update``) | 1 | the found-inf verdict; ``torch.amp.GradScaler`` pays the same one |

Each data-parallel strategy and ZeRO runs with SGD and with AdamW: AdamW's ``.item()`` of its
``step`` per parameter per step reads a CPU tensor in a GPU run too (not counted; issue 33).

The p2p size check (distlab/p2p.py, on by default) sends a size header with every message. On
CUDA its verdict is deferred (the header copied to the host without blocking, read once it has
landed): 0 syncs per receive. The CPU tests play that path with ``p2p.defer_size_checks_on_cpu()``
(CPU headers would be read at once, one ``tolist`` per receive, counted as a sync): the pipeline
and ring workers run with the check on that way, and a test counts 0 per receive against 1 on
the immediate path.
"""
from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import load, p2p
from distlab.host_sync import HostSyncMeter
from distlab.spawn import run_distributed
from distlab.metrics import Timeline, device_clock
from distlab.models import ToyMLP, seeded
from distlab.testing import shard

STEPS = 2
BATCH = 8  # global batch; 4 rows per rank at W = 2


def _metered(step, steps: int = STEPS) -> dict:
    """One warm-up ``step()``, then ``steps`` metered ones: syncs, steps and the report."""
    step()
    with HostSyncMeter() as meter:
        for _ in range(steps):
            step()
    return {"syncs": len(meter), "steps": steps, "report": meter.report()}


def _check(results: list[dict], budget) -> None:
    """``budget(name, rank)``: the most syncs per step each rank's strategy may pay."""
    for rank, mine in enumerate(results):
        for name, got in mine.items():
            per_step, allowed = got["syncs"] / got["steps"], budget(name, rank)
            assert per_step <= allowed, (f"rank {rank}, {name}: {per_step:g} host syncs per step, budget {allowed} "
                                         f"(each makes the CPU wait for the GPU):\n{got['report']}")


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """An ordinary torch training step (the wrappers all-reduce in backward, ZeRO in step)."""
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _data(rank: int, world_size: int, step: int = 0):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randint(3, (BATCH,), generator=g)
    return shard(x, rank, world_size), shard(y, rank, world_size)


# --------------------------------------------------------------------------- the meter
# An INFO logger that formats its records, as a training log does; outside logging's tree (no parent), so no
# other handler formats them too (from the venv, the suite once counted pytest's own formatter and a second
# handler of a module imported twice: 4 reprs for 1)
_LOG = logging.Logger("test_host_sync.private", logging.INFO)
_LOG.addHandler(logging.StreamHandler(io.StringIO()))


def _sync_calls():
    x, cpu, host_buffer = torch.arange(6.0), torch.device("cpu"), torch.empty(6)
    return [("repr", lambda: print(x)), ("repr", lambda: str(x)), ("repr", lambda: _LOG.info("loss %s", x)),
            ("to host", lambda: x.to(torch.device("cpu"))), ("to host", lambda: x.to(device=cpu)),
            ("to host", lambda: host_buffer.copy_(x)),
            ("linalg info check", lambda: torch.linalg.inv(torch.eye(2) + x[:4].view(2, 2))),
            ("item", lambda: x.sum().item()), ("item", lambda: bool(x.sum() > 0)),
            ("item", lambda: 1 if (x > 0).any() else 0), ("item", lambda: f"{x.sum():.2f}"),
            ("tolist", lambda: x.tolist()), ("to host", lambda: x.cpu()), ("to host", lambda: x.to("cpu")),
            ("nonzero", lambda: torch.nonzero(x > 2)), ("nonzero", lambda: torch.where(x > 2)),
            ("boolean mask index", lambda: x[x > 2]), ("masked_select", lambda: x.masked_select(x > 2)),
            ("unique", lambda: torch.unique(x)), ("repeat_interleave", lambda: torch.tensor([1, 2]).repeat_interleave(2)
                                                  .repeat_interleave(torch.tensor([1, 1, 2, 2]))),
            ("equal", lambda: torch.equal(x, x)), ("cuda.synchronize", lambda: torch.cuda.synchronize()),
            ("Event.synchronize", lambda: torch.cuda.Event().synchronize()),
            ("cuda.synchronize", lambda: device_clock("cpu"))]  # the bench's timers: a sync on CUDA


@pytest.mark.parametrize("op, call", _sync_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_meter_counts_each_sync_at_its_line(op, call):
    with HostSyncMeter() as meter:
        try:
            call()
        except (RuntimeError, AssertionError, AttributeError):  # no CUDA here: counted before the real call fails
            pass
    assert meter.counts() == {op: 1}, f"expected one {op}, counted {meter.counts()}: {meter.report()}"
    assert any(w.startswith("tests/test_host_sync.py:") for w in meter.records[0].where), meter.records[0]


def test_meter_ignores_what_never_waits():
    x, w, device, buffer = torch.arange(6.0, requires_grad=True), torch.arange(6.0), torch.device("cpu"), torch.empty(6)
    with HostSyncMeter() as meter:
        y = torch.where(x > 2, x, 0.0).masked_fill(w > 4, 0.0)
        torch._foreach_mul_([w, w.clone()], 0.5)
        (y * torch.isfinite(y).all()).sum().backward()
        w.to(torch.float64), w.to(w.device), w.numpy(), torch.nonzero_static(w, size=6)
        w.to(device), buffer.copy_(w)  # the run's device (a no-op here; on a GPU, device to device)
        torch.linalg.inv_ex(torch.eye(2))  # no error check: the info stays on the device
        torch.tensor([1, 2]).repeat_interleave(torch.tensor([1, 2]), output_size=3)
    assert len(meter) == 0, meter.report()


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.AdamW(ps, foreach=False), lambda ps: torch.optim.AdamW(ps, foreach=True),
    lambda ps: torch.optim.Adam(ps)], ids=["AdamW", "AdamW foreach", "Adam"])
def test_meter_ignores_adam_step_counters_kept_on_the_host(optimizer):
    # torch keeps a non-capturable Adam's `step` on the CPU in a GPU run too: its .item() per
    # parameter per step reads host memory and waits for nothing.
    params = [nn.Parameter(torch.ones(3)) for _ in range(3)]
    opt = optimizer(params)
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    with HostSyncMeter() as meter:
        opt.step()
        params[0].sum().item()  # still counted: a parameter's value is on the device
    assert meter.counts() == {"item": 1}, meter.report()


def test_budget_failure_names_the_line_and_meters_nest():
    w = nn.Parameter(torch.ones(3))
    w.register_hook(lambda g: g * float(g.sum()))  # a sync inside backward: autograd's hook
    with HostSyncMeter() as outer:
        with HostSyncMeter() as inner:
            (w * 2).sum().backward()
        w.grad.tolist()
    assert (len(inner), len(outer)) == (1, 2), (inner.report(), outer.report())
    with pytest.raises(AssertionError, match=r"2 host syncs per step .* budget 1:\n1 x item at "
                                             r"tests/test_host_sync.py:\d+ in <lambda>"):
        outer.check(budget=1, steps=1, what="hook")
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist, "the meter's patches must be undone on exit"


def test_timeline_records_spans_without_a_sync():
    on, off = Timeline("cpu"), Timeline("cpu", enabled=False)
    with HostSyncMeter() as meter:
        for timeline in (on, off):
            start = timeline.mark()
            torch.ones(4).sum()
            timeline.span(start, 0, "F", 3)
    assert len(meter) == 0, meter.report()
    (lane, start, end, kind, label), = on.spans
    assert (lane, kind, label) == (0, "F", 3) and start <= end and off.spans == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timeline_waits_once_when_read():
    timeline, x = Timeline("cuda"), torch.ones(256, 256, device="cuda")
    with HostSyncMeter() as meter:
        for mb in range(4):
            start = timeline.mark()
            x = x @ x / 256
            timeline.span(start, 0, "F", mb)
        assert len(meter) == 0, meter.report()
        spans = timeline.spans
    assert meter.counts() == {"Event.synchronize": 1}, meter.report()
    assert [s[4] for s in spans] == [0, 1, 2, 3] and all(a[2] <= b[1] + 1e-6 for a, b in zip(spans, spans[1:]))


# --------------------------------------------------------------------------- data parallelism and ZeRO
def _worker_data_parallel(rank, world_size):
    ddp_overlap, ddp_bucketed = load("phase3_multi_node", "ddp_overlap"), load("phase3_multi_node", "ddp_bucketed")
    trainer, zero = load("phase1_data_parallel", "trainer"), load("phase3_multi_node", "zero")
    from torch.distributed.optim import ZeroRedundancyOptimizer
    x, y = _data(rank, world_size)
    small = 200 / 2**20  # 200-byte buckets: several per step
    bare = lambda m: m  # noqa: E731 (ZeRO communicates in its optimizer: no wrapper)
    out = {}
    # AdamW as a GPU run has it: its step counts on the CPU (read with .item(), no wait); SGD has no state to read.
    for kind, (cls, kw) in {"SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                            "AdamW": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))}.items():
        model = seeded(ToyMLP, 0, 6, 10, 3)
        opt = cls(model.parameters(), **kw)
        out[f"naive DDP, {kind}"] = _metered(lambda: trainer.train_step(model, opt, F.cross_entropy, x, y))
        plain = lambda ps, cls=cls, kw=kw: cls(ps, **kw)  # noqa: E731
        strategies = {  # name: (wrap the model, build the optimizer)
            "per-parameter DDP": (ddp_overlap.DDPIndividualParameters, plain),
            "bucketed DDP": (lambda m: ddp_bucketed.DDPBucketed(m, bucket_size_mb=small), plain),
            "torch DDP": (nn.parallel.DistributedDataParallel, plain),
            "ZeRO-1": (bare, lambda ps, cls=cls, kw=kw: zero.ZeroOptimizer(ps, cls, stage=1, **kw)),
            "ZeRO-2": (bare, lambda ps, cls=cls, kw=kw: zero.ZeroOptimizer(ps, cls, stage=2, bucket_size_mb=small,
                                                                             **kw)),
            "torch ZeroRedundancyOptimizer": (nn.parallel.DistributedDataParallel,
                                              lambda ps, cls=cls, kw=kw: ZeroRedundancyOptimizer(ps, cls, **kw))}
        for name, (wrap, make) in strategies.items():
            model = seeded(ToyMLP, 0, 6, 10, 3)
            wrapped, opt = wrap(model), make(list(model.parameters()))
            out[f"{name}, {kind}"] = _metered(lambda: _train_step(wrapped, opt, x, y))  # run before the next loop
    return out


def test_data_parallel_and_zero_steps_never_sync_like_torch():
    results = run_distributed(_worker_data_parallel, 2, backend="gloo")
    _check(results, lambda name, rank: 0)


# --------------------------------------------------------------------------- pipeline
def _worker_pipeline(rank, world_size):
    pp = load("phase2_advanced", "pipeline")
    p2p.disable_strict()  # as outside pytest: the size check's headers on every message, CUDA's deferred path
    assert p2p.enable_size_check()
    with p2p.defer_size_checks_on_cpu():
        return _pipeline_steps(rank, world_size, pp)


def _pipeline_steps(rank, world_size, pp):
    m, hidden = 4, 8
    x = torch.randn(m * 2, 6, generator=torch.Generator().manual_seed(0))
    y = torch.randint(3, (m * 2,), generator=torch.Generator().manual_seed(1))
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for timeline in (False, True):
            module = pp.build_stage_module(rank, world_size, 6, hidden, 3, layers_per_stage=1)
            stage = pp.PipelineStage(module, (2, hidden), timeline=timeline)
            opt = torch.optim.SGD(module.parameters(), lr=0.1)
            out[f"{schedule}, timeline {'on' if timeline else 'off'}"] = _metered(lambda: pp.train_step(
                stage, opt, schedule, x if rank == 0 else None, y if rank == world_size - 1 else None,
                F.cross_entropy, m))
            kinds = [e[3] for e in stage.events]
            assert kinds.count("F") == (m if timeline else 0), f"rank {rank}, {schedule}: timeline {kinds}"
    return out


def test_pipeline_step_syncs_only_for_the_loss_it_returns():
    results = run_distributed(_worker_pipeline, 2, backend="gloo")
    _check(results, lambda name, rank: 1 if rank == 1 else 0)  # the last stage's float(loss)


# --------------------------------------------------------------------------- ring attention
def _worker_ring(rank, world_size):
    ring = load("phase5_large_models", "ring_attention")
    p2p.disable_strict()
    assert p2p.enable_size_check()
    with p2p.defer_size_checks_on_cpu():  # the size check on, as on CUDA
        return _ring_steps(rank, world_size, ring)


def _ring_steps(rank, world_size, ring):
    layout = ring.sequence_layout(12, world_size, "zigzag")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 12, 4, generator=g)[:, :, layout[rank]] for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    return {"ring attention": _metered(lambda: ring.ring_attention(q, k, v, layout).backward(dout))}


def test_ring_attention_never_syncs():
    results = run_distributed(_worker_ring, 2, backend="gloo")
    _check(results, lambda name, rank: 0)


# --------------------------------------------------------------------------- loss scaler
def _worker_scaler(rank, world_size):
    mp = load("phase2_advanced", "mixed_precision")
    x, y = _data(rank, world_size)
    out = {}
    model = seeded(ToyMLP, 0, 6, 10, 3)
    scalers = {"DynamicLossScaler": mp.DynamicLossScaler(init_scale=2.0 ** 8),
               "torch GradScaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)}
    for name, scaler in scalers.items():
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(m=m, opt=opt, scaler=scaler):
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.cross_entropy(m(x), y)).backward()
            for p in m.parameters():  # as one all-reduce of the gradients would, without its own syncs
                dist.all_reduce(p.grad)
            scaler.step(opt)
            scaler.update()
        out[name] = _metered(step)
    return out


def test_loss_scaler_syncs_once_per_step_like_grad_scaler():
    results = run_distributed(_worker_scaler, 2, backend="gloo")
    torch_per_step = [r["torch GradScaler"]["syncs"] / STEPS for r in results]
    assert torch_per_step == [1, 1], f"GradScaler's found-inf read: {torch_per_step} syncs per step; " \
                                     f"{results[0]['torch GradScaler']['report']}"
    _check([{"DynamicLossScaler": r["DynamicLossScaler"]} for r in results], lambda name, rank: 1)


# --------------------------------------------------------------------------- the p2p size check
def _worker_size_check(rank, world_size):
    p2p.disable_strict()  # as outside pytest: every message carries its size header
    assert p2p.enable_size_check()
    receives = 3

    def exchanges():
        for _ in range(receives):
            p2p.exchange(torch.full((5,), float(rank)), torch.empty(5), 1 - rank)

    out = {"immediate": _metered(exchanges)}  # CPU headers: read at once, as CUDA ones were
    with p2p.defer_size_checks_on_cpu():
        out["deferred"] = _metered(exchanges)
        pending = len(p2p._deferred)
    assert pending >= 1, f"rank {rank}: no verdict left to read after the step: were the headers read at once?"
    return {**out, "receives": receives}


def test_p2p_size_check_costs_no_host_sync_per_receive_on_the_cuda_path():
    for rank, got in enumerate(run_distributed(_worker_size_check, 2, backend="gloo")):
        # the baseline: the meter sees the immediate path's one header read per receive
        assert got["immediate"]["syncs"] == got["receives"] * got["immediate"]["steps"], \
            f"rank {rank}: immediate size check: {got['immediate']['report']}"
        assert got["deferred"]["syncs"] == 0, \
            f"rank {rank}: deferred size check: {got['deferred']['syncs']} host syncs:\n{got['deferred']['report']}"
