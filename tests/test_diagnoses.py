"""The first line of a failure names its cause (issue 32, part 2), one test per kind of mistake.

Each test seeds the mistake itself (a catalogue transform of a solution, run directly, or the error text a
backend really prints) and checks the learner's first line; grading/bugs/diagnoses.toml holds the same
mistakes for ``python -m distlab.bugs``, which checks the line through a whole student copy.
"""
from __future__ import annotations

import copy
import re
import types

import pytest
import torch

from distlab import bugs, outcome, regions, templates
from distlab.models import ToyMLP, seeded
from distlab.spawn import run_distributed
from distlab.testing import (assert_models_close, assert_tensors_close, diagnose, explain_sum, explain_tags,
                             ring_tagged)

TRAINER = bugs.REPO / "solutions" / "phase1_data_parallel" / "trainer.py"


def _bug(bug_id: str) -> bugs.Bug:
    (bug,) = [b for b in bugs.catalogue() if b.id == bug_id]
    return bug


# --------------------------------------------------------------------------- edits outside the TODOs
def test_an_edit_outside_the_todos_is_named_by_its_function(tmp_path):
    stub = templates.render(TRAINER)
    finished = bugs.render_partial(TRAINER, {"1.6", "1.7", "1.8"})  # every TODO filled in, markers kept
    assert regions.edited_outside_todos(stub, stub) == []
    assert regions.edited_outside_todos(finished, stub) == [], "code inside the TODO regions is the learner's"
    seeded_bug = bugs.render_partial(TRAINER, {"1.6", "1.7", "1.8"}, _bug("1.6-zero-grad-deleted").mutated())
    assert regions.edited_outside_todos(seeded_bug, stub) == ["train_step"]
    # The learner's copy, as the plugin reads it: the note leads the failing test's message.
    mine = tmp_path / "phase1_data_parallel" / "template_trainer.py"
    mine.parent.mkdir()
    mine.write_text(finished)
    assert bugs.outside_edit_note("1.6-1.8 naive data parallel", tmp_path) is None
    mine.write_text(seeded_bug)
    note = bugs.outside_edit_note("1.6-1.8 naive data parallel", tmp_path)
    assert note is not None and note.startswith(
        "you edited train_step in phase1_data_parallel/template_trainer.py (not a TODO): restore"), note
    assert bugs.outside_edit_note("bench", tmp_path) is None  # not an exercise


# --------------------------------------------------------------------------- backend errors
GLOO_PAIR = ("[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:809] state_ >= "
             "CONNECTED. 1 vs 4. Pair is not connected ([127.0.0.1]:41376$0 <--> [none])")  # 1.1's global rank


@pytest.mark.parametrize("text,cause", [
    (GLOO_PAIR, "a message was addressed to a rank outside this group"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5432",
     "another rank's process ended mid-collective"),
    ("Invalid destination rank: should be within the range of [0, 2), but got 3",
     "a src/dst outside the group's ranks was addressed"),
    ("[enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 16 vs 12",
     "sender and receiver disagree on the message size (16 bytes arrived for a 12-byte buffer)"),
])
def test_a_backend_error_reads_as_its_cause(text, cause):
    exc = outcome.rebuild(("error", "builtins", "RuntimeError", f"{text}\nmore of gloo's text", "tb", False), 1)
    first = str(exc).splitlines()[0]
    assert first.startswith(f"rank 1: {cause}"), first
    assert text[:60] in first, "the backend's own words stay, after the cause"
    again = outcome.rebuild(outcome.failure(exc), 1)  # a result read twice (a jail, then the verdict)
    assert str(again).count(cause) == 1, str(again)


@pytest.mark.parametrize("text", ["hidden size 10 is not divisible by 3",
                                  "Error(s) in loading state_dict: size mismatch for encoder.pos_embedding"])
def test_other_errors_pass_unchanged(text):
    # A load_state_dict "size mismatch" is another model's checkpoint, not two ranks disagreeing.
    exc = outcome.rebuild(("error", "builtins", "RuntimeError", text, "", False), 0)
    assert str(exc) == f"rank 0: {text}"


