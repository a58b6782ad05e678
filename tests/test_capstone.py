"""The capstone trainer runs every strategy and resumes exactly from its checkpoints.

The capstone is the demo of RUN_MODE=imagenet (demos/imagenet.py). Its own ``main()``
runs in ranks started by run_distributed (init_from_env adopts the launcher's process
group), on tiny settings: a small ViT on 8x8 digits for six steps. The lesson modules
it uses come through ``distlab.loader.load``, as do the checkpoints read here. The baseline of
every resume is one uninterrupted run (a module fixture), which checkpoints at steps 2, 4 and 6.
tests/test_deployment.py checks the cluster manifests' commands against its parser.
"""
from __future__ import annotations

import contextlib
import copy
import io
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from distlab.spawn import run_distributed
from distlab.loader import load

TINY = ["--model", "vit_tiny", "--image-size", "8", "--global-batch", "16", "--max-steps", "6",
        "--warmup-steps", "2", "--lr", "0.05"]


def _worker_capstone(rank, world_size, args):
    from demos import imagenet

    return imagenet.main(TINY + args)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The checkpoints of an uninterrupted 6-step run on 2 ranks: steps 2, 4 and 6 (the final model)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(directory), "--checkpoint-every", "2"],
                    timeout_s=120)
    return directory


def _final_model(directory: Path) -> dict:
    ckpt = load("phase4_production", "checkpoint").CheckpointManager(directory).latest()
    assert ckpt is not None and ckpt.step == 6, f"no final checkpoint at step 6 in {directory}"
    return ckpt.load(0)["engine"]["model"]


@pytest.mark.parametrize("strategy", ["ddp", "ours", "zero1", "zero2", "zero3", "fsdp"])
def test_capstone_trains_and_checkpoints_with_each_strategy(strategy, tmp_path):
    # torch's FSDP2 saves through torch.distributed.checkpoint, not this script's checkpoints
    saves = strategy != "fsdp"
    args = ["--strategy", strategy.rstrip("123")] + (["--checkpoint-dir", str(tmp_path)] if saves else [])
    if strategy.startswith("zero"):
        args += ["--zero-stage", strategy[-1]]
    results = run_distributed(_worker_capstone, 2, args, timeout_s=120)
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in results)
    if saves:
        assert load("phase4_production", "checkpoint").CheckpointManager(tmp_path).latest().step == 6


