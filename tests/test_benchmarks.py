"""benchmarks/: every topic follows the interface, and the summary and README section are built from results."""
from __future__ import annotations

import importlib
import inspect

import pytest

from benchmarks import run as bench_run


@pytest.mark.parametrize("topic", bench_run.topics())
def test_benchmark_module_has_run_quick_and_main(topic):
    module = importlib.import_module(f"benchmarks.bench_{topic}")
    assert "quick" in inspect.signature(module.run).parameters, f"bench_{topic}.run must take quick="
    assert callable(getattr(module, "main", None)), f"bench_{topic} has no main()"


def test_summary_and_readme_section_come_from_the_results(tmp_path, monkeypatch):
    results = {"collectives": {"machine": {"cores": 2, "torch": "x"}, "comparisons": {
        "ring allreduce 16MiB W=2": {"ratio": 0.93, "metric": "time", "world_size": 2, "size": "16 MiB"}}},
        "zero": {"comparisons": {"optimizer state bytes": {"ratio": 0.5, "metric": "bytes", "world_size": 2,
                                                           "size": "1.6M params"}}}}
    summary = bench_run.summarise(results)
    assert summary["comparisons"]["collectives/ring allreduce 16MiB W=2"]["ratio"] == 0.93
    assert summary["comparisons"]["zero/optimizer state bytes"]["metric"] == "bytes"
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nintro\n")
    monkeypatch.setattr(bench_run, "README", readme)
    bench_run.render_readme(summary)
    bench_run.render_readme(summary)  # idempotent: one section, replaced in place
    text = readme.read_text()
    assert text.count(bench_run.BEGIN) == 1 and "| collectives/ring allreduce 16MiB W=2 | time | 0.93 | 2 | 16 MiB |" in text
    assert text.startswith("# title\n\nintro\n")
