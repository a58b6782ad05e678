"""The bench itself: launcher, ledger, loader switch, data, models, metrics, plots, grading."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from distlab import LearnerTODO
from distlab.comm import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, CommLedger, all_gather_single, reduce_scatter_single
from distlab.spawn import RankError, run_distributed

REPO = Path(__file__).resolve().parent.parent


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --------------------------------------------------------------------------- launcher
def _worker_rank_info(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item(), os.getpid()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_run_distributed_returns_results_in_rank_order(world_size):
    results = run_distributed(_worker_rank_info, world_size)
    total = sum(range(world_size))
    assert [r[:3] for r in results] == [(r, world_size, total) for r in range(world_size)]
    assert all(_pid_gone(r[3]) for r in results), "a rank outlived run_distributed"


def _worker_deadlock(rank, world_size, pid_dir):
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    t = torch.zeros(1)
    dist.recv(t, src=(rank + 1) % world_size)  # everyone receives, nobody sends


def test_deadlocked_recv_fails_within_the_timeout(tmp_path):
    run_distributed(_worker_rank_info, 1)  # the forkserver's one-time start is not what is timed
    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError)) as info:
        run_distributed(_worker_deadlock, 2, str(tmp_path), timeout_s=6)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"took {elapsed:.1f} s to notice a deadlock with timeout_s=6"
    assert "rank" in str(info.value)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and all(_pid_gone(p) for p in pids), "a deadlocked rank survived"


def _worker_one_raises(rank, world_size, pid_dir):
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    dist.barrier()  # every rank is up and has written its pid
    if rank == 1:
        raise ValueError("bad shard size 7")
    dist.barrier()  # the others wait for rank 1, which never comes


def test_one_rank_raising_makes_the_parent_raise_quickly(tmp_path):
    run_distributed(_worker_rank_info, 1)  # the forkserver's one-time start is not what is timed
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1: bad shard size 7") as info:
        run_distributed(_worker_one_raises, 3, str(tmp_path), timeout_s=60)
    assert time.monotonic() - start < 5
    assert str(info.value) == "rank 1: bad shard size 7"  # the rank once, no launcher text
    shown = info.value.rank_traceback  # what the pytest plugin prints under the message
    assert shown.startswith("--- in rank 1 ---") and "_worker_one_raises" in shown
    assert "spawn.py" not in shown and "ValueError: bad shard size 7" not in shown, shown
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 3 and all(_pid_gone(p) for p in pids), "a rank survived another's failure"


def _worker_todo(rank, world_size):
    from distlab.todo import todo
    raise todo("9.9 something", "guidelines.md#somewhere")


def test_learner_todo_comes_back_as_one_line():
    with pytest.raises(LearnerTODO) as info:
        run_distributed(_worker_todo, 2)
    message = str(info.value)
    assert "\n" not in message and "TODO 9.9 something" in message and "guidelines.md#somewhere" in message


def _worker_says_its_rank(rank, world_size):
    raise AssertionError(f"rank {rank}, step 3, parameter fc1.weight: max abs diff 2e-2")


def test_a_message_that_names_its_rank_is_not_prefixed_again():
    with pytest.raises(AssertionError) as info:
        run_distributed(_worker_says_its_rank, 1)
    assert str(info.value) == "rank 0, step 3, parameter fc1.weight: max abs diff 2e-2"


@pytest.mark.parametrize("actual, diagnosis", [
    (lambda e: 2 * e, "2.00x the expected value everywhere: summed where a mean was due"),
    (lambda e: e / 4, "0.25x the expected value everywhere: averaged twice"),
    (lambda e: -e, "a sign flipped"),
    (lambda e: torch.zeros_like(e), "all zeros"),
    (lambda e: e.masked_fill(torch.arange(e.numel()) == 3, float("inf")), "inf/nan"),
    (lambda e: e + torch.linspace(0, 1, e.numel()), None),  # no recognisable cause: nothing claimed
])
def test_a_mismatch_names_its_recognisable_cause(actual, diagnosis):
    from distlab.testing import assert_tensors_close

    expected = torch.linspace(-3, 5, 17)
    with pytest.raises(AssertionError) as info:
        assert_tensors_close(actual(expected), expected, "rank 1, step 0, gradient of fc1.weight")
    message = str(info.value)
    assert message.startswith("rank 1, step 0, gradient of fc1.weight: max abs diff")
    if diagnosis:
        assert diagnosis in message, message
    else:
        assert "; it " not in message, message


def _worker_killed(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named():
    with pytest.raises(RankError, match="rank 1 died \\(signal 9\\)"):
        run_distributed(_worker_killed, 2, timeout_s=30)


def _worker_env(rank, world_size):
    return os.environ.get("DISTLAB_PROBE")


def test_ranks_see_the_environment_of_the_call_not_of_the_forkserver(monkeypatch):
    run_distributed(_worker_env, 1)  # the forkserver is running by now
    monkeypatch.setenv("DISTLAB_PROBE", "fresh")
    assert run_distributed(_worker_env, 2) == ["fresh", "fresh"]


def test_run_distributed_rejects_zero_ranks():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_distributed(_worker_env, 0)


def test_init_from_env_without_torchrun_is_rank_0_of_1():
    code = ("from distlab.launch import init_from_env, shutdown; import torch.distributed as dist; "
            "e = init_from_env(); t = __import__('torch').ones(2); dist.all_reduce(t); "
            "print(e.rank, e.world_size, e.backend, t.tolist()); shutdown()")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DISTLAB_DEVICE"] = "cpu"  # a GPU machine would pick cuda with "cpu:gloo,cuda:nccl" (tests/test_gpu.py)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "0 1 gloo [1.0, 1.0]"


# --------------------------------------------------------------------------- ledger
def _worker_ledger(rank, world_size):
    peer = 1 - rank
    t = torch.ones(10)  # 40 bytes
    ledger = CommLedger()
    with ledger:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        work = dist.all_reduce(torch.ones(3, dtype=torch.float64), async_op=True)  # 24 bytes
        work.wait()
        out = torch.empty(20)
        all_gather_single(out, t)
        reduce_scatter_single(torch.empty(5), t)
        if rank == 0:
            dist.send(t, dst=peer)
        else:
            dist.recv(t, src=peer)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), peer),
                                       dist.P2POp(dist.irecv, torch.empty(4), peer)])
        for r in reqs:
            r.wait()
        req = dist.isend(torch.ones(2), peer) if rank == 0 else dist.irecv(torch.empty(2), peer)
        req.wait()
    dist.all_reduce(torch.ones(1))  # after exit: not recorded, and dist is restored
    assert dist.all_reduce.__module__.startswith("torch")
    summary = ledger.summary()
    assert summary["all_reduce"] == {"calls": 2, "bytes": 40 + 24}, summary
    assert summary["broadcast"] == {"calls": 1, "bytes": 40}, summary
    assert summary[ALL_GATHER_SINGLE] == {"calls": 1, "bytes": 40}, summary
    assert summary[REDUCE_SCATTER_SINGLE] == {"calls": 1, "bytes": 40}, summary
    sent = 40 * (rank == 0) + 16 + 8 * (rank == 0)
    received = 40 * (rank == 1) + 16 + 8 * (rank == 1)
    assert (ledger.sent_bytes(), ledger.received_bytes()) == (sent, received), summary
    assert all(r.group_size == 2 for r in ledger.records)
    # Ring estimate of what this rank sends: all_reduce 2(W-1)/W n = n at W=2, all_gather
    # (W-1) n, reduce_scatter (W-1)/W n, broadcast n, p2p sends.
    assert ledger.wire_bytes() == (40 + 24) + 40 + 40 + 20 + sent, ledger.wire_bytes()


def test_comm_ledger_counts_calls_and_bytes_of_every_kind():
    run_distributed(_worker_ledger, 2)


# --------------------------------------------------------------------------- loader switch
def test_load_picks_solution_template_or_student_copy(tmp_path, monkeypatch):
    from distlab.loader import load

    monkeypatch.delenv("DISTLAB_STUDENT_DIR", raising=False)
    monkeypatch.setenv("DISTLAB_IMPL", "solutions")
    assert load("phase1_data_parallel", "trainer").__name__ == "solutions.phase1_data_parallel.trainer"
    monkeypatch.setenv("DISTLAB_IMPL", "templates")
    assert load("phase1_data_parallel", "trainer").__name__ == "phase1_data_parallel.template_trainer"
    student = tmp_path / "phase1_data_parallel"
    student.mkdir()
    (student / "template_trainer.py").write_text("MARK = 'student copy'\n")
    monkeypatch.setenv("DISTLAB_STUDENT_DIR", str(tmp_path))
    assert load("phase1_data_parallel", "trainer").MARK == "student copy"
    monkeypatch.setenv("DISTLAB_IMPL", "wrong")
    with pytest.raises(ValueError, match="expected one of"):
        load("phase1_data_parallel", "trainer")


@pytest.mark.e2e
@pytest.mark.timeout(400)  # a nested grading run with its own 300 s deadline
def test_grade_scores_a_student_copy_per_exercise(tmp_path):
    """A student who finished the sampler (1.4-1.5) and nothing else."""
    student = tmp_path / "alice"
    shutil.copytree(REPO / "phase1_data_parallel", student / "phase1_data_parallel")
    shutil.copy(REPO / "solutions/phase1_data_parallel/data_loader.py",
                student / "phase1_data_parallel/template_data_loader.py")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "distlab.grading.grade", f"--student-dir={student}", "--out", str(out),
                           "--tests", "tests/test_phase1.py", "--", "-k", "sampler or 1-1.6-tied_frozen-sgd or 2-allreduce_allgather"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())
    scores = {t["name"]: (t["score"], t["max_score"]) for t in results["tests"]}
    # Points from grading/weights.toml: the sampler's 2 in full, nothing for the rest.
    assert scores["1.4-1.5 distributed sampler"] == (2, 2), scores
    assert scores["1.6-1.8 naive data parallel"] == (0, 3), scores
    assert scores["1.1-1.3 all-reduce three ways"] == (0, 3), scores
    by_name = {t["name"]: t for t in results["tests"]}
    assert "TODO 1.6" in by_name["1.6-1.8 naive data parallel"]["output"]
    assert results["score"] == 2 and results["max_score"] == 8


# --------------------------------------------------------------------------- data
def test_digits_is_real_split_and_upsampled():
    from distlab.data import digits

    train, test = digits("train"), digits("test", image_size=16)
    assert len(train) + len(test) == 1797
    assert train.tensors[0].shape[1:] == (1, 8, 8) and test.tensors[0].shape[1:] == (1, 16, 16)
    assert set(train.tensors[1].tolist()) == set(range(10))
    assert digits("train", flatten=True).tensors[0].shape[1] == 64


def test_synthetic_sets_are_seeded():
    from distlab.data import synthetic_classification, synthetic_tokens

    a, b = synthetic_classification(seed=3), synthetic_classification(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    x, y = synthetic_tokens(n_seq=4, seq_len=8, vocab_size=16).tensors
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])


def _write_idx(path: Path, array: np.ndarray) -> None:
    magic = {1: 0x0801, 3: 0x0803}[array.ndim]
    path.write_bytes(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
                     + array.astype(np.uint8).tobytes())


def test_mnist_loader_reads_idx_files_and_names_the_flag_when_missing(tmp_path):
    from distlab.data import mnist

    with pytest.raises(FileNotFoundError, match="--download"):
        mnist(tmp_path, "train")
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 3)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    ds = mnist(tmp_path, "train")
    x, y = ds[5]
    assert len(ds) == 6 and x.shape == (1, 28, 28) and y == 5


def test_cifar10_loader_reads_batches_and_names_the_flag_when_missing(tmp_path):
    from distlab.data import cifar10

    with pytest.raises(FileNotFoundError, match="--download"):
        cifar10(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="--download"):
        cifar10(tmp_path, "train", verify_checksums=False)
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 255, (2, 3072), dtype=np.uint8), "labels": [1, 7]}
        (base / name).write_bytes(pickle.dumps(batch))
    (base / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    # Tiny files cannot match the official MD5s; verify_checksums=False accepts them.
    ds = cifar10(tmp_path, "train", verify_checksums=False)
    x, y = ds[1]
    assert len(ds) == 10 and x.shape == (3, 32, 32) and y == 7
    assert len(cifar10(tmp_path, "test", verify_checksums=False)) == 2


def test_imagefolder_loader_reads_the_imagenet_layout(tmp_path):
    from PIL import Image

    from distlab.data import imagefolder

    with pytest.raises(FileNotFoundError, match="train/ and val/"):
        imagefolder(tmp_path, "train")
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((40, 30, 3), 60 * i, np.uint8)).save(tmp_path / split / cls / f"{i}.png")
    ds = imagefolder(tmp_path, "train", image_size=32)
    x, y = ds[3]
    assert len(ds) == 4 and ds.classes == ["cat", "dog"] and x.shape == (3, 32, 32) and y == 1


# --------------------------------------------------------------------------- models, metrics, plots
def test_tied_frozen_model_shares_one_parameter_and_freezes_another():
    from distlab.models import TiedFrozenModel

    m = TiedFrozenModel(vocab_size=11, dim=6, with_unused=True)
    names = [n for n, _ in m.named_parameters()]
    assert "head.weight" not in names and m.head.weight is m.embed.weight
    assert not m.frozen.weight.requires_grad
    m(torch.randint(11, (2, 5))).sum().backward()
    assert m.unused.weight.grad is None and m.frozen.weight.grad is None and m.embed.weight.grad is not None


def test_tiny_gpt_shapes_and_loss():
    from distlab.models import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    idx = torch.randint(32, (3, 8))
    logits, loss = TinyGPT(cfg)(idx, idx)
    assert logits.shape == (3, 8, 32) and abs(loss.item() - np.log(32)) < 0.5
    with pytest.raises(ValueError, match="exceeds block_size"):
        TinyGPT(cfg)(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible by n_head"):
        GPTConfig(n_embd=10, n_head=3)


def test_metrics_and_plots(tmp_path):
    from distlab.metrics import StepTimer, Throughput, format_bytes, format_table
    from distlab.plots import plot_bandwidth, plot_bars, plot_loss_curves, plot_timeline

    timer = StepTimer()
    with timer("compute"):
        sum(range(1000))
    assert timer.total("compute") > 0 and list(timer.summary()) == ["compute"]
    tp = Throughput(warmup=1)
    tp.record(10, 5.0)
    tp.record(10, 0.5)
    assert tp.samples_per_s == 20
    # One formatter for the demos' tables and the doctor's messages ("all_reduce #3 (16 B)").
    assert [format_bytes(n) for n in (16, 4096, 3 << 20, 1536 << 10, 9 << 30)] == \
        ["16 B", "4 KiB", "3 MiB", "1.5 MiB", "9 GiB"]
    assert format_table([{"a": 1, "bb": "x"}]).splitlines()[0].split() == ["a", "bb"]
    paths = [plot_loss_curves({"a": [3, 2, 1]}, tmp_path / "l.png"),
             plot_timeline([(0, 0.0, 1.0, "F", "0"), (1, 0.5, 2.0, "B", "0")], tmp_path / "t.png"),
             plot_bandwidth({"ring": [(1024, 1.0), (2048, 2.0)]}, tmp_path / "b.png"),
             plot_bars({"ddp": 1.0, "zero": 0.5}, tmp_path / "m.png", "bytes")]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def _worker_tensor_result(rank, world_size):
    return {"rank": rank, "weights": torch.full((1000,), float(rank))}


def test_ranks_can_return_tensors():
    results = run_distributed(_worker_tensor_result, 2)
    assert [r["rank"] for r in results] == [0, 1]
    assert torch.equal(results[1]["weights"], torch.ones(1000))


TORCHRUN_REPORT = """TODO 1.1 sum it: not implemented yet (see phase1_data_parallel/guidelines.md#x)
TODO 1.1 sum it: not implemented yet (see phase1_data_parallel/guidelines.md#x)
W1123 site-packages/torch/distributed/elastic/multiprocessing/api.py] Sending process 1 closing signal SIGTERM
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : {code} (pid: 30239)
"""


@pytest.mark.parametrize("code, dropped", [(3, True), (1, False)])
def test_launcher_filter_keeps_a_todo_to_one_line_and_any_other_failure_whole(code, dropped):
    import io

    from distlab.todo import filter_launcher_output

    out = io.StringIO()
    assert filter_launcher_output(io.StringIO("starting\n" + TORCHRUN_REPORT.format(code=code)), out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["starting", "TODO 1.1 sum it: not implemented yet (see phase1_data_parallel/guidelines.md#x)"]
    assert (len(lines) == 2) == dropped, lines  # a rank that failed otherwise keeps torchrun's report


def _worker_sync_helpers(rank, world_size):
    from distlab.models import TinyCNN
    from distlab.lessons.sync import allreduce_gradients, average_buffers, broadcast_module

    torch.manual_seed(rank)  # every rank starts different
    model = TinyCNN()
    for b in model.buffers():
        if b.is_floating_point():
            b.fill_(float(rank))
    broadcast_module(model, buffers=False)
    average_buffers(model)
    mean_rank = sum(range(world_size)) / world_size
    for b in model.buffers():
        if b.is_floating_point():
            assert torch.equal(b, torch.full_like(b, mean_rank)), f"rank {rank}: buffer not averaged"
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    allreduce_gradients(model.parameters())
    expected = sum(range(1, world_size + 1)) / world_size
    assert all(torch.allclose(p.grad, torch.full_like(p, expected)) for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [1, 3])
def test_sync_helpers_match_their_definitions(world_size):
    """distlab.lessons.sync: broadcast (parameters only), buffer and gradient means, as phase 1 defines them."""
    results = run_distributed(_worker_sync_helpers, world_size)
    for rank, params in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(params, results[0])), f"rank {rank} differs from rank 0"


def test_loss_curves_give_every_series_its_own_style_and_bars_name_their_units(tmp_path):
    from distlab.plots import curve_styles, plot_bars

    styles = curve_styles(14)  # more series than the 10-colour palette
    assert len(set(styles)) == 14 and styles[0] == ("black", "-"), styles
    import matplotlib.pyplot as plt

    seen = {}
    original = plt.Axes.set_ylabel
    plt.Axes.set_ylabel = lambda self, text, *a, **k: seen.setdefault("ylabel", text)
    try:
        plot_bars({"a": 3 * 2**20, "b": 512 * 2**10}, tmp_path / "bars.png", "sent per step", unit="bytes")
    finally:
        plt.Axes.set_ylabel = original
    assert seen["ylabel"] == "sent per step (MiB)" and (tmp_path / "bars.png").stat().st_size > 0


def test_no_sync_restores_syncing_when_its_body_raises():
    # no_sync is given code (distlab.lessons.sync.NoSyncMixin), shared by every data-parallel wrapper:
    # an exception inside the body (a bad batch, an OOM) must not leave gradients unsynchronised.
    from distlab.lessons.sync import NoSyncMixin

    wrapper = NoSyncMixin()
    with pytest.raises(ZeroDivisionError):
        with wrapper.no_sync():
            assert wrapper.require_sync is False
            1 / 0
    assert wrapper.require_sync is True, "no_sync left syncing off after its body raised"
    with wrapper.no_sync():
        with wrapper.no_sync():
            pass
        assert wrapper.require_sync is False, "a nested no_sync turned syncing back on too early"
    assert wrapper.require_sync is True


def _worker_debug_level(rank, world_size):
    import torch.distributed as dist

    return str(dist.get_debug_level())


def test_ranks_follow_the_launchers_torch_distributed_debug_not_the_forkservers(monkeypatch):
    """The forkserver imports torch once, reading TORCH_DISTRIBUTED_DEBUG then; every run's ranks must
    use the launcher's value now (a forkserver started under DETAIL made later DDP runs crash)."""
    run_distributed(_worker_debug_level, 1)  # the forkserver exists before the variable is set
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert run_distributed(_worker_debug_level, 2) == ["DebugLevel.DETAIL"] * 2
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    assert run_distributed(_worker_debug_level, 2) == ["DebugLevel.OFF"] * 2


def test_nbytes_counts_tensors_collections_and_freed_storage():
    """The bench's one byte counter: what the ledger, the p2p size headers and the memory meters count."""
    from distlab.metrics import nbytes

    a, b = torch.zeros(3, dtype=torch.float64), torch.zeros(5, dtype=torch.float16)
    assert nbytes(a) == 24 and nbytes([a, (b, None)]) == 34 and nbytes(None) == 0
    freed = torch.zeros(4)
    freed.untyped_storage().resize_(0)  # ZeRO-3 frees a gathered unit's storage this way
    assert nbytes(freed) == 0 and nbytes([a, freed]) == 24
