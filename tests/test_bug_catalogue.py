"""The seeded-bug catalogue (grading/bugs/, distlab/bugs.py): its transforms still apply to
the solutions, it covers every phase, and the runner reports a seeded bug as caught.
The full catalogue runs on demand (``python -m distlab.bugs``, minutes); its last result is
benchmarks/results/bug_catalogue.json."""
from __future__ import annotations

import re

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
    assert phases >= {"1", "2", "3", "4"}, f"phases covered: {sorted(phases)}"


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
