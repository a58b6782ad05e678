"""The tour's table is measured, not asserted: here its claims are checked.

Every exact strategy ends where its single-process twin does (the MLP's, or for context
and expert parallelism their own models'); compression does not; ZeRO divides the model
state as the textbook says; ZeRO-3 sends 1.5x what DDP sends.
"""
from __future__ import annotations

import pytest

from distlab.spawn import run_distributed


def _worker_tour(rank, world_size, out_dir):
    from demos import tour

    return tour.main(["--quick", "--out", out_dir])


@pytest.mark.e2e  # the whole tour, every strategy (26 s): the main suite stays under 600 s
@pytest.mark.parametrize("world_size", [2, 3])
def test_tour_strategies_match_single_process(world_size, tmp_path):
    summary = run_distributed(_worker_tour, world_size, str(tmp_path), timeout_s=240)[0]
    assert {"context parallel, ring [phase 5]", "expert parallel, MoE [phase 5]"} <= set(summary)
    for name, r in summary.items():
        if "DDP [phase 4]" in name:  # compression: lossy by design, but it must still have trained
            assert r["max_param_diff"] > 1e-6 and r["final_loss"] < 2.5, f"{name}: {r}"
            continue
        # 12 float32 steps of SGD with momentum; only the order of sums differs between
        # strategies, which moves parameters by ~1e-7. A missing 1/W moves them by ~1e-1.
        assert r["max_param_diff"] < 1e-5, f"{name}: parameters differ from single process by {r['max_param_diff']:.2e}"
        assert abs(r["final_loss"] - r["single_final_loss"]) < 1e-5, \
            f"{name}: final loss {r['final_loss']}, its single process {r['single_final_loss']}"
        assert r["bytes_per_step"] > 0 or name == "single process", f"{name} sent nothing"
    ddp, zero3 = summary["torch DDP"]["bytes_per_step"], summary["ZeRO-3 / FSDP [phase 3]"]["bytes_per_step"]
    assert 1.45 < zero3 / ddp < 1.6, f"ZeRO-3 sends {zero3 / ddp:.2f}x DDP's bytes (textbook 1.5x, plus padding)"
    full = summary["naive DP [phase 1]"]["state_bytes"]  # params + grads + momentum, replicated
    for name, kept in (("ZeRO-1 [phase 3]", 2 + 1 / world_size), ("ZeRO-2 [phase 3]", 1 + 2 / world_size),
                       ("ZeRO-3 / FSDP [phase 3]", 3 / world_size)):
        ratio = summary[name]["state_bytes"] / (full / 3)
        assert abs(ratio - kept) < 0.05, f"{name}: state/rank is {ratio:.3f} parameter sizes, expected {kept:.3f}"
    assert (tmp_path / "loss_curves.png").is_file() and (tmp_path / "pipeline_1f1b.png").is_file()


# --- the tour's figures, read from their layout (panels, series, labels), not from pixels --------------

def _fake_results(world_size: int = 2, steps: int = 12) -> dict[str, dict]:
    """A tour's results: every MLP strategy within 1e-7..1e-6 of single process, compression 1e-2 off,
    context and expert parallelism on losses of other scales, each with its own twin."""
    from demos import tour

    single = [2.3 - 0.1 * k for k in range(steps)]
    results = {}
    for i, (name, (family, _)) in enumerate(tour.STRATEGIES.items()):
        if family in tour.OWN_MODELS:
            twin = [5.0 - 0.3 * k for k in range(steps)] if family == "cp" else [1.9 - 0.05 * k for k in range(steps)]
            losses, baseline = [v + 3e-7 for v in twin], (twin, {})
        else:
            off = 0.0 if name == "single process" else 1e-2 if family == "compress" else i * 1e-7
            losses, baseline = [v + off * (k + 1) / steps for k, v in enumerate(single)], None
        results[name] = {"losses": losses, "baseline": baseline, "bytes_per_step": 1000.0 * (i + 1),
                         "state_bytes": 500.0 * (i + 1)}
    return results


def test_tour_loss_plot_shows_each_run_against_its_own_single_process():
    from demos import tour
    from distlab.plots import figure_of, loss_panels

    results = _fake_results()
    groups = tour.by_model(results, "losses", hidden=64, world_size=2)
    panels = loss_panels(groups)
    mlp = [n for n, (f, _) in tour.STRATEGIES.items() if f not in tour.OWN_MODELS]
    assert len(panels) == 2 * 3, [p.title for p in panels]  # MLP, TinyGPT, MoE: loss above difference
    loss, diff = panels[0], panels[1]
    assert list(loss.series) == mlp and list(diff.series) == mlp[1:], (loss.series.keys(), diff.series.keys())
    single = results["single process"]["losses"]
    for name in mlp[1:]:  # the difference, from the results themselves
        want = [a - b for a, b in zip(results[name]["losses"], single)]
        assert diff.series[name] == pytest.approx(want, abs=1e-12), name
    # curves 1e-7 apart, unreadable on the loss scale (~2): the difference axis spans decades down to them
    assert diff.yscale == "symlog" and diff.linthresh < 1e-7, (diff.yscale, diff.linthresh)
    # context and expert parallelism: their own panels, each run beside its own twin, never on the MLP's axes
    for family, (own_loss, own_diff) in (("cp", panels[2:4]), ("ep", panels[4:6])):
        name = next(n for n, (f, _) in tour.STRATEGIES.items() if f == family)
        assert list(own_loss.series) == ["its single process", name], own_loss.series.keys()
        assert own_loss.series["its single process"] == results[name]["baseline"][0]
        assert own_diff.series[name] == pytest.approx([3e-7] * 12, abs=1e-9), own_diff.series
        assert name not in loss.series and name in own_loss.title.replace("\n", " "), own_loss.title
    # the drawn figure: one axes per panel, with the panel's title, lines and values
    fig = figure_of(panels, rows_of=2)
    try:
        drawn = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        assert sorted(drawn) == sorted(p.title for p in panels)
        for top, bottom in zip(panels[::2], panels[1::2]):  # a model's column: its loss above its difference
            a, b = drawn[top.title].get_position(), drawn[bottom.title].get_position()
            assert a.x0 == b.x0 and a.y0 > b.y0, (top.title, bottom.title)
        for panel in panels:
            ax = drawn[panel.title]
            lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if line.get_label()[0] != "_"}
            assert lines == panel.series, panel.title
            assert ax.get_yscale() == panel.yscale, panel.title
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_tour_bar_plots_keep_other_models_off_the_mlp_axes():
    from demos import tour
    from distlab.plots import bar_panels, figure_of

    results = _fake_results()
    panels = bar_panels(tour.by_model(results, "bytes_per_step", hidden=64, world_size=2), "sent", unit="bytes")
    own = {n for n, (f, _) in tour.STRATEGIES.items() if f in tour.OWN_MODELS}
    assert len(panels) == 3 and not own & set(panels[0].series), [p.series.keys() for p in panels]
    titles = [p.title.replace("\n", " ") for p in panels]
    assert [set(p.series) for p in panels[1:]] == [{n} for n in own if n in titles[1]] + [{n} for n in own if n in titles[2]]
    fig = figure_of(panels)
    try:
        drawn = [ax for ax in fig.axes if ax.get_visible()]
        assert len(drawn) == 3
        for ax, panel in zip(drawn, panels):
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            assert ticks == list(panel.series), (ticks, panel.title)
            heights = [bar.get_height() for bar in ax.patches]
            assert heights == pytest.approx([v[0] / 1024 for v in panel.series.values()]), panel.title  # KiB
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
