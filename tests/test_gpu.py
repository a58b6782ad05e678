"""The GPU tier (``pytest -m gpu``): NCCL and CUDA tensors, checked against the single process.

The default suite runs gloo on CPU tensors; these tests run only when ``-m gpu`` selects
them (otherwise they skip at once), and skip with "needs N CUDA devices" on a machine
with fewer GPUs than they need. NCCL (the device map "cpu:gloo,cuda:nccl") at world size 1
and at the largest the machine's GPUs allow: the course's collectives and ring; DDP (per
parameter, bucketed), ZeRO-1/2/3 and FSDP; tensor parallel, GPipe/1F1B, ring and Ulysses
attention and MoE, each through its main test's own worker with device "cuda" (the same
baselines and tolerances); every RUN_MODE but the parameter server's on one GPU; and several
ranks sharing the GPU on gloo with CUDA tensors (the collectives gloo runs on CUDA).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.spawn import run_distributed
from distlab.loader import load

pytestmark = pytest.mark.gpu
NCCL = "cpu:gloo,cuda:nccl"  # what init_from_env gives a CUDA job: CPU control messages keep gloo


@pytest.fixture(autouse=True)
def _only_when_selected(request):
    if "gpu" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the GPU tier: run it with pytest -m gpu")


def needs_gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA device{'s' * (n > 1)}")


# --------------------------------------------------------------------------- NCCL, world size 1
def _worker_collectives(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    assert "nccl" in dist.get_backend() and device.index == rank
    collectives, ring = load("phase1_data_parallel", "collectives"), load("phase3_multi_node", "ring_allreduce")
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0)).to(device)  # 1001: not a multiple of W
    fns = {**collectives.STRATEGIES, "ring": ring.ring_allreduce, "ring pipelined": ring.ring_allreduce_pipelined,
           "dist.all_reduce": lambda t, op="sum": dist.all_reduce(t) if op == "sum" else
           dist.all_reduce(t, op=dist.ReduceOp.AVG)}
    failures = []
    for name, fn in fns.items():
        for op in ("sum", "avg"):
            got = x.clone()
            fn(got, op=op)
            # One rank: the sum (and the mean) over the ranks is the tensor itself, bit for bit.
            if got.device != device or not torch.equal(got, x):
                failures.append(f"{name} ({op}) on {got.device}: max diff {(got.cpu() - x.cpu()).abs().max():.1e}")
    return failures


@needs_gpus(1)
def test_nccl_collectives_and_ring_match_the_single_process():
    assert run_distributed(_worker_collectives, 1, backend=NCCL, timeout_s=120) == [[]]


def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def _worker_training_steps(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(1)
    rows = 8 * world_size  # 8 rows per rank: the mean over ranks of each rank's mean is the global mean
    batches = [(torch.randn(rows, 16, generator=g).to(device), torch.randint(4, (rows,), generator=g).to(device))
               for _ in range(3)]
    reference = _mlp(device)  # the single process: plain SGD with momentum on the whole batches
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    batches = [(x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]) for x, y in batches]  # my shard

    def the_torch_way(wrap):  # backward, step: the wrappers finish their all-reduces when backward ends
        def make(model):
            wrapped, opt = wrap(model), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            def step(x, y):
                opt.zero_grad()
                F.cross_entropy(wrapped(x), y).backward()
                opt.step()
            return step
        return make

    def zero(stage):
        def make(model):
            zero_opt = load("phase3_multi_node", "zero").ZeroOptimizer(
                model.parameters(), torch.optim.SGD, stage=stage, bucket_size_mb=0.001, lr=0.1, momentum=0.9)

            def step(x, y):
                zero_opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                zero_opt.step()
            return step
        return make

    failures = []
    ddp = {"DDPIndividualParameters": lambda m: load("phase3_multi_node", "ddp_overlap").DDPIndividualParameters(m),
           "DDPBucketed": lambda m: load("phase3_multi_node", "ddp_bucketed").DDPBucketed(m, bucket_size_mb=0.001),
           "torch DDP": lambda m: nn.parallel.DistributedDataParallel(m, device_ids=[device.index])}
    for name, make in {**{n: the_torch_way(w) for n, w in ddp.items()}, "ZeRO-1": zero(1), "ZeRO-2": zero(2)}.items():
        model = _mlp(device)
        step = make(model)
        for x, y in batches:
            step(x, y)
        for k, v in model.state_dict().items():
            # One rank: the same float32 ops on the same GPU; only the optimizer's kernels
            # (per tensor vs one flat shard) may round differently, by ~1e-7. Several: NCCL's
            # reductions sum in another order than one process, ~1e-7 relative per step, 3 steps.
            if v.device != device or not torch.allclose(v, expected[k], rtol=1e-5, atol=1e-6):
                failures.append(f"{name}: {k} on {v.device} differs by {(v - expected[k]).abs().max():.1e}")
    fsdp = load("phase3_multi_node", "fsdp").FullyShardedDataParallel(_mlp(device), torch.optim.SGD, lr=0.1,
                                                                     momentum=0.9)
    for x, y in batches:
        fsdp.zero_grad()
        F.cross_entropy(fsdp(x), y).backward()
        fsdp.step()
    full = load("phase3_multi_node", "fsdp_state").full_state_dict(fsdp)
    for k, v in expected.items():
        if not torch.allclose(full[k].to(device), v, rtol=1e-5, atol=1e-6):  # as above
            failures.append(f"FSDP (ZeRO-3): {k} differs by {(full[k].to(device) - v).abs().max():.1e}")
    return failures


GPUS = torch.cuda.device_count()


@pytest.mark.parametrize("world_size", sorted({1, max(GPUS, 1)}))  # 1, and every GPU the machine has
def test_nccl_ddp_and_zero_steps_match_the_single_process(world_size):
    if GPUS < world_size:
        pytest.skip(f"needs {world_size} CUDA device{'s' * (world_size > 1)}")
    assert run_distributed(_worker_training_steps, world_size, backend=NCCL, timeout_s=180) == [[]] * world_size


# --------------------------------------------------------------------------- the main suite's workers on NCCL
# The DDP and ZeRO tests' own workers (tests/test_phase3_ddp_zero.py), given device "cuda": the same
# float64 models, baselines and tolerances, at the largest world size the GPUs allow that divides their
# global batch of 12 rows (8 GPUs: 6).
LARGEST = max(w for w in (1, 2, 3, 4, 6, 12) if w <= max(GPUS, 1))


@pytest.mark.timeout(420)  # two worlds of up to 180 s each (NCCL's start on many GPUs), then the report
@pytest.mark.parametrize("impl", ["overlap", "bucketed"])
def test_nccl_ddp_workers_match_single_process_and_torch_ddp(impl):
    from test_phase3_ddp_zero import _worker_ddp_kinds

    if GPUS == 0:
        pytest.skip("needs 1 CUDA device")
    for kinds, buckets in ((["mlp"], [1, 3]), (["tied_frozen"], [1])):  # the bucket caps are ToyMLP's
        run_distributed(_worker_ddp_kinds, LARGEST, impl, kinds, buckets, False, "cuda", backend=NCCL, timeout_s=180)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nccl_zero_workers_match_single_process(stage):
    from test_phase3_ddp_zero import _worker_zero

    if GPUS == 0:
        pytest.skip("needs 1 CUDA device")
    run_distributed(_worker_zero, LARGEST, stage, "cuda", backend=NCCL, timeout_s=240)


# Tensor parallel, pipeline, ring and Ulysses attention, MoE: their tests' workers with "cuda", at the
# largest of their world sizes (1-4) the GPUs allow.
MODEL_PARALLEL = min(max(GPUS, 1), 4)
WORKERS = {  # name -> (test module, worker, its arguments after rank and world size)
    "tensor-parallel TinyGPT": ("test_phase2_model_parallel", "_worker_parallel_gpt", ()),
    "GPipe": ("test_phase2_model_parallel", "_worker_pipeline", ("gpipe",)),
    "1F1B": ("test_phase2_model_parallel", "_worker_pipeline", ("1f1b",)),
    "ring attention": ("test_phase5_context", "_worker_ring", ()),
    "Ulysses attention": ("test_phase5_context", "_worker_ulysses", ()),
    "expert-parallel MoE": ("test_phase5_experts", "_worker_moe", ()),
}


@pytest.mark.parametrize("strategy", list(WORKERS))
def test_nccl_model_parallel_workers_match_single_process(strategy):
    import importlib

    if GPUS == 0:
        pytest.skip("needs 1 CUDA device")
    module, worker, args = WORKERS[strategy]
    run_distributed(getattr(importlib.import_module(module), worker), MODEL_PARALLEL, *args, "cuda",
                    backend=NCCL, timeout_s=240)


def _worker_every_mode(rank, world_size, runs):
    import importlib

    done = []
    for mode, module, argv in runs:
        importlib.import_module(module).main(argv)
        torch.cuda.synchronize()
        done.append(mode)
    return done


@needs_gpus(1)
@pytest.mark.timeout(700)  # every mode in one run with a 600 s deadline
def test_every_mode_runs_on_one_gpu_with_nccl(tmp_path):
    """Every RUN_MODE's main on cuda:0 with NCCL, as ``NPROC=1 RUN_MODE=... ./entrypoint.sh`` on a GPU node
    (but the parameter server's: with one rank it starts a CPU world of its own)."""
    from test_devices import entrypoint_modes, tiny_runs

    modes = entrypoint_modes()
    runs = [(m, modes[m], argv) for m, argv in tiny_runs(str(tmp_path), 1) if m != "parameter_server"]
    done = run_distributed(_worker_every_mode, 1, runs, backend=NCCL, timeout_s=600)[0]
    assert set(done) == set(modes) - {"parameter_server"}


# --------------------------------------------------------------------------- CUDA tensors on gloo, several ranks
def _worker_cuda_on_gloo(rank, world_size):
    from distlab.launch import init_from_env

    env = init_from_env()  # DISTLAB_DEVICE=cuda: the ranks share the GPUs there are
    assert env.device.type == "cuda" and env.backend == "gloo", env
    x = torch.arange(5.0, device=env.device) + rank
    expected = sum(torch.arange(5.0) + r for r in range(world_size))  # the single process's sum
    got = x.clone()
    dist.all_reduce(got)
    out = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(out, x)
    b = x.clone()
    dist.broadcast(b, src=0)
    # Integer-valued floats: every sum is exact whatever the order.
    return [got.device == env.device and torch.equal(got.cpu(), expected),
            all(torch.equal(o.cpu(), torch.arange(5.0) + r) for r, o in enumerate(out)),
            torch.equal(b.cpu(), torch.arange(5.0))]


@needs_gpus(1)
def test_cuda_tensors_on_gloo_with_several_ranks(monkeypatch):
    monkeypatch.setenv("DISTLAB_DEVICE", "cuda")
    assert run_distributed(_worker_cuda_on_gloo, 3, backend="gloo", timeout_s=120) == [[True] * 3] * 3