# --------------------------------------------------------------------------- pytest.raises(match=)
def test_a_regex_miss_shows_pattern_and_message_in_line_one():
    from distlab.pytest_plugin import _first_line

    with pytest.raises(AssertionError) as info:
        with pytest.raises(ValueError, match="checksum"):
            raise ValueError("/tmp/x.pt: payload hash differs: the file is corrupted")
    want = ("the error's message does not match the test's pattern: expected a match for 'checksum', got "
            "'/tmp/x.pt: payload hash differs: the file is corrupted'")
    assert _first_line(info) == want
    from_rank = outcome.rebuild(outcome.failure(info.value), 2)  # raised in a rank
    assert str(from_rank).splitlines()[0] == f"rank 2: {want}"


# --------------------------------------------------------------------------- the ratio, on every value check
def test_a_bf16_sum_against_its_mean_is_named_as_a_factor():
    # 2.5a without /W at W=3: the sum and the mean each rounded to bf16 once (2^-8 relative apiece).
    grads = [torch.full((3, 4), 30000.0) + torch.arange(12.0).view(3, 4) * (r + 1) for r in range(3)]
    total = sum(g.to(torch.bfloat16).float() for g in grads)
    with pytest.raises(AssertionError, match=r"it is 3\.00x the expected value everywhere: summed where a mean "
                                             r"was due \(never divided by W\?\)"):
        assert_tensors_close(total.to(torch.bfloat16), (total / 3).to(torch.bfloat16), "p.grad", rtol=0, atol=0)


