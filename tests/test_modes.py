"""Every RUN_MODE runs on its defaults at any world size, and a bad choice says what to change.

Running 27 modes at 4 world sizes would take many minutes, so the coverage is split:

* in-process, no process group: every mode's ``resolve_args(args, world_size)`` (the
  defaults that adapt to the world size, and the checks of what the lesson code splits;
  demos/sizes.py) resolves its defaults at world sizes 1-8, which include docker-compose's
  3 nodes (and 6 with NPROC=2). The result is resolved again as if the user had typed it:
  a default that the world size does not divide fails there, with the flag named;
* real runs in one 3-rank world: three modes whose sizes the lesson code splits and checks
  itself (tensor parallel: heads, width, vocabulary; sequence parallel: tokens; context
  parallel: Ulysses's heads) run their ``main`` on the defaults that depend on the world
  size, with few steps. tests/test_deployment.py runs the three-node compose topology on
  loopback;
* each explicit choice that cannot work names its flag and a value that can: the value is
  taken from the message and resolved;
* a launch that fails prints one short report naming the failing rank (torchrun through
  entrypoint.sh), and entrypoint.sh refuses bad NPROC / NNODES / MAX_RESTARTS / NODE_RANK.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from distlab.procs import kill_process_tree, marked_environ
from distlab.spawn import run_distributed
from distlab.loader import load

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "entrypoint.sh"
MODES = dict(re.findall(r"^\s*\[(\w+)\]=([\w.]+)\s*$", ENTRYPOINT.read_text(), flags=re.M))


def _resolve(mode: str, argv: list[str], world_size: int, monkeypatch) -> argparse.Namespace:
    monkeypatch.setenv("RUN_MODE", mode)  # entrypoint.sh exports it; the pipeline's schedule defaults to it
    module = importlib.import_module(MODES[mode])
    return module.resolve_args(module.build_parser().parse_args(argv), world_size)


def test_every_mode_resolves_its_defaults_at_world_sizes_1_to_8(monkeypatch):
    failures = []
    for mode, module in MODES.items():
        demo = importlib.import_module(module)
        assert hasattr(demo, "build_parser") and hasattr(demo, "resolve_args"), \
            f"{module}: give it build_parser() and resolve_args(args, world_size) (see demos/sizes.py)"
        for world_size in range(1, 9):
            try:
                resolved = _resolve(mode, [], world_size, monkeypatch)
                again = demo.resolve_args(argparse.Namespace(**vars(resolved)), world_size)  # as if typed
                assert vars(again) == vars(resolved), f"resolving twice changed {vars(resolved)} to {vars(again)}"
            except Exception as exc:  # every failing (mode, world size) is listed, not only the first
                failures.append(f"RUN_MODE={mode} NPROC={world_size}: {type(exc).__name__}: {exc}")
    assert not failures, "defaults that do not work:\n" + "\n".join(failures)


@pytest.mark.parametrize("mode, argv, world_size, flag", [
    ("pipeline_1f1b", ["--microbatches", "2"], 3, "--microbatches"),
    ("pipeline_interleaved", ["--microbatches", "8"], 3, "--microbatches"),
    ("pipeline_1f1b", ["--layers-per-stage", "0"], 2, "--layers-per-stage"),
    ("pipeline_interleaved", ["--layers-per-stage", "3"], 2, "--layers-per-stage"),
    ("pipeline_gpipe", ["--batch", "100"], 2, "--batch"),
    ("tensor_parallel", ["--n-head", "4"], 3, "--n-head"),
    ("tensor_parallel", ["--vocab", "64"], 3, "--vocab"),
    ("tensor_parallel", ["--n-embd", "50"], 2, "--n-embd"),
    ("sequence_parallel", ["--seq-len", "64"], 3, "--seq-len"),
    ("tp_dp_2d", ["--tp-size", "2"], 3, "--tp-size"),
    ("tp_dp_2d", ["--global-batch", "9"], 4, "--global-batch"),
    ("device_mesh", ["--tp-size", "3"], 3, "--tp-size"),
    ("imagenet", ["--global-batch", "64"], 3, "--global-batch"),
    ("imagenet", ["--global-batch", "2"], 3, "--global-batch"),  # below the world size: never "try 0"
    ("mixed_precision", ["--global-batch", "16"], 3, "--global-batch"),
    ("activation_checkpointing", ["--steps", "5", "--warmup", "5"], 1, "--warmup"),
    ("context_parallel", ["--heads", "8"], 3, "--heads"),
    ("context_parallel", ["--seq-len", "4"], 3, "--seq-len"),
    ("expert_parallel", ["--experts", "4"], 3, "--experts"),
    ("expert_parallel", ["--experts", "4", "--top-k", "5"], 2, "--top-k"),
    ("fault_tolerance", ["--global-batch", "12"], 5, "--global-batch"),
    ("data_parallel_overlap", ["--global-batch", "64"], 3, "--global-batch"),
    ("tour", ["--hidden", "100"], 3, "--hidden"),
    ("parameter_server", ["--servers", "7"], 3, "--servers"),
    ("sharded_checkpoint", ["--steps", "2"], 2, "--steps"),
])
def test_a_choice_that_cannot_work_names_the_flag_and_a_value_that_does(mode, argv, world_size, flag, monkeypatch):
    with pytest.raises(ValueError) as info:
        _resolve(mode, argv, world_size, monkeypatch)
    message = str(info.value)
    suggested = re.search(rf"use {flag} (-?\d+)", message)
    assert suggested and int(suggested.group(1)) > 0, f"no positive value for {flag} in: {message}"
    fixed = list(argv)
    fixed[fixed.index(flag) + 1] = suggested.group(1)
    _resolve(mode, fixed, world_size, monkeypatch)  # the suggestion must work


def test_interleaved_pipeline_builds_the_same_model_as_gpipe_and_1f1b():
    from demos.pipeline import build_chunks

    pp = load("phase2_advanced", "pipeline")
    for stages in (1, 2, 3):
        models = {}
        for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
            # Every rank's pieces, in virtual-stage order (chunk c of rank r is virtual stage c*p + r).
            pieces = [build_chunks(pp, schedule, rank, stages, chunks, 64, 8, 10, layers_per_stage=4)
                      for rank in range(stages)]
            ordered = [pieces[rank][c] for c in range(len(pieces[0])) for rank in range(stages)]
            models[schedule, chunks] = [p for piece in ordered for p in piece.parameters()]
        reference = models["gpipe", 1]
        assert len(reference) == 2 * (stages * 4 + 2)  # 4 hidden blocks per stage, plus input and output layers
        for key, params in models.items():
            assert len(params) == len(reference) and all(torch.equal(a, b) for a, b in zip(params, reference)), \
                f"{key} at {stages} stages builds another model than GPipe: its losses would not compare"


def _worker_modes(rank, world_size, runs):
    for module, argv in runs:
        importlib.import_module(module).main(argv)


def test_the_modes_that_split_sizes_run_on_their_defaults_at_three_ranks():
    runs = [  # few steps; every size that depends on the world size is left to its default
        ("demos.tensor_parallel", ["--steps", "1", "--batch", "2"]),
        ("demos.sequence_parallel", ["--batch", "1"]),
        ("demos.context_parallel", ["--seq-len", "16", "--head-dim", "4", "--repeats", "1"]),
    ]
    run_distributed(_worker_modes, 3, runs, timeout_s=240)


def _launch(env: dict, args: list[str], timeout_s: float = 180) -> tuple[int, str]:
    """``entrypoint.sh args`` with ``env``; (exit code, stdout + stderr). Nothing outlives it."""
    marker = os.urandom(8).hex()
    proc = subprocess.Popen([str(ENTRYPOINT), *args], cwd=REPO, env={**marked_environ(marker), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    finally:
        kill_process_tree(proc.pid, marker)
        proc.wait()


def test_a_failed_launch_prints_the_error_once_with_its_rank():
    code, output = _launch({"RUN_MODE": "pipeline_1f1b", "NPROC": "2", "OMP_NUM_THREADS": "1"},
                           ["--microbatches", "1"])
    lines = output.strip().splitlines()
    message = "--microbatches 1 must be at least 2 with 2 stages, or the pipeline never fills: use --microbatches 2"
    assert code == 1, output
    assert output.count(message) == 1, output  # not once per rank
    assert re.search(r"^demos\.pipeline failed on rank [01] \(exit code 1\): ValueError: ", output, flags=re.M), output
    # entrypoint's command line, torchrun's log line of the first failure, the report: not 64 lines
    assert len(lines) <= 6 and "Traceback" not in output, output


@pytest.mark.parametrize("env, says", [
    ({"NPROC": "0"}, "NPROC='0' is not a number of processes per node: use a positive integer (NPROC=2)"),
    ({"NPROC": "-1"}, "NPROC='-1' is not a number of processes per node"),
    ({"NNODES": "abc"}, "NNODES='abc' is not a number of nodes: use a positive integer (NNODES=2), or MIN:MAX"),
    ({"NNODES": "4:2"}, "NNODES='4:2': the minimum is above the maximum; use NNODES=2:4"),
    ({"MAX_RESTARTS": "x"}, "MAX_RESTARTS='x' is not a number of restarts: use a whole number (MAX_RESTARTS=3)"),
    ({"NODE_RANK": "first"}, "NODE_RANK='first' is not a node rank: use 0 on the first node"),
])
def test_entrypoint_says_what_to_write_instead_of_a_bad_variable(env, says):
    out = subprocess.run([str(ENTRYPOINT)], env={**os.environ, "RUN_MODE": "comm", "TORCHRUN": "false", **env},
                         capture_output=True, text=True, timeout=30)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"entrypoint.sh: {says}"), out.stderr


def test_a_demo_records_its_error_for_torchrun_and_the_report_keeps_a_bug_s_traceback(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from distlab.todo import run_demo, summarize_failure

    def main():
        raise RuntimeError("shapes do not match")

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))  # what torchrun gives each worker
    with pytest.raises(SystemExit) as info:
        run_demo(main)  # rank 0: records the error (torch's @record) and exits without printing it
    assert info.value.code == 1 and error_file.is_file()
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(error_file)),
                1: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none.json")),
                2: ProcessFailure(local_rank=2, pid=12, exitcode=1, error_file=str(error_file))}  # the same error
    report = summarize_failure(ChildFailedError("demos.x", failures)).splitlines()
    assert report[0] == "demos.x failed on rank 0 (exit code 1): RuntimeError: shapes do not match", report
    # not a ValueError (a flag to change) but a bug: where it broke comes with it, once
    assert report[1] == "  Traceback (most recent call last):" and report[-2] == "  RuntimeError: shapes do not match"
    assert report[-1] == "  and rank(s) 2 with the same error; rank 1 (exit code -9, SIGKILL)", report
    assert sum(line.strip() == "RuntimeError: shapes do not match" for line in report) == 1, report  # not rank 2's


def test_a_demo_stops_with_one_line_at_a_todo_and_at_a_bad_flag(tmp_path, monkeypatch, capfd):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from distlab.todo import TODO_EXIT_CODE, run_demo, summarize_failure, todo

    def unfinished():
        raise todo("1.1 sum it", "guidelines.md#x")

    def bad_flag():
        raise ValueError("--microbatches 1 must be at least 2: use --microbatches 2")

    def bug():
        raise RuntimeError("shapes do not match")

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)  # without torchrun
    for main, code in ((unfinished, TODO_EXIT_CODE), (bad_flag, 1)):
        with pytest.raises(SystemExit) as info:
            run_demo(main)
        assert info.value.code == code
    assert capfd.readouterr().err.splitlines() == [
        "TODO 1.1 sum it: not implemented yet (see tests/guidelines.md#x)",
        "ValueError: --microbatches 1 must be at least 2: use --microbatches 2"]
    with pytest.raises(RuntimeError, match="shapes do not match"):  # a bug keeps its traceback
        run_demo(bug)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))  # under torchrun: the TODO is recorded too
    with pytest.raises(SystemExit):
        run_demo(unfinished)
    report = summarize_failure(ChildFailedError("demos.x", {0: ProcessFailure(0, 10, TODO_EXIT_CODE, str(error_file))}))
    assert report == "demos.x failed on rank 0 (exit code 3): LearnerTODO: TODO 1.1 sum it: not implemented yet " \
                     "(see tests/guidelines.md#x)", report
