"""The seeded-bug catalogue (grading/bugs/, distlab/bugs.py): its transforms still apply to
the solutions, it covers every phase, and the runner reports a seeded bug as caught.
The full catalogue runs on demand (``python -m distlab.bugs``, minutes); its last result is
benchmarks/results/bug_catalogue.json."""
from __future__ import annotations

import re

import pytest

from distlab import bugs
from distlab.pytest_plugin import load_weights


def test_catalogue_applies_and_covers_every_phase():
    catalogue = bugs.catalogue()
    assert len(catalogue) >= 40, f"{len(catalogue)} bugs; the issue asks for at least 40"
    weights = load_weights()
    for bug in catalogue:
        assert bug.exercise in weights, f"{bug.id}: exercise {bug.exercise!r} is not in grading/weights.toml"
        mutated = bug.mutated()  # raises if an `old` no longer occurs exactly once
        assert mutated != (bugs.REPO / bug.file).read_text(), f"{bug.id}: the transform changes nothing"
        compile(mutated, bug.file, "exec")  # a bug is a wrong program, not a syntax error
    phases = {re.match(r"(\d+)\.", b.exercise)[1] for b in catalogue}
    assert phases >= {"1", "2", "3", "4", "5"}, f"phases covered: {sorted(phases)}"


@pytest.mark.e2e
def test_runner_catches_a_seeded_bug():
    # Cheap and deterministic: the straggler rule by the mean (no process group).
    (bug,) = [b for b in bugs.catalogue() if b.id == "4.12-by-the-mean"]
    row = bugs.run_bug(bug)
    assert row["status"] == "caught", row


def test_gloo_size_mismatch_is_translated():
    # gloo's own abort text (torch 2.x, tcp/pair.cc), as a wrong ring chunk at W=3 produces it.
    from distlab.testing import translate_size_mismatch

    gloo = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
            "/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:464] op.preamble.length <= "
            "op.nbytes. 16 vs 12. Received data size doesn't match expected size.")
    assert translate_size_mismatch(gloo, rank=2, step=1).startswith(
        "rank 2 received 16 bytes, expected 12: sender and receiver disagree on the message size; "
        "check the chunk index at step 1")
    assert translate_size_mismatch("Connection closed by peer", rank=2) is None


def _worker_forgotten_division(rank, world_size, source):
    # The seeded bug's trainer, run directly (no scratch copy): one gradient all-reduce.
    import types

    import torch

    from distlab.models import ToyMLP, seeded
    from distlab.testing import assert_grads_close, shard

    trainer = types.ModuleType("trainer_with_bug")
    exec(compile(source, "trainer.py", "exec"), trainer.__dict__)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.arange(8) % 3
    baseline, model = seeded(ToyMLP, 0, 6, 10, 3).double(), seeded(ToyMLP, 0, 6, 10, 3).double()
    torch.nn.functional.cross_entropy(baseline(x), y).backward()
    torch.nn.functional.cross_entropy(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    trainer.allreduce_gradients(model)
    try:
        assert_grads_close(model, baseline, rank=rank, step=0, rtol=1e-10, atol=1e-10)
    except AssertionError as exc:
        return str(exc)
    return "no difference"


def test_a_forgotten_division_is_named_as_a_factor():
    # The message the learner sees for the classic bug: the factor and its likely cause.
    from distlab.spawn import run_distributed

    (bug,) = [b for b in bugs.catalogue() if b.id == "1.7-never-divided"]
    messages = run_distributed(_worker_forgotten_division, 2, bug.mutated())
    assert messages[1].startswith("rank 1, step 0, gradient of fc1.weight: max abs diff"), messages[1]
    assert "it is 2.00x the expected value everywhere: summed where a mean was due (never divided by W?)" \
        in messages[1], messages[1]