def test_a_loss_scale_never_divided_out_is_named_on_the_update():
    # 2.3's unscale_ multiplying by 1: the step's update is S times torch's, not the parameter.
    model = seeded(ToyMLP, 0, 6, 10, 3)
    baseline = copy.deepcopy(model)
    x, y = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1])
    for m, scale in ((model, 1024.0), (baseline, 1.0)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        (torch.nn.functional.cross_entropy(m(x), y) * scale).backward()  # never unscaled where scale > 1
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
    with pytest.raises(AssertionError) as info:
        assert_models_close(model, baseline, rank=0, step=0, rtol=0, atol=0, start=before)
    assert "the update (the parameter minus its value before the step) is 1024.00x the expected value " \
           "everywhere: a power of two: the loss scale never divided out" in str(info.value), info.value
    assert diagnose(torch.ones(4) * 0.5, torch.ones(4)).startswith("; it is 0.50x")  # no world: W unknown


# --------------------------------------------------------------------------- ring chunks, by their tags
def _worker_tagged_ring(rank, world_size, sources):
    """The catalogue's mutated ring modules, run directly on tagged inputs; returns each failure's line."""
    lines = {}
    for bug_id, source in sources.items():
        ring = types.ModuleType(bug_id)
        exec(compile(source, "ring_allreduce.py", "exec"), ring.__dict__)
        tagged = [ring_tagged(q, 12, world_size) for q in range(world_size)]
        sizes = [t.numel() for t in tagged[0].tensor_split(world_size)]
        if bug_id.startswith("3.1"):
            mine, due = ring.ring_reduce_scatter(tagged[rank]), sum(tagged).tensor_split(world_size)[rank]
            chunks = [(rank, sizes[rank])]
        else:
            mine = ring.ring_all_gather(tagged[rank].tensor_split(world_size)[rank].clone(), 12)
            due, chunks = torch.cat([t.tensor_split(world_size)[q] for q, t in enumerate(tagged)]), list(enumerate(sizes))
        try:
            assert_tensors_close(mine, due, f"rank {rank}, {bug_id}", rtol=0, atol=0,
                                 explain=explain_tags(world_size, chunks))
            lines[bug_id] = "no difference"
        except AssertionError as exc:
            lines[bug_id] = str(exc)
    return lines


def test_a_wrong_ring_chunk_names_whose_chunk_arrived():
    ids = ("3.1-chunk-off-by-one", "3.2-chunk-off-by-one", "3.2-neighbours-swapped")
    lines = run_distributed(_worker_tagged_ring, 3, {i: _bug(i).mutated() for i in ids})[0]
    assert lines["3.2-neighbours-swapped"].endswith(
        "; chunk 1 holds rank 2's chunk 2; expected rank 1's chunk 1: the wrong chunk: is the chunk index off by "
        "one, or are the ring's neighbours swapped (send to rank+1, receive from rank-1)?"), lines
    assert "; chunk 1 holds rank 2's chunk 2; expected rank 1's chunk 1: the wrong chunk" \
        in lines["3.2-chunk-off-by-one"], lines
    assert "; chunk 0 holds " in lines["3.1-chunk-off-by-one"] and "expected rank 0's chunk 0 + rank 1's chunk 0 + " \
        "rank 2's chunk 0: " in lines["3.1-chunk-off-by-one"], lines


def test_tags_read_back_counts_and_garbage():
    w = 2
    due = (ring_tagged(0, 4, w) + ring_tagged(1, 4, w))[:2]  # chunk 0, summed over both ranks
    explain = explain_tags(w, [(0, 2)])
    assert explain(2 * due, due).endswith("2 x rank 0's chunk 0 + 2 x rank 1's chunk 0; expected rank 0's chunk 0 "
                                          "+ rank 1's chunk 0: a part counted more than once: a received chunk "
                                          "added twice, or a ring step too many?")
    assert "rank(s) [1]'s part is missing" in explain(ring_tagged(0, 4, w)[:2], due)
    assert "holds no sum of the ranks' chunks (garbage: never written?)" in explain(torch.full((2,), 0.5), due)
    assert explain(due, due) == ""


# --------------------------------------------------------------------------- the catalogue's expectations
def test_the_catalogue_expects_a_cause_for_twenty_mistakes(tmp_path):
    expecting = [b for b in bugs.catalogue() if b.expect]
    assert len(expecting) >= 20, [b.id for b in expecting]
    row = {"status": "caught", "message": "rank 1: a message was addressed to a rank outside this group (...)"}
    (bug,) = [b for b in expecting if b.id == "1.1-global-src-on-subgroup"]  # an [[expect]] on phase1.toml's bug
    assert re.search(bug.expect, row["message"])
    (tmp_path / "a.toml").write_text('[[expect]]\nid = "no-such-bug"\nexpect = "x"\n')
    with pytest.raises(ValueError, match=r"\[\[expect\]\] for bug ids not in .*: \['no-such-bug'\]"):
        bugs.catalogue(tmp_path)


# --------------------------------------------------------------------------- whose inputs a sum holds
def _worker_sum_of_inputs(rank, world_size, sources):
    lines = {}
    for bug_id, (strategy, source) in sources.items():
        collectives = types.ModuleType(bug_id)
        exec(compile(source, "collectives.py", "exec"), collectives.__dict__)
        inputs = [torch.randn(7, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
                  for r in range(world_size)]
        mine = inputs[rank].clone()
        getattr(collectives, strategy)(mine, op="sum")
        try:
            assert_tensors_close(mine, sum(inputs), f"rank {rank}, {bug_id}", explain=explain_sum(inputs))
            lines[bug_id] = "no difference"
        except AssertionError as exc:
            lines[bug_id] = str(exc)
    return lines


def test_a_wrong_sum_names_whose_inputs_it_holds():
    bugs_ = {"1.2-drops-rank0": "allreduce_allgather_sum", "1.3-scatters-own-data": "allreduce_gather_scatter"}
    lines = run_distributed(_worker_sum_of_inputs, 3, {i: (s, _bug(i).mutated()) for i, s in bugs_.items()})[1]
    assert lines["1.2-drops-rank0"].endswith("; it holds rank 1's input + rank 2's input: rank(s) [0]'s input is "
                                             "missing"), lines
    assert lines["1.3-scatters-own-data"].endswith("; it holds rank 0's input: one input, not the total, reached this "
                                                   "rank (sent out an input where the reduced total was due?)"), lines
    assert explain_sum([torch.ones(3)])(torch.zeros(3), torch.ones(3)).endswith("it holds none of the inputs: "
                                                                                 "rank(s) [0]'s input is missing")