@pytest.mark.e2e  # 7-15 s: in the end-to-end tier, which .ci/run runs after the main suite
def test_capstone_resume_is_bit_identical_and_elastic(uninterrupted, tmp_path):
    """Uninterrupted 6 steps == stop at step 4 and resume; resuming on 1 rank instead of 2 is close."""
    straight, resumed, elastic = uninterrupted, tmp_path / "resumed", tmp_path / "elastic"
    assert run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(resumed), "--stop-at-step", "4"],
                           timeout_s=120)[0] == {"stopped_at": 4}
    run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(resumed)], timeout_s=120)
    a, b = _final_model(straight), _final_model(resumed)
    for name in a:  # same world size, same order of every sum: bitwise
        assert torch.equal(a[name], b[name]), f"parameter {name} differs after resume"
    run_distributed(_worker_capstone, 2, ["--checkpoint-dir", str(elastic), "--stop-at-step", "4"], timeout_s=120)
    run_distributed(_worker_capstone, 1, ["--checkpoint-dir", str(elastic)], timeout_s=120)
    c = _final_model(elastic)
    for name in a:  # 1 rank sums the global batch in another order than 2: float32 rounding only
        torch.testing.assert_close(c[name], a[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _main_said(args: list[str], directory: Path) -> tuple[str, list[str]]:
    """Run the capstone in this rank; return rank 0's printed lines and this rank's warnings naming ``directory``."""
    from demos import imagenet

    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        imagenet.main(TINY + args + ["--checkpoint-dir", str(directory)])
    return out.getvalue(), [str(w.message) for w in caught if str(directory) in str(w.message)]


def _worker_capstone_fallbacks(rank, world_size, fallback, nothing):
    """Four runs in one rank process (torchvision is imported once): resume past a damaged step 4,
    a stale resume, a refusal when no checkpoint loads, then --fresh there."""
    from distlab.lessons import resume

    fallback, nothing = Path(fallback), Path(nothing)
    said = {"fallback": _main_said([], fallback)}
    # The newest loadable checkpoint is now the resumed run's step 6, past --max-steps 5.
    with pytest.raises(ValueError, match=r"step_00000006 is at step 6, past the 5 steps of this run "
                                         r"\(--max-steps 5\): pass --max-steps 6 or more"):
        _main_said(["--max-steps", "5"], fallback)
    before = {p: p.read_bytes() for p in sorted(nothing.rglob("*")) if p.is_file()}
    from demos import imagenet

    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(resume.ResumeRefused, match=r"none of the 2 checkpoint\(s\) .* loads into this run"):
        warnings.simplefilter("always")
        imagenet.main(TINY + ["--checkpoint-dir", str(nothing)])
    refused = [str(w.message) for w in caught if str(nothing) in str(w.message)]
    torch.distributed.barrier()  # both ranks refused before either compares
    after = {p: p.read_bytes() for p in sorted(nothing.rglob("*")) if p.is_file()}
    assert after == before, f"rank {rank}: a refused resume changed {sorted(set(after) ^ set(before))}"
    torch.distributed.barrier()  # both compared before --fresh deletes them
    printed, fresh_said = _main_said(["--fresh"], nothing)
    assert fresh_said == [], f"rank {rank}: --fresh over them warned {fresh_said}"
    said["nothing"] = (printed, refused)
    return said


def test_capstone_resumes_from_the_previous_checkpoint_when_the_newest_does_not_load(uninterrupted, tmp_path):
    """Checkpoints that verify but do not load are skipped with a warning naming them and the reason.

    ``fallback``: step 4's rank-0 file holds another model's shapes: every rank resumes from step 2
    and ends bitwise on the uninterrupted run. ``nothing``: step 2's rank-1 file also comes from
    another run (its sampler's seed): the resume is refused, every file as it was; then ``--fresh``
    starts over, bitwise the uninterrupted run (rank 0 fully loaded step 2 and rank 1 most of step 4
    before the other rank refused them, so it also checks that a refused checkpoint leaves nothing
    behind). A checkpoint past --max-steps is an error.
    """
    ckpt = load("phase4_production", "checkpoint")
    fallback, nothing = tmp_path / "fallback", tmp_path / "nothing"
    shutil.copytree(uninterrupted, fallback)
    shutil.rmtree(fallback / "step_00000006")  # as if the job had died during step 5
    # Rewritten through the checkpoint's own writer, so they verify. The same ViT for 16-px images
    # (64 patches + the class token): load_state_dict copies every other tensor, then raises.
    state = ckpt.load_file(fallback / "step_00000004" / "rank0.pt")
    state["engine"]["model"]["encoder.pos_embedding"] = torch.zeros(1, 65, 128)
    ckpt.save_file(state, fallback / "step_00000004" / "rank0.pt")
    shutil.copytree(fallback, nothing)
    state = ckpt.load_file(nothing / "step_00000002" / "rank1.pt")
    state["sampler"]["seed"] = 1  # loaded after the engine and the scheduler
    ckpt.save_file(state, nothing / "step_00000002" / "rank1.pt")
    assert ckpt.CheckpointManager(nothing).latest().step == 4, "the damaged checkpoints must still verify"

    said = run_distributed(_worker_capstone_fallbacks, 2, str(fallback), str(nothing), timeout_s=120)
    mismatch, seed = "size mismatch for encoder.pos_embedding", "saved sampler has seed=1 but this one has 0"
    for case, directory in (("fallback", fallback), ("nothing", nothing)):
        step4, step2 = f"{directory / 'step_00000004'}: ", f"{directory / 'step_00000002'}: "
        expected = [[[step4 + "RuntimeError", mismatch]], [[step4 + "rank(s) 0 could not load it"]]]  # per rank
        if case == "nothing":  # what the refused resume warned; --fresh then warned nothing
            expected[0] += [[step2 + "rank(s) 1 could not load it"]]
            expected[1] += [[step2 + "ValueError", seed]]
        for rank, want in enumerate(expected):
            warned = said[rank][case][1]
            assert len(warned) == len(want) and all(all(w in m for w in ws) for m, ws in zip(warned, want)), \
                f"{case}, rank {rank}: expected one warning per skipped checkpoint with {want}, got {warned}"
        b = _final_model(directory)
        for name, a in _final_model(uninterrupted).items():  # same world size and order of every sum: bitwise
            assert torch.equal(a, b[name]), f"{case}: parameter {name} differs from the uninterrupted run"
    printed = {case: said[0][case][0] for case in said[0]}
    assert f"resumed from {fallback / 'step_00000002'} (step 2," in printed["fallback"], printed["fallback"]
    assert f"no checkpoint in {nothing}: starting from step 0" in printed["nothing"], printed["nothing"]


def _worker_capstone_fp16_resume(rank, world_size, straight, resumed):
    """An uninterrupted fp16 run, then the same run stopped at step 2 and resumed, in one rank process."""
    from demos import imagenet

    fp16 = TINY + ["--amp", "fp16", "--checkpoint-every", "2", "--max-steps", "4"]
    imagenet.main(fp16 + ["--checkpoint-dir", straight])
    imagenet.main(fp16 + ["--checkpoint-dir", resumed, "--stop-at-step", "2"])
    imagenet.main(fp16 + ["--checkpoint-dir", resumed])


def test_capstone_fp16_resume_keeps_the_loss_scaler(tmp_path):
    """The loss scaler's scale and growth count are training state: a resumed fp16 run ends with the
    uninterrupted run's scaler (and model), not one restarted at step 2 (growth count 2 instead of 4)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_distributed(_worker_capstone_fp16_resume, 2, str(straight), str(resumed), timeout_s=120)
    manager = load("phase4_production", "checkpoint").CheckpointManager
    a, b = (manager(d).latest().load(0) for d in (straight, resumed))
    assert a["step"] == b["step"] == 4 and a["scaler"]["_growth_tracker"] == 4, a["scaler"]
    assert b["scaler"] == a["scaler"], f"the resumed run's loss scaler {b['scaler']} != {a['scaler']}"
    for name, p in a["engine"]["model"].items():  # same world size, same order of every sum: bitwise
        assert torch.equal(p, b["engine"]["model"][name]), f"parameter {name} differs after an fp16 resume"


def _worker_capstone_and_restart(rank, world_size, args, other: str):
    """A capstone run to step 4; another experiment's checkpoints (steps 10, 12, 14 of ``other``) copied
    into its directory; its restart to step 8 in the same rank process (torchvision is imported once).
    Returns what the restart printed."""
    from demos import imagenet

    imagenet.main(TINY + args + ["--max-steps", "4"])
    if rank == 0:
        for step in Path(other).iterdir():
            shutil.copytree(step, Path(args[1]) / step.name)
    torch.distributed.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cannot resume" per skipped step: test_capstone_resumes_from_the_previous...
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            imagenet.main(TINY + args + ["--max-steps", "8"])
    return out.getvalue()


def test_capstone_keep_never_counts_nor_deletes_another_experiments_newer_checkpoints(tmp_path):
    """Another experiment's steps 10, 12 and 14 land in --checkpoint-dir after the capstone saved 2 and 4:
    they verify but do not load (another model). The restart skips them, resumes from step 4, saves 6 and 8
    with --keep 3: it keeps its own 4, 6, 8 and leaves the other's files byte for byte. (Counting the
    other's, pruning deleted every checkpoint of the run.)"""
    other = tmp_path / "other"
    with load("phase4_production", "checkpoint").CheckpointManager(other) as manager:  # closed: free for the run
        for step in (10, 12, 14):
            manager.save(step, {"engine": {"model": {"weight": torch.zeros(7)}}})
    foreign = {p.relative_to(other): p.read_bytes() for p in other.rglob("*.pt")}
    run = tmp_path / "run"
    printed = run_distributed(_worker_capstone_and_restart, 2, ["--checkpoint-dir", str(run), "--checkpoint-every",
                                                               "2", "--keep", "3"], str(other), timeout_s=120)[0]
    names = sorted(p.name for p in run.iterdir())
    assert names == [f"step_{s:08d}" for s in (4, 6, 8, 10, 12, 14)], f"expected the run's 4, 6, 8 and the other's: {names}"
    assert {path: (run / path).read_bytes() for path in foreign} == foreign, "the other experiment's files changed"
    assert f"resumed from {run / 'step_00000004'} (step 4," in printed, f"the restart did not resume: {printed}"


def _worker_eval_and_units(rank, world_size):
    """evaluate() on an uneven split (no hang, exact count); ZeRO-3 on the ViT gathers one block at a time."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from demos import imagenet
    FSDP = load("phase3_multi_node", "fsdp").FullyShardedDataParallel
    torch.manual_seed(0)
    model = imagenet.build_model("vit_tiny", 10, 8)
    reference = copy.deepcopy(model)
    fsdp = FSDP(model)
    # 11 images over 3 ranks in batches of 3: shards of 4, 4, 3 images, so 2, 2 and 1 batches; each
    # forward is a collective (ZeRO-3 gathers), so unequal batch counts would hang.
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(11, 3, 8, 8, generator=g), torch.randint(10, (11,), generator=g))
    accuracy = imagenet.evaluate(fsdp, data, torch.device("cpu"), rank, world_size, batch_size=3)
    with torch.no_grad():
        expected = (reference.eval()(data.tensors[0]).argmax(1) == data.tensors[1]).double().mean().item()
    assert accuracy == expected, f"rank {rank}: accuracy {accuracy} != {expected} on 11 images"
    units = [type(u.module).__name__ for u in fsdp.units]
    assert units.count("EncoderBlock") == 4, f"ViT units {units}: expected one per encoder layer"
    fsdp.memory.reset()
    fsdp.max_gathered = 0
    F.cross_entropy(fsdp(data.tensors[0][:4]), data.tensors[1][:4]).backward()
    block = max(u.full.numel() * u.full.element_size() for u in fsdp.units if u.module is not model)
    root = next(u.full.numel() * u.full.element_size() for u in fsdp.units if u.module is model)
    shards = sum(u.shard.numel() * u.shard.element_size() for u in fsdp.units)
    # The root (class token, position embedding) + the unit in backward + one prefetched.
    assert fsdp.max_gathered <= 3 and fsdp.memory.peak["params"] <= shards + root + 2 * block, \
        f"rank {rank}: {fsdp.max_gathered} units gathered, params peak {fsdp.memory.peak['params']} B " \
        f"> shards {shards} + root {root} + 2 x block {block}"


def test_capstone_evaluate_is_exact_and_vit_zero3_gathers_one_block_at_a_time():
    run_distributed(_worker_eval_and_units, 3, timeout_s=120)
